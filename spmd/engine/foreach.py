"""Multi-tensor ops on lists of DTensors: `torch._foreach_*` (torch.optim with `foreach=True`, gradient clipping)
and the fused optimizer kernels (`_fused_adam_`, `_fused_adamw_`, `_fused_sgd_`, `_fused_adagrad_`; `fused=True`).

An elementwise multi-tensor op whose tensors line up position by position (one shape and layout per position) is
one call of the same op on the lists of stacked components: one kernel per list, as in plain torch, whatever the
number of devices. An in-place op first relayouts each position's other tensors to the written one's layout (what
the element op's rule does too). Lists that do not line up run the element op position by position through the
ordinary dispatcher, each element with its own layout and sharding rule.
"""

from __future__ import annotations

import functools
import operator

import torch

from spmd.collectives import backend_for
from spmd.collectives.local import one_copy, share, shared
from spmd.dtensor import DTensor
from spmd.engine import planner
from spmd.engine.decision import written_arguments
from spmd.errors import MeshMismatchError, MixedTensorError

aten = torch.ops.aten

_FUSED = {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_",
          "aten::_amp_foreach_non_finite_check_and_unscale_"}  # GradScaler's unscale and check of the gradients
# multi-tensor ops whose element op is not elementwise: they run position by position
_NOT_ELEMENTWISE = {"aten::_foreach_norm", "aten::_foreach_max", "aten::_foreach_mm"}
# plain tensors a fused kernel takes beside the DTensor lists: per-parameter steps, AMP's scaler state, a tensor lr
_PLAIN_ARGUMENTS = {"state_steps", "grad_scale", "found_inf", "inv_scale", "lr", "scalars"}
_KEY, _STACK, _PENDING, _COPIED_VIEW = map(operator.attrgetter, ("_key", "_stack", "_pending", "_copied_view"))
# key lists found equal: (id of the first layout of each, length) -> the two lists (see same_keys)
_AGREED: dict = {}
_AGREED_LIMIT = 1024


def is_multi_tensor(func) -> bool:
    name = func._schema.name
    return name.startswith("aten::_foreach_") or name in _FUSED


def run(func, args, kwargs):
    """Runs `func` on lists of DTensors: on the stacked components where the lists line up, else per position."""
    signature = _signature(func)
    if signature.elementwise:
        lined_up = _line_up(func, signature, args, kwargs)
        if not isinstance(lined_up, str):
            out = _run_on_stacks(func, *lined_up)
            if signature.name == "aten::_amp_foreach_non_finite_check_and_unscale_":
                _agree_across_clients(args[1], args[0][0]._layout.mesh)
            return out
        if signature.fused:
            raise MixedTensorError(f"{signature.name} on DTensors: {lined_up}")
    return _run_per_element(func, args, kwargs)


class _Signature:
    """What the line-up reads of an op's schema, once per op: argument names, which are tensor lists, which the
    op writes through its alias annotations."""

    def __init__(self, func):
        schema = func._schema
        self.name = schema.name
        self.fused = self.name in _FUSED
        self.elementwise = self.fused or self.name not in _NOT_ELEMENTWISE
        self.in_place = not schema.returns
        self.names = tuple(a.name for a in schema.arguments)
        self.tensor_lists = tuple(a.name for a in schema.arguments if str(a.type) == "List[Tensor]")
        self.aliased_writes = written_arguments(func)


@functools.cache
def _signature(func) -> _Signature:
    return _Signature(func)


