"""Helpers the rules share: argument normalisation, kernels that call the op on stacked components, and
constants a kernel needs (shard offsets)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch._dispatch.python import no_python_dispatcher
from torch.utils._python_dispatch import _disable_current_modes

from spmd.dtensor import DTensor
from spmd.engine.decision import Decision, Kernel, OpCall, TensorSpec
from spmd.engine.validate import named_for_the_user
from spmd.mesh import axis_dims


def norm_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def norm_dims(dims, rank: int) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({norm_dim(d, rank) for d in dims}))


def replace_tensors(args, kwargs, locals_):
    """args/kwargs with each TensorSpec/DTensor replaced, in dispatcher order, by the next local tensor."""
    it = iter(locals_)

    def sub(a):
        if isinstance(a, (TensorSpec, DTensor)):
            return next(it)
        if isinstance(a, (list, tuple)) and any(isinstance(x, (TensorSpec, DTensor)) for x in a):
            return type(a)(sub(x) for x in a)
        return a

    new_args = tuple(sub(a) for a in args)
    new_kwargs = {k: sub(v) for k, v in kwargs.items()} if kwargs else {}
    return new_args, new_kwargs


def _positional_slots(args, kwargs):
    """Positions of the DTensor arguments when all of them are top-level positional ones, else None."""
    if kwargs and any(isinstance(v, (DTensor, list, tuple)) for v in kwargs.values()):
        return None
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a) for a in args):
        return None
    return tuple(i for i, a in enumerate(args) if isinstance(a, DTensor))


def named_tensors(call: OpCall) -> list:
    """(argument name, TensorSpec) of each DTensor argument, in the order of the components a kernel gets
    (positional, then keyword)."""
    names = [a.name for a in call.func._schema.arguments]
    return ([(names[i], s) for i, s in enumerate(call.args) if isinstance(s, TensorSpec)]
            + [(n, s) for n, s in call.kwargs.items() if isinstance(s, TensorSpec)])


def keeps_pending_sum(decision: Decision, spec: TensorSpec, any_sum: bool = False) -> Decision:
    """`decision` leaving input 0's pending gradient sum (one backward made: `TensorSpec.gradient`; with `any_sum`,
    any pending sum) unresolved, where the op reads that input in its own layout and reduces nothing itself: the op
    is linear in it, so its result is the sum of the op on each summand, left pending for later (on a smaller
    tensor, or at the leaf)."""
    if not spec.pending or not (spec.gradient or any_sum) or decision.reduce \
            or tuple(decision.inputs[0]) != tuple(spec.axes):
        return decision
    return dataclasses.replace(decision, keeps=(0,), reduce=(spec.pending,))


def per_device(func, l, a, k, count: int, written: tuple[int, ...] = ()):
    """`func` on each local device's components, restacked (None outputs stay None; an op returning nothing
    returns None). `written`: the components `func` writes, which it gets as copies, stacked back into `l`'s after
    (in a traced graph torch's inductor miscompiles a custom op's writes into views of one stack, and into clones
    of them, which it drops: pytorch/pytorch#198031; a pointwise copy it keeps)."""
    outs, parts = [], []
    for d in range(count):
        parts.append([_kept_copy(t[d]) if j in written else t[d] for j, t in enumerate(l)])
        args, kwargs = replace_tensors(a, k, parts[-1])
        outs.append(func(*args, **kwargs))
    for j in written:
        l[j].copy_(torch.stack([p[j] for p in parts]))
    if outs[0] is None:
        return None
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs)
    return tuple(None if o[0] is None else torch.stack(o) for o in zip(*outs))


def _kept_copy(x: torch.Tensor) -> torch.Tensor:
    return x.logical_or(False) if x.dtype == torch.bool else x * 1


def raise_if_kernel_refuses(func, dtype: torch.dtype, rank: int, *args) -> None:
    """Raises torch's own error where its kernel of `func` does not take `dtype` (meta kernels, which check the
    arguments first, do not check dtypes), by running it on one element of that dtype (on the CPU, outside any
    trace: a trace would run the meta kernel)."""
    with _disable_current_modes(), no_python_dispatcher():
        func(torch.zeros((1,) * rank, dtype=dtype), *args)


# reduced-precision floats, which torch's CPU kernels compute in float32 and round once
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


