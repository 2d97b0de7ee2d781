"""The ``Plan``: a strategy and a storage ``PartitionSpec`` per parameter, a batch size, predictions."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import jax
from jax.sharding import PartitionSpec as P

from osdp_jax.core.bytes import format_bytes
from osdp_jax.core.layout import Layout, ParamLayout, one_segment
from osdp_jax.core.stack import Segment
from osdp_jax.core.strategies import GATHERED, sharded_dim
from osdp_jax.core.tensor import storage_spec

# 9 adds "mesh_shape" and "sequence", 8 "tensor" and "model_axis", 7 "model_loop", 6 "accumulate", 5 the
# zero2 strategy and gather_dtype, 4 units ("unit", "unit_remat"), 3 layer segments, 2 dense kernels; 1-8 are
# still read
PLAN_FORMAT = 9
READABLE_FORMATS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def _spec_to_json(spec: P) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_str(spec: P) -> str:
    """``P(None, 'data')`` -> ``"None, data"``; a replicated spec -> ``""``."""
    return ", ".join(str(e) for e in spec)


def _spec_from_json(entries: list) -> P:
    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])


def describe_segments(segments) -> str:
    """``"layers 0-19 replicate, 20-47 zero3 k=2, remat=dots"``: adjacent segments that run alike
    (strategy, split count, remat policy, two-stage gather) shown as one, and each segment's remat
    policy when they differ."""
    runs = []
    for s in segments:
        if runs and tuple(runs[-1][2:]) == (s.strategy, s.split, s.remat, s.two_stage):
            runs[-1][1] = s.stop
        else:
            runs.append([s.start, s.stop, s.strategy, s.split, s.remat, s.two_stage])
    one = len({r[4] for r in runs}) == 1
    parts = [(f"{a}-{b - 1}" if b - a > 1 else f"{a}") + f" {strategy}" + (f" k={k}" if k > 1 else "")
             + (" 2-stage" if two_stage else "") + ("" if one else f" remat={remat}")
             for a, b, strategy, k, remat, two_stage in runs]
    return "layers " + ", ".join(parts) + (f", remat={runs[0][4]}" if one else "")


def _padding_helps(pp, devices: int) -> bool:
    """Whether padding a parameter's first dimension to a multiple of ``devices`` is a sensible way
    to shard it there: a matrix (a dense kernel or an embedding; in a layer stack, after the layer
    axis) whose padding adds at most an eighth of its rows. Not a convolution kernel's spatial
    dimension, nor a stack's layer count."""
    dims = pp.shape[1:] if pp.in_loop else pp.shape
    if len(dims) != 2 or dims[0] < devices:
        return False
    return (-dims[0]) % devices <= dims[0] / 8


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """One parameter's decision in a :class:`Plan` (``plan.params``; ``plan.strategies`` and
    ``plan.specs`` give the same as pytrees).

    Attributes:
      path, shape, dtype, nbytes: the parameter (``nbytes`` whole, in bytes).
      strategy: ``"replicate"``, ``"zero3"``, ``"hsdp"`` or ``"zero2"``; for a layer stack cut in
        segments, the first segment's (:meth:`layer_segments` gives each).
      spec: its storage ``PartitionSpec``.
      in_loop: a layer stack's parameter, gathered one layer at a time.
      model_loop: an ``in_loop`` parameter sliced per iteration by the model's own
        ``jax.lax.scan`` (Flax ``nn.scan``, ``nnx.scan``), not by ``osdp_jax.layers.scan``.
      split: operator splitting: the slices its dense layer gathers one at a time (1: whole).
      two_stage: gathered one mesh axis at a time, inside a node first (2-D meshes).
      dense, unit, segments, gather_dtype, accumulate: where it is gathered, its unit, its layer
        segments, the dtype it is gathered in, and where its gradient is summed across
        microbatches (``"shard"`` or ``"whole"``).
      tensor: ``"column"`` or ``"row"`` where it is split over the plan's ``model_axis``
        (tensor parallelism, ``osdp_jax.core.tensor``; ``spec`` is then its data-parallel part),
        else ``""``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    strategy: str
    spec: P
    nbytes: int  # whole parameter, bytes
    in_loop: bool = False  # layer-stacked, gathered per layer inside osdp_jax.layers.scan
    split: int = 1  # operator splitting: slices its dense layer gathers one at a time (zero3 only)
    two_stage: bool = False  # gathered one mesh axis at a time, intra-node first (2-D meshes)
    dense: bool = False  # a kernel of a dense layer (found by tracing the loss): gathered at its layer
    segments: tuple[Segment, ...] = ()  # a stacked parameter's layer segments (empty: one, as above)
    unit: str = ""  # the unit (osdp_jax.units) a sharded parameter is gathered at; "": once per step
    gather_dtype: str = ""  # a sharded parameter gathered in this dtype (plan(compute_dtype=)); "": its own
    accumulate: str = ""  # with microbatches: its gradient summed "whole" (a zero3/hsdp weight gathered once
    #                       per step and kept) or in its "shard"; "": the strategy's default
    model_loop: bool = False  # in_loop, sliced per iteration by the model's own jax.lax.scan
    tensor: str = ""  # split over Plan.model_axis: "column" (output features), "row" (input features), or ""

    def layer_segments(self) -> tuple[Segment, ...]:
        """The segments of a stacked (``in_loop``) parameter: its own, or one over all its layers."""
        if not self.in_loop:
            return ()
        return self.segments or one_segment(self.shape[0], self.spec, self.strategy, self.split,
                                            self.two_stage, "full")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How each parameter lives on the data-parallel devices, and the batch size.

    Byte figures are per device for the whole training step; ``predicted_*`` come from the cost
    model, ``xla_peak_bytes`` from compiling the planned step (None when no ``loss_fn`` was given).
    """

    params: tuple[ParamPlan, ...]
    axes: tuple[str, ...]
    num_devices: int
    batch_size: int | None
    budget_bytes: int
    predicted_peak_bytes: float
    predicted_step_seconds: float | None
    predicted_samples_per_second: float | None
    xla_peak_bytes: int | None = None
    predicted_collective_seconds: float | None = None  # of predicted_step_seconds, the collectives
    hardware: str = ""
    search_seconds: float = 0.0  # cost tables and exact search
    planning_seconds: float = 0.0  # all of plan(), wall clock
    compile_seconds: float = 0.0  # of which compiling probe and verification steps (wall clock: compiles
    #                                 running at once on worker threads count once)
    compiles: int = 0  # XLA compiles that planning ran
    probes_read: int = 0  # probe figures read from disk (osdp_jax.planner.probe_store) instead of traced and compiled
    unit_remat: str = "full"  # the remat policy units run under (osdp_jax.units)
    pool_overlap: float = 0.0  # the cost model's pool overlap omega (_cost), fitted on a compiled plan
    unit_scale: float = 1.0  # the units' temp savings scaled by it (_cost), refitted on a compiled plan
    microbatches: int = 1  # the global batch runs as this many microbatches (gradient accumulation)
    model_axis: str | None = None  # the mesh axis the "column"/"row" parameters are split over (tensor parallelism)
    mesh_shape: tuple[tuple[str, int], ...] = ()  # (axis, devices) of the mesh it was made for; make_mesh builds it
    sequence: bool = False  # sequence parallelism over model_axis: row layers' outputs split on their sequence
    treedef: object = dataclasses.field(default=None, compare=False, repr=False)

    # --- the mesh ------------------------------------------------------------------------------
    def make_mesh(self, devices=None, axis_types=None):
        """The mesh the plan was made for (:attr:`mesh_shape`), over ``devices`` (default
        ``jax.devices()``), with ``jax.make_mesh``; ``plan(model_sizes=...)`` may choose a shape
        other than the mesh it was given."""
        if not self.mesh_shape:
            raise ValueError("this plan does not record its mesh shape (a plan JSON of format 8 or older): build "
                             f"the mesh yourself, with data-parallel axes {list(self.axes)} of {self.num_devices} "
                             "devices")
        names, sizes = zip(*self.mesh_shape)
        return jax.make_mesh(tuple(sizes), tuple(names), axis_types=axis_types, devices=devices)

    # --- pytree views --------------------------------------------------------------------------
    def _tree(self, values):
        if self.treedef is not None:
            return jax.tree.unflatten(self.treedef, values)
        tree: dict = {}
        for pp, v in zip(self.params, values):
            *parents, leaf = pp.path.split("/")
            node = tree
            for k in parents:
                node = node.setdefault(k, {})
            node[leaf] = v
        return tree

    @property
    def specs(self):
        """Pytree of storage ``PartitionSpec`` shaped like the (unboxed) params, a model axis included."""
        return self._tree([storage_spec(pp.spec, pp.shape, pp.tensor, self.model_axis, pp.in_loop)
                           for pp in self.params])

    @property
    def tensor(self) -> dict[str, str]:
        """Path -> ``"column"``/``"row"`` of every parameter split over :attr:`model_axis`."""
        return {pp.path: pp.tensor for pp in self.params if pp.tensor}

    @property
    def strategies(self):
        """Pytree of strategy names shaped like the (unboxed) params."""
        return self._tree([pp.strategy for pp in self.params])

    @property
    def splits(self):
        """Pytree of split counts k shaped like the (unboxed) params (1: not split)."""
        return self._tree([pp.split for pp in self.params])

    @property
    def splits_by_path(self) -> dict[str, int]:
        """Paths of the split kernels and their k (> 1)."""
        return self.layout.splits_by_path

    @property
    def specs_by_path(self) -> dict[str, P]:
        return self.layout.specs_by_path

    @property
    def layout(self) -> Layout:
        """The plan's :class:`~osdp_jax.Layout`: what the runtime needs of it."""
        return Layout(tuple(ParamLayout(pp.path, pp.spec, pp.strategy, pp.in_loop, pp.split, pp.two_stage,
                                        pp.dense, pp.layer_segments(), pp.unit, pp.gather_dtype,
                                        pp.accumulate, pp.model_loop, pp.tensor)
                            for pp in self.params),
                      tuple(self.axes), unit_remat=self.unit_remat, model_axis=self.model_axis, sequence=self.sequence)

    @property
    def segments(self) -> dict[str, list[tuple]]:
        """Path -> ``[(start, stop, strategy, k, remat), ...]`` of each layer-stacked parameter:
        layers ``start`` to ``stop - 1`` stored and run that way."""
        return {pp.path: [(s.start, s.stop, s.strategy, s.split, s.remat) for s in pp.layer_segments()]
                for pp in self.params if pp.in_loop}

    @property
    def units(self) -> dict[str, list[str]]:
        """Unit -> paths of the sharded parameters gathered there (``osdp_jax.units``)."""
        out: dict[str, list[str]] = {}
        for pp in self.params:
            if pp.unit:
                out.setdefault(pp.unit, []).append(pp.path)
        return out

    @property
    def two_stage(self) -> frozenset[str]:
        """Paths of the parameters gathered in two stages (inner mesh axis, then outer)."""
        return self.layout.two_stage

    @property
    def in_loop(self) -> frozenset[str]:
        """Paths of the parameters the model gathers inside its layer loop."""
        return self.layout.in_loop

    def counts(self) -> dict[str, int]:
        """Number of parameters per strategy."""
        return dict(Counter(pp.strategy for pp in self.params))

    # --- text ----------------------------------------------------------------------------------
    def summary(self, group: bool = True) -> str:
        """The plan as text: a table of the parameters, the layer stacks' segments, the units, the
        batch size, the predicted and XLA peaks against the budget, and the predicted step time.

        Args:
          group: with True, one row per group of parameters that share a shape, dtype, strategy,
            spec, split count and where they are gathered; the row is named by the group's first
            parameter and ``(+N)`` others (``Plan.strategies`` gives each parameter's). With False,
            one row per parameter.
        """
        groups: dict[tuple, list[ParamPlan]] = {}
        for pp in self.params:
            mixed = len(pp.layer_segments()) > 1
            key = (pp.shape, pp.dtype, "segments" if mixed else pp.strategy, P() if mixed else pp.spec,
                   pp.in_loop, 1 if mixed else pp.split, pp.two_stage, bool(pp.unit), pp.accumulate, pp.tensor)
            groups.setdefault(key if group else (*key, pp.path), []).append(pp)
        rows = [("parameters", "count", "shape", "dtype", "strategy", "spec", "gathered", "split",
                 "bytes each")]
        for (shape, dtype, strategy, spec, _, split, _, _, accumulate, tensor, *_), pps in groups.items():
            name = pps[0].path if len(pps) == 1 else f"{pps[0].path} (+{len(pps) - 1})"
            where = "" if strategy in ("replicate", "zero2") else (
                "per layer" if pps[0].in_loop else "per unit" if pps[0].unit else "per step")
            where = "per layer" if strategy == "segments" else where
            notes = [where] if where else []
            notes += ["2-stage"] if pps[0].two_stage else []
            notes += [f"{tensor}-parallel"] if tensor else []
            spec = storage_spec(spec, shape, tensor, self.model_axis, pps[0].in_loop)
            notes += [f"in {pps[0].gather_dtype}"] if pps[0].gather_dtype else []
            if self.microbatches > 1 and accumulate:  # where the gradient is summed, when not the default
                notes.append(("kept across microbatches" if strategy in GATHERED else "grad summed whole")
                             if accumulate == "whole" else "grad summed sharded")
            where = ", ".join(notes) or "-"
            rows.append((name[:48], str(len(pps)), str(shape), dtype, strategy, _spec_str(spec),
                         where, str(split) if split > 1 else "-", format_bytes(pps[0].nbytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        stacks: dict[tuple, list[str]] = {}
        for pp in self.params:
            if pp.in_loop and (len(pp.layer_segments()) > 1 or pp.layer_segments()[0].remat != "full"):
                text = describe_segments(pp.layer_segments())
                stacks.setdefault(text, []).append(pp.path)
        if stacks:
            lines += ["", "layer segments (per stacked parameter):"]
            for text, paths in stacks.items():
                who = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1})"
                lines.append(f"  {who}: {text}")
        units = self.units
        if units:
            names = sorted(units)
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            lines += ["", f"units (gathered on each call and again in the backward pass, remat={self.unit_remat}): "
                          f"{shown}"]
        total = sum(pp.nbytes for pp in self.params)
        sps = self.predicted_samples_per_second
        minor = [pp for pp in self.params if pp.strategy in GATHERED and not pp.tensor
                 and sharded_dim(pp.spec) > (1 if pp.in_loop else 0) and _padding_helps(pp, self.num_devices)]
        if minor:
            pp = minor[0]
            lines += ["", f"note: {len(minor)} sharded parameter(s) split along a later dimension because the "
                          f"device count does not divide the first, e.g. {pp.path} {pp.shape} as "
                          f"{_spec_str(pp.spec)}: XLA transposes such a weight in full around each gather; "
                          f"padding that first dimension to a multiple of {self.num_devices} avoids it"]
        lines += [
            "",
            (f"mesh {' x '.join(f'{a} {n}' for a, n in self.mesh_shape)} (osdp_jax.Plan.make_mesh builds it); "
             if self.mesh_shape else "")
            + f"data-parallel axes {self.axes} ({self.num_devices} devices)"
            + (f", model axis {self.model_axis!r} ({len(self.tensor)} parameters split over it"
               + (", sequence-parallel)" if self.sequence else ")") if self.model_axis else "")
            + f", hardware {self.hardware}",
            f"parameters: {format_bytes(total)} total; strategies: {self.counts()}; "
            f"split kernels: {len(self.splits_by_path)}",
            f"batch size: {self.batch_size if self.batch_size is not None else '-'}"
            + (f", as {self.microbatches} microbatches of {self.batch_size // self.microbatches} "
               "(gradient accumulation)"
               if self.microbatches > 1 and self.batch_size else ""),
            f"per-device peak: predicted {format_bytes(self.predicted_peak_bytes)}, "
            f"XLA {format_bytes(self.xla_peak_bytes) if self.xla_peak_bytes is not None else 'not compiled'}, "
            f"budget {format_bytes(self.budget_bytes)} (XLA's figure of the step osdp_jax.make_train_step builds; "
            "a step of your own holds it with osdp_jax.value_and_grad, osdp_jax.check_budget checks it)",
            f"predicted: {self.predicted_step_seconds * 1e3:.2f} ms/step ("
            f"{(self.predicted_collective_seconds or 0.0) * 1e3:.2f} ms collectives), {sps:.1f} samples/s"
            if sps is not None else "predicted throughput: - (no loss_fn/batch given)",
            f"planning: {self.planning_seconds:.1f} s, of which {self.compiles} compiles {self.compile_seconds:.1f} s "
            f"and search {self.search_seconds:.3f} s"
            + (f"; {self.probes_read} probes read from the probe store" if self.probes_read else ""),
        ]
        return "\n".join(lines)

    def __str__(self):
        return self.summary()

    # --- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("params", "treedef")}
        d["axes"] = list(self.axes)
        d["mesh_shape"] = [list(x) for x in self.mesh_shape]
        d["format"] = PLAN_FORMAT
        d["params"] = [{"path": pp.path, "shape": list(pp.shape), "dtype": pp.dtype,
                        "strategy": pp.strategy, "spec": _spec_to_json(pp.spec), "nbytes": pp.nbytes,
                        "in_loop": pp.in_loop, "split": pp.split, "two_stage": pp.two_stage,
                        "dense": pp.dense, "segments": [seg.to_json() for seg in pp.segments], "unit": pp.unit,
                        "gather_dtype": pp.gather_dtype, "accumulate": pp.accumulate, "model_loop": pp.model_loop,
                        "tensor": pp.tensor}
                       for pp in self.params]
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        if d.pop("format", None) not in READABLE_FORMATS:
            raise ValueError(f"not an osdp-jax plan JSON (formats {list(READABLE_FORMATS)})")
        params = tuple(ParamPlan(p["path"], tuple(p["shape"]), p["dtype"], p["strategy"],
                                 _spec_from_json(p["spec"]), p["nbytes"], p.get("in_loop", False),
                                 p.get("split", 1), p.get("two_stage", False), p.get("dense", False),
                                 tuple(Segment.from_json(x) for x in p.get("segments", ())), p.get("unit", ""),
                                 p.get("gather_dtype", ""), p.get("accumulate", ""), p.get("model_loop", False),
                                 p.get("tensor", ""))
                       for p in d.pop("params"))
        d["axes"] = tuple(d["axes"])
        d["mesh_shape"] = tuple((str(a), int(n)) for a, n in d.get("mesh_shape", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(params=params, **{k: v for k, v in d.items() if k in known})

    def check_matches(self, infos) -> None:
        """Raise a clear error when ``infos`` (from :func:`describe`) are not the planned params."""
        planned = {pp.path: pp for pp in self.params}
        for info in infos:
            pp = planned.get(info.path)
            if pp is None:
                raise ValueError(f"parameter {info.path!r} is not in the plan; re-plan for these params")
            if tuple(pp.shape) != info.shape:
                raise ValueError(f"parameter {info.path!r} has shape {info.shape} but the plan was made "
                                 f"for {tuple(pp.shape)}; re-plan for these params")
        if len(infos) != len(planned):
            missing = sorted(set(planned) - {i.path for i in infos})
            raise ValueError(f"the plan has parameters these params lack: {missing[:3]}; re-plan")
