"""Convolutions, pooling and resampling: the batch axis and the channel axes keep their sharding, the spatial
axes are whole on each device (a window would cross a shard's edge).

A convolution is a contraction over input channels, like a matmul: output channels sharded with the weight carry
to the output, input channels sharded in both input and weight leave a pending sum, and the weight's gradient
is a pending sum over the batch's mesh dim; a grouped convolution with channel shards of whole groups convolves
each device's groups. On the stacked components each device's convolution is one group
of a grouped convolution (the device axis folded into the channels), so one kernel computes every device's
result, whatever each one holds. Pooling, unpooling and resampling work per sample and channel, and so do grid
sampling (each sample reads its own grid) and patch extraction (`im2col`/`col2im`, whose patch axis is
channel-major): the device axis is folded into the batch.
"""

from __future__ import annotations

import math

import torch

from spmd.collectives.local import one_copy, shared
from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.common import replace_tensors
from spmd.engine.rules.contraction import einsum_axes
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten


# -- convolution -------------------------------------------------------------------------------------------------
class _Conv:
    """The layouts of one convolution: `x` [N, Cin, *spatial] (or unbatched [Cin, *spatial]), `w` [Cout, Cin/g,
    *k] ([Cin, Cout/g, *k] transposed). Mesh dims are chosen as for the matmul `nc,oc->no` (TF's priorities).
    A grouped convolution keeps its channels sharded where the shards hold whole groups (a depthwise one always
    does): each device convolves its own groups, nothing to sum; otherwise its channels are whole.

    `ci`: the mesh dim of the input channels, summed over (a pending sum of the output, and `summed_out` that of
    the input's gradient); `co`: of the output channels; `local_groups`: the groups of each device's convolution."""

    def __init__(self, call: OpCall, x, w):
        self.transposed, self.groups = bool(arg(call, "transposed")), arg(call, "groups")
        self.batched, self.num_local = x.rank == w.rank, call.num_local
        n = x.axes[0] if self.batched else None
        c_in = x.axes[1 if self.batched else 0]
        w_out, w_in = (w.axes[1], w.axes[0]) if self.transposed else (w.axes[0], w.axes[1])
        spatial = (None,) * (w.rank - 2)
        if self.groups != 1:
            g = _group_dim(call, self.groups, (c_in, w.axes[0]), n)
            self.n, self.ci, self.co, self.summed_out = n, None, g, None
            self.local_groups = self.groups // (1 if g is None else call.shards(g))
            self.x_axes = ((n, g) if self.batched else (g,)) + spatial
            self.w_axes = (g, None) + spatial
            self.out_axes = ((n, g) if self.batched else (g,)) + spatial
        else:
            (_, (_, ci)), (n, co), _ = einsum_axes("nc,oc->no", [(n, c_in), (w_out, w_in)])
            self.n, self.ci, self.co, self.summed_out, self.local_groups = n, ci, co, co, 1
            self.x_axes = ((n, ci) if self.batched else (ci,)) + spatial
            self.w_axes = ((ci, co) if self.transposed else (co, ci)) + spatial
            self.out_axes = ((n, co) if self.batched else (co,)) + spatial
        self.static = [arg(call, name) for name in ("stride", "padding", "dilation", "transposed",
                                                    "output_padding")]

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """Stacked activations `(L, n, C_l, *s)` as one grouped convolution's `(n, L*C_l, *s)`."""
        return (t if self.batched else t.unsqueeze(1)).transpose(0, 1).flatten(1, 2)

    def ungrouped(self, t: torch.Tensor) -> torch.Tensor:
        out = t.unflatten(1, (self.num_local, -1)).transpose(0, 1)
        return out if self.batched else out.squeeze(1)

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.batched and self.ci is None and self.co is None:  # one weight everywhere: fold devices into batch
            bias = None if bias is None else bias[:bias.shape[0] // self.num_local]
            out = aten.convolution(x.flatten(0, 1), w[0], bias, *self.static, self.groups)
            return out.unflatten(0, (self.num_local, -1))
        out = aten.convolution(self.grouped(x), w.flatten(0, 1), bias, *self.static,
                               self.local_groups * self.num_local)
        return self.ungrouped(out)


def _group_dim(call: OpCall, groups: int, candidates: tuple, batch) -> str | None:
    """The mesh dim (the input channels', else the weight's first axis') whose shards hold whole groups."""
    return next((m for m in candidates if m is not None and m != batch and groups % call.shards(m) == 0), None)


@register(aten.convolution.default)
def convolution_rule(call: OpCall) -> Decision:
    """Batch and channels keep their sharding (input channels leave a pending sum); spatial axes whole."""
    specs = call.specs
    conv = _Conv(call, specs[0], specs[1])
    reduce = ((conv.ci,),) if conv.ci is not None else ()
    if len(specs) == 2:
        return Decision((conv.x_axes, conv.w_axes), (conv.out_axes,), lambda l, a, k: conv.forward(l[0], l[1], None),
                        reduce=reduce)
    inputs = (conv.x_axes, conv.w_axes, (conv.co,))
    if not reduce:
        return Decision(inputs, (conv.out_axes,), lambda l, a, k: conv.forward(l[0], l[1], l[2].flatten()))
    bias_view = (conv.num_local,) + ((1,) if conv.batched else ()) + (-1,) + (1,) * (specs[1].rank - 2)

    def add_bias(outs, locals_, args, kwargs):  # once, after the sum over input channels
        out, bias = outs[0], locals_[2].view(bias_view)
        if shared(out):  # a sum over the whole mesh: one copy that every device shares, and so is the bias
            one_copy(out).add_(bias[:1])
            return [out]
        return [out.add_(bias)]
    return Decision(inputs, (conv.out_axes,), lambda l, a, k: conv.forward(l[0], l[1], None), reduce=reduce,
                    epilogue=add_bias)


@register(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> Decision:
    """The gradients of input (pending over the output channels' mesh dim), weight and bias (pending over the
    batch's mesh dim), each laid out like what it is the gradient of; `None` where `output_mask` says so."""
    _, x, w = call.specs[:3]
    conv = _Conv(call, x, w)
    mask = list(arg(call, "output_mask"))
    outputs = (conv.x_axes, conv.w_axes, (conv.co,))
    pending = (conv.summed_out, conv.n, conv.n)
    bias_sizes = arg(call, "bias_sizes")
    local_bias = None if bias_sizes is None else [conv.num_local * bias_sizes[0] // call.shards(conv.co)]

    def kernel(locals_, args, kwargs):
        g, xs, ws = locals_
        gi, gw, gb = aten.convolution_backward(conv.grouped(g), conv.grouped(xs), ws.flatten(0, 1), local_bias,
                                               *conv.static, conv.local_groups * conv.num_local, mask)
        per_device = (conv.num_local, -1)
        return (None if gi is None else conv.ungrouped(gi), None if gw is None else gw.unflatten(0, per_device),
                None if gb is None else gb.unflatten(0, per_device))

    return Decision((conv.out_axes, conv.x_axes, conv.w_axes),
                    tuple(axes if m else None for axes, m in zip(outputs, mask)), kernel,
                    reduce=tuple((d,) if m and d is not None else () for d, m in zip(pending, mask)), single=False)


# -- pooling, resampling, spatial padding ------------------------------------------------------------------------
def _spatial_ops() -> dict:
    """Ops that work on each (sample, channel) plane alone -> the number of spatial axes they work on."""
    names = {"max_pool{}d_with_indices": (2, 3), "max_pool{}d_with_indices_backward": (2, 3),
             "avg_pool{}d": (2, 3), "avg_pool{}d_backward": (2, 3), "_adaptive_avg_pool{}d": (2, 3),
             "_adaptive_avg_pool{}d_backward": (2, 3), "adaptive_max_pool{}d": (2, 3),
             "adaptive_max_pool{}d_backward": (2, 3), "upsample_nearest{}d": (1, 2, 3),
             "_upsample_nearest_exact{}d": (1, 2, 3), "upsample_linear{}d": (1,), "upsample_bilinear{}d": (2,),
             "upsample_trilinear{}d": (3,), "upsample_bicubic{}d": (2,), "_upsample_bilinear{}d_aa": (2,),
             "_upsample_bicubic{}d_aa": (2,), "reflection_pad{}d": (1, 2, 3), "replication_pad{}d": (1, 2, 3),
             "max_unpool{}d": (2, 3)}  # unpooling scatters each plane's values to their flat indices in that plane
    ops = {}
    for pattern, ks in names.items():
        for k in ks:
            for name in (pattern.format(k), pattern.format(k) + "_backward"):
                packet = getattr(aten, name, None)
                for overload in ("default", "vec"):
                    if packet is not None and overload in packet.overloads():
                        ops[getattr(packet, overload)] = k
    return ops


_SPATIAL = _spatial_ops()


@register(*_SPATIAL)
def spatial_rule(call: OpCall) -> Decision:
    """Batch and channel axes keep their sharding, the `k` spatial axes are whole; the device axis is folded into
    the batch (an unbatched input's device axis becomes its batch)."""
    k = _SPATIAL[call.func]
    specs = call.specs
    lead = specs[0].axes[:specs[0].rank - k]
    axes = lead + (None,) * k
    folded = len(lead) == 2
    sizes = "input_size" in [a.name for a in call.func._schema.arguments]

    def kernel(locals_, args, kwargs):
        xs = [x.flatten(0, 1) if folded else x for x in locals_]
        args, kwargs = replace_tensors(args, kwargs, xs)
        if sizes:  # a resampling gradient names the input's global size: the folded local one here
            args, kwargs = _with_input_size(call, args, kwargs, tuple(xs[0].shape[:-k]))
        out = call.func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.unflatten(0, (call.num_local, -1)) if folded else out
        return tuple(o.unflatten(0, (call.num_local, -1)) if folded else o for o in out)

    outputs = tuple(axes for r in call.func._schema.returns)
    return Decision(tuple(axes for _ in specs), outputs, kernel, single=len(outputs) == 1)


def _with_input_size(call: OpCall, args, kwargs, lead: tuple):
    position = [a.name for a in call.func._schema.arguments].index("input_size")
    if position < len(args):
        size = args[position]
        return args[:position] + (list(lead) + list(size[len(lead):]),) + args[position + 1:], kwargs
    return args, {**kwargs, "input_size": list(lead) + list(kwargs["input_size"][len(lead):])}


# -- per-sample ops: sampling grids, patch extraction ----------------------------------------------------------------
def _folded(call: OpCall, batched: bool, kernel_args):
    """A kernel running `call.func` once on every device's samples: the stack axis folded into the batch (an
    unbatched component's stack axis becomes its batch). `kernel_args(locals_, args)` gives the op's arguments
    from the folded components."""
    n_local = call.num_local

    def fold(t):
        return t.flatten(0, 1) if batched else t

    def unfold(t):
        return None if t is None else t.unflatten(0, (n_local, -1)) if batched else t

    def kernel(locals_, args, kwargs):
        out = call.func(*kernel_args([None if t is None else fold(t) for t in locals_], args), **kwargs)
        return unfold(out) if isinstance(out, torch.Tensor) else tuple(unfold(o) for o in out)
    return kernel


def _batch_and_channel(x, batched: bool = True) -> tuple:
    """The batch and channel axes' mesh dims of an [N, C, ...] (or unbatched [C, ...]) input."""
    return (x.axes[0], x.axes[1] if x.axes[1] != x.axes[0] else None) if batched else (None, x.axes[0])


@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler_rule(call: OpCall) -> Decision:
    """Each sample reads its own grid, each channel is sampled alike: batch (of input and grid) and channel axes
    keep their sharding, the spatial axes are whole (a grid point may read anywhere in its plane)."""
    x, grid = call.specs[:2]
    n, c = _batch_and_channel(x)
    n = n if n is not None else grid.axes[0] if grid.axes[0] != c else None
    x_axes, grid_axes = (n, c) + (None,) * (x.rank - 2), (n,) + (None,) * (grid.rank - 1)
    kernel = _folded(call, True, lambda l, a: (*l, *a[2:]))
    return Decision((x_axes, grid_axes), (x_axes,), kernel)


@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward_rule(call: OpCall) -> Decision:
    """The grid's gradient sums over the channels: pending over the channel axis' mesh dim."""
    _, x, grid = call.specs[:3]
    n, c = _batch_and_channel(x)
    n = n if n is not None else grid.axes[0] if grid.axes[0] != c else None
    x_axes, grid_axes = (n, c) + (None,) * (x.rank - 2), (n,) + (None,) * (grid.rank - 1)
    mask = list(arg(call, "output_mask"))
    kernel = _folded(call, True, lambda l, a: (*l, *a[3:]))
    outputs = (x_axes if mask[0] else None, grid_axes if mask[1] else None)
    reduce = ((), (c,) if mask[1] and c is not None else ())
    return Decision((x_axes, x_axes, grid_axes), outputs, kernel, reduce=reduce, single=False)


@register(aten.im2col.default)
def im2col_rule(call: OpCall) -> Decision:
    """Patches of each (sample, channel) plane: batch and channel axes keep their sharding, spatial axes whole;
    a channel shard's patches are a block of the output's `C * kernel` axis (channel-major)."""
    x = call.specs[0]
    batched = x.rank == 4
    n, c = _batch_and_channel(x, batched)
    lead = (n, c) if batched else (c,)
    kernel = _folded(call, batched, lambda l, a: (*l, *a[1:]))
    return Decision((lead + (None, None),), (lead + (None,),), kernel)


@register(aten.col2im.default)
def col2im_rule(call: OpCall) -> Decision:
    """The inverse of im2col: a shard of the `C * kernel` axis that holds whole channels keeps its sharding."""
    cols = call.specs[0]
    batched = cols.rank == 3
    n, c = _batch_and_channel(cols, batched)
    patch = math.prod(arg(call, "kernel_size"))
    if c is not None and (cols.shape[1 if batched else 0] // call.shards(c)) % patch:
        c = None  # a shard would cut through a channel's patches
    lead = (n, c) if batched else (c,)
    kernel = _folded(call, batched, lambda l, a: (*l, *a[1:]))
    return Decision((lead + (None,),), (lead + (None, None),), kernel)