class _Scalar:
    """The `pad` of a replicated 0-d operand among higher-rank ones: its one value, 0-d, so that torch promotes
    dtypes as for a 0-d tensor (`bf16 * f32_0d` is bf16), not as for the stack of every device's copy."""

    def __repr__(self) -> str:
        return "SCALAR"


SCALAR = _Scalar()


def broadcast_view(x: torch.Tensor, pad: int | _Scalar | None) -> torch.Tensor:
    """Stacked components `(L, *local)` viewed as `(L, 1, ..., 1, *local)` with `pad` ones: right-aligned to a
    higher rank (or, for SCALAR, the one value). (Shaped from the components themselves, so that a decision holds
    on finer blocks too: see engine/multi_axis.py.)"""
    if pad is SCALAR:
        return x[0]
    return x if pad is None else x.view(_padded_shape(x, pad))


def _padded_shape(x: torch.Tensor, pad: int) -> tuple:
    return (x.shape[0],) + (1,) * pad + tuple(x.shape[1:])  # (a tuple: `view` parses a torch.Size more slowly)


def generic_kernel(func, arg_overrides: dict | None = None, kwarg_overrides: dict | None = None,
                   pads: tuple | None = None) -> Kernel:
    """Calls `func` on local components: DTensors replaced in order (optionally right-aligned to a higher rank
    with `pads`' axes of 1, see `aligned_inputs`), then positional/keyword arguments overridden by static local
    values."""
    names = [a.name for a in func._schema.arguments]
    op = getattr(func, "_op", func)  # the C++ callable: skips OpOverload.__call__
    overrides = [(i, v) for i, v in (arg_overrides or {}).items()]
    slots = []  # filled on the first call: the argument structure is fixed for one cache key
    views = []  # so are the components' shapes: `pads` as view shapes, from the first call's components

    def kernel(locals_, args, kwargs):
        if pads is not None:
            if not views:
                views.append([p if p is None or p is SCALAR else _padded_shape(x, p) for x, p in zip(locals_, pads)])
            locals_ = [x if v is None else x[0] if v is SCALAR else x.view(v) for x, v in zip(locals_, views[0])]
        if not slots:
            slots.append(_positional_slots(args, kwargs))
        positions = slots[0]
        if positions is None:
            a, kw = replace_tensors(args, kwargs, locals_)
            a = list(a)
        else:
            a, kw = list(args), kwargs
            for j, i in enumerate(positions):
                a[i] = locals_[j]
        for i, v in overrides:
            if i < len(a):
                a[i] = v
            else:
                kw = {**kw, names[i]: v}
        if kwarg_overrides:
            kw = {**kw, **kwarg_overrides}
        return op(*a, **kw)

    def specialize(args, kwargs):
        """A kernel without the general argument rewriting, for the common leading-DTensors call shapes."""
        if pads is not None or overrides or kwarg_overrides:
            return kernel
        positions = _positional_slots(args, kwargs)
        if positions == (0,):
            return (lambda l, a, k: op(l[0])) if len(args) == 1 and not kwargs else \
                (lambda l, a, k: op(l[0], *a[1:], **k))
        if positions == (0, 1):
            return (lambda l, a, k: op(l[0], l[1])) if len(args) == 2 and not kwargs else \
                (lambda l, a, k: op(l[0], l[1], *a[2:], **k))
        return kernel

    kernel.specialize = specialize
    return kernel


