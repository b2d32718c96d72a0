"""View and shape ops: reshape, permute, squeeze/unsqueeze, expand, slicing, cat, split, unbind.

Why the rules hold: these ops move elements without combining them, so a sharded axis survives whenever its
blocks map onto contiguous blocks of output axes (permute, unsqueeze, expand of other axes, a reshape that
keeps each device's elements one block: engine/rules/reshapes.py). Otherwise the axis is gathered first: the
answer never depends on the layout. The same holds for an axis sharded over several mesh dims (`"x+y"`: its blocks
are ordered as one mesh dim of their product's size), so the rules that move axes whole, and the reshapes, are
registered `multi_axis`: a view of such an axis keeps it, instead of gathering its minor mesh dims.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from spmd.dtensor import dense_strides
from spmd.engine.registry import lookup, register
from spmd.engine.decision import Decision, OpCall, TensorSpec, is_inplace, unsupported
from spmd.engine.rules.common import (block_starts, check_in_range, constant, first_device, generic_kernel,
                                      keeps_pending_sum, norm_dim, shard_starts, zero_d_as_one_element)
from spmd.engine.rules.reduction import arg, arg_index
from spmd.engine.rules.reshapes import reshape_axes
from spmd.layout import axis_dims

aten = torch.ops.aten


def _infer_size(size, numel: int) -> tuple:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return tuple(size)


# view ops that rearrange their whole input: they pass any pending sum on, and the dispatcher resolves such a view
# through its base (an in-place write into one reaches its base through the op's inverse, engine/dispatch.py)
REARRANGING_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._reshape_alias.default,
                               aten.permute.default, aten.transpose.int, aten.t.default})


def keeps_pending(rule):
    """`rule` for a view op that passes a pending sum through when its input needs no relayout: the view of a sum is
    the sum of the views, so the sum stays pending for the consumer that reduces it where it is cheapest (a
    sequence-parallel relayout: one reduce-scatter; a gradient's bucket at its leaf) instead of being all-reduced
    by the view. Such a view holds its base's unreduced components and is marked `copies`: its reduction and an
    in-place write into it go through its base (engine/dispatch.py), so that view and base share the reduced memory,
    as torch's do, and one reduction serves both. Views without such a way back (squeeze, unsqueeze) pass only a
    gradient's sum (one backward made, `TensorSpec.gradient`: nothing writes it) and resolve other pending inputs
    first. `_unsafe_view` reshapes a temporary no one else holds (a matrix product's result, on its way out of
    `linear` or `matmul` of a 3-D input): any sum passes, unmarked."""
    def with_pending(call: OpCall) -> Decision:
        decision, spec = rule(call), call.specs[0]
        if call.func is aten._unsafe_view.default:
            return keeps_pending_sum(decision, spec, any_sum=True)
        kept = keeps_pending_sum(decision, spec, any_sum=call.func in REARRANGING_VIEWS)
        return decision if kept is decision else replace(kept, copies=True)
    with_pending.__doc__ = rule.__doc__
    return with_pending


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
          multi_axis=True)
@keeps_pending
def view_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    out_shape = _infer_size(arg(call, "size"), math.prod(spec.shape))
    need, out = reshape_axes(spec.shape, spec.axes, out_shape, call.shards)
    local = (call.num_local,) + call.local_shape(out_shape, out)
    return Decision((need,), (out,), lambda l, a, k: l[0].reshape(local))


@register(aten.expand.default, multi_axis=True)
def expand_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    size = list(arg(call, "size"))
    lead = len(size) - spec.rank
    shape = [spec.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    need = tuple(None if spec.shape[j] != shape[j + lead] else m for j, m in enumerate(spec.axes))
    out = (None,) * lead + need
    local = (call.num_local,) + call.local_shape(tuple(shape), out)
    aligned = (call.num_local,) + (1,) * lead + call.local_shape(spec, need)  # new leading axes after the stack
    return Decision((need,), (out,), lambda l, a, k: l[0].view(aligned).expand(local))


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(call: OpCall) -> Decision:
    """Each operand expanded to the common shape, as torch's eager decomposition does (traced under the Python
    dispatcher, the op can reach a DTensor whole: `F.mse_loss` broadcasts its operands first)."""
    shape = torch.broadcast_shapes(*[s.shape for s in call.specs])
    expands = [expand_rule(replace(call, func=aten.expand.default, args=(s, shape), kwargs={})) for s in call.specs]
    kernels = [d.kernel for d in expands]
    return Decision(tuple(d.inputs[0] for d in expands), tuple(d.outputs[0] for d in expands),
                    lambda l, a, k: [kernel([x], a, k) for kernel, x in zip(kernels, l)], single=False)


@register(aten.permute.default, multi_axis=True)
@keeps_pending
def permute_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dims = [norm_dim(d, spec.rank) for d in arg(call, "dims")]
    local = [0] + [d + 1 for d in dims]
    return Decision((spec.axes,), (tuple(spec.axes[d] for d in dims),), lambda l, a, k: l[0].permute(local))


@register(aten.transpose.int, aten.t.default, multi_axis=True)
@keeps_pending
def transpose_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    if spec.rank < 2:
        return Decision((spec.axes,), (spec.axes,), lambda l, a, k: l[0])
    d0, d1 = (0, 1) if call.func is aten.t.default else (norm_dim(arg(call, "dim0"), spec.rank),
                                                         norm_dim(arg(call, "dim1"), spec.rank))
    axes = list(spec.axes)
    axes[d0], axes[d1] = axes[d1], axes[d0]
    return Decision((spec.axes,), (tuple(axes),), lambda l, a, k: l[0].transpose(d0 + 1, d1 + 1))


@register(aten.unsqueeze.default, multi_axis=True)
@keeps_pending
def unsqueeze_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = norm_dim(arg(call, "dim"), spec.rank + 1)
    out = spec.axes[:dim] + (None,) + spec.axes[dim:]
    return Decision((spec.axes,), (out,), lambda l, a, k: l[0].unsqueeze(dim + 1))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, multi_axis=True)
@keeps_pending
def squeeze_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dims = arg(call, "dim")
    dims = range(spec.rank) if dims is None else ([dims] if isinstance(dims, int) else dims)
    # squeeze by the global shape: a sharded axis can have local size 1 without being squeezable
    drop = tuple(sorted({norm_dim(d, spec.rank) for d in dims if spec.rank and spec.shape[norm_dim(d, spec.rank)]
                         == 1}))
    out = tuple(m for i, m in enumerate(spec.axes) if i not in drop)
    local = tuple(d + 1 for d in drop)
    return Decision((spec.axes,), (out,), lambda l, a, k: l[0].squeeze(local) if local else l[0])


@register(aten.slice.Tensor, multi_axis=True)
def slice_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = norm_dim(arg(call, "dim", 0), spec.rank)
    start, end, step = arg(call, "start"), arg(call, "end"), arg(call, "step", 1) or 1
    size = spec.shape[dim]
    full = step == 1 and (start in (None, 0) or start <= -size) and (end is None or end >= size)
    axes = spec.axes if full else tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    return Decision((axes,), (axes,), lambda l, a, k: aten.slice.Tensor(l[0], dim + 1, start, end, step))


@register(aten.select.int, multi_axis=True)
def select_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim, index = norm_dim(arg(call, "dim"), spec.rank), arg(call, "index")
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    return Decision((axes,), (axes[:dim] + axes[dim + 1:],), lambda l, a, k: l[0].select(dim + 1, index))


def _merged(specs, skip: int | None = None) -> tuple:
    """Per axis the first operand's sharding (axis `skip` unsharded); a mesh dim on two axes shards neither."""
    r = specs[0].rank
    out, owners = [None] * r, {}
    for s in specs:
        for i, m in enumerate(s.axes):
            if i != skip and m is not None:
                for d in axis_dims(m):
                    owners.setdefault(d, set()).add(i)
                if out[i] is None:
                    out[i] = m
    return tuple(None if m is not None and any(len(owners[d]) > 1 for d in axis_dims(m)) else m for m in out)


