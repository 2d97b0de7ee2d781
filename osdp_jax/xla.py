"""XLA's figures for compiled steps: memory, FLOPs and collectives (public helpers)."""
from osdp_jax.core.xla import (
    StepProfile,
    collectives_by_place,
    count_collectives,
    loop_flops,
    profile_compiled,
    time_compiled,
)

__all__ = ["StepProfile", "collectives_by_place", "count_collectives", "loop_flops", "profile_compiled",
           "time_compiled"]
