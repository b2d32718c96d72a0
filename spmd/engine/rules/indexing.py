"""Ops that address elements by index tensors or masks: `index_fill`, flat indexing (`take`, `put`), masked
scatters and the masked gather of upsampling's decompositions (`_unsafe_masked_index`).

Why the rules hold: an index along one dim addresses the whole of that axis, so it is whole on each device while
the other axes keep their sharding (`index_fill`, like `index_select` in `view`). A flat index addresses the whole
tensor: `take` reads a replicated tensor at each device's block of indices, so the indices (and the result) stay
sharded. A masked scatter consumes its source in the order of the whole mask, and `put` and the masked index ops
write wherever their indices point: their operands are replicated, and each device computes its (whole) component.
Indexing by a boolean mask (`x[mask]`) makes a result as long as the mask has true entries: see value_shaped.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from spmd.dtensor import DTensor
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, TensorSpec, unsupported
from spmd.engine.rules.common import (broadcast_view, check_in_range, first_device, generic_kernel, norm_dim,
                                     replace_tensors, shard_starts, zero_d_as_one_element)
from spmd.engine.rules.pointwise import aligned_inputs, broadcast_shape, is_inplace, merge_axes
from spmd.engine.rules.reduction import arg
from spmd.engine.rules.value_shaped import masked, value_shaped_rule
from spmd.layout import UNSHARDED

aten = torch.ops.aten


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@zero_d_as_one_element
def index_fill_rule(call: OpCall) -> Decision:
    """Fills the slices at replicated indices along `dim` (whole on each device); other axes keep their sharding.
    A tensor value is 0-d, the same on every device."""
    spec, index = call.specs[:2]
    dim = norm_dim(arg(call, "dim"), spec.rank)
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    value_axes = tuple((None,) * s.rank for s in call.specs[2:])

    def kernel(locals_, args, kwargs):
        value = locals_[2] if len(locals_) > 2 else args[3]
        if isinstance(value, torch.Tensor):  # stacked components (or a plain 0-d tensor): one element each
            value = value.reshape(-1)[0]
        return call.func(locals_[0], dim + 1, locals_[1][0].reshape(-1), value)
    return Decision((axes, (None,) * index.rank) + value_axes, (axes,), kernel)


@register(aten.take.default)
def take_rule(call: OpCall) -> Decision:
    """`self` replicated; each device reads it at its block of the (sharded) indices."""
    spec, index = call.specs
    return Decision(((None,) * spec.rank, index.axes), (index.axes,), lambda l, a, k: torch.take(l[0][0], l[1]))


@register(aten.put.default, aten.masked_scatter.default, aten.masked_scatter_backward.default,
          aten._unsafe_masked_index.default, aten._unsafe_masked_index_put_accumulate.default)
def whole_rule(call: OpCall) -> Decision:
    """Operands replicated; each device runs the op on its own (whole) components."""
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in call.specs]
    meta_args, meta_kwargs = replace_tensors(call.args, call.kwargs, metas)
    out_rank = call.func(*meta_args, **meta_kwargs).dim()
    local = generic_kernel(call.func)

    def kernel(locals_, args, kwargs):
        return torch.stack([local([x[j] for x in locals_], args, kwargs) for j in range(call.num_local)])
    return Decision(tuple((None,) * s.rank for s in call.specs), ((None,) * out_rank,), kernel)


# -- advanced indexing: self[indices], self[indices] = values ---------------------------------------------------------


class _Advanced(NamedTuple):
    """Where `self[indices]` puts its axes (torch's rule): the index tensors broadcast to `shape`, new axes that
    sit at the first indexed axis when the indexed axes are adjacent, else in front of the kept ones."""
    indexed: tuple[int, ...]  # self's axes addressed by an index tensor
    kept: tuple[int, ...]  # self's other axes, in order
    shape: tuple[int, ...]  # the index tensors' broadcast shape
    start: int  # the result's axis where the new axes begin

    def out_axes(self, self_axes: tuple, new_axes: tuple) -> tuple:
        kept = tuple(self_axes[i] for i in self.kept)
        return kept[:self.start] + new_axes + kept[self.start:]

    def out_shape(self, self_shape: tuple) -> tuple:
        return self.out_axes(self_shape, self.shape)


def _advanced(call: OpCall, spec: TensorSpec, indices) -> _Advanced:
    entries = [(i, t) for i, t in enumerate(indices) if t is not None]
    indexed = tuple(i for i, _ in entries)
    kept = tuple(i for i in range(spec.rank) if i not in indexed)
    adjacent = indexed == tuple(range(indexed[0], indexed[-1] + 1))
    shape = broadcast_shape([tuple(t.shape) for _, t in entries])
    return _Advanced(indexed, kept, shape, indexed[0] if adjacent else 0)


def _index_axes(call: OpCall, adv: _Advanced, indices, taken: set) -> tuple:
    """The sharding of the new axes: the index tensors' merged as pointwise operands, without the mesh dims in
    `taken` (self's), which a result cannot use twice."""
    specs = [t for t in indices if isinstance(t, TensorSpec)]
    return tuple(None if m in taken else m for m in merge_axes(specs, adv.shape))


def _index_tensors(call: OpCall, indices, new_axes: tuple, adv: _Advanced):
    """(the axes of each DTensor index, a function giving the kernel each index tensor (stacked, right-aligned to
    the new axes, or a plain 0-d tensor) from its locals and args)."""
    specs = [t for t in indices if isinstance(t, TensorSpec)]
    axes, pads = aligned_inputs(specs, new_axes, adv.shape)
    first_local = 1
    picks, j = [], 0
    for pos, t in enumerate(indices):
        if isinstance(t, TensorSpec):
            picks.append((first_local + j, pads[j]))
            j += 1
        elif t is not None:  # a plain 0-d tensor: the same index on every device
            picks.append((None, pos))

    def tensors(locals_, args):
        return [broadcast_view(locals_[i], p) if i is not None else args[1][p] for i, p in picks]
    return axes, tensors


def _stack_index(n: int, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Each device's own component, as an advanced index over the stack axis broadcast with `rank` new axes."""
    return torch.arange(n, device=like.device).view((n,) + (1,) * rank)


def identity_first_index_as_slice(args) -> tuple | None:
    """`x[arange(n)[:, None, ...], i1, ...]` with a plain identity over `x`'s sharded first axis and the other
    indices of size 1 along it (how HuggingFace builds a padding mask: `mask[batch_idx, kv_idx]`) is
    `x[:, i1[0], ...]`, which the rule below keeps sharded along that axis where an index over it would gather
    `x`: the dispatcher's rewrite of such a call. None where the call is not of that form (inside a trace too:
    the values are not known there)."""
    x, indices = args[0], args[1]
    first = indices[0] if len(indices) > 1 else None
    if not isinstance(x, DTensor) or x._layout.sharding_specs[0] == UNSHARDED or type(first) is not torch.Tensor \
            or first.dtype not in (torch.int64, torch.int32) or any(t is None or t.dtype == torch.bool
                                                                     for t in indices[1:]):
        return None
    rank = max(t.dim() for t in indices)
    n = x.shape[0]
    if first.dim() != rank or first.shape[0] != n or first.numel() != n or \
            any(t.dim() == rank and t.shape[0] != 1 for t in indices[1:]) or \
            not torch.equal(first.reshape(-1), torch.arange(n, device=first.device)):
        return None
    return x, [None, *(t[0] if t.dim() == rank else t for t in indices[1:])]


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> Decision:
    """`self[i0, i1, ...]`: the indexed axes whole on each device, the kept axes keep their sharding, the new
    axes follow the index tensors'. Each device indexes its own component: the stack axis is one more advanced
    index, and the indexed axes moved to the front make torch put the new axes first, then where torch would."""
    spec, indices = call.specs[0], call.args[1]
    if masked(indices):  # as many elements as the masks have true entries
        return value_shaped_rule(call)
    adv = _advanced(call, spec, indices)
    self_axes = tuple(None if i in adv.indexed else m for i, m in enumerate(spec.axes))
    new_axes = _index_axes(call, adv, indices, {m for m in self_axes if m is not None})
    index_axes, index_tensors = _index_tensors(call, indices, new_axes, adv)
    perm = (0,) + tuple(i + 1 for i in adv.indexed + adv.kept)
    nb = len(adv.shape)
    moved = tuple(range(1, nb + 1)), tuple(range(adv.start + 1, adv.start + nb + 1))

    def kernel(locals_, args, kwargs):
        x = locals_[0].permute(perm)
        out = x[(_stack_index(call.num_local, nb, x), *index_tensors(locals_, args))]
        return out.movedim(*moved) if adv.start else out
    return Decision((self_axes,) + index_axes, (adv.out_axes(self_axes, new_axes),), kernel)


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put_rule(call: OpCall) -> Decision:
    """`self[i0, i1, ...] = values`: `self` keeps its layout, in place or not. `values` broadcasts to the indexed
    result's shape and takes its sharding (self's kept axes; the new axes replicated). On an indexed axis sharded
    over a mesh dim each device writes the indices that fall in its block (the others go to a scratch slot past
    its end). With `accumulate` the functional op may leave the index tensors sharded: each device adds its
    share of the values, and self's components count on the first device of those mesh dims only: the result
    is a pending sum over them (duplicate indices add, as in torch)."""
    spec, indices = call.specs[0], call.args[1]
    inplace = is_inplace(call.func)
    if masked(indices):
        return _masked_fill(call, inplace) or _masked_put(call, inplace)
    adv = _advanced(call, spec, indices)
    accumulate = bool(arg(call, "accumulate", False))
    summed = accumulate and not inplace and spec.dtype is not torch.bool
    taken = {m for m in spec.axes if m is not None}
    new_axes = _index_axes(call, adv, indices, taken) if summed else (None,) * len(adv.shape)
    sums = tuple(m for m in new_axes if m is not None)
    index_axes, index_tensors = _index_tensors(call, indices, new_axes, adv)
    values = call.args[2]
    value_axes, value_pad = (), None
    if isinstance(values, TensorSpec):
        out_shape = adv.out_shape(spec.shape)
        (axes,), (value_pad,) = aligned_inputs([values], adv.out_axes(spec.axes, new_axes), out_shape)
        value_axes = (axes,)
    nb = len(adv.shape)
    perm = (0,) + tuple(i + 1 for i in adv.indexed + adv.kept)
    moved = tuple(range(adv.start + 1, adv.start + nb + 1)), tuple(range(1, nb + 1))
    remaps = _block_remaps(call, spec, adv)
    first = first_device(call, sums, spec.rank)

    def kernel(locals_, args, kwargs):
        x = locals_[0]
        idx = index_tensors(locals_, args)
        v = locals_[-1] if value_axes else args[2]
        if value_axes:
            v = broadcast_view(v, value_pad)
            v = v.movedim(*moved) if adv.start else v
        target = x if inplace else torch.where(first(x), x, 0) if sums else x
        work = _padded(target, remaps, idx)
        if work is target and not inplace and not sums:
            work = target = x.clone()
        work.permute(perm).index_put_((_stack_index(call.num_local, nb, x), *idx), v, accumulate)
        if work is target:
            return target
        written = _unpadded(work, remaps)
        return target.copy_(written) if inplace else written.contiguous()
    return Decision((spec.axes,) + index_axes + value_axes, (spec.axes,), kernel, inplace=inplace,
                    reduce=(sums,) if sums else ())


def _masked_fill(call: OpCall, inplace: bool) -> Decision | None:
    """`self[mask] = value` (or `+=`, with `accumulate`) of one value (0-d), where the mask addresses whole axes of
    `self` (`x[x < 0] = 0`, `x[:, rows] = 1`): `masked_fill`, elementwise, so `self` keeps any layout and the mask
    takes the sharding of the axes it covers. None for other masked puts."""
    spec, indices, values = call.specs[0], call.args[1], call.args[2]
    entries = [(i, t) for i, t in enumerate(indices) if t is not None]
    one_value = (isinstance(values, TensorSpec) and values.rank == 0) or (
        isinstance(values, torch.Tensor) and values.dim() == 0)
    accumulate = bool(arg(call, "accumulate", False))
    if len(entries) != 1 or not one_value or (accumulate and spec.dtype is torch.bool):
        return None
    start, mask = entries[0]
    if mask.dtype is not torch.bool or mask.shape != spec.shape[start:start + mask.rank]:
        return None  # (uint8 masks, a mask that does not fit: torch's own kernel decides)
    before, after = (1,) * start, (1,) * (spec.rank - start - mask.rank)

    def kernel(locals_, args, kwargs):
        x, m = locals_[0], locals_[1]
        m = m.view(m.shape[:1] + before + m.shape[1:] + after)
        v = (locals_[2].view((-1,) + (1,) * spec.rank) if len(locals_) > 2 else args[2]).to(x.dtype)
        out = x + torch.where(m, v, 0) if accumulate else torch.where(m, v, x)
        return x.copy_(out) if inplace else out
    value_axes = ((),) if isinstance(values, TensorSpec) else ()
    return Decision((spec.axes, spec.axes[start:start + mask.rank]) + value_axes, (spec.axes,), kernel,
                    inplace=inplace)


def _masked_put(call: OpCall, inplace: bool) -> Decision:
    """`self[mask] = values` consumes `values` in the order of the whole mask's true entries: every operand
    replicated, each device writes its whole component (in place only into a replicated `self`)."""
    decision = whole_rule(call)
    if not inplace:
        return decision
    if any(call.specs[0].axes):
        raise unsupported(call, "a boolean mask writes values in the order of the whole mask, so the target must "
                                "be replicated; relayout it first, or use torch.where / masked_fill (`x[mask] += v`: "
                                "`x = torch.where(mask, x + v, x)`)")
    return dataclasses.replace(decision, inplace=True,
                               kernel=lambda l, a, k: l[0].copy_(decision.kernel(l, a, k)))


def _block_remaps(call: OpCall, spec: TensorSpec, adv: _Advanced) -> list:
    """Per indexed axis sharded over a mesh dim: (its index tensor's position, the axis, its size, block size,
    each device's first index)."""
    out = []
    for k, i in enumerate(adv.indexed):
        m = spec.axes[i]
        if m is not None:
            block = spec.shape[i] // call.shards(m)
            out.append((k, i, spec.shape[i], block, shard_starts(call, m, block, len(adv.shape))))
    return out


def _padded(x: torch.Tensor, remaps: list, idx: list) -> torch.Tensor:
    """`x` with one scratch slot past the end of each remapped axis, and `idx` (in place) made block-local: an
    index outside a device's block points at the scratch slot."""
    for k, i, size, block, starts in remaps:
        check_in_range(idx[k], size, IndexError, f"index {{}} is out of bounds for dimension {k} with size {size}",
                       negative=True)
        local = idx[k] + size * (idx[k] < 0) - starts(x)
        idx[k] = torch.where((local >= 0) & (local < block), local, block)
        slot = list(x.shape)
        slot[i + 1] = 1
        x = torch.cat([x, x.new_zeros(slot)], dim=i + 1)
    return x


def _unpadded(x: torch.Tensor, remaps: list) -> torch.Tensor:
    for _, i, _, block, _ in remaps:
        x = x.narrow(i + 1, 0, block)
    return x
