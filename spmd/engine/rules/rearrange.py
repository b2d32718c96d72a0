"""Rearrangements within a few axes: `rot90`, `channel_shuffle`, `pixel_shuffle`, `pixel_unshuffle` and
`_chunk_cat` (which regroups the trailing axes of several tensors).

Why the rules hold: each moves elements within the axes it names (rot90's two; a shuffle's channel and spatial
axes) and keeps every other (batch) axis as it is, so those keep their sharding and each device rearranges its
block, the named axes whole. One exception keeps more: `pixel_shuffle` turns each run of r² consecutive channels
into one output channel (and `pixel_unshuffle` each channel into such a run), so a block of channels maps onto
a block of output channels, and the channel axis stays sharded where the smaller channel count divides evenly.
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.common import norm_dim
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten


@register(aten.rot90.default)
def rot90_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    k = arg(call, "k")
    dims = [norm_dim(d, spec.rank) for d in arg(call, "dims")]
    axes = tuple(None if i in dims else m for i, m in enumerate(spec.axes))
    local = [d + 1 for d in dims]
    return Decision((axes,), (axes,), lambda l, a, k_: torch.rot90(l[0], k, local))


@register(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_rule(call: OpCall) -> Decision:
    """(N, C, *spatial): C is reordered across groups, so whole; the device axis is folded into the batch."""
    spec = call.specs[0]
    axes = (spec.axes[0], None) + spec.axes[2:]
    groups = arg(call, "groups")
    op = call.func

    def kernel(l, a, k):
        return op(l[0].flatten(0, 1), groups).unflatten(0, l[0].shape[:2])
    return Decision((axes,), (axes,), kernel)


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(call: OpCall) -> Decision:
    """(*batch, C, H, W): batch axes keep their sharding, H and W are whole, C stays sharded where blocks of
    channels map onto blocks of output channels (the device axis is one more batch axis to the kernel)."""
    spec = call.specs[0]
    r = arg(call, "upscale_factor" if call.func is aten.pixel_shuffle.default else "downscale_factor")
    c = spec.shape[-3]
    fewer = c // (r * r) if call.func is aten.pixel_shuffle.default else c
    m = spec.axes[-3]
    channels = m if m is not None and fewer % call.shards(m) == 0 else None
    axes = spec.axes[:-3] + (channels, None, None)
    op = call.func
    return Decision((axes,), (axes,), lambda l, a, k: op(l[0], r))


@register(aten._chunk_cat.default)
def chunk_cat_rule(call: OpCall) -> Decision:
    """Each tensor is split in `num_chunks` along `dim` and the i-th chunks concatenated (padded): the axes from
    `dim` on are whole, the leading (batch) axes, alike in every tensor, keep the first tensor's sharding."""
    specs = call.specs
    dim = norm_dim(arg(call, "dim"), specs[0].rank)
    lead = specs[0].axes[:dim]
    inputs = tuple(lead + (None,) * (s.rank - dim) for s in specs)
    return Decision(inputs, (lead + (None, None),),
                    lambda l, a, k: aten._chunk_cat.default(list(l), dim + 1, arg(call, "num_chunks")))
