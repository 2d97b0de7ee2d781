"""Which kernels pair up for tensor parallelism, found from the model's own dense calls.

Megatron-style tensor parallelism splits a *column* layer's output features and the *row* layer
that reads them on its input features, so the hidden activations between them stay split
(``osdp_jax.core.tensor``). Tracing the loss once (``planner.discover``) records every kernel
that reaches a Flax ``Dense``/``nnx.Linear`` layer (or ``osdp_jax.split.dense``) or a multi-head
projection (``DenseGeneral``/``nnx.LinearGeneral``), in the order the layers are first called.
From that order and the kernels' shapes :func:`find_pairs` takes:

- a *row* kernel ``(F, D)``, with ``F != D``;
- as its *columns*, the run of kernels called just before it, in the same parent module, each
  ``(D_i, F)`` with ``D_i != F``: an MLP's up (and gate) kernels before its down kernel;
- and for attention written with multi-head projections (Flax's ``MultiHeadDotProductAttention``,
  ``nnx.MultiHeadAttention``, or ``DenseGeneral(features=(H, hd))`` of one's own): a row
  ``(H, hd, D)`` (the output projection), with the run of ``(D_i, H, hd)`` projections called
  just before it in the same module (q, k, v) as its ``"heads"`` columns, split by whole heads.
  Grouped-query attention's k/v (fewer heads) end the run: such attention stays data-parallel.

A layer stack's kernels (``osdp_jax.layers.scan``) pair by their layers' shapes; a model's own
scan's (``nn.scan``) do not pair. A kernel is in one pair at most; a kernel in none stays
data-parallel only. Square 2-D kernels (attention's q/k/v/o projections of width d written as
``Dense(d)``) are not paired from shapes, since the calls alone do not show whether one layer
reads another's output: name them with ``tensor_roles(..., hint=...)`` patterns (``"column"``
for q/k/v, whose heads are then contiguous slices of d, and ``"row"`` for o). The pairing
decides only where the model axis's collectives go, never the result: the step leaves that axis
to XLA's partitioner, which keeps any pairing exact.
"""
from __future__ import annotations

import fnmatch

from osdp_jax.core.describe import describe
from osdp_jax.core.tensor import ROLES
from osdp_jax.planner.discover import find


def _parent(path: str) -> str:
    return path.rpartition("/")[0].rpartition("/")[0]


def find_pairs(order, shapes: dict) -> list[tuple[tuple[str, ...], str]]:
    """``[(column kernel paths, row kernel path), ...]`` from the kernels' first-call ``order``
    and ``shapes`` (path -> shape), as the module docstring says: a 2-D row ``(F, D)`` with its
    run of ``(D_i, F)`` columns, or a multi-head row ``(H, hd, D)`` with its run of
    ``(D_i, H, hd)`` projections."""
    pairs, taken = [], set()
    order = [p for p in order if len(shapes.get(p, ())) in (2, 3)]
    for i, row in enumerate(order):
        hidden, out = shapes[row][:-1], shapes[row][-1]
        if hidden == (out,) or row in taken:
            continue
        columns = []
        for before in reversed(order[:i]):
            d_in, rest = shapes[before][0], shapes[before][1:]
            if before in taken or _parent(before) != _parent(row) or rest != hidden or (d_in,) == hidden:
                break
            columns.append(before)
        if columns:
            pairs.append((tuple(reversed(columns)), row))
            taken |= {row, *columns}
    return pairs


def _bias(kernel_path: str, paths) -> str | None:
    """The bias beside a dense layer's kernel (``.../kernel`` -> ``.../bias``), if the params have it."""
    head, _, last = kernel_path.rpartition("/")
    bias = f"{head}/bias" if last == "kernel" else None
    return bias if bias in paths else None


def tensor_groups(loss_fn, params, batch, *, size: int = 1, hint=None) -> list[dict[str, str]]:
    """The pairs :func:`tensor_roles` splits, one ``{path: role}`` per pair (its column and row
    kernels and the columns' biases), in the order the model calls them; the kernels ``hint``
    names form one more, last (arguments as for :func:`tensor_roles`). The planner chooses per
    pair whether to split it (``plan(tensor="auto")``)."""
    infos = {i.path: i.shape for i in describe(params)}
    found = find(loss_fn, params, batch)
    # a layer stack's kernels (osdp_jax.layers.scan) pair per layer; a model's own scan's do not
    layer = {p: s[1:] if p in found.in_loop else s for p, s in infos.items() if p not in found.model_loop}
    groups = []
    for columns, row in find_pairs([p for p in found.dense_order if p in layer], layer):
        if layer[row][0] % size == 0:
            kind = "heads" if len(layer[row]) == 3 else "column"
            groups.append({**{c: kind for c in columns}, row: "row"})
    hinted: dict[str, str] = {}
    for pattern, role in (hint or {}).items():
        if role not in ROLES:
            raise ValueError(f"tensor hint {pattern!r}: role must be one of {list(ROLES)}, got {role!r}")
        matched = [p for p in infos if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise ValueError(f"tensor hint {pattern!r} matches no parameter; paths look like "
                             f"{sorted(infos)[:3]}")
        hinted.update({p: role for p in matched})
    groups = [kept for kept in ({p: r for p, r in g.items() if p not in hinted} for g in groups) if kept]
    groups += [hinted] if hinted else []
    taken = {p for g in groups for p in g}
    for group in groups:
        for path, role in list(group.items()):
            bias = _bias(path, infos)
            if role in ("column", "heads") and bias is not None and bias not in taken:
                group[bias] = role
    return groups


def tensor_roles(loss_fn, params, batch, *, size: int = 1, hint=None) -> dict[str, str]:
    """Path -> ``"column"``/``"row"`` for the pairs :func:`find_pairs` finds in ``loss_fn``'s dense
    calls (traced once, abstractly; ``params`` and ``batch`` may be ``ShapeDtypeStruct``s), each
    column's bias split with it: what ``Layout.from_specs(..., tensor=)`` takes.

    Args:
      size: the model axis's device count: a pair whose hidden width it does not divide is left
        out (it stays data-parallel).
      hint: ``{fnmatch pattern: "column" | "row"}`` over parameter paths (e.g.
        ``{"*/attn/[qkv]/kernel": "column", "*/attn/o/kernel": "row"}``), which take the place of
        the found pairs for the kernels they match.
    """
    return {path: role for group in tensor_groups(loss_fn, params, batch, size=size, hint=hint)
            for path, role in group.items()}
