"""Hardware profiles: presets with sourced numbers, and profiles measured on a mesh (public)."""
from ._hardware import PRESETS, Hardware, default_hardware, load, resolve_hardware, save
from ._profile import fit_ring, profile

__all__ = ["Hardware", "PRESETS", "default_hardware", "fit_ring", "load", "profile", "resolve_hardware", "save"]
