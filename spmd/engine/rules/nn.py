"""Neural-network ops: layer, batch and group norm, embedding and embedding bags, negative log-likelihood,
pairwise distances (and their backward ops).

Each works on stacked components `(L, *local)`; where an op would sum over its leading axes (a weight
gradient), the sum is taken per device and then all-reduced over the mesh dims that shard those axes.
"""

from __future__ import annotations

import math

import torch

from spmd.collectives import Collective, Kind
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, TensorSpec, unsupported
from spmd.engine.rules.common import (REDUCED_PRECISION, block_starts, check_in_range, constant,
                                      per_device, replace_tensors, shard_starts)
from spmd.engine.rules.pointwise import merge_axes
from spmd.engine.rules.reduction import arg
from spmd.mesh import axis_dims

aten = torch.ops.aten


def _batch_dims(axes) -> tuple:
    return tuple(m for m in axes if m is not None)


def _normalized_dims(x: TensorSpec, n: int) -> tuple:
    """The mesh dims that shard the `n` normalised (last) axes of `x`."""
    return tuple(d for m in x.axes[x.rank - n:] if m is not None for d in axis_dims(m))


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of torch's layer norm statistics: the input's on the CPU, float32 for half precision elsewhere."""
    return torch.float32 if x.dtype in REDUCED_PRECISION and x.device.type != "cpu" else x.dtype


def _affine_view(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Stacked weight or bias components (L, *normalised) viewed to broadcast over (L, *leading, *normalised)."""
    return t.view(t.shape[:1] + (1,) * (rank - t.dim()) + t.shape[1:])


@register(aten.native_layer_norm.default, blockwise=True)
def layer_norm_rule(call: OpCall) -> Decision:
    """Normalised axes whole on each device, weight and bias replicated, other axes keep their sharding; or, where
    the normalised axes are sharded, they stay so, with weight and bias sharded alike: the mean and the variance
    (two passes) are all-reduced sums over those mesh dims."""
    x = call.specs[0]
    n = len(arg(call, "normalized_shape"))
    if _normalized_dims(x, n):
        return _sharded_layer_norm(call, x, n)
    axes = x.axes[:x.rank - n] + (None,) * n
    replicated = tuple((None,) * s.rank for s in call.specs[1:])
    stats = axes[:x.rank - n] + (None,) * n

    def kernel(l, a, k):
        weight = l[1][0] if len(l) > 1 and a[2] is not None else None
        bias = l[-1][0] if a[3] is not None else None
        return aten.native_layer_norm.default(l[0], a[1], weight, bias, a[4])
    return Decision((axes,) + replicated, (axes, stats, stats), kernel, single=False)


def _sharded_layer_norm(call: OpCall, x: TensorSpec, n: int) -> Decision:
    reduced, count, eps = _normalized_dims(x, n), math.prod(arg(call, "normalized_shape")), arg(call, "eps")
    has_w, has_b = (isinstance(arg(call, name), TensorSpec) for name in ("weight", "bias"))
    dims = tuple(range(x.rank + 1 - n, x.rank + 1))
    stats = x.axes[:x.rank - n] + (None,) * n

    def kernel(l, a, k, run):
        xl, rest = l[0], iter(l[1:])
        xf = _opmath(xl)  # (torch's kernel accumulates in float32)
        mean = run(0, xf.sum(dims, keepdim=True)) / count
        rstd = torch.rsqrt(run(1, (xf - mean).square().sum(dims, keepdim=True)) / count + eps)
        out = (xf - mean) * rstd
        if has_w:
            out = out * _affine_view(next(rest), xl.dim())
        if has_b:
            out = out + _affine_view(next(rest), xl.dim())
        return out.to(xl.dtype), mean.to(_stats_dtype(xl)), rstd.to(_stats_dtype(xl))
    params = tuple(x.axes[x.rank - n:] for _ in range(int(has_w) + int(has_b)))
    collective = Collective(Kind.ALL_REDUCE, reduced, op="sum")
    return Decision((x.axes,) + params, (x.axes, stats, stats), kernel, single=False,
                    collectives=(collective, collective))


