"""The controller's shadow cache: what spmd's engine did to the shadows of one op call, replayed without it.

On the controller the engine runs each op on `meta` shadows only for their metadata, yet torch's meta kernels
(Python reference implementations for pointwise ops) cost ~10x the engine itself. The metadata an op produces is
a function of its call: the op, each DTensor argument's engine key (layout, shape, dtype, pending reduction) and
its shadow's strides and storage offset, and the other arguments (floats only by type where the engine's plan
ignores their value, as its own cache does). So the first call of a key runs the engine and records an `Entry`:

- per output: an input returned as itself (an in-place op), or a new DTensor's class, shape, strides, layout,
  pending reduction, `_copied_view` and its shadow's size, strides, storage offset and dtype;
- per input whose state the engine changed (a pending reduction resolved into it): its new shadow and state.

A later call of the key builds the outputs from that record and updates the inputs alike; no kernel runs. The
shadows are fresh `meta` tensors, not views of the inputs' shadows: nothing on the controller reads their data
or storage, only their metadata (the wrappers autograd sees are new tensors on either path). Calls the record
cannot express (an op that rebinds its input's sizes, `squeeze_`; a plain tensor result; a view copied in another
layout, which an in-place op writes back into the input it was taken from) always take the engine.

`CHECK = True` (the tests) runs the engine on every hit too, then the replay from the same input states, and
raises if they made different metadata.
"""

from __future__ import annotations

import torch

from spmd import explain
from spmd.dtensor import DTensor
from spmd.engine import dispatch

CHECK = False  # (the tests set it)
STATS = {"hits": 0, "misses": 0, "checked": 0}
_CACHE: dict = {}
_LIMIT = 100_000
_UNCACHEABLE = "uncacheable"  # a key whose calls always run the engine
_META = torch.device("meta")


class Entry:
    """What one op call did to the shadows. `outputs`: per output None, an input's index (returned as itself), or
    a new DTensor's `_output_facts`; `structure`: None for a single DTensor, else the sequence type; `inputs`:
    (index, shadow facts, layout, pending, pending_op) per input whose state the engine changed."""

    __slots__ = ("outputs", "structure", "inputs")

    def __init__(self, outputs, structure, inputs):
        self.outputs, self.structure, self.inputs = outputs, structure, inputs

    def facts(self):
        return self.outputs, self.structure, self.inputs


def key_of(func, args, kwargs, tensors: list):
    """The call's cache key (None when it cannot have one); appends its DTensor arguments to `tensors`."""
    blind = dispatch._FLOAT_BLIND.get(id(func))
    if blind is None:
        blind = dispatch._float_blind(func)
    blind = bool(blind)  # (a multi-tensor op's floats never change its shapes either)
    try:
        return id(func), _sig(args, tensors, blind), _sig(tuple(kwargs.items()), tensors, blind) if kwargs else ()
    except _NoKey:
        return None


class _NoKey(Exception):
    pass


def _sig(a, tensors, blind):
    t = type(a)
    if t is float:
        return float if blind else a
    if isinstance(a, DTensor):
        tensors.append(a)
        s = a._stack
        return a._key, s.stride(), s.storage_offset(), a._copied_view
    if t is tuple or t is list:
        return tuple(_sig(x, tensors, blind) for x in a)
    if isinstance(a, torch.Tensor):
        if a.dim() == 0:  # a 0-d plain tensor: a broadcast scalar, its value never changes the metadata
            return "scalar", a.dtype, a.device
        raise _NoKey  # (the engine refuses it, or replicates it under implicit_replication)
    return a


def run(func, args, kwargs):
    """The engine's result of `func(*args, **kwargs)` on shadows: replayed from the cache where it can be."""
    if explain.RECORDERS:  # the recorder follows the engine's own steps
        return dispatch.dispatch(func, args, kwargs)
    tensors: list = []
    key = key_of(func, args, kwargs, tensors)
    try:
        entry = _CACHE.get(key) if key is not None else _UNCACHEABLE
    except TypeError:  # an unhashable argument
        entry = _UNCACHEABLE
    if entry is _UNCACHEABLE:
        return dispatch.dispatch(func, args, kwargs)
    if entry is None:
        STATS["misses"] += 1
        out, entry = _recorded(func, args, kwargs, tensors)
        if len(_CACHE) >= _LIMIT:
            _CACHE.clear()
        _CACHE[key] = entry
        return out
    STATS["hits"] += 1
    if CHECK:
        return _checked(func, args, kwargs, tensors, entry)
    return _replay(entry, tensors)


