"""What an osdp-jax train step tells the model while it is traced.

The step runs the user's unmodified ``loss_fn``. Two hooks inside the model consult this context:
``osdp_jax.layers.scan`` (a layer stack run in segments, its weights gathered one layer at a time) and
``osdp_jax.split.dense`` with the Flax ``Dense``/``Linear`` interception (operator splitting).
Split kernels reach the model as a :class:`SplitKernel`: this device's ZeRO-3 shard carrying the
full kernel's shape, so Flax's parameter shape checks pass; any use other than a dense layer
fails loudly for a kernel split in k > 1 slices and gathers an unsplit one (k = 1) there. While
the planner discovers a model's layers (``recording``), the context recognises parameters by
object identity (``id``) of the traced array, which is how an unmodified layer's kernel is
matched to its path.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from osdp_jax.core.layout import Collective
from osdp_jax.core.tensor import model_spec, output_spec
from osdp_jax.runtime.collectives import gather


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """How one split kernel runs: its local array is sharded along ``dim``, gathered as ``how``,
    in ``k`` slices."""

    dim: int
    how: Collective
    k: int
    model: P | None = None  # a kernel split over the model axis too (core.tensor): its gathered sharding

    def gather(self, shard):
        """The whole kernel from this device's ``shard``, all-gathered over the data axes (and kept
        split over the model axis as :attr:`model` says)."""
        return gather(shard, self.dim, self.how, self.model)


class SplitEntry(NamedTuple):
    """A split kernel as the step plans it (``StepContext.split``)."""

    dim: int  # sharded dimension of the stored parameter
    how: Collective
    k: int
    n: int  # devices in the gather


class SplitKernel:
    """A split kernel as the model sees it: this device's shard, with the whole kernel's shape.

    Only ``osdp_jax.split.dense`` (and the intercepted Flax ``Dense``/``Linear``) can use a kernel
    split in k > 1 slices. An unsplit (k = 1) per-step kernel is gathered by its dense layer; any
    other use gathers it there and then (``jnp`` functions, attributes such as ``.T``).
    """

    def __init__(self, shard, shape: tuple[int, ...], spec: SplitSpec, path: str):
        self.shard, self.shape, self.spec, self.path = shard, tuple(shape), spec, path

    @property
    def dtype(self):
        return self.shard.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key):  # nnx reads a variable's value as ``var[...]``
        if key is Ellipsis:
            return self
        return self.as_array()[key]

    def __jax_array__(self):
        return self.as_array()

    def __array__(self, *args, **kwargs):
        return self.as_array().__array__(*args, **kwargs)

    def gathered(self):
        """The whole kernel, all-gathered here (the fallback of an unsplit kernel, k = 1)."""
        return self.spec.gather(self.shard)

    def __getattr__(self, name):
        # only reached for attributes a SplitKernel lacks (.T, .astype, .reshape, ...)
        spec = self.__dict__.get("spec")
        if name.startswith("__") or spec is None or spec.k != 1:
            raise AttributeError(name)
        return getattr(self.gathered(), name)

    def as_array(self):
        """The whole kernel, gathered here, for an unsplit kernel (k = 1); a ``TypeError`` naming
        the kernel for a split one, which only a dense layer can use."""
        if self.spec.k == 1:
            return self.gathered()
        raise TypeError(
            f"parameter {self.path!r} is split by the plan (operator splitting, k={self.spec.k}): the "
            f"model may only use it through osdp_jax.split.dense or a flax Dense/nnx Linear layer. "
            f"Plan with splits=(1,) (or exclude this kernel) if it is used in other ways")

    def __repr__(self):
        return f"SplitKernel({self.path!r}, shape={self.shape}, k={self.spec.k})"


# Not a registered pytree, on purpose: Flax's lifted transforms (nn.scan, nn.map_variables) flatten
# the params they carry, and would then hand the model the shard's shape instead of the kernel's.


@dataclasses.dataclass
class StepContext:
    split: dict = dataclasses.field(default_factory=dict)  # path -> SplitEntry
    kernels: dict = dataclasses.field(default_factory=dict)  # discovery: id(array) -> (array, path)
    recording: bool = False  # discovery: record which parameters reach the hooks, change nothing
    recorded_loop: set = dataclasses.field(default_factory=set)
    recorded_split: set = dataclasses.field(default_factory=set)
    recorded_dense: list = dataclasses.field(default_factory=list)  # discovery: kernel paths in first-call order
    recorded_inputs: dict = dataclasses.field(default_factory=dict)  # discovery: kernel path -> its input's shape
    recorded_stacks: list = dataclasses.field(default_factory=list)  # paths of each layers.scan call
    per_step: frozenset = frozenset()  # sharded parameters gathered whole before the loss
    units: dict = dataclasses.field(default_factory=dict)  # path -> the unit it is gathered at (runtime.units)
    unit_remat: str = "full"  # the remat policy units run under
    in_unit: bool = False  # tracing inside a unit call: nested units run as plain calls
    recorded_units: list = dataclasses.field(default_factory=list)  # discovery: (kind, name, paths) per call
    recorded_saved: dict = dataclasses.field(default_factory=dict)  # discovery: unit site -> saved activation bytes
    # unit call site key -> its jitted call (runtime.units.shared)
    shared: dict = dataclasses.field(default_factory=dict)
    param_shapes: dict = dataclasses.field(default_factory=dict)  # discovery: path -> shape of each parameter
    recorded_hidden: list = dataclasses.field(default_factory=list)  # discovery: linen call sites whose parameters
    #                                                                  reach them only through a lifted transform
    # stacks run by the model's own scans
    # (runtime.model_loops); loop_used: the paths a scan ran per iteration
    loop_placeholders: dict = dataclasses.field(default_factory=dict)  # id -> (placeholder, StackView)
    loop_used: set = dataclasses.field(default_factory=set)
    tensor: dict = dataclasses.field(default_factory=dict)  # path -> "column"/"row" (core.tensor)
    model_axis: str | None = None  # the mesh axis those kernels are split over
    sequence: bool = False  # row layers' outputs split on their sequence (core.tensor.output_spec)
    tensor_ids: dict = dataclasses.field(default_factory=dict)  # id(what the model gets) -> (it, role)

    def wrap(self, array, path: str):
        """What the model gets for parameter ``path``: a :class:`SplitKernel` if the plan splits it
        (a per-step kernel; layer stacks are wrapped per layer by ``runtime.stack``), else
        ``array``; recorded when discovering."""
        if self.recording:
            # keep the array itself: its id must not be reused while the context lives
            self.kernels[id(array)] = (array, path)
            self.param_shapes[path] = tuple(getattr(array, "shape", ()))
            return array
        role = self.tensor.get(path) if isinstance(array, jax.Array) else None  # a stack's: per layer (runtime.stack)
        model = model_spec(array.shape, role, self.model_axis)
        if model is not None:
            array = jax.lax.with_sharding_constraint(array, model)
        entry = self.split.get(path)
        if entry is None:
            out = array
        else:
            shape = list(array.shape)
            shape[entry.dim] *= entry.n
            out = SplitKernel(array, tuple(shape), SplitSpec(entry.dim, entry.how, entry.k, model), path)
        if role:
            self.tensor_ids[id(out)] = (out, role)
        return out

    def tensor_output(self, kernel, y):
        """``y``, the output of a dense layer run on ``kernel``, sharded over the model axis as the
        kernel's tensor role says (``core.tensor.output_spec``); as it is for any other kernel."""
        hit = self.tensor_ids.get(id(kernel))
        if hit is None or hit[0] is not kernel:
            return y
        return jax.lax.with_sharding_constraint(y, output_spec(y.ndim, hit[1], self.model_axis, self.sequence))

    def lookup(self, array) -> str | None:
        """The path of an array recorded during discovery, or None."""
        hit = self.kernels.get(id(array))
        return None if hit is None or hit[0] is not array else hit[1]


ACTIVE: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("osdp_jax_step", default=None)


@contextlib.contextmanager
def active(ctx: StepContext):
    token = ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        ACTIVE.reset(token)
