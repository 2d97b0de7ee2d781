"""Which submodules are units: the default policy, and the user's path patterns.

Discovery records every call that could be a unit (``runtime.units``): each Flax linen submodule
method called in the step (its module path, e.g. ``"encoder/block_3"``), each nnx module marked
with ``osdp_jax.units.mark`` and each function decorated with ``osdp_jax.units.unit`` (named by
the longest path prefix their parameters share), with the paths of the parameters it holds.
:func:`choose` picks the units among them:

- given ``patterns`` (``fnmatch`` patterns such as ``"blocks_*"``), the call sites they match;
- by default:

  1. every nnx module marked and every function decorated by the user;
  2. the *layer list*: linen submodules whose name ends in a number (``block_3``, ``layers_0``,
     ``Dense_1``) and that have a sibling of the same name but for the number;
  3. in a model without layer stacks (``osdp_jax.layers.scan``), any other linen submodule
     holding at least ``share`` (1/8) of the parameter bytes, with no smaller such submodule
     inside it;

  and of nested choices, the outermost.

A parameter that two chosen units hold (a weight shared between them) is gathered at neither.
"""
from __future__ import annotations

import fnmatch
import re

DEFAULT_SHARE = 1 / 8
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def sites(calls) -> dict[str, tuple[str, frozenset]]:
    """Name -> (kind, parameter paths) of the recorded calls ``(kind, name, paths)``, a site
    called several times (or with several methods) merged."""
    out: dict = {}
    for kind, name, paths in calls:
        k, had = out.get(name, (kind, frozenset()))
        out[name] = (k, had | frozenset(paths))
    return out


def _layer_list(names) -> set[str]:
    groups: dict = {}
    for name in names:
        parent, _, last = name.rpartition("/")
        m = _NUMBERED.match(last)
        if m:
            groups.setdefault((parent, m.group(1)), []).append(name)
    return {n for members in groups.values() if len(members) >= 2 for n in members}


def choose(calls, sizes: dict, patterns=None, share: float = DEFAULT_SHARE, total: float | None = None,
           stacks: bool = False) -> dict[str, str]:
    """Parameter path -> unit name (module docstring); ``sizes`` maps the paths that may be in a
    unit to bytes, ``total`` is the model's bytes (default: their sum). A model with layer stacks
    (``stacks``) gets no share-rule units: it is planned per layer already, and its top-level
    weights are gathered at their dense layer."""
    found = sites(calls)
    if patterns is not None:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        chosen = {n for n in found if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in found)]
        if unmatched:
            shown = ", ".join(sorted(found)[:8]) or "none"
            raise ValueError(f"units pattern {unmatched[0]!r} matches no submodule the loss calls; the "
                             f"call sites are: {shown}{' ...' if len(found) > 8 else ''}")
    else:
        chosen = {n for n, (kind, _) in found.items() if kind != "linen"}
        linen = [n for n, (kind, _) in found.items() if kind == "linen"]
        chosen |= _layer_list(linen)
        taken = frozenset().union(*(found[n][1] for n in chosen)) if chosen else frozenset()
        total = total or sum(sizes.values()) or 1
        big = [] if stacks else [n for n in linen if n not in chosen and not (found[n][1] & taken)
                                 and sum(sizes.get(p, 0) for p in found[n][1]) >= share * total]
        chosen |= {n for n in big if not any(m != n and found[m][1] < found[n][1] for m in big)}
    # the outermost of nested choices
    outer = {n for n in chosen if not any(m != n and found[n][1] < found[m][1] for m in chosen)}
    owner: dict = {}
    for n in sorted(outer):
        for p in found[n][1]:
            owner.setdefault(p, []).append(n)
    return {p: names[0] for p, names in owner.items() if len(names) == 1 and p in sizes}


def from_found(found, infos, patterns=None, share: float = DEFAULT_SHARE) -> dict[str, str]:
    """:func:`choose` on what discovery found (``_discover.Found``) for the parameters ``infos``:
    stacked parameters are never in a unit (they are gathered per layer), and the share rule
    counts the whole model."""
    sizes = {i.path: i.nbytes for i in infos if i.path not in found.in_loop}
    return choose(found.units, sizes, patterns, share, sum(i.nbytes for i in infos), bool(found.stacks))


def unmarked_list(paths) -> list[str]:
    """Modules of a list in an nnx model's parameter ``paths`` (``"blocks/0"``, ``"blocks/1"``: a
    numbered path component with a sibling), in order: where an nnx model likely calls its blocks
    in a loop, which are units only once :func:`osdp_jax.units.mark`-ed (nnx has no hook through
    which discovery could see a module's call)."""
    heads = set()
    for path in paths:
        parts = path.split("/")
        heads |= {"/".join(parts[:i + 1]) for i, part in enumerate(parts) if part.isdigit()}
    return sorted(_layer_list(heads), key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0,
                                                                                          p) for p in n.split("/")])