@register(aten.cat.default, multi_axis=True)
def cat_rule(call: OpCall) -> Decision:
    """torch skips legacy empty operands (shape [0], e.g. an empty KV cache), whatever the others' rank: so does
    the kernel (their stacked components are 2-D), and they keep their layout."""
    specs = call.specs
    kept = [i for i, s in enumerate(specs) if s.shape != (0,)] or list(range(len(specs)))
    dim = norm_dim(arg(call, "dim", 0), specs[kept[0]].rank)
    out = _merged([specs[i] for i in kept], skip=dim)
    if len(kept) == len(specs):
        return Decision((out,) * len(specs), (out,), lambda l, a, k: torch.cat(l, dim + 1))
    inputs = tuple(out if i in kept else None for i in range(len(specs)))
    return Decision(inputs, (out,), lambda l, a, k: torch.cat([l[i] for i in kept], dim + 1))


@register(aten.stack.default, multi_axis=True)
def stack_rule(call: OpCall) -> Decision:
    """Operands of one shape, sharded alike, stack piecewise; the new axis is unsharded. Plain 0-d operands
    among 0-d ones (the zeros a derivative formula makes: unbind's gradient) are one element on every device."""
    specs, operands = call.specs, arg(call, "tensors")
    dim = norm_dim(arg(call, "dim", 0), specs[0].rank + 1)
    axes = _merged(specs)
    out = (axes[:dim] + (None,) + axes[dim:],)
    if len(specs) == len(operands):
        return Decision((axes,) * len(specs), out, lambda l, a, k: torch.stack(l, dim + 1))
    distributed, n = [isinstance(t, TensorSpec) for t in operands], call.num_local

    def kernel(l, a, k):
        it = iter(l)
        return torch.stack([next(it) if d else t.expand(n) for d, t in zip(distributed, a[0])], dim + 1)
    return Decision((axes,) * len(specs), out, kernel)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.unsafe_split.Tensor,
          aten.unsafe_split_with_sizes.default, multi_axis=True)
