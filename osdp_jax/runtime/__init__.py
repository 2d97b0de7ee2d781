"""What runs inside an osdp-jax train step, importing one way:

    collectives  (the gather primitive and its reduce-scatter backward)
        -> context     (the step context, SplitKernel)
        -> kernels     (split matmul, embedding lookup, gathering after an input is ready)
        -> hooks       (split.dense: what dense layers call)
        -> interception (unmodified Flax Dense/Linear/Embed routed to the hooks, thread-scoped)
        -> stack       (layers.scan: a layer stack run in segments, gathered per layer)
        -> place       (parameters, optimizer state and batches laid out as planned)
        -> step        (the train and eval steps, compiling a step)

This package imports nothing from the planner.
"""
