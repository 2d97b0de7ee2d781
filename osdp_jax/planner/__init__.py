"""The planner's stages, in the order data flows through them: discover (trace the loss) ->
problem -> calibration (probe compiles, probe store, caches) -> cost -> segments -> search ->
verify, strung together by :mod:`osdp_jax.planner.pipeline` (``osdp_jax.plan``) and
:mod:`osdp_jax.planner.budgets` (``osdp_jax.plan_budgets``). It imports the core and the
runtime, never the CLI. Internal: the public API is :mod:`osdp_jax` and :mod:`osdp_jax.planning`."""
