"""The ``osdp-jax`` command: TOML configs, the runner that plans and trains the bundled models,
data, checkpoints, preemption, several processes, budget sweeps and the paper report. Built on the
public API; nothing in the library imports it."""
