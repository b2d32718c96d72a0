"""Multi-tensor ops on lists of DTensors: `torch._foreach_*` (torch.optim with `foreach=True`, gradient clipping)
and the fused optimizer kernels (`_fused_adam_`, `_fused_adamw_`, `_fused_sgd_`, `_fused_adagrad_`; `fused=True`).

An elementwise multi-tensor op whose tensors line up position by position (one shape and layout per position) is
one call of the same op on the lists of stacked components: one kernel per list, as in plain torch, whatever the
number of devices. An in-place op first relayouts each position's other tensors to the written one's layout (what
the element op's rule does too). Lists that do not line up run the element op position by position through the
ordinary dispatcher, each element with its own layout and sharding rule.
"""

from __future__ import annotations

import torch
import torch.utils._foreach_utils
from torch.optim import optimizer

from spmd.collectives import backend_for
from spmd.dtensor import DTensor
from spmd.engine import planner
from spmd.errors import MeshMismatchError, MixedTensorError

aten = torch.ops.aten

_FUSED = {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_",
          "aten::_amp_foreach_non_finite_check_and_unscale_"}  # GradScaler's unscale and check of the gradients
# multi-tensor ops whose element op is not elementwise: they run position by position
_NOT_ELEMENTWISE = {"aten::_foreach_norm", "aten::_foreach_max", "aten::_foreach_mm"}
# plain tensors a fused kernel takes beside the DTensor lists: per-parameter steps, AMP's scaler state, a tensor lr
_PLAIN_ARGUMENTS = {"state_steps", "grad_scale", "found_inf", "inv_scale", "lr", "scalars"}


def is_multi_tensor(func) -> bool:
    name = func._schema.name
    return name.startswith("aten::_foreach_") or name in _FUSED


def let_torch_optim_take(*types) -> None:
    """Makes torch.optim and `clip_grad_norm_` choose their foreach paths for these tensor types where they would
    for plain tensors (on CUDA by default), as torch does for its own DTensor."""
    for supported in (optimizer._foreach_supported_types, torch.utils._foreach_utils._foreach_supported_types):
        supported.extend(t for t in types if t not in supported)


def run(func, args, kwargs):
    """Runs `func` on lists of DTensors: on the stacked components where the lists line up, else per position."""
    fused = func._schema.name in _FUSED
    if fused or func._schema.name not in _NOT_ELEMENTWISE:
        lined_up = _line_up(func, args, kwargs, fused)
        if not isinstance(lined_up, str):
            out = _run_on_stacks(func, *lined_up)
            if func._schema.name == "aten::_amp_foreach_non_finite_check_and_unscale_":
                _agree_across_clients(args[1], args[0][0]._layout.mesh)
            return out
        if fused:
            raise MixedTensorError(f"{func._schema.name} on DTensors: {lined_up}")
    return _run_per_element(func, args, kwargs)


def _line_up(func, args, kwargs, fused: bool):
    """`func`'s arguments with every DTensor replaced by its stacked components and the DTensors whose layouts
    the results take (None for an in-place op), or a string saying why the lists do not line up."""
    named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
    reference = next(v for v in named.values() if _is_tensor_list(v) and v)
    reference_keys = [getattr(t, "_key", None) for t in reference]
    if None in reference_keys:
        return "its first tensor list holds plain tensors; distribute them first with spmd.copy_to_mesh"
    in_place = not func._schema.returns
    resolve = fused  # a foreach op leaves pending reductions to the element rules, which may keep them
    if not resolve and any(t._pending for t in reference):
        return "a pending reduction"
    if in_place and any(t._copied_view for t in reference):
        return "an in-place write to a view that does not share memory with its base"
    reference_stacks = [t._local for t in reference]
    if resolve:
        reference_keys = [t._key for t in reference]  # (resolved: no pending reduction in them any more)
    stacked = {}
    for argument in func._schema.arguments:
        name, value = argument.name, named.get(argument.name)
        if value is reference:
            value = reference_stacks
        elif _is_tensor_list(value):
            # an input read (not written) may be relayouted to the written tensor's layout, as the element rules do
            relayout = in_place and not _written(argument, named)
            value = _stacks(value, reference, reference_keys, relayout, resolve, name)
        elif isinstance(value, DTensor):
            value = _scalar_stack(value, name)
        elif isinstance(value, torch.Tensor) and name not in _PLAIN_ARGUMENTS:
            value = f"the plain tensor {name} (shape {list(value.shape)})"
        if isinstance(value, str):
            return value
        stacked[name] = value
    positional = [stacked[a.name] for a in func._schema.arguments[:len(args)]]
    return positional, {k: stacked[k] for k in kwargs}, (None if in_place else reference)


def _written(argument, named) -> bool:
    """Whether the op writes this argument (a fused step writes its gradients only to unscale them)."""
    if argument.name == "grads":
        return named.get("grad_scale") is not None
    return argument.alias_info is not None and argument.alias_info.is_write


def _stacks(tensors, reference, reference_keys, relayout: bool, resolve: bool, name: str):
    """The stacked components of a list of tensors laid out as the `reference` list, or why not."""
    if [getattr(t, "_key", None) for t in tensors] == reference_keys:  # the common case: layout, shape, dtype equal
        return [t._stack for t in tensors]  # (the reference's keys hold no pending reduction)
    stacks = [_stack(t, ref, relayout, resolve, name) for t, ref in zip(tensors, reference)]
    return next((s for s in stacks if isinstance(s, str)), stacks)


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
    return [DTensor(o, r._layout, r.shape) for o, r in zip(out, reference)]


def _is_tensor_list(value) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


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