@register(aten.native_layer_norm_backward.default, blockwise=True)
def layer_norm_backward_rule(call: OpCall) -> Decision:
    x = call.specs[1]
    normalized, _, _, weight, bias, mask = call.args[2:8]
    n = len(normalized)
    if _normalized_dims(x, n):
        return _sharded_layer_norm_backward(call, x, n)
    axes = x.axes[:x.rank - n] + (None,) * n
    params = (None,) * n
    reduced = _batch_dims(axes)
    has_w, has_b = weight is not None, bias is not None
    inputs = [axes, axes, axes, axes] + [params] * (int(has_w) + int(has_b))
    fused = call.num_local == 1 and len(axes) > n  # one device: the native kernel's sums are per device

    def kernel(l, a, k):
        g, xl, mean, rstd = l[:4]
        w = l[4][0] if has_w else None
        if fused:
            b = l[-1][0] if has_b else None
            gx, gw, gb = aten.native_layer_norm_backward.default(g, xl, normalized, mean, rstd, w, b, mask)
            return gx, None if gw is None else gw.unsqueeze(0), None if gb is None else gb.unsqueeze(0)
        gx = aten.native_layer_norm_backward.default(g, xl, normalized, mean, rstd, w, None,
                                                     [True, False, False])[0] if mask[0] else None
        lead = tuple(range(1, g.dim() - n))  # per device: sum over the local leading axes, not the stack axis
        per_w = (lambda t: t.sum(lead) if lead else t)  # noqa: E731 (sum(()) would reduce every axis)
        gw = per_w(g * ((xl - mean) * rstd)) if mask[1] and has_w else None
        gb = per_w(g) if mask[2] and has_b else None
        return gx, gw, gb
    # outputs the mask does not ask for (or without weight/bias) are None
    wanted = (mask[0], mask[1] and has_w, mask[2] and has_b)
    outputs = tuple(ax if want else None for ax, want in zip((axes, params, params), wanted))
    reduce = tuple(reduced if want and i else () for i, want in enumerate(wanted))
    return Decision(tuple(inputs), outputs, kernel, reduce=reduce, single=False)


def _sharded_layer_norm_backward(call: OpCall, x: TensorSpec, n: int) -> Decision:
    """The input's gradient needs two sums over the normalised axes (of g·w and g·w·x̂): one all-reduce of both over
    their mesh dims; the weight's and bias' gradients keep their sharding, pending over the leading axes' dims."""
    normalized, _, _, weight, bias, mask = call.args[2:8]
    reduced, count = _normalized_dims(x, n), math.prod(normalized)
    has_w, has_b = weight is not None, bias is not None
    dims = tuple(range(x.rank + 1 - n, x.rank + 1))
    lead = tuple(range(1, x.rank + 1 - n))  # per device: sum over the local leading axes, not the stack axis
    stats = x.axes[:x.rank - n] + (None,) * n
    params = x.axes[x.rank - n:]

    def kernel(l, a, k, run):
        g, xl, mean, rstd = l[:4]
        gf = _opmath(g)
        normed = (_opmath(xl) - mean) * rstd
        gx = gw = gb = None
        if mask[0]:
            scaled = gf * _affine_view(l[4], g.dim()) if has_w else gf
            sums = run(0, torch.cat([scaled.sum(dims, keepdim=True), (scaled * normed).sum(dims, keepdim=True)], -1))
            gx = (rstd * (scaled - sums[..., :1] / count - normed * sums[..., 1:] / count)).to(g.dtype)
        if mask[1] and has_w:
            gw = (gf * normed).sum(lead).to(g.dtype) if lead else (gf * normed).to(g.dtype)
        if mask[2] and has_b:
            gb = gf.sum(lead).to(g.dtype) if lead else gf.to(g.dtype)
        return gx, gw, gb
    inputs = (x.axes, x.axes, stats, stats) + (params,) * (int(has_w) + int(has_b))
    wanted = (mask[0], mask[1] and has_w, mask[2] and has_b)
    outputs = tuple(ax if want else None for ax, want in zip((x.axes, params, params), wanted))
    leading = _batch_dims(x.axes[:x.rank - n])
    reduce = tuple(leading if want and i else () for i, want in enumerate(wanted))
    return Decision(inputs, outputs, kernel, reduce=reduce, single=False,
                    collectives=(Collective(Kind.ALL_REDUCE, reduced, op="sum"),))


