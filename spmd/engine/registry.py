"""The table that finds the sharding rule of an op.

A rule is registered for aten overloads with `@register(aten.op.overload, ...)` (a packet registers all its
overloads); an op has at most one rule. A family of ops found by a property rather than by name (pointwise ops,
by `torch.Tag.pointwise`) is registered with `register_family`. `floats_at_run_time=True` says the rule's
kernels read float arguments when they run, so the dispatcher's cache ignores their values (Adam's step size
changes every step without a cache miss); every other rule may decide on them (dropout's p, a norm's order).
`blockwise=True` says the rule's kernels act on each element (or each block) alone and read no mesh coordinate
(but those of the dims a decision names `fixed`), so a decision it makes with an axis sharded over one mesh dim
holds as well with that axis sharded over several: the dispatcher then runs it on multi-axis layouts as they are
(see `engine/multi_axis.py`). `multi_axis=True` says the rule reads `TensorSpec.axes` entries that are tuples of
mesh dims itself (random ops: a global index).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Entry(NamedTuple):
    rule: Callable
    floats_at_run_time: bool
    blockwise: bool = False
    multi_axis: bool = False


_RULES: dict = {}
_FAMILIES: list = []  # (predicate, Entry)


def register(*ops, floats_at_run_time: bool = False, blockwise: bool = False, multi_axis: bool = False):
    """Registers the decorated rule for each aten overload; a second rule for one op is an error."""
    def deco(rule):
        for op in ops:
            overloads = [getattr(op, name) for name in op.overloads()] \
                if isinstance(op, torch._ops.OpOverloadPacket) else [op]
            for overload in overloads:
                if overload in _RULES:
                    other = _RULES[overload].rule
                    raise ValueError(f"{overload} already has the rule {other.__module__}.{other.__qualname__}; "
                                     f"{rule.__module__}.{rule.__qualname__} cannot be registered for it too "
                                     "(one op, one rule: let that rule delegate)")
                _RULES[overload] = Entry(rule, floats_at_run_time, blockwise, multi_axis)
        return rule
    return deco


def register_family(predicate: Callable, *, floats_at_run_time: bool = False, blockwise: bool = False):
    """Registers the decorated rule for every op without a rule of its own for which `predicate(op)` holds."""
    def deco(rule):
        _FAMILIES.append((predicate, Entry(rule, floats_at_run_time, blockwise)))
        return rule
    return deco


def lookup(func) -> Entry | None:
    """The rule entry of `func`, or None (the dispatcher then tries a replicated fallback or raises)."""
    entry = _RULES.get(func)
    if entry is None:
        entry = next((e for predicate, e in _FAMILIES if predicate(func)), None)
        if entry is not None:
            _RULES[func] = entry
    return entry


def registered_ops() -> list:
    return sorted(_RULES, key=str)
