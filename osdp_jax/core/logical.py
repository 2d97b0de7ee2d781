"""A layout as Flax logical axis rules: ``(logical name, mesh axes)`` pairs, as MaxText writes them.

Models annotated with logical axis names (``nn.with_logical_partitioning``,
``nnx.with_partitioning``) are placed by rules that map each name to mesh axes
(``nn.logical_to_mesh_sharding(specs, mesh, rules)``). :func:`logical_axis_rules` gives the rules
that place every annotated parameter exactly as a :class:`~osdp_jax.Layout` stores it: each
name maps to the mesh axes its dimensions are split over, or to None. One rule per name holds
only where every parameter carrying the name splits it alike; where two do not, the layout has
no rules, and the error names both.
"""
from __future__ import annotations

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from osdp_jax.core.describe import path_name
from osdp_jax.core.layout import as_layout, spec_tree


def logical_names(params) -> dict[str, tuple]:
    """Path -> the logical name of each dimension (None where a dimension has none) of every
    parameter annotated in ``params`` (linen boxes, or an ``nnx.State`` whose variables carry
    sharding names)."""
    if _is_nnx_state(params):
        from flax import nnx
        specs = nnx.get_partition_spec(params)
    else:
        specs = nn.get_partition_spec(params)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P) or x is None)[0]
    out = {}
    for path, spec in flat:
        spec = getattr(spec, "value", spec)  # nnx: a variable holding its spec
        if isinstance(spec, P) and any(name is not None for name in spec):
            out[path_name(path)] = tuple(spec)
    return out


def _is_nnx_state(params) -> bool:
    return type(params).__module__.startswith("flax.nnx")


def logical_axis_rules(params, plan) -> tuple[tuple[str, object], ...]:
    """The ``(logical name, mesh axes or None)`` rules under which Flax places every annotated
    parameter of ``params`` as ``plan`` (a ``Plan`` or ``Layout``) stores it, model axis included:
    ``nn.logical_to_mesh_sharding(nn.get_partition_spec(params), mesh, rules)`` then gives the
    shardings ``osdp_jax.shard`` places them with. Names in the order the sorted parameter paths
    first show them.

    Raises:
      ValueError: ``params`` carry no logical names; a split dimension has no name; or two
        parameters split one name differently (both named).
    """
    names = logical_names(params)
    if not names:
        raise ValueError("the params carry no logical axis names (nn.with_logical_partitioning, "
                         "nnx.with_partitioning): there is nothing to write rules for")
    layout = as_layout(plan)
    specs = {path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        spec_tree(params, layout), is_leaf=lambda x: isinstance(x, P))[0]}
    rules: dict = {}
    seen: dict = {}  # name -> the parameter its rule came from
    for path in sorted(names):
        spec = tuple(specs[path]) + (None,) * (len(names[path]) - len(specs[path]))
        for dim, (name, entry) in enumerate(zip(names[path], spec)):
            if name is None:
                if entry is not None:
                    raise ValueError(f"parameter {path!r} is split over {entry!r} on dimension {dim}, which has "
                                     f"no logical name: no rule can place it")
                continue
            if name in rules and rules[name] != entry:
                raise ValueError(f"logical name {name!r} is split over {rules[name]!r} in {seen[name]!r} but over "
                                 f"{entry!r} in {path!r}: one rule per name cannot place both as the layout does")
            rules.setdefault(name, entry)
            seen.setdefault(name, path)
    return tuple(rules.items())