@register(aten.embedding.default, blockwise=True)
def embedding_rule(call: OpCall) -> Decision:
    """A table sharded on the vocabulary axis: each device looks up the rows it holds (others give zeros) and
    one all-reduce sums the pieces. A table sharded on the embedding axis: a local lookup."""
    table, idx = call.specs
    vocab_dim, emb_dim = table.axes
    idx_axes = tuple(None if m in (vocab_dim, emb_dim) else m for m in idx.axes)
    rows = table.shape[0] // call.shards(vocab_dim)
    mesh, n_local = call.mesh, call.num_local
    # first row held by each local device, shaped to broadcast over the indices
    offsets = None if vocab_dim is None else shard_starts(call, vocab_dim, rows, idx.rank)
    stack_base = constant(lambda: torch.arange(n_local, device=mesh.torch_device).view(
        (n_local,) + (1,) * idx.rank) * rows)

    vocab_size = table.shape[0]

    def kernel(l, a, k):
        weight, ids = l
        check_in_range(ids, vocab_size, IndexError, "index out of range in self")
        flat = weight.reshape(n_local * rows, weight.shape[-1])
        if offsets is None:
            out = torch.nn.functional.embedding(ids + stack_base(ids), flat)
            return out.view(ids.shape + (weight.shape[-1],))
        local = ids - offsets(ids)
        outside = (local < 0) | (local >= rows)
        out = torch.nn.functional.embedding(local.clamp(0, rows - 1) + stack_base(ids), flat)
        return out.masked_fill_(outside.unsqueeze(-1), 0)
    vocab = (vocab_dim,) if vocab_dim is not None else ()  # (the kernel reads its blocks' first rows)
    return Decision(((vocab_dim, emb_dim), idx_axes), (idx_axes + (emb_dim,),), kernel,
                    reduce=(vocab,) if vocab else (), fixed=vocab)


@register(aten.embedding_renorm_.default, blockwise=True)
def embedding_renorm_rule(call: OpCall) -> Decision:
    """`nn.Embedding(max_norm=...)` rescales the rows its indices name to a norm of at most `max_norm`, in place.
    Every device sees all the indices (gathered) and rescales the named rows it holds (a table sharded on the
    vocabulary axis: its block of rows). A row's norm on a table sharded on the embedding axis would need every
    device's columns: refused."""
    table, idx = call.specs
    vocab_dim, emb_dim = table.axes
    if emb_dim is not None:
        raise unsupported(call, f"a row's norm needs the whole embedding axis, sharded over {emb_dim!r} here: "
                                "shard the table over the vocabulary axis, or relayout it")
    rows = table.shape[0] // call.shards(vocab_dim)
    starts = block_starts(call, vocab_dim, rows)
    max_norm, norm_type = call.args[2:4]

    first_rows = constant(lambda: torch.tensor(starts, device=call.mesh.torch_device).view(-1, 1))

    def kernel(l, a, k):
        weight, ids = l
        if type(weight) is not torch.Tensor:  # inside a trace: the rows named, as a mask (no value-shaped result)
            held = weight.shape[0]  # (a replicated table may be one copy that every device shares)
            local = ids.flatten(1)[:held] - first_rows(ids)[:held]
            inside = (local >= 0) & (local < rows)
            named = torch.zeros(weight.shape[:2], dtype=torch.int32, device=weight.device).scatter_add_(
                1, local.clamp(0, rows - 1), inside.int()) > 0
            norms = torch.linalg.vector_norm(weight, norm_type, dim=-1)
            scale = torch.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
            return weight.mul_(scale.unsqueeze(-1).to(weight.dtype))
        for component, named, start in zip(weight, ids, starts):  # (the rows each device holds differ)
            local = named.flatten() - start
            aten.embedding_renorm_(component, local[(local >= 0) & (local < rows)], max_norm, norm_type)
        return weight
    vocab = (vocab_dim,) if vocab_dim is not None else ()
    return Decision(((vocab_dim, None), (None,) * idx.rank), ((vocab_dim, None),), kernel, inplace=True,
                    fixed=vocab)


