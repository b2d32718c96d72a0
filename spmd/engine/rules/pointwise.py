"""Pointwise ops: each output element depends on the same element of every (broadcast) operand.

Why the rule holds: slicing commutes with elementwise maps, so any sharding of the output can be computed
locally once every operand has the same sharding (broadcast axes of size 1 stay unsharded).
Output layout (TF's elementwise rule): operands are right-aligned; per axis the first operand's sharding
wins; a mesh dim that would shard two different output axes shards neither. In-place ops keep `self`'s layout.
"""

from __future__ import annotations

import dataclasses

import torch

from spmd.engine.registry import register, register_family
from spmd.engine.decision import Decision, OpCall, TensorSpec, is_inplace, unsupported
from spmd.engine.rules.common import SCALAR, generic_kernel
from spmd.layout import axis_dims

aten = torch.ops.aten


def broadcast_shape(shapes) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes])) if shapes else ()


def merge_axes(specs: list[TensorSpec], out_shape: tuple[int, ...]) -> tuple:
    r = len(out_shape)
    claims: dict = {}  # mesh dim -> output axes it shards in some operand
    first: list = [None] * r
    for s in specs:
        for j, m in enumerate(s.axes):
            i = j + r - s.rank
            if m is None or (s.shape[j] == 1 and out_shape[i] != 1):
                continue
            claims.setdefault(m, set()).add(i)
            if first[i] is None:
                first[i] = m
    conflicted = {i for axes in claims.values() if len(axes) > 1 for i in axes}
    out = [None if i in conflicted else m for i, m in enumerate(first)]
    # a mesh dim may still appear twice if it lost on one axis and won on another: keep it on the first
    seen = set()
    for i, m in enumerate(out):
        if m is not None:
            if m in seen:
                out[i] = None
            seen.add(m)
    return tuple(out)


def aligned_inputs(specs: list[TensorSpec], out_axes: tuple, out_shape: tuple, scalars: tuple = ()):
    """Per operand: the axes it must have for `out_axes`, and how many axes of 1 right-align its rank (None for
    none; SCALAR for the 0-d operands of indices `scalars`, replicated ones: see `broadcast_view`)."""
    r = len(out_shape)
    inputs, pads = [], []
    for i, s in enumerate(specs):
        axes = tuple(None if (s.shape[j] == 1 and out_shape[j + r - s.rank] != 1) else out_axes[j + r - s.rank]
                     for j in range(s.rank))
        inputs.append(axes)
        pads.append(SCALAR if i in scalars else None if s.rank == r else r - s.rank)
    return tuple(inputs), tuple(pads)


# elementwise ops whose native_functions.yaml entries lack torch's `pointwise` tag (torch tags the ops it wrote
# as TensorIterator kernels with a generated lowering; these have hand-written kernels or are rarely fused):
# taken as tagged, so their in-place overloads and their gradients join the family too (torch 2.13 tags leaky_relu,
# 2.11 does not). prelu's weight is viewed by torch to broadcast over the channel axis, and its backward returns
# both gradients at the broadcast shape (autograd sums the weight's).
_UNTAGGED = {aten.rsub.Tensor, aten.floor_divide.default, aten.floor_divide.Scalar, aten.fill.Scalar,
             aten.hardswish.default, aten.leaky_relu.default, aten._prelu_kernel.default,
             aten._prelu_kernel_backward.default}


def _tagged(func) -> bool:
    return torch.Tag.pointwise in func.tags or func in _UNTAGGED


def is_pointwise(func) -> bool:
    """Ops tagged pointwise, and the untagged ones of the family: in-place overloads of pointwise ops
    (`masked_fill_.Scalar`) and the gradients of elementwise maps with one output (`softplus_backward`: the
    derivative is elementwise too)."""
    if _tagged(func):
        return True
    name = func._schema.name.split("::")[-1]
    if name.endswith("_") or name.startswith("__i"):  # add_.Tensor, floor_divide_.Tensor, __irshift__.Scalar
        packet = getattr(torch.ops.aten, "__" + name[3:] if name.startswith("__i") else name[:-1], None)
        # the functional overload of the same name, or `default` for an in-place `Tensor` one (floor_divide)
        names = (func._overloadname, "default") if func._overloadname == "Tensor" else (func._overloadname,)
        return packet is not None and any(_tagged(getattr(packet, n)) for n in names if hasattr(packet, n))
    if name.endswith("_backward") and len(func._schema.returns) == 1:
        forward = getattr(torch.ops.aten, name[:-len("_backward")], None)
        return forward is not None and any(_tagged(getattr(forward, o)) for o in forward.overloads())
    return False


@register_family(is_pointwise, floats_at_run_time=True, blockwise=True)
def pointwise_rule(call: OpCall) -> Decision:
    specs = call.specs
    if any(a.alias_info is not None and a.alias_info.is_write for a in call.func._schema.arguments[1:]):
        raise unsupported(call, "out= variants are not supported; use the functional form")
    out_shape = broadcast_shape([s.shape for s in specs])
    inplace = is_inplace(call.func)
    out_axes = specs[0].axes if inplace else merge_axes(specs, out_shape)
    if inplace and specs[0].shape != out_shape:
        raise unsupported(call, "in-place op whose result would broadcast self")
    n_out = len(call.func._schema.returns)  # frexp: mantissa and exponent
    keeps, dims = _linear_in_pending(call, specs, out_axes) if n_out == 1 else ((), ())
    # a 0-d operand among higher-rank ones holds one value on every device (once its pending sum is resolved)
    scalars = tuple(i for i, s in enumerate(specs) if not s.shape and out_shape and i not in keeps)
    inputs, pads = aligned_inputs(specs, out_axes, out_shape, scalars)
    kernel = generic_kernel(call.func, pads=pads if any(p is not None for p in pads) else None)
    if n_out > 1:
        return Decision(inputs, (out_axes,) * n_out, kernel, single=False)
    return Decision(inputs, (out_axes,), kernel, inplace=inplace, keeps=keeps, reduce=(dims,) if keeps else ())


