"""The planner's view of a loss function written for ``make_train_step(has_aux=, rng=, state=)``.

``plan()`` compiles probe steps of ``loss_fn(params, batch) -> loss``. A loss that takes
``rng=`` or ``state=`` (mutable collections: BatchNorm statistics) or returns ``(loss, aux)`` /
``(loss, new_state)`` / ``(loss, (aux, new_state))`` is seen through :class:`PlainLoss`: the key
and the state are zeros of their shapes (the figures do not depend on their values), and only
the loss is kept. It is hashable by the function, the flags and the state's structure, shapes
and dtypes, so the steps compiled for it are kept for the next plan (the probes are kept by what
the loss traces to, ``_discover.fingerprint``).
"""
from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class PlainLoss:
    """``loss(params, batch) -> scalar`` of a train-step ``fn`` (see the module docstring)."""

    fn: object
    has_aux: bool = False
    rng: bool = False
    state: tuple | None = None  # (treedef, ((shape, dtype), ...)) of the mutable state (PRNG keys too)

    @classmethod
    def of(cls, fn, has_aux: bool = False, rng: bool = False, state=None):
        """``fn`` itself when it takes and returns nothing more than a loss; else its plain view."""
        if not (has_aux or rng or state is not None):
            return fn
        if state is not None:
            leaves, treedef = jax.tree.flatten(state)
            state = (treedef, tuple((tuple(x.shape), x.dtype) for x in leaves))
        return cls(fn, bool(has_aux), bool(rng), state)

    def __call__(self, params, batch):
        kwargs = {}
        if self.rng:
            kwargs["rng"] = jax.random.key(0)
        if self.state is not None:
            treedef, specs = self.state
            kwargs["state"] = jax.tree.unflatten(treedef, [jax.lax.full(s, 0, d) for s, d in specs])  # keys too
        out = self.fn(params, batch, **kwargs)
        if self.has_aux or self.state is not None:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"with {'has_aux=True' if self.has_aux else 'state='}, loss_fn must return "
                                f"(loss, aux), (loss, new_state) or (loss, (aux, new_state)), as make_train_step "
                                f"takes it; got {type(out).__name__}")
            out = out[0]
        return out