@register(aten.embedding_dense_backward.default, blockwise=True)
def embedding_backward_rule(call: OpCall) -> Decision:
    """The gradient of the whole table per device (replicated rows), summed over the mesh dims sharding the ids or
    the output's gradient (replicated ids, `token_type_ids` expanded over a sharded batch, are sliced to it)."""
    grad, idx = call.specs
    num_weights, padding_idx, scale_by_freq = call.args[2:5]
    rows = merge_axes([idx, TensorSpec(grad.axes[:-1], idx.shape, grad.dtype)], idx.shape)
    idx_axes = tuple(None if m == grad.axes[-1] else m for m in rows)
    if scale_by_freq:  # the frequencies must be global: gather the ids
        idx_axes = (None,) * idx.rank
    emb_dim = grad.axes[-1]
    n_local = call.num_local

    def kernel(l, a, k):
        g, ids = l
        width = g.shape[-1]
        stacked = ids + (torch.arange(n_local, device=ids.device) * num_weights).view((n_local,) + (1,) * (
            ids.dim() - 1))
        out = aten.embedding_dense_backward.default(g.reshape(-1, width), stacked.reshape(-1),
                                                    n_local * num_weights, -1, scale_by_freq)
        out = out.view(n_local, num_weights, width)
        if padding_idx >= 0:
            out[:, padding_idx] = 0
        return out
    return Decision((idx_axes + (emb_dim,), idx_axes), ((None, emb_dim),), kernel,
                    reduce=((_batch_dims(idx_axes)),) if _batch_dims(idx_axes) else ())


def _nll_layout(x: TensorSpec, target: TensorSpec) -> tuple:
    """(input axes, target axes) of a negative log-likelihood: the class axis (1, or 0 unbatched) whole; the
    batch and spatial axes (the target's) keep the sharding of input and target merged (the input's first)."""
    if x.rank == 1:
        return (None,), ()
    t_axes = merge_axes([TensorSpec(x.axes[:1] + x.axes[2:], target.shape, x.dtype), target], target.shape)
    return t_axes[:1] + (None,) + t_axes[1:], t_axes


def _classes_last(x: torch.Tensor) -> torch.Tensor:
    """Stacked components `(L, N, C, *spatial)` (or `(L, C)`) as rows of classes `(L * N * prod(spatial), C)`."""
    c = 2 if x.dim() > 2 else 1
    return x.movedim(c, -1).reshape(-1, x.shape[c])


@register(aten.nll_loss2d_forward.default, blockwise=True)
def nll_loss_rule(call: OpCall) -> Decision:
    """Per device: the sum of the picked log-probabilities and of their weights; both all-reduced over the
    mesh dims sharding the batch and spatial axes; the mean is their ratio. The class axis must be whole on
    each device (engine/rules/vocab_parallel.py registers `nll_loss_forward` and calls this rule when it is)."""
    x, target = call.specs[0], call.specs[1]
    weight, reduction, ignore_index = call.args[2:5]
    x_axes, t_axes = _nll_layout(x, target)
    inputs = (x_axes, t_axes) + (((None,),) if weight is not None else ())
    n_local = call.num_local

    def kernel(l, a, k):
        xl, tl = l[0], l[1]
        w = l[2][0] if weight is not None else None
        per, _ = aten.nll_loss_forward.default(_classes_last(xl), tl.reshape(-1), w, 0, ignore_index)
        if reduction == 0:
            return per.view(tl.shape), xl.new_zeros(n_local)
        mask = (tl != ignore_index).reshape(n_local, -1)
        picked_w = (w[tl.clamp(min=0)] if w is not None else torch.ones_like(tl, dtype=xl.dtype))
        total = (picked_w.reshape(n_local, -1) * mask).sum(1)
        return per.view(n_local, -1).sum(1), total
    reduced = _batch_dims(t_axes) if reduction != 0 else ()
    out_axes = (t_axes if reduction == 0 else (), ())
    if reduction != 0 and not reduced:  # every device holds the whole batch: torch's own sum (and its rounding)
        return Decision(inputs, out_axes, lambda l, a, k: per_device(call.func, l, a, k, n_local), single=False)
    if reduction == 1 and reduced:  # both sums in one all-reduce, then their ratio
        def mean(l, a, k, run):
            sums = run(0, torch.stack(kernel(l, a, k), 1))
            return sums[:, 0] / sums[:, 1], sums[:, 1].contiguous()
        return Decision(inputs, out_axes, mean, collectives=(Collective(Kind.ALL_REDUCE, reduced, op="sum"),),
                        single=False)

    def epilogue(outs, l, a, k):
        return [outs[0] / outs[1], outs[1]] if reduction == 1 else outs
    return Decision(inputs, out_axes, kernel, reduce=(reduced, reduced) if reduced else (), epilogue=epilogue,
                    single=False)