def split_rule(call: OpCall) -> Decision:
    """(`unsafe_split` shares memory as `split` does: torch only leaves its outputs untracked as views.)"""
    spec = call.specs[0]
    dim = norm_dim(arg(call, "dim", 0), spec.rank)
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    size = spec.shape[dim]
    if call.func is aten.unbind.int:
        n, out = size, axes[:dim] + axes[dim + 1:]
    elif call.func in (aten.split.Tensor, aten.unsafe_split.Tensor):
        split = arg(call, "split_size")
        n, out = max(1, -(-size // split)) if split else 1, axes
    else:
        n, out = len(arg(call, "split_sizes")), axes
    kernel = generic_kernel(call.func, arg_overrides={2 if call.func is not aten.unbind.int else 1: dim + 1})
    return Decision((axes,), (out,) * n, lambda l, a, k: tuple(kernel(l, a, k)), single=False)


@register(aten.slice_backward.default, multi_axis=True)
def slice_backward_rule(call: OpCall) -> Decision:
    """Zeros with the slice's gradient placed in: the sliced axis is whole on each device (unless the slice was
    the whole axis), other axes keep the gradient's sharding."""
    grad = call.specs[0]
    sizes, dim = tuple(arg(call, "input_sizes")), norm_dim(arg(call, "dim"), grad.rank)
    start, end, step = arg(call, "start"), arg(call, "end"), arg(call, "step")
    axes = grad.axes if grad.shape[dim] == sizes[dim] else tuple(None if i == dim else m
                                                                 for i, m in enumerate(grad.axes))
    local = (call.num_local,) + call.local_shape(sizes, axes)
    if grad.shape[dim] == sizes[dim]:
        return Decision((axes,), (axes,), lambda l, a, k: l[0].clone())
    return Decision((axes,), (axes,), lambda l, a, k: aten.slice_backward.default(l[0], local, dim + 1, start,
                                                                                     end, step))


@register(aten.select_backward.default, multi_axis=True)
def select_backward_rule(call: OpCall) -> Decision:
    """Zeros with the selected slice's gradient placed in: the new axis is unsharded, others keep their sharding."""
    grad = call.specs[0]
    sizes = tuple(arg(call, "input_sizes"))
    dim, index = norm_dim(arg(call, "dim"), len(sizes)), arg(call, "index")
    out = grad.axes[:dim] + (None,) + grad.axes[dim:]
    local = (call.num_local,) + call.local_shape(sizes, out)
    return Decision((grad.axes,), (out,), lambda l, a, k: aten.select_backward.default(l[0], local, dim + 1, index))


@register(aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
          aten.scatter_reduce.two)
@zero_d_as_one_element
def indexed_rule(call: OpCall) -> Decision:
    """gather/scatter along `dim`: indices address the whole axis, so it is unsharded; another axis may stay
    sharded where every operand has the same size on it (element i of it only meets element i)."""
    specs = call.specs
    dim = norm_dim(arg(call, "dim"), specs[0].rank)
    same = [i for i in range(specs[0].rank) if i != dim and len({s.shape[i] for s in specs}) == 1]
    merged = _merged(specs, skip=dim)
    axes = tuple(m if i in same else None for i, m in enumerate(merged))
    kernel = generic_kernel(call.func, arg_overrides={1: dim + 1})
    picked = _sharded_indices(call, dim, axes)
    if picked is None:
        return Decision((axes,) * len(specs), (axes,), kernel)
    rows = axes[:dim] + (picked,) + axes[dim + 1:]
    if call.func is aten.gather.default:  # each device reads its own indices' elements
        return Decision((axes, rows), (rows,), kernel)
    return _scatter_add_of_sharded_rows(call, dim, axes, picked, kernel)


def _scatter_add_of_sharded_rows(call: OpCall, dim: int, axes: tuple, picked, kernel) -> Decision:
    """`scatter_add` whose indices and source are sharded alike along `dim` (gather's gradient after a lookup of
    sharded indices): each device adds its own rows, and the result is a pending sum over those mesh dims. `self`
    is counted once: on their first device, or, sharded alike along `dim` (zeros made like the gradient), each
    device's block at its rows."""
    self_ = call.specs[0]
    rows = axes[:dim] + (picked,) + axes[dim + 1:]
    first = first_device(call, (picked,), self_.rank)
    if self_.axes[dim] != picked:
        def summing(locals_, args, kwargs):
            return kernel([torch.where(first(locals_[0]), locals_[0], 0), *locals_[1:]], args, kwargs)
        return Decision((axes, rows, rows), (axes,), summing, reduce=((picked,),))
    block = self_.shape[dim] // call.shards(picked)
    view = [1] * (self_.rank + 1)
    view[0], view[dim + 1] = call.num_local, block
    own_rows = _block_rows(call, picked, block, view)

    def placed(locals_, args, kwargs):
        x = locals_[0]
        shape = list(x.shape)
        shape[dim + 1] = self_.shape[dim]
        out = x.new_zeros(shape).scatter_add_(dim + 1, own_rows(x).expand(x.shape), x)
        return kernel([out, *locals_[1:]], args, kwargs)
    return Decision((rows, rows, rows), (axes,), placed, reduce=((picked,),))


def _sharded_indices(call: OpCall, dim: int, axes: tuple):
    """The sharding of `gather`'s indices along `dim` (of `scatter_add`'s, where its source's rows are sharded
    alike) that may stay: the sharded rows of a lookup, or of its gradient. None where they are whole, or where
    another axis is sharded over the same mesh dims."""
    specs = call.specs
    picked = specs[1].axes[dim]
    if picked is None or _shares_a_mesh_dim(picked, axes):
        return None
    if call.func is aten.gather.default:
        return picked
    if call.func is aten.scatter_add.default and specs[2].axes[dim] == picked and \
            specs[2].shape[dim] == specs[1].shape[dim]:
        return picked
    return None


@register(aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default)
@zero_d_as_one_element
def indexed_inplace_rule(call: OpCall) -> Decision:
    """scatter_ into a target that keeps its layout: it must not be sharded where the index is shorter than the
    target (other than along `dim`); the index and source take the target's sharding. Along a sharded `dim` the
    index and source are whole and each device writes the indices that fall in its block (the others into a
    scratch slot past its block, dropped)."""
    specs = call.specs
    dim = norm_dim(arg(call, "dim"), specs[0].rank)
    target = specs[0].axes
    if any(m is not None and i != dim and len({s.shape[i] for s in specs}) > 1 for i, m in enumerate(target)):
        raise unsupported(call, "the target is sharded where the index is shorter; relayout the target so that "
                                "those axes are unsharded")
    m = target[dim]
    if m is None:
        return Decision((target,) * len(specs), (target,), generic_kernel(call.func, arg_overrides={1: dim + 1}),
                        inplace=True)
    whole = tuple(None if i == dim else a for i, a in enumerate(target))
    block = specs[0].shape[dim] // call.shards(m)
    starts = shard_starts(call, m, block, specs[0].rank)
    d, size = dim + 1, specs[0].shape[dim]

    def kernel(locals_, args, kwargs):
        check_in_range(locals_[1], size, RuntimeError,
                       f"index {{}} is out of bounds for dimension {dim} with size {size}")
        local, index = locals_[0], locals_[1] - starts(locals_[1])
        index = index.masked_fill((index < 0) | (index >= block), block)  # outside this block: the scratch slot
        padded = torch.cat([local, local.narrow(d, 0, 1)], d)
        call.func(padded, d, index, *locals_[2:], *args[3 + len(locals_) - 2:], **kwargs)
        return local.copy_(padded.narrow(d, 0, block))
    return Decision((target,) + (whole,) * (len(specs) - 1), (target,), kernel, inplace=True)


def _shares_a_mesh_dim(sharding, axes: tuple) -> bool:
    """Whether an axis sharded as `sharding` would use a mesh dim that one of `axes` uses already."""
    return bool(set(axis_dims(sharding)) & {d for m in axes if m is not None for d in axis_dims(m)})


def _each_device(call: OpCall):
    """Each local device's position on the stack axis, `(L, 1)`: an advanced index that picks its own component."""
    return constant(lambda: torch.arange(call.num_local, device=call.mesh.torch_device).view(-1, 1))


def _block_rows(call: OpCall, mesh_dims, block: int, shape: tuple):
    """The global indices of each local device's block along an axis sharded over `mesh_dims`, `(L, block)`
    viewed as `shape`."""
    return constant(lambda: (torch.tensor(block_starts(call, mesh_dims, block), device=call.mesh.torch_device)
                             .view(-1, 1) + torch.arange(block, device=call.mesh.torch_device)).view(shape))


@register(aten.diagonal.default)
def diagonal_rule(call: OpCall) -> Decision:
    """A real view of each component: the two axes of the diagonal are unsharded (the result's last axis runs
    along both), the others keep their sharding."""
    spec = call.specs[0]
    d1, d2 = norm_dim(arg(call, "dim1"), spec.rank), norm_dim(arg(call, "dim2"), spec.rank)
    offset = arg(call, "offset")
    axes = tuple(None if i in (d1, d2) else m for i, m in enumerate(spec.axes))
    out = tuple(m for i, m in enumerate(axes) if i not in (d1, d2)) + (None,)
    return Decision((axes,), (out,), lambda l, a, k: l[0].diagonal(offset, d1 + 1, d2 + 1))


@register(aten.unfold.default)
def unfold_rule(call: OpCall) -> Decision:
    """Windows along `dimension` (a real view of each component): that axis is whole, as is the new trailing
    axis of window elements; the others keep their sharding. A 0-d input is one element along dimension 0."""
    spec = call.specs[0]
    if spec.rank == 0:
        return Decision(((),), ((None,),), lambda l, a, k: l[0].unsqueeze(1))
    dim, size, step = norm_dim(arg(call, "dimension"), spec.rank), arg(call, "size"), arg(call, "step")
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    return Decision((axes,), (axes + (None,),), lambda l, a, k: l[0].unfold(dim + 1, size, step))


@register(aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default)
def as_strided_rule(call: OpCall) -> Decision:
    """`as_strided` addresses the global tensor's memory, which only a replicated component holds whole: inputs
    are replicated, and each component is viewed with the requested strides at its own place in the stack, so
    the result is a real view (autograd's backward of a view writes through one). A sharded input is gathered
    first; the dispatcher then marks the result as a copy, and an in-place op on it is refused."""
    specs = call.specs
    whole = tuple((None,) * s.rank for s in specs)
    size, stride = tuple(arg(call, "size")), tuple(arg(call, "stride"))
    offset = arg(call, "storage_offset") or 0
    scatter = call.func is aten.as_strided_scatter.default

    def view(x):  # each component `x[j]` viewed as `x[j].as_strided(size, stride, offset)`
        if x.stride()[1:] != dense_strides(x, x.shape[1:]):  # not the memory the global strides describe
            x = x.contiguous()
        return x.as_strided((x.shape[0],) + size, (x.stride(0),) + stride, x.storage_offset() + offset)

    def kernel(locals_, args, kwargs):
        if scatter:
            out = locals_[0].clone()
            view(out).copy_(locals_[1])
            return out
        return view(locals_[0]).clone() if call.func is aten.as_strided_copy.default else view(locals_[0])
    out_rank = specs[0].rank if scatter else len(size)
    return Decision(whole, ((None,) * out_rank,), kernel)



@register(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default, multi_axis=True)
def triangle_rule(call: OpCall) -> Decision:
    """`tril`/`triu` in any layout, with no collective: a device whose block of the matrix axes starts at global
    row r0 and column c0 zeroes the elements on the dropped side of the diagonal shifted by c0 - r0."""
    spec = call.specs[0]
    inplace = is_inplace(call.func)
    rows, cols = spec.axes[-2:]
    if rows is None and cols is None:
        return Decision((spec.axes,), (spec.axes,), generic_kernel(call.func), inplace=inplace)
    n_rows, n_cols = call.local_shape(spec.shape, spec.axes)[-2:]
    shifts = [c - r for r, c in zip(block_starts(call, rows, n_rows), block_starts(call, cols, n_cols))]
    diagonal, lower = arg(call, "diagonal", 0), call.func in (aten.tril.default, aten.tril_.default)

    def build() -> torch.Tensor:
        device = call.mesh.torch_device
        above = (torch.arange(n_cols, device=device) - torch.arange(n_rows, device=device).view(-1, 1)
                 + torch.tensor(shifts, device=device).view(-1, 1, 1))  # global column - row, per device
        dropped = above > diagonal if lower else above < diagonal
        return dropped.view((call.num_local,) + (1,) * (spec.rank - 2) + (n_rows, n_cols))
    dropped = constant(build)

    def kernel(locals_, args, kwargs):
        x = locals_[0]
        return x.masked_fill_(dropped(x), 0) if inplace else x.masked_fill(dropped(x), 0)
    return Decision((spec.axes,), (spec.axes,), kernel, inplace=inplace)


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
          aten.new_empty_strided.default, multi_axis=True)
def new_factory_rule(call: OpCall) -> Decision:
    """`x.new_zeros(size)` and friends: a tensor of the given global size on x's mesh, with x's layout when it
    has x's shape (autograd builds a leaf's `.grad` with `grad.new_empty_strided(...).copy_(grad)`); zeros of x's
    rank have x's sharding on the axes of x's size (a gradient formula's zeros that it copies a slice of x into, as
    rfft's does); else replicated (circular padding writes x's slices along any axis into a `new_empty`)."""
    spec = call.specs[0]
    size = tuple(arg(call, "size"))
    out = (None,) * len(size)
    if len(size) == spec.rank and (size == spec.shape or call.func is aten.new_zeros.default):
        out = tuple(m if n == s else None for m, n, s in zip(spec.axes, size, spec.shape))
    local = (call.num_local,) + call.local_shape(size, out)
    if call.func is aten.new_empty_strided.default:
        kernel = lambda l, a, k: l[0].new_empty(local, dtype=k.get("dtype"))  # noqa: E731
    else:
        kernel = generic_kernel(call.func, arg_overrides={1: local})
    return Decision((spec.axes,), (out,), kernel)


@register(aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default,
          aten.transpose_.default, aten.t_.default, multi_axis=True)
def inplace_view_rule(call: OpCall) -> Decision:
    """`squeeze_` and friends (torch.matmul of a 1-D operand uses them): the out-of-place op's decision; the
    dispatcher then rebinds the DTensor to its result (an in-place view op returns self)."""
    name = call.func._schema.name.split("::")[-1][:-1]
    packet = getattr(aten, name)
    overload = call.func._overloadname  # transpose_ is `default`, its functional op `int`
    functional = getattr(packet, overload if overload in packet.overloads() else packet.overloads()[0])
    return replace(lookup(functional).rule(replace(call, func=functional)), rebinds=True)


def _whole(spec, dims) -> tuple:
    return tuple(None if i in dims else m for i, m in enumerate(spec.axes))


@register(aten.constant_pad_nd.default)
def pad_rule(call: OpCall) -> Decision:
    """Padding moves the elements of the padded axes only (the trailing ones): those are whole on each device."""
    spec, pad = call.specs[0], arg(call, "pad")
    dims = {spec.rank - 1 - i // 2 for i in range(len(pad)) if pad[i]}
    axes = _whole(spec, dims)
    return Decision((axes,), (axes,), generic_kernel(call.func))


@register(aten.roll.default, aten.flip.default)
@zero_d_as_one_element
def roll_rule(call: OpCall) -> Decision:
    """roll/flip move elements along their dims only (roll without dims: along the flattened tensor)."""
    spec = call.specs[0]
    given = arg(call, "dims")
    dims = {norm_dim(d, spec.rank) for d in given} if given else set(range(spec.rank))
    axes = _whole(spec, dims)
    local = [norm_dim(d, spec.rank) + 1 for d in given] if given else None
    if local is None:  # roll of the flattened tensor: roll each (whole) component flattened
        shifts = arg(call, "shifts")
        return Decision((axes,), (axes,), lambda l, a, k: l[0].flatten(1).roll(shifts, 1).view(l[0].shape))
    return Decision((axes,), (axes,), generic_kernel(call.func, arg_overrides={
        arg_index(call.func, "dims"): local}))


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> Decision:
    """Tiling keeps the sharding of axes repeated once; tiled axes are whole (new leading axes unsharded)."""
    spec, reps = call.specs[0], tuple(arg(call, "repeats"))
    lead = len(reps) - spec.rank
    axes = _whole(spec, {i for i in range(spec.rank) if reps[lead + i] != 1})
    view = (call.num_local,) + (1,) * lead + call.local_shape(spec, axes)
    return Decision((axes,), ((None,) * lead + axes,), lambda l, a, k: l[0].view(view).repeat((1,) + reps))


@register(aten.index_select.default)
@zero_d_as_one_element
def index_select_rule(call: OpCall) -> Decision:
    """Rows picked along `dim`: that axis is whole on each device, others keep sharding. Sharded indices (a batch
    of rows to look up) stay sharded where no other axis uses their mesh dims: each device picks its own rows, and
    the result's `dim` axis is sharded as the indices are."""
    spec, index = call.specs
    dim = norm_dim(arg(call, "dim"), spec.rank)
    axes = _whole(spec, {dim})
    picked = index.axes[0] if index.rank == 1 else None
    if picked is None or _shares_a_mesh_dim(picked, axes):
        return Decision((axes, (None,) * index.rank), (axes,),
                        lambda l, a, k: l[0].index_select(dim + 1, l[1][0].reshape(-1)))
    devices = _each_device(call)
    size = spec.shape[dim]

    def kernel(locals_, args, kwargs):
        x, rows = locals_[0].movedim(dim + 1, 1), locals_[1]
        check_in_range(rows, size, IndexError, "index out of range in self")  # (advanced indexing would wrap -1)
        return x[devices(rows), rows].movedim(1, dim + 1).contiguous()
    return Decision((axes, (picked,)), (axes[:dim] + (picked,) + axes[dim + 1:],), kernel)


_ADDS = (aten.index_add.default, aten.index_add_.default)


@register(aten.index_add.default, aten.index_copy.default, aten.index_reduce.default, aten.index_add_.default,
          aten.index_copy_.default, aten.index_reduce_.default)
@zero_d_as_one_element
def index_add_rule(call: OpCall) -> Decision:
    """index_select's gradient (and its siblings index_copy, index_reduce): rows of `source` added (copied,
    reduced) at replicated indices along `dim`, which is whole on each device; other axes are sharded alike in
    self and source (their sizes agree; a 0-d source of a one-element index is one element on every device).
    In place, self keeps its layout (`dim` must be whole in it) and source takes it."""
    self_, index, source = call.specs
    dim = norm_dim(arg(call, "dim"), self_.rank)
    inplace = is_inplace(call.func)
    if call.func is aten.index_add.default:
        summed = _index_add_of_sharded_rows(call, dim)
        if summed is not None:
            return summed
    if call.func in _ADDS and self_.axes[dim] is not None and source.rank == self_.rank:
        return _index_add_into_sharded_rows(call, dim, inplace)
    axes = tuple(None if i == dim else m for i, m in enumerate(self_.axes)) if inplace else \
        _merged([self_, source], skip=dim)
    source_axes = axes if source.rank == self_.rank else ()
    as_rows = (call.num_local,) + (1,) * self_.rank
    size = self_.shape[dim]

    def kernel(locals_, args, kwargs):
        rows = locals_[2] if source.rank == self_.rank else locals_[2].view(as_rows)
        index = locals_[1][0].reshape(-1)
        if call.func in _ADDS:  # (torch's kernel on the stacked components words it otherwise)
            check_in_range(index, size, RuntimeError,
                           f"index {{}} is out of bounds for dimension {dim} with size {size}")
        return call.func(locals_[0], dim + 1, index, rows, *args[4:], **kwargs)
    return Decision((axes, (None,) * index.rank, source_axes), (axes,), kernel, inplace=inplace)


def _index_add_into_sharded_rows(call: OpCall, dim: int, inplace: bool) -> Decision:
    """`index_add` into a `self` sharded along `dim` (a mixture-of-experts layer adding each expert's output to its
    tokens): `self` keeps its layout, the indices and the source's rows are whole, and each device adds the rows
    whose indices fall in its block (the others' values masked to zeros at a clamped index)."""
    self_ = call.specs[0]
    m = self_.axes[dim]
    block = self_.shape[dim] // call.shards(m)
    starts, alpha, size = block_starts(call, m, block), arg(call, "alpha", 1), self_.shape[dim]
    rows_shape = [-1 if i == dim else 1 for i in range(self_.rank)]

    def kernel(locals_, args, kwargs):
        x, index, values = locals_
        index = index[0].reshape(-1)
        check_in_range(index, size, RuntimeError, f"index {{}} is out of bounds for dimension {dim} with size {size}")
        out = x if inplace else x.clone()
        for device, start in enumerate(starts):
            local = index - start
            mine = ((local >= 0) & (local < block)).view(rows_shape)
            out[device].index_add_(dim, local.clamp(0, block - 1), torch.where(mine, values[device], 0), alpha=alpha)
        return out
    source_axes = tuple(None if i == dim else a for i, a in enumerate(self_.axes))
    return Decision((self_.axes, (None,) * call.specs[1].rank, source_axes), (self_.axes,), kernel, inplace=inplace)


def _index_add_of_sharded_rows(call: OpCall, dim: int) -> Decision | None:
    """`index_add` of rows sharded with their indices (index_select's gradient after a lookup of sharded indices):
    each device adds its own rows, and the result is a pending sum over those mesh dims. `self` is counted once:
    on their first device, or, sharded alike along `dim` (zeros made like the gradient), each device's block at
    its rows. None where the indices are not sharded alike with the rows along `dim`."""
    self_, index, source = call.specs
    picked = index.axes[0] if index.rank == 1 else None
    if picked is None or source.rank != self_.rank or source.axes[dim] != picked:
        return None
    axes = _merged([self_, source], skip=dim)
    if _shares_a_mesh_dim(picked, axes):
        return None
    self_rows = self_.axes[dim] == picked
    block = self_.shape[dim] // call.shards(picked)
    own_rows = _block_rows(call, picked, block, (call.num_local, block))
    first = first_device(call, (picked,), self_.rank)
    devices = _each_device(call)
    alpha, size = arg(call, "alpha", 1), self_.shape[dim]

    def kernel(locals_, args, kwargs):
        x, rows, values = locals_[0].movedim(dim + 1, 1), locals_[1], locals_[2].movedim(dim + 1, 1)
        check_in_range(rows, size, RuntimeError, f"index {{}} is out of bounds for dimension {dim} with size {size}")
        values = (values * alpha if alpha != 1 else values).to(x.dtype)
        if self_rows:
            out = x.new_zeros((x.shape[0], self_.shape[dim]) + x.shape[2:])
            rows, values = torch.cat([own_rows(rows), rows], 1), torch.cat([x, values], 1)
        else:
            out = torch.where(first(locals_[0]), locals_[0], 0).movedim(dim + 1, 1)
        out.index_put_((devices(rows), rows), values, accumulate=True)
        return out.movedim(1, dim + 1)
    self_axes = axes[:dim] + (picked if self_rows else None,) + axes[dim + 1:]
    return Decision((self_axes, (picked,), axes[:dim] + (picked,) + axes[dim + 1:]), (axes,), kernel,
                    reduce=((picked,),))