def _line_up(func, signature: _Signature, args, kwargs):
    """`func`'s arguments with every DTensor replaced by its stacked components and the DTensors whose layouts
    the results take (None for an in-place op), or a string saying why the lists do not line up."""
    named = dict(zip(signature.names, args))
    named.update(kwargs)
    reference = next(named[name] for name in signature.tensor_lists if named.get(name))
    try:
        reference_keys = list(map(_KEY, reference))
    except AttributeError:
        return "its first tensor list holds plain tensors; distribute them first with spmd.copy_to_mesh"
    resolve = signature.fused  # a foreach op leaves pending reductions to the element rules, which may keep them
    pending = any(map(_PENDING, reference))
    if pending and not resolve:
        return "a pending reduction"
    if signature.in_place and any(map(_COPIED_VIEW, reference)):
        return "an in-place write to a view that does not share memory with its base"
    if pending:
        reference_stacks = [t._local for t in reference]
        reference_keys = list(map(_KEY, reference))  # (resolved: no pending reduction in them any more)
    else:
        reference_stacks = list(map(_STACK, reference))
    stacked = {}
    for name in signature.names:
        value = named.get(name)
        if value is reference:
            value = reference_stacks
        elif name in signature.tensor_lists and value:
            # an input read (not written) may be relayouted to the written tensor's layout, as the element rules do
            relayout = signature.in_place and not _written(signature, name, named)
            value = _stacks(value, reference, reference_keys, relayout, resolve, name)
        elif isinstance(value, DTensor):
            value = _scalar_stack(value, name)
        elif isinstance(value, torch.Tensor) and name not in _PLAIN_ARGUMENTS:
            value = f"the plain tensor {name} (shape {list(value.shape)})"
        if isinstance(value, str):
            return value
        stacked[name] = value
    if reference_stacks[0].shape[0] > 1:
        _once_where_shared(signature, named, stacked)
    positional = [stacked[name] for name in signature.names[:len(args)]]
    return positional, {k: stacked[k] for k in kwargs}, (None if signature.in_place else reference)


def _once_where_shared(signature: _Signature, named, stacked) -> None:
    """The lists' stacks at the positions where the op's written tensors (for an out-of-place op: the first list's)
    are one copy shared by every device: see `once_where_shared`."""
    lists = [name for name in signature.tensor_lists if name not in _PLAIN_ARGUMENTS and stacked.get(name)]
    written = [name for name in lists if _written(signature, name, named)] if signature.in_place else lists[:1]
    once_where_shared([stacked[name] for name in lists], [lists.index(name) for name in written],
                      [named[name] for name in lists])


def once_where_shared(stacks: list[list], written: list[int], tensors: list[list]) -> None:
    """At the positions whose written stacks (`stacks[i]` for i in `written`) are all one copy shared by every
    device (a value replicated over the whole mesh: see engine/dispatch.py), the op runs once: every list's stack
    there becomes the first device's components. A position where only some written stacks are shared gives those
    each device's own memory first, kept by their DTensors (`tensors`, the lists the stacks came from, all laid out
    at each position as the first list)."""
    for i, reference in enumerate(tensors[0]):
        if max(reference._layout.num_shards_per_axis(), default=1) > 1:
            continue  # (only a value that every device holds alike is shared)
        shares = [shared(stacks[w][i]) for w in written]
        if all(shares):
            for s in stacks:
                s[i] = one_copy(s[i])
        elif any(shares):
            for w, is_shared in zip(written, shares):
                if is_shared and stacks[w][i] is tensors[w][i]._stack:
                    tensors[w][i]._stack = stacks[w][i] = stacks[w][i].contiguous()


def _written(signature: _Signature, name: str, named) -> bool:
    """Whether the op writes this argument (a fused step writes its gradients only to unscale them)."""
    if name == "grads":
        return named.get("grad_scale") is not None
    return name in signature.aliased_writes


def _stacks(tensors, reference, reference_keys, relayout: bool, resolve: bool, name: str):
    """The stacked components of a list of tensors laid out as the `reference` list, or why not."""
    try:
        if same_keys(list(map(_KEY, tensors)), reference_keys):  # the common case: layout, shape, dtype equal
            return list(map(_STACK, tensors))  # (the reference's keys hold no pending reduction)
    except AttributeError:  # plain tensors in the list
        if name in _PLAIN_ARGUMENTS and not any(isinstance(t, DTensor) for t in tensors):
            return list(tensors)  # (per-parameter steps)
    stacks = [_stack(t, ref, relayout, resolve, name) for t, ref in zip(tensors, reference)]
    return next((s for s in stacks if isinstance(s, str)), stacks)


def same_keys(keys: list, reference_keys: list) -> bool:
    """`keys == reference_keys`, remembered. Equal layouts are often distinct objects (each parameter's own, the
    cached plans'), and comparing them runs `Layout.__eq__` per element; the lists of a later step hold the same
    key tuples, or tuples of the same layout objects, which compare without it. So a pair found equal is kept, and
    a pair equal to a kept one (by value: usually by identity, at C speed) is equal too."""
    if not keys or len(keys) != len(reference_keys):
        return keys == reference_keys
    memo = (id(keys[0][0]), id(reference_keys[0][0]), len(keys))
    agreed = _AGREED.get(memo)  # (its lists keep the layouts alive, so the ids in `memo` stay theirs)
    if agreed is not None and agreed[0] == keys and agreed[1] == reference_keys:
        return True
    if keys != reference_keys:
        return False
    if len(_AGREED) >= _AGREED_LIMIT:
        _AGREED.clear()
    _AGREED[memo] = (keys, reference_keys)
    return True