def _recorded(func, args, kwargs, tensors):
    """Runs the engine, and records what it did (or `_UNCACHEABLE`)."""
    before = [_state(t) for t in tensors]
    out = dispatch.dispatch(func, args, kwargs)
    return out, _record(out, tensors, before)


def _checked(func, args, kwargs, tensors, entry):
    """Runs the engine, then the replay from the same input states; both must make the same metadata."""
    before = [(_state(t), t._key) for t in tensors]
    made = _record(dispatch.dispatch(func, args, kwargs), tensors, [b[0] for b in before])
    engine_after = [_state(t)[1:] + (t._key,) for t in tensors]
    for t, (state, key) in zip(tensors, before):
        t._stack, t._layout, t._pending, t._pending_op, t._key = state[0], *state[6:], key
    out = _replay(entry, tensors)
    replayed = _record(out, tensors, [b[0] for b in before])
    STATS["checked"] += 1
    if made is _UNCACHEABLE or replayed.facts() != made.facts() or \
            [_state(t)[1:] + (t._key,) for t in tensors] != engine_after:
        raise AssertionError(f"shadow cache: {func} replayed {replayed.facts()}, the engine made "
                             f"{made if made is _UNCACHEABLE else made.facts()}")
    return out


def _state(t: DTensor):
    s = t._stack
    return (s, tuple(s.shape), s.stride(), s.storage_offset(), tuple(t.shape), t.stride(), t._layout, t._pending,
            t._pending_op)


def _record(out, tensors, before):
    changed = []
    for i, (t, old) in enumerate(zip(tensors, before)):
        now = _state(t)
        if now[4:6] != old[4:6] or (now[0] is old[0] and now[1:4] != old[1:4]):
            return _UNCACHEABLE  # its wrapper or shadow changed in place (a rebinding view op)
        if now[0] is not old[0] or now[6:] != old[6:]:
            changed.append((i, _stack_facts(t._stack), t._layout, t._pending, t._pending_op))
    if isinstance(out, DTensor):
        structure, leaves = None, (out,)
    elif type(out) in (tuple, list):
        structure, leaves = type(out), out
    else:
        return _UNCACHEABLE
    ids = {id(t): i for i, t in enumerate(tensors)}
    outputs, new = [], set()
    for o in leaves:
        if o is None:
            outputs.append(None)
        elif id(o) in ids:
            outputs.append(ids[id(o)])
        elif not isinstance(o, DTensor) or id(o) in new or o._view_of is not None:
            return _UNCACHEABLE  # a plain result, one new tensor returned twice, or a copied view of its input
        else:
            new.add(id(o))
            outputs.append(_output_facts(o))
    return Entry(tuple(outputs), structure, tuple(changed))


def _stack_facts(s: torch.Tensor):
    return tuple(s.shape), s.stride(), s.storage_offset(), s.dtype


def _output_facts(o: DTensor):
    """Everything that makes a new output (besides its shadow): its class, wrapper, layout and pending state."""
    return (type(o), tuple(o.shape), o.stride(), _stack_facts(o._stack), o._layout, o._pending, o._pending_op,
            o._copied_view)


def _shadow(facts) -> torch.Tensor:
    shape, stride, offset, dtype = facts
    if not offset:
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n)
    return torch.empty(extent, dtype=dtype, device=_META).as_strided(shape, stride, offset)


def _replay(entry: Entry, tensors):
    for i, facts, layout, pending, pending_op in entry.inputs:
        t = tensors[i]
        t._stack, t._layout = _shadow(facts), layout
        t._pending, t._pending_op = pending, pending_op
        t._key = (layout, tuple(t.shape), facts[3], pending, pending_op) if pending else \
            (layout, tuple(t.shape), facts[3])
    outs = [o if o is None else tensors[o] if type(o) is int else _new_output(o) for o in entry.outputs]
    if entry.structure is None:
        return outs[0]
    return entry.structure(outs)


def _new_output(facts) -> DTensor:
    cls, shape, stride, stack, layout, pending, pending_op, copied_view = facts
    out = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=stack[3], device=_META)
    out._stack, out._layout = _shadow(stack), layout
    if pending:
        out._pending, out._pending_op = pending, pending_op
        out._key = (layout, shape, stack[3], pending, pending_op)
    else:
        out._key = (layout, shape, stack[3])
    if copied_view:
        out._copied_view = True
    return out
