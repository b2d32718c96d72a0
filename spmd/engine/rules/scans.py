"""Scans and top-k along a sharded axis, without gathering it.

Why the rules hold: a prefix sum over a sharded axis is each block's own prefix sum plus the total of the blocks
before it, so one all-gather of the per-block totals (one element per row) over the axis' mesh dim completes
every block; the same holds for products (the product of earlier blocks multiplies in, zeros included) and for
logcumsumexp (log-add-exp of earlier blocks' logsumexp). The k largest of an axis are among the k largest of each
block: a local top-k, an all-gather of the k candidates (values and global indices), and a top-k of those.
Without a sharded axis, or where this does not apply, the ops use `reduction.scan_rule` (the axis gathered).
"""

from __future__ import annotations

import torch

from spmd.collectives import Collective, Kind
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import shard_starts
from spmd.engine.rules.reduction import arg, scan_rule

aten = torch.ops.aten

# op -> (how the totals of the blocks before a device combine, how they complete its local scan)
_PREFIX = {
    aten.cumsum.default: (lambda t, before, d: torch.where(before, t, 0).sum(d, keepdim=True, dtype=t.dtype),
                          lambda local, prefix: local + prefix),
    aten.cumprod.default: (lambda t, before, d: torch.where(before, t, 1).prod(d, keepdim=True, dtype=t.dtype),
                           lambda local, prefix: local * prefix),
    aten.logcumsumexp.default: (lambda t, before, d: torch.where(before, t, -torch.inf).logsumexp(d, keepdim=True),
                                lambda local, prefix: torch.logaddexp(local, prefix)),
}


def _sharded_dim(call: OpCall):
    """(dim, its mesh dim, its block size) of the op's `dim` when sharded over a mesh dim with a non-empty block,
    else None."""
    spec = call.specs[0]
    if not spec.rank:
        return None
    dim = arg(call, "dim", -1) % spec.rank
    m = spec.axes[dim]
    if m is None or call.mesh.dim_size(m) == 1 or spec.shape[dim] == 0:
        return None
    return dim, m, spec.shape[dim] // call.shards(m)


@register(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default)
def sharded_scan_rule(call: OpCall) -> Decision:
    """Each device scans its block, then completes it with the combined totals of the blocks before it (one
    all-gather of the last element of each block's scan)."""
    sharded = _sharded_dim(call)
    spec = call.specs[0]
    if sharded is None or (call.func is aten.logcumsumexp.default and not spec.dtype.is_floating_point):
        return scan_rule(call)
    dim, m, _ = sharded
    combine, complete = _PREFIX[call.func]
    shards = call.shards(m)
    coordinate = shard_starts(call, m, 1, spec.rank)  # each device's block number along m
    ahead = (1,) * (dim + 1) + (shards,) + (1,) * (spec.rank - dim - 1)
    d = dim + 1

    def kernel(locals_, args, kwargs, run):
        local = call.func(locals_[0], d, *args[2:], **kwargs)
        totals = run(0, local.narrow(d, local.shape[d] - 1, 1))  # (L, ..., shards, ...): every block's total
        before = torch.arange(shards, device=local.device).view(ahead) < coordinate(local)
        return complete(local, combine(totals, before, d))
    return Decision((spec.axes,), (spec.axes,), kernel, collectives=(Collective(Kind.ALL_GATHER, (m,), axis=dim),))


@register(aten.topk.default)
def sharded_topk_rule(call: OpCall) -> Decision:
    """With `sorted` results and k at most a block: the top k of each block, all-gathered with their global
    indices, and the top k of those; the result's axis is whole on every device, the others keep their sharding.
    Unsorted results (whose order is torch's kernel's own) and larger k gather the axis."""
    sharded = _sharded_dim(call)
    k, largest = arg(call, "k"), bool(arg(call, "largest", True))
    if sharded is None or not arg(call, "sorted", True) or k > sharded[2]:
        return scan_rule(call)
    dim, m, block = sharded
    spec = call.specs[0]
    d = dim + 1
    starts = shard_starts(call, m, block, spec.rank)

    def kernel(locals_, args, kwargs, run):
        values, indices = torch.topk(locals_[0], k, d, largest, True)
        values, indices = run(0, values), run(1, indices + starts(indices))
        values, picked = torch.topk(values, k, d, largest, True)
        return values, indices.gather(d, picked)
    axes = tuple(None if i == dim else a for i, a in enumerate(spec.axes))
    gather = Collective(Kind.ALL_GATHER, (m,), axis=dim)
    return Decision((spec.axes,), (axes, axes), kernel, collectives=(gather, gather), single=False)