def constant(build: Callable[[], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor a kernel needs that depends only on its decision (e.g. each device's first index of a shard):
    `get(like)` builds it once for eager runs, and anew whenever the kernel runs inside a trace (on fake or
    traced components, `like`), so that a cached decision never mixes real and traced tensors."""
    cached: list = []

    def get(like: torch.Tensor) -> torch.Tensor:
        if type(like) is not torch.Tensor:
            return build()
        if not cached:
            cached.append(build())
        return cached[0]
    return get


def shard_starts(call: OpCall, mesh_dim: str, block: int, ndim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per local device, the first global index of its block along an axis sharded over `mesh_dim` (blocks of
    `block` elements), shaped `(L, 1, ..., 1)` with `ndim` trailing ones to broadcast over a component; a
    `constant`."""
    starts = block_starts(call, mesh_dim, block)
    shape = (call.num_local,) + (1,) * ndim
    return constant(lambda: torch.tensor(starts, device=call.mesh.torch_device).view(shape))


def check_in_range(index: torch.Tensor, size: int, error: type, message: str, negative: bool = False,
                   ignored: int | None = None) -> None:
    """torch's error where an index of an axis of `size` falls outside it (from -size where `negative`; the value
    `ignored` is allowed), for a kernel that maps indices to each device's block and would otherwise drop such an
    index without a word. Raised at once for real CPU tensors, as torch's kernels raise it (`message` formatted with
    the first bad index); elsewhere, and inside a trace, an asynchronous assert, as torch's CUDA kernels report it."""
    inside = (index >= (-size if negative else 0)) & (index < size)
    if ignored is not None:
        inside |= index == ignored
    everywhere = inside.all()
    if type(everywhere) is torch.Tensor and everywhere.device.type == "cpu":  # (a trace makes even a constant's fake)
        if not everywhere:
            raise named_for_the_user(error(message.format(index[~inside][0].item())))
    else:
        torch._assert_async(everywhere, message.format("(some index)"))


def first_device(call: OpCall, mesh_dims: tuple, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Whether each local device is the first along every mesh dim of `mesh_dims`, shaped `(L, 1, ..., 1)` (where
    a sum over those mesh dims counts a replicated term once)."""
    starts = [shard_starts(call, m, 1, rank) for m in mesh_dims]

    def get(like: torch.Tensor) -> torch.Tensor:
        out = torch.ones((call.num_local,) + (1,) * rank, dtype=torch.bool, device=like.device)
        for s in starts:
            out = out & (s(like) == 0)
        return out
    return get


def block_starts(call: OpCall, axis, block: int) -> list[int]:
    """Per local device, the first global index of its block along a tensor axis sharded over `axis` (a mesh dim,
    several, row-major as a layout orders them, or None: 0 on every device)."""
    mesh = call.mesh
    base, dims = mesh.min_global_device_id(), axis_dims(axis)
    starts = []
    for device in mesh.local_device_ids():
        location, index = mesh.device_location(device - base), 0
        for d in dims:
            index = index * mesh.dim_size(d) + location[mesh.axis_index(d)]
        starts.append(index * block)
    return starts


def zero_d_as_one_element(rule: Callable) -> Callable:
    """For a rule of an op along a `dim`: torch reads a 0-d `self` as one element along dim 0 (`cumsum(0)`,
    `flip(0)`, `index_select(0, i)` of a 0-d tensor), so decide as for shape (1,) and view each 0-d component so;
    the results, 1-element along the new axis, are 0-d again. A plain 0-d tensor among the operands (the
    `zeros(())` that torch 2.11's max/sort/topk gradients scatter into) is one element on every device."""
    def decide(call: OpCall):
        if call.specs[0].rank:
            return rule(call)
        zero_d = [s.rank == 0 for s in call.specs]
        one = dataclasses.replace(call, args=tuple(_one_element(a) for a in call.args),
                                  kwargs={k: _one_element(v) for k, v in call.kwargs.items()})
        decision = rule(one)
        inner = _with_plain_as_components(decision.kernel, call)

        def kernel(locals_, args, kwargs):
            out = inner([x.unsqueeze(1) if z else x for x, z in zip(locals_, zero_d)], args, kwargs)
            return out.squeeze(1) if isinstance(out, torch.Tensor) else type(out)(o.squeeze(1) for o in out)
        return dataclasses.replace(
            decision, kernel=kernel, inputs=tuple(() if z else axes for z, axes in zip(zero_d, decision.inputs)),
            outputs=tuple(None if o is None else () for o in decision.outputs))
    decide.__name__, decide.__doc__ = rule.__name__, rule.__doc__
    return decide


def _with_plain_as_components(kernel: Kernel, call: OpCall) -> Kernel:
    """`kernel` given each plain 0-d tensor argument as stacked one-element components `(L, 1)`."""
    def plain(a):
        return isinstance(a, torch.Tensor) and not isinstance(a, DTensor)

    if not any(plain(a) for a in list(call.args) + list(call.kwargs.values())):
        return kernel

    n = call.num_local

    def stacked(a):
        return a.reshape(1, 1).expand(n, 1) if plain(a) else a
    return lambda l, a, k: kernel(l, tuple(map(stacked, a)), {name: stacked(v) for name, v in k.items()})


def _one_element(a):
    return TensorSpec((None,), (1,), a.dtype, a.pending) if isinstance(a, TensorSpec) and not a.shape else a
