"""Hardware profiles: presets with sourced numbers, and profiles measured on a mesh (public)."""
from osdp_jax.core.hardware import PRESETS, Hardware, default_hardware, load, resolve_hardware, save
from osdp_jax.core.profile import fit_ring, profile

__all__ = ["Hardware", "PRESETS", "default_hardware", "fit_ring", "load", "profile", "resolve_hardware", "save"]
