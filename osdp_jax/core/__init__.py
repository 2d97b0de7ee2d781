"""Values every layer shares: per-parameter facts (describe), layouts and plans, layer-stack
segments, strategies, byte sizes, XLA's figures, hardware profiles and the JAX-version readers.
Nothing here imports the runtime, the planner or the CLI. Internal: the public API is
:mod:`osdp_jax` and its public submodules."""