@register(aten.nll_loss2d_backward.default, blockwise=True)
def nll_loss_backward_rule(call: OpCall) -> Decision:
    x, target = call.specs[1], call.specs[2]
    weight, reduction, ignore_index = call.args[3:6]
    x_axes, t_axes = _nll_layout(x, target)
    g_axes = t_axes if reduction == 0 else ()
    inputs = (g_axes, x_axes, t_axes) + (((None,),) if weight is not None else ()) + ((),)

    def kernel(l, a, k):
        g, xl, tl = l[0], l[1], l[2]
        w = l[3][0] if weight is not None else None
        total = l[-1][0]
        flat_g = g.reshape(-1) if reduction == 0 else g[0]
        rows = aten.nll_loss_backward.default(flat_g, _classes_last(xl), tl.reshape(-1), w, reduction,
                                              ignore_index, total)
        c = 2 if xl.dim() > 2 else 1
        return rows.view(xl.movedim(c, -1).shape).movedim(-1, c).contiguous()
    return Decision(inputs, (x_axes,), kernel)


# -- batch norm ------------------------------------------------------------------------------------------------------
class _BatchNorm:
    """Batch norm of `x` [N, C, *spatial]: per-channel statistics over every other axis. Those axes keep their
    sharding (the statistics are sums, all-reduced over their mesh dims: the global batch's, as SyncBatchNorm);
    the channel axis is sharded as the running statistics are (or as the input's, without them)."""

    def __init__(self, call: OpCall, x, running):
        c = running.axes[0] if running is not None else x.axes[1] if x.rank > 1 else None
        self.c = c  # running statistics are updated in place: they keep their layout, the input follows
        self.x_axes = tuple(c if i == 1 else None if m == c else m for i, m in enumerate(x.axes))
        self.batch = tuple(m for i, m in enumerate(self.x_axes) if i != 1 and m is not None)
        self.count = x.shape[0] * math.prod(x.shape[2:])  # elements per channel in the global batch
        self.dims = (1,) + tuple(range(3, x.rank + 1))  # the stacked components' per-channel reduction axes
        self.view = (1, -1) + (1,) * (x.rank - 2)  # a stacked (L, C) statistic against (L, N, C, *spatial)

    def per_channel(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], *self.view)

    def collectives(self):
        return (Collective(Kind.ALL_REDUCE, self.batch, op="sum"),) if self.batch else ()


def _optional_specs(call: OpCall, names) -> dict:
    """The TensorSpecs of the (optional) tensor arguments `names` that are given, by name."""
    return {n: arg(call, n) for n in names if isinstance(arg(call, n), TensorSpec)}


# the batch norms whose mode is in their name rather than a `training` argument; `_batch_norm_with_update` returns
# a fourth, empty tensor (a cuDNN workspace elsewhere)
_TRAINING = {aten._batch_norm_with_update.default: True, aten._native_batch_norm_legit_no_training.default: False}


@register(aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
          aten._native_batch_norm_legit.no_stats, *_TRAINING)