# functional ops linear in their pending-sum operands (f(sum of p) = sum of f(p)), by which operands: "both"
# operands pending over the same dims (a sum of sums), "either" one of them (the other is a factor), or the
# "first" (scaled, or a numerator)
_LINEAR = {aten.add.Tensor: "both", aten.add_.Tensor: "both", aten.sub.Tensor: "both", aten.mul.Tensor: "either", aten.div.Tensor: "first",
           aten.neg.default: "first", aten.mul.Scalar: "first", aten.div.Scalar: "first"}


def _linear_in_pending(call: OpCall, specs: list[TensorSpec], out_axes: tuple):
    """(input indices, mesh dims) of a pending sum the op passes through unresolved; ((), ()) where it cannot."""
    kind = _LINEAR.get(call.func)
    dims = next((s.pending for s in specs if s.pending), ())
    # a device holds a partial sum of its block; an output sharded over a summed dim would mix different blocks
    if kind is None or not dims or set(dims) & {d for m in out_axes for d in axis_dims(m)}:
        return (), ()
    pending = [s.pending for s in specs]
    if any(p and not s.shape and any(o.dtype != s.dtype for o in specs) for p, s in zip(pending, specs)):
        return (), ()  # a pending 0-d operand of another dtype: resolved, so that torch promotes it as one value
    if kind == "both":
        linear = len(specs) == 2 and all(isinstance(a, TensorSpec) for a in call.args[:2]) and \
            pending == [dims, dims]
    elif kind == "either":
        linear = sum(bool(p) for p in pending) == 1
    else:
        linear = isinstance(call.args[0], TensorSpec) and pending[0] == dims and not any(pending[1:])
    return (tuple(i for i, p in enumerate(pending) if p), dims) if linear else ((), ())


def like_rule(call: OpCall) -> Decision:
    """Ops whose output has the layout of their first input, computed independently per component."""
    specs = call.specs
    axes = specs[0].axes
    return Decision(tuple(axes if i == 0 else s.axes for i, s in enumerate(specs)), (axes,),
                    _in_memory_format(call, generic_kernel(call.func)), inplace=is_inplace(call.func))


def _in_memory_format(call: OpCall, kernel):
    """A channels-last `memory_format` names the global rank (4, or 5 for 3-d), which the stacked components
    exceed by one: the kernel runs in the contiguous format, then each component is laid out channels last."""
    if call.kwargs.get("memory_format") not in (torch.channels_last, torch.channels_last_3d):
        return kernel
    contiguous = generic_kernel(call.func, kwarg_overrides={"memory_format": torch.contiguous_format})
    rank = call.specs[0].rank + 1
    channels_last = (0, 1) + tuple(range(3, rank)) + (2,)  # (L, N, C, *spatial) -> (L, N, *spatial, C)
    back = tuple(channels_last.index(i) for i in range(rank))
    return lambda l, a, k: contiguous(l, a, k).permute(channels_last).contiguous().permute(back)


register(aten.clone, aten.alias, aten.detach, aten.lift_fresh, aten.fill_, aten.zero_, aten.positive,
         aten.conj_physical, floats_at_run_time=True, blockwise=True)(like_rule)


@register(aten._conj.default, aten._neg_view.default)
def lazy_view_rule(call: OpCall) -> Decision:
    """torch's lazy conjugate and negation are bits on a tensor that its kernels read; a DTensor's components
    must not carry them (the wrapper, which torch checks, would not), so the values are computed. The result is
    then a copy, not a view: an in-place op on it is refused rather than lost."""
    axes = call.specs[0].axes
    compute = torch.conj_physical if call.func is aten._conj.default else torch.neg
    return Decision((axes,), (axes,), lambda l, a, k: compute(l[0]), copies=True)


@register(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, floats_at_run_time=True, blockwise=True)
def value_free_like_rule(call: OpCall) -> Decision:
    """`ones_like` and kin read only their input's layout and shape: a pending sum stays pending for its readers."""
    decision = like_rule(call)
    return dataclasses.replace(decision, keeps=(0,)) if call.specs[0].pending else decision


@register(aten._to_copy.default, blockwise=True)
def to_copy_rule(call: OpCall) -> Decision:
    device = call.kwargs.get("device")
    if device is not None and torch.device(device) != call.mesh.torch_device:
        raise unsupported(call, f"it moves the tensor to {device}, but the mesh's components live on "
                                f"{call.mesh.torch_device}; create a mesh on that device and use copy_to_mesh")
    return like_rule(call)


@register(aten.copy_.default, blockwise=True)
def copy_rule(call: OpCall) -> Decision:
    if len(call.specs) == 1:  # from a plain 0-d tensor (`x[0, 1] = 7.0`): a scalar every device writes
        dst = call.specs[0]
        return Decision((dst.axes,), (dst.axes,), generic_kernel(call.func), inplace=True)
    dst, src = call.specs
    inputs, pads = aligned_inputs([dst, src], dst.axes, dst.shape)
    return Decision(inputs, (dst.axes,), generic_kernel(call.func, pads=pads), inplace=True)