def _stack(t, ref: DTensor, relayout: bool, resolve: bool, name: str):
    """The stacked components of `t` (at the position of `ref` in the lists) laid out as `ref`, or why not."""
    if not isinstance(t, DTensor):
        if name in _PLAIN_ARGUMENTS:
            return t
        return f"{name} holds a plain tensor (shape {list(t.shape)}) where the other lists hold DTensors; " \
               "distribute it first with spmd.copy_to_mesh"
    if t._pending and not resolve:
        return "a pending reduction"
    if t._layout == ref._layout and t.shape == ref.shape:
        return t._local
    if not relayout or t.shape != ref.shape:
        return f"{name} has shape {list(t.shape)} and layout {t._layout} where the list written has " \
               f"{list(ref.shape)} and {ref._layout}"
    if t._layout.mesh != ref._layout.mesh:
        raise MeshMismatchError(f"{name}: a tensor on {t._layout.mesh} at the position of one on "
                                f"{ref._layout.mesh}; copy it with spmd.copy_to_mesh or relayout first")
    steps = planner.plan_on(ref._layout.mesh, t._layout.axes, ref._layout.axes, t._pending, t._pending_op)
    return planner.run(t._stack, ref._layout.mesh, steps)


def _agree_across_clients(found_inf: torch.Tensor, mesh) -> None:
    """A client saw only its own devices' gradients: every client takes the largest flag, so that all of them skip
    the step or none does (GradScaler's infinity check)."""
    if mesh.is_fully_local():
        return
    flags = found_inf.reshape(1).expand(mesh.num_local_devices()).contiguous()
    found_inf.copy_(backend_for(mesh).all_reduce(flags, mesh, tuple(mesh.dim_names), "max")[0])


def _scalar_stack(t: DTensor, name: str):
    """A 0-d DTensor argument (clip_grad_norm_'s coefficient) as one plain 0-d tensor: all its copies are equal."""
    if t.dim() != 0:
        return f"the DTensor argument {name} of shape {list(t.shape)} is not a list"
    return t._local[0]


def _run_on_stacks(func, args, kwargs, reference):
    out = func(*args, **kwargs)
    if reference is None:  # in place: the DTensors' components were written
        return None
    n = reference[0]._stack.shape[0]  # (outputs computed once are shared by every device)
    return [DTensor(o if o.shape[0] == n else share(o, n), r._layout, r.shape)
            for o, r in zip(out, reference)]


_ELEMENT_NAMES = {"norm": "linalg_vector_norm"}  # `_foreach_norm(ord, dtype)` has linalg's signature


def _element_op(func):
    name = func._schema.name[len("aten::_foreach_"):]
    return getattr(aten, _ELEMENT_NAMES.get(name, name))  # a packet: overloads resolve from the arguments


def _run_per_element(func, args, kwargs):
    """Applies the element op of `func` at every position of its list arguments; in-place ops return None."""
    op = _element_op(func)
    n = len(args[0])

    def pick(a, i):
        if isinstance(a, (list, tuple)) and len(a) == n:
            return a[i]
        if isinstance(a, torch.Tensor) and not hasattr(a, "_layout") and a.dim() == 1 and a.numel() == n:
            return a[i].item()  # a tensor of per-element scalars (e.g. `_foreach_addcdiv_.Tensor`)
        return a

    # foreach ops pass some scalars positionally that the element op takes as keywords (addcmul_'s `value`)
    schema = getattr(op, op.overloads()[0])._schema
    n_positional = sum(not a.kwarg_only for a in schema.arguments)
    keyword_names = [a.name for a in schema.arguments if a.kwarg_only]
    extra = dict(zip(keyword_names, args[n_positional:]))
    results = []
    for i in range(n):
        element_kwargs = {k: pick(v, i) for k, v in {**extra, **kwargs}.items()}
        results.append(op(*[pick(a, i) for a in args[:n_positional]], **element_kwargs))
    return None if not func._schema.returns else results