def batch_norm_rule(call: OpCall) -> Decision:
    """Evaluation, or training on a whole batch: torch's own kernel on each device's components (no collective:
    torch's values and dtypes). Training on a sharded batch: the batch's statistics (two all-reduces over its mesh
    dims: mean, then the centred squares), running statistics updated in place."""
    specs = _optional_specs(call, ("input", "weight", "bias", "running_mean", "running_var"))
    x = specs["input"]
    bn = _BatchNorm(call, x, specs.get("running_mean"))
    training = _TRAINING.get(call.func, arg(call, "training"))
    momentum, eps = arg(call, "momentum"), arg(call, "eps")
    reserve = call.func is aten._batch_norm_with_update.default
    names = [n for n in ("input", "weight", "bias", "running_mean", "running_var") if n in specs]
    inputs = tuple(bn.x_axes if n == "input" else (bn.c,) for n in names)
    slot = {n: i for i, n in enumerate(names)}
    stats = (bn.c,)  # (evaluation: empty on the CPU, the running statistics' size on CUDA)
    outputs = (bn.x_axes, stats, stats) + (((None,),) if reserve else ())
    writes = tuple(slot[n] for n in ("running_mean", "running_var") if n in slot) if training else ()
    if not (training and bn.batch):
        if not training and bn.c is None:  # every device's channels alike: one call over all devices' rows
            return Decision(inputs, outputs, lambda l, a, k: _folded_batch_norm(call.func, l, a, k), single=False)
        return Decision(inputs, outputs, lambda l, a, k: per_device(call.func, l, a, k, call.num_local),
                        single=False, writes=writes)
    stat_dtype = next((specs[n].dtype for n in ("weight", "running_mean") if n in specs), x.dtype)

    def kernel(l, a, k, run):
        xl = _opmath(l[0])
        mean = run(0, xl.sum(bn.dims)) / bn.count
        centred = xl - bn.per_channel(mean)
        var = run(0, centred.square().sum(bn.dims)) / bn.count
        invstd = (var + eps).rsqrt()
        if "running_mean" in slot:
            l[slot["running_mean"]].mul_(1 - momentum).add_(mean, alpha=momentum)
            unbiased = var * (bn.count / max(bn.count - 1, 1))
            l[slot["running_var"]].mul_(1 - momentum).add_(unbiased, alpha=momentum)
        scale = invstd * _opmath(l[slot["weight"]]) if "weight" in slot else invstd  # y = x * scale + shift,
        shift = -mean * scale  # as torch's kernel computes it
        if "bias" in slot:
            shift = shift + _opmath(l[slot["bias"]])
        y = (xl * bn.per_channel(scale) + bn.per_channel(shift)).to(l[0].dtype)
        outs = y, mean.to(stat_dtype), invstd.to(stat_dtype)
        return outs + (l[0].new_empty(l[0].shape[0], 0, dtype=torch.uint8),) if reserve else outs
    return Decision(inputs, outputs, kernel, collectives=bn.collectives(), single=False, writes=writes)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """`t` in the precision torch's CPU kernels compute reduced-precision floats in (float32)."""
    return t.float() if t.dtype in REDUCED_PRECISION else t


def _folded_batch_norm(func, l, a, k):
    """Evaluation with every device's statistics and parameters alike: one call of torch's kernel over all the
    devices' rows (each row is normalised on its own)."""
    x = l[0]
    args, kwargs = replace_tensors(a, k, [x.flatten(0, 1)] + [t[0] for t in l[1:]])
    outs = func(*args, **kwargs)
    return (outs[0].view(x.shape),) + tuple(o.expand(x.shape[0], *o.shape) for o in outs[1:])


# `batch_norm_backward` (the gradient of `_batch_norm_with_update`) names `train` `update` and the saved inverse
# standard deviation `save_var`, and takes the (empty) reserve tensor last
_NEW_BACKWARD = aten.batch_norm_backward.default


@register(aten.native_batch_norm_backward.default, _NEW_BACKWARD)
def batch_norm_backward_rule(call: OpCall) -> Decision:
    """Evaluation, or training on a whole batch: torch's own kernel on each device's components (weight and bias
    gradients of evaluation are each device's sums, pending over the batch's mesh dims). Training on a sharded
    batch: the input's gradient needs the batch's sums of the gradient (one all-reduce, two sums stacked), which
    are the weight's and bias' gradients."""
    new = call.func is _NEW_BACKWARD
    names = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean",
             "save_var" if new else "save_invstd") + (("reserve",) if new else ())
    specs = _optional_specs(call, names)
    bn = _BatchNorm(call, specs["input"], specs.get("running_mean"))
    training, mask = arg(call, "update" if new else "train"), list(arg(call, "output_mask"))
    given = [n for n in names if n in specs]
    slot = {n: i for i, n in enumerate(given)}
    if "save_var" in slot:
        slot["save_invstd"] = slot["save_var"]
    inputs = tuple(bn.x_axes if n in ("grad_out", "input") else (None,) if n == "reserve" else (bn.c,)
                   for n in given)
    pending = () if training else bn.batch  # evaluation: each device's sums, to be reduced by the consumer
    outputs = (bn.x_axes if mask[0] else None, (bn.c,) if mask[1] else None, (bn.c,) if mask[2] else None)
    reduce = ((), pending if mask[1] else (), pending if mask[2] else ())
    if not (training and bn.batch):
        return Decision(inputs, outputs, lambda l, a, k: per_device(call.func, l, a, k, call.num_local),
                        reduce=reduce, single=False)
    grad_dtype = specs["weight"].dtype if "weight" in specs else specs["input"].dtype

    def kernel(l, a, k, run):
        g, xl = _opmath(l[0]), _opmath(l[1])
        mean, invstd = _opmath(l[slot["save_mean"]]), _opmath(l[slot["save_invstd"]])
        xhat = (xl - bn.per_channel(mean)) * bn.per_channel(invstd)
        sums = torch.stack([g.sum(bn.dims), (g * xhat).sum(bn.dims)])  # (2, L, C): one collective for both
        sums = run(0, sums.transpose(0, 1)).transpose(0, 1)
        scale = bn.per_channel(invstd)
        if "weight" in slot:
            scale = scale * bn.per_channel(_opmath(l[slot["weight"]]))
        gx = None
        if mask[0]:
            gx = scale * (g - bn.per_channel(sums[0]) / bn.count - xhat * bn.per_channel(sums[1]) / bn.count)
            gx = gx.to(l[1].dtype)
        return gx, sums[1].to(grad_dtype) if mask[1] else None, sums[0].to(grad_dtype) if mask[2] else None
    return Decision(inputs, outputs, kernel, collectives=bn.collectives(), reduce=reduce, single=False)


# -- group norm ------------------------------------------------------------------------------------------------------
def _group_norm_layout(call: OpCall, x: TensorSpec, groups: int) -> tuple:
    """Statistics per (sample, group) over the group's channels and every spatial axis: the batch axis keeps its
    sharding, the spatial axes are whole, and so are the channels, unless each device holds whole groups."""
    channels = x.axes[1] if x.rank > 1 and x.axes[1] is not None and groups % call.shards(x.axes[1]) == 0 else None
    return (x.axes[0], channels) + (None,) * (x.rank - 2)


@register(aten.native_group_norm.default)
def group_norm_rule(call: OpCall) -> Decision:
    """Every device normalises its own samples (the stack axis folded into the batch), and its own groups where
    the channels are sharded at group boundaries (then the affine weight and bias are each device's own, applied
    after torch's kernel): no collective."""
    x = call.specs[0]
    channels_total, spatial, groups, eps = call.args[4:8]
    axes = _group_norm_layout(call, x, groups)
    shards = call.shards(axes[1]) if axes[1] is not None else 1
    has = [isinstance(arg(call, n), TensorSpec) for n in ("weight", "bias")]
    params = tuple((axes[1],) for h in has if h)

    def kernel(l, a, k):
        xl, rest = l[0], iter(l[1:])
        weight, bias = (next(rest) if h else None for h in has)
        per_device = shards > 1 and xl.shape[0] > 1  # (each device's own channels of weight and bias)
        # (the kernel wants contiguous input, as torch's group_norm gives it: a gathered channel axis is not)
        out, mean, rstd = aten.native_group_norm.default(
            xl.flatten(0, 1).contiguous(), None if per_device or weight is None else weight[0],
            None if per_device or bias is None else bias[0], xl.shape[0] * xl.shape[1], channels_total // shards,
            spatial, groups // shards, eps)
        out = out.view(xl.shape)
        if per_device:
            affine = (xl.shape[0], 1, -1) + (1,) * (xl.dim() - 3)
            out = out * weight.view(affine) if weight is not None else out
            out = out + bias.view(affine) if bias is not None else out
        stats_of = (xl.shape[0], -1)
        return out, mean.unflatten(0, stats_of), rstd.unflatten(0, stats_of)
    stats = (x.axes[0], axes[1])
    return Decision((axes,) + params, (axes, stats, stats), kernel, single=False)


@register(aten.native_group_norm_backward.default)
def group_norm_backward_rule(call: OpCall) -> Decision:
    """The input's gradient per sample (folded as the forward); the weight's and bias' gradients are each
    device's sums over its samples, pending over the batch's mesh dim (sharded as the channels are)."""
    x = call.specs[1]
    has_w = isinstance(arg(call, "weight"), TensorSpec)
    mask, groups = list(arg(call, "output_mask")), arg(call, "group")
    axes = _group_norm_layout(call, x, groups)
    shards = call.shards(axes[1]) if axes[1] is not None else 1
    channels, spatial = arg(call, "C") // shards, arg(call, "HxW")
    stats = (x.axes[0], axes[1])
    inputs = (axes, axes, stats, stats) + (((axes[1],),) if has_w else ())

    def kernel(l, a, k):
        g, xl, mean, rstd = l[:4]
        weight = l[4] if has_w else None
        n_local, n = xl.shape[:2]
        if not (mask[1] or mask[2]) and (shards == 1 or weight is None):  # every device's samples in one call
            gx = aten.native_group_norm_backward.default(
                g.flatten(0, 1).contiguous(), xl.flatten(0, 1).contiguous(), mean.flatten(0, 1), rstd.flatten(0, 1),
                None if weight is None else weight[0], n_local * n, channels, spatial, groups // shards,
                [True, False, False])[0]
            return gx.view(xl.shape), None, None
        # per device (its own weight; the weight's and bias' gradients summed over its samples as torch's kernel
        # sums them, in float32 for a reduced-precision input), then pending over the batch's mesh dim
        outs = [aten.native_group_norm_backward.default(g[d].contiguous(), xl[d].contiguous(), mean[d], rstd[d],
                                                        None if weight is None else weight[d], n, channels, spatial,
                                                        groups // shards, mask)
                for d in range(n_local)]
        return tuple(None if o[0] is None else torch.stack(o) for o in zip(*outs))
    pending = (x.axes[0],) if x.axes[0] is not None else ()
    outputs = (axes if mask[0] else None, (axes[1],) if mask[1] else None, (axes[1],) if mask[2] else None)
    reduce = ((), pending if mask[1] else (), pending if mask[2] else ())
    return Decision(inputs, outputs, kernel, reduce=reduce, single=False)


# -- embedding bag ---------------------------------------------------------------------------------------------------
def _embedding_columns(spec: TensorSpec, emb_dim) -> tuple:
    """A table-wide tensor (table, gradient, `max` mode's indices) [rows, D]: rows whole, columns as the table's."""
    return (None, emb_dim) if spec.rank == 2 else (None,)


@register(aten._embedding_bag.default, aten._embedding_bag_backward.default)
def embedding_bag_rule(call: OpCall) -> Decision:
    """A bag sums (averages, maxes) its rows' columns each on its own: a table sharded on its embedding axis
    (Megatron's) gives each device its columns of every bag, no collective. The vocabulary axis is gathered, the
    indices, offsets and bag bookkeeping are read whole by every device (a bag's rows may lie anywhere)."""
    backward = call.func is aten._embedding_bag_backward.default
    if backward and arg(call, "sparse"):
        raise unsupported(call, "a sparse gradient cannot be a DTensor; use sparse=False")
    wide = call.specs[0]  # the table, or the output's gradient
    columns = [s.axes[1] for s in call.specs if s.rank == 2 and s.shape == wide.shape]  # and `max` mode's indices
    emb_dim = next((m for m in columns if m is not None), None)
    inputs = tuple(_embedding_columns(s, emb_dim) if s is wide or (s.rank == 2 and s.shape == wide.shape)
                   else (None,) * s.rank for s in call.specs)
    if backward:
        outputs = ((None, emb_dim),)
    else:
        max_mode = arg(call, "mode") == 2
        outputs = ((None, emb_dim), (None,), (None,), (None, emb_dim) if max_mode else (None,))
    n_local = call.num_local
    return Decision(inputs, outputs, lambda l, a, k: per_device(call.func, l, a, k, n_local), single=backward)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_weights_backward_rule(call: OpCall) -> Decision:
    """Each index' weight's gradient is the dot product of its bag's gradient with its row: over a table
    sharded on its embedding axis, each device's part of it, pending over that axis' mesh dim."""
    grad = call.specs[0]
    emb_dim = grad.axes[1]
    inputs = ((None, emb_dim), (None, emb_dim)) + tuple((None,) * s.rank for s in call.specs[2:])
    n_local = call.num_local
    return Decision(inputs, ((None,),), lambda l, a, k: per_device(call.func, l, a, k, n_local),
                    reduce=((emb_dim,),) if emb_dim is not None else ())


@register(aten._pdist_forward.default, aten._pdist_backward.default)
def pdist_rule(call: OpCall) -> Decision:
    """Distances between every pair of rows: each row meets every other, and a column shard would leave a pending
    p-norm (a sum only of p-th powers), so the input is replicated; every device computes the result once from
    its first replica."""
    n_local = call.num_local

    def kernel(l, a, k):
        args, kwargs = replace_tensors(a, k, [t[0] for t in l])
        out = call.func(*args, **kwargs)
        return out.expand(n_local, *out.shape).contiguous()
    rank = 1 if call.func is aten._pdist_forward.default else call.specs[1].rank  # distances, or the rows' grad
    return Decision(tuple((None,) * s.rank for s in call.specs), ((None,) * rank,), kernel)
