"""Reductions over tensor axes.

Why the rules hold: with even shards, sum/max/min of the per-shard results is the global sum/max/min, and the
mean of equal-sized shard means is the global mean, so a sharded reduced axis costs one all-reduce over its
mesh dim; any/all, logsumexp and the variance take two steps of that kind (their partial results all-reduced), and
argmax/argmin (max/min with indices) gather each device's extreme and its index, and a product is the product of
the blocks' products (gathered: one value per device). Reductions that do not decompose that way (median, mode,
...) first gather the reduced axes.
A histogram over a given range is a sum (of the shards' histograms); a segment reduction reduces along one axis
only, so the axes after it keep their sharding.
Output layout (TF): the input layout without the reduced axes (kept as unsharded with keepdim).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from spmd.collectives import Collective, Kind
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import (broadcast_view, generic_kernel, keeps_pending_sum, norm_dim, norm_dims,
                                      raise_if_kernel_refuses, shard_starts, zero_d_as_one_element)
from spmd.engine.rules.pointwise import aligned_inputs, broadcast_shape, merge_axes

aten = torch.ops.aten


def arg(call: OpCall, name: str, default=None):
    """The value of argument `name` of the op, positional or keyword; if absent, the schema's default (`mode`'s
    `dim=-1`: torch's meaning of the call), else `default`."""
    for i, a in enumerate(call.func._schema.arguments):
        if a.name == name:
            if i < len(call.args):
                return call.args[i]
            if name in call.kwargs:
                return call.kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def arg_index(func, name: str) -> int:
    return next(i for i, a in enumerate(func._schema.arguments) if a.name == name)


def reduce_rule(call: OpCall, mode: str, dims=None, keepdim=None) -> Decision:
    """mode: 'sum' | 'avg' | 'max' | 'min' (one all-reduce) or 'gather' (unshard the reduced axes first)."""
    spec = call.specs[0]
    r = spec.rank
    dims = () if r == 0 else norm_dims(arg(call, "dim") if dims is None else dims, r)  # 0-d: dim 0/-1 or none
    keepdim = bool(arg(call, "keepdim", False)) if keepdim is None else keepdim
    axes = spec.axes
    if mode == "gather":
        axes = tuple(None if i in dims else m for i, m in enumerate(axes))
    out_axes = tuple(None if i in dims else m for i, m in enumerate(axes) if keepdim or i not in dims)
    reduced = tuple(axes[i] for i in dims if axes[i] is not None)
    kernel = _dims_kernel(call, dims, r)
    n_out = len(call.func._schema.returns)
    return Decision((axes,) + tuple(s.axes for s in call.specs[1:]), (out_axes,) * n_out, kernel,
                    reduce=((reduced,) * n_out) if reduced else (), reduce_op=mode, single=n_out == 1)


def _dims_kernel(call: OpCall, dims: tuple, r: int):
    """Runs the op on stacked components with its `dim` argument shifted past the stack axis."""
    func = call.func
    names = [a.name for a in func._schema.arguments]
    local_dims = [d + 1 for d in dims]
    if r == 0:
        return _full_kernel(call, r)
    if "dim" in names:
        dim_type = func._schema.arguments[names.index("dim")].type
        if isinstance(dim_type, torch.OptionalType):
            dim_type = dim_type.getElementType()
        scalar = isinstance(dim_type, torch.IntType)  # `int dim` / `int? dim` rather than `int[]? dim`
        value = local_dims[0] if scalar else local_dims
        if scalar and len(dims) != 1:
            return _full_kernel(call, r)
        return generic_kernel(func, arg_overrides={names.index("dim"): value})
    return _full_kernel(call, r)


def _full_kernel(call: OpCall, r: int):
    """Full reductions (no dim argument, or dim=None; any reduction of a 0-d input): reduce every axis but the
    stack axis. A 0-d input's components are viewed as `(L, 1)`: each is reduced as a one-element axis."""
    func = call.func
    dims = tuple(range(1, r + 1)) or (1,)
    as_axes = (lambda x: x) if r else (lambda x: x.unsqueeze(1))
    if func in (aten.sum.default, aten.mean.default):
        torch_fn = torch.sum if func is aten.sum.default else torch.mean
        return lambda l, a, k: torch_fn(as_axes(l[0]), dim=dims, dtype=k.get("dtype"))
    if func in (aten.max.default, aten.min.default, aten.amax.default, aten.amin.default):
        torch_fn = torch.amax if func in (aten.max.default, aten.amax.default) else torch.amin
        return lambda l, a, k: torch_fn(as_axes(l[0]), dim=dims)
    names = [x.name for x in func._schema.arguments]
    if func in (aten.median.default, aten.nanmedian.default):  # torch's own op per (whole) component: an empty
        return lambda l, a, k: torch.stack([func(c) for c in l[0]])  # one gives nan, as torch's
    if "dim" not in names:  # prod/any/all of everything: flatten each component, reduce its axis 1
        torch_fn = {aten.prod.default: torch.prod, aten.any.default: torch.any, aten.all.default: torch.all}[func]
        return lambda l, a, k: torch_fn(l[0].reshape(l[0].shape[0], -1), dim=1, **k)
    # other ops with dim=None reduce the flattened tensor: flatten each component, reduce its axis 1; with keepdim
    # the result has r axes of size 1 (none for a 0-d input), as torch's
    inner = generic_kernel(func, arg_overrides={names.index("dim"): 1} if "dim" in names else None)
    kept = (1,) * r if arg(call, "keepdim", False) else None

    def kernel(locals_, args, kwargs):
        x = locals_[0].reshape(locals_[0].shape[0], -1)
        out = inner([x] + list(locals_[1:]), args, kwargs)
        if kept is None:
            return out
        if isinstance(out, torch.Tensor):
            return out.reshape(out.shape[:1] + kept)
        return type(out)(o.reshape(o.shape[:1] + kept) for o in out)
    return kernel


@register(aten.sum.dim_IntList, aten.sum.default, blockwise=True)
def sum_rule(call: OpCall) -> Decision:
    """A pending sum summed over unsharded axes stays pending: a sum of sums, reduced later on the smaller result (a
    grouped-query attention's key gradient, summed over the heads sharing it, then reduce-scattered on its way to a
    sequence-sharded key; a loss summed from a row-parallel layer's result) rather than all-reduced whole first."""
    return keeps_pending_sum(reduce_rule(call, "sum"), call.specs[0], any_sum=True)


# a NaN counts as 0 in each shard's nansum as in the whole's; nonzero counts add up
register(aten.nansum.default, aten.count_nonzero.default, aten.count_nonzero.dim_IntList)(
    lambda call: reduce_rule(call, "sum"))
register(aten.mean.dim, aten.mean.default, blockwise=True)(lambda call: reduce_rule(call, "avg"))
register(aten.amax.default, aten.max.default, blockwise=True)(lambda call: reduce_rule(call, "max"))
register(aten.amin.default, aten.min.default, blockwise=True)(lambda call: reduce_rule(call, "min"))
register(aten.median.dim, aten.mode.default, aten.kthvalue.default,
         aten.nanmedian.dim, aten.median.default, aten.nanmedian.default, aten.hash_tensor.default)(
    lambda call: reduce_rule(call, "gather"))


# -- reductions in two steps: local partial results, all-reduced -----------------------------------------------------
def _reduced_dims(call: OpCall, decision: Decision) -> tuple:
    """The mesh dims (of more than one device) that shard the axes `decision` reduces."""
    return tuple(m for m in (decision.reduce[0] if decision.reduce else ()) if call.mesh.dim_size(m) > 1)


def _local_dims(call: OpCall) -> tuple:
    """The reduced axes of the stacked components (past the stack axis)."""
    return tuple(d + 1 for d in norm_dims(arg(call, "dim"), call.specs[0].rank))


_ANY = (aten.any.dim, aten.any.default)


@register(*_ANY, aten.all.dim, aten.all.default, blockwise=True)
def any_all_rule(call: OpCall) -> Decision:
    """any (all): each device's own, then an all-reduce max (min) over the reduced axes' mesh dims."""
    decision = reduce_rule(call, "max")
    reduced = _reduced_dims(call, decision)
    if not reduced:
        return replace(decision, reduce=())
    local = decision.kernel

    def kernel(locals_, args, kwargs, run):
        out = local(locals_, args, kwargs)  # (bool, or uint8 for a uint8 input, as torch's)
        return run(0, out.to(torch.uint8)).to(out.dtype)
    op = "max" if call.func in _ANY else "min"
    return replace(decision, kernel=kernel, reduce=(), collectives=(Collective(Kind.ALL_REDUCE, reduced, op=op),))


@register(aten.logsumexp.default, blockwise=True)
def logsumexp_rule(call: OpCall) -> Decision:
    """log Σ exp x = m + log Σ exp(x − m), m the global max (taken as 0 where infinite, as torch does): an
    all-reduce max, then an all-reduce sum of each device's Σ exp(x − m)."""
    decision = reduce_rule(call, "max")
    reduced = _reduced_dims(call, decision)
    if not reduced or not call.specs[0].dtype.is_floating_point:
        return reduce_rule(call, "gather")
    dims, keepdim = _local_dims(call), bool(arg(call, "keepdim", False))

    def kernel(locals_, args, kwargs, run):
        x = locals_[0]
        top = run(0, x.amax(dims, keepdim=True))
        top = top.masked_fill(top.abs() == float("inf"), 0)
        out = run(1, (x - top).exp().sum(dims, keepdim=True)).log().add_(top)
        return out if keepdim else out.squeeze(dims)
    return replace(decision, kernel=kernel, reduce=(), collectives=(
        Collective(Kind.ALL_REDUCE, reduced, op="max"), Collective(Kind.ALL_REDUCE, reduced, op="sum")))


_WITH_MEAN = (aten.var_mean.correction, aten.std_mean.correction)
_STD = (aten.std.correction, aten.std_mean.correction)


@register(aten.var.correction, aten.std.correction, *_WITH_MEAN, blockwise=True)
def variance_rule(call: OpCall) -> Decision:
    """Variance in two passes: the mean (an all-reduce of the sums), then an all-reduce of the sums of squared
    deviations from it, divided by max(N − correction, 0) as torch divides; std its square root."""
    decision = reduce_rule(call, "sum")
    reduced = _reduced_dims(call, decision)
    spec = call.specs[0]
    if not reduced or not spec.dtype.is_floating_point:
        return reduce_rule(call, "gather")
    dims, keepdim = _local_dims(call), bool(arg(call, "keepdim", False))
    count = math.prod(spec.shape[d - 1] for d in dims)
    correction = arg(call, "correction")
    divisor = max(count - (1 if correction is None else correction), 0)

    def kernel(locals_, args, kwargs, run):
        x = locals_[0]
        mean = run(0, x.sum(dims, keepdim=True)) / count
        var = run(1, (x - mean).square().sum(dims, keepdim=True)) / divisor
        out = var.sqrt() if call.func in _STD else var
        out, mean = (out, mean) if keepdim else (out.squeeze(dims), mean.squeeze(dims))
        return (out, mean) if call.func in _WITH_MEAN else out
    return replace(decision, kernel=kernel, reduce=(), collectives=(
        Collective(Kind.ALL_REDUCE, reduced, op="sum"), Collective(Kind.ALL_REDUCE, reduced, op="sum")))


@register(aten.aminmax.default)
def aminmax_rule(call: OpCall) -> Decision:
    """min and max at once: each decomposes, but a decision has one pending reduction op, so the kernel completes
    both itself over the sharded reduced axes' mesh dims (one all-reduce min, one all-reduce max)."""
    decision = reduce_rule(call, "min")
    reduced = _reduced_dims(call, decision)
    if not reduced:
        return replace(decision, reduce=())
    local = decision.kernel

    def kernel(locals_, args, kwargs, run):
        low, high = local(locals_, args, kwargs)
        return run(0, low), run(1, high)
    return replace(decision, kernel=kernel, reduce=(), collectives=(
        Collective(Kind.ALL_REDUCE, reduced, op="min"), Collective(Kind.ALL_REDUCE, reduced, op="max")))


_INF = float("inf")
_DECOMPOSABLE_ORDERS = (1.0, 2.0, _INF)


def _norm_order(call: OpCall) -> float:
    """linalg_vector_norm's `ord`, or `p` of norm/dist (None: 2)."""
    order = arg(call, "ord", arg(call, "p"))
    return 2.0 if order is None else float(order)


def _partial_norm(x: torch.Tensor, ord_: float, dims: tuple, keepdim: bool = False) -> torch.Tensor:
    """The part of ‖x‖_p that decomposes over shards: max |x| for p=inf, else the sum of |x|^p (p = 1, 2)."""
    x = x.abs()
    if ord_ == _INF:
        return x.amax(dim=dims, keepdim=keepdim)
    return (x if ord_ == 1.0 else x * x).sum(dim=dims, keepdim=keepdim)


def _norm_root(ord_: float):
    """The epilogue that turns the reduced partial norm into the norm (p=2's square root), or None."""
    return (lambda outs, l, a, k: [outs[0].sqrt()]) if ord_ == 2.0 else None


@register(aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim)
def norm_rule(call: OpCall) -> Decision:
    """‖x‖_p: all-reduce the local sums of |x|^p (or the local max for p=inf), then take the p-th root."""
    spec = call.specs[0]
    ord_ = _norm_order(call)
    dims = norm_dims(arg(call, "dim"), spec.rank)
    if ord_ not in _DECOMPOSABLE_ORDERS or not any(spec.axes[i] for i in dims):
        return reduce_rule(call, "gather")
    decision = reduce_rule(call, "max" if ord_ == _INF else "sum")
    keepdim = bool(arg(call, "keepdim", False))
    local_dims = tuple(d + 1 for d in dims)

    def kernel(locals_, args, kwargs):
        dtype = kwargs.get("dtype")
        x = locals_[0] if dtype is None else locals_[0].to(dtype)
        return _partial_norm(x, ord_, local_dims, keepdim)
    return replace(decision, kernel=kernel, epilogue=_norm_root(ord_))


@register(aten.dist.default)
def dist_rule(call: OpCall) -> Decision:
    """‖a − b‖_p: the operands aligned on their broadcast shape as for a pointwise op, then a full reduction of
    the difference as in `norm_rule` (orders that do not decompose gather everything)."""
    a, b = call.specs
    shape = broadcast_shape([a.shape, b.shape])
    ord_ = _norm_order(call)
    axes = merge_axes([a, b], shape) if ord_ in _DECOMPOSABLE_ORDERS else (None,) * len(shape)
    inputs, pads = aligned_inputs([a, b], axes, shape)
    reduced = tuple(m for m in axes if m is not None)

    def difference(locals_):  # each component flattened: the reduction is over all its elements
        x, y = map(broadcast_view, locals_, pads)
        return (x - y).reshape(call.num_local, -1)
    if not reduced:
        return Decision(inputs, ((),), lambda l, _, k: torch.linalg.vector_norm(difference(l), ord_, dim=1))
    return Decision(inputs, ((),), lambda l, _, k: _partial_norm(difference(l), ord_, (1,)), reduce=(reduced,),
                    reduce_op="max" if ord_ == _INF else "sum", epilogue=_norm_root(ord_))


@register(aten.trace.default)
def trace_rule(call: OpCall) -> Decision:
    """The sum of the diagonal: with the rows sharded, each device sums the diagonal entries of its block of rows
    (their columns whole on it), one pending sum over the rows' mesh dim; a sharded column axis is gathered."""
    spec = call.specs[0]
    if spec.dtype == torch.bool:
        raise_if_kernel_refuses(call.func, spec.dtype, 2)
    rows, (n, c) = spec.axes[0], spec.shape
    if rows is None or c == 0:
        return Decision(((None, None),), ((),), lambda l, a, k: l[0].diagonal(dim1=1, dim2=2).sum(-1))
    block = n // call.shards(rows)
    starts = shard_starts(call, rows, block, 1)

    def kernel(locals_, args, kwargs):
        x = locals_[0]
        cols = starts(x) + torch.arange(block, device=x.device)  # (L, block): each row's diagonal column
        picked = x.gather(2, cols.clamp(max=c - 1).unsqueeze(-1)).squeeze(-1)
        return picked.masked_fill(cols >= c, 0).sum(-1)
    return Decision(((rows, None),), ((),), kernel, reduce=((rows,),))


@register(aten.sort.default, aten.sort.stable, aten._safe_softmax.default, aten.cummax.default,
          aten.cummin.default)  # cumsum, cumprod, logcumsumexp, topk: engine/rules/scans.py, which delegates here
@zero_d_as_one_element
def scan_rule(call: OpCall) -> Decision:
    """Ops along one axis whose every output depends on the whole axis: that axis is gathered, others kept
    (also softmax's, through engine/rules/vocab_parallel.py, when the class axis is not sharded)."""
    spec = call.specs[0]
    dim = arg(call, "dim", -1)
    dim = dim % spec.rank if spec.rank else 0
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    n_out = len(call.func._schema.returns)
    return Decision((axes,), (axes,) * n_out, generic_kernel(call.func, arg_overrides={
        arg_index(call.func, "dim"): dim + 1}), single=n_out == 1)


@zero_d_as_one_element
def softmax_backward_rule(call: OpCall) -> Decision:
    grad, out = call.specs
    dim = arg(call, "dim") % grad.rank
    axes = tuple(None if i == dim else m for i, m in enumerate(grad.axes))
    return Decision((axes, axes), (axes,), generic_kernel(call.func, arg_overrides={2: dim + 1}))


@register(aten.histc.default)
def histc_rule(call: OpCall) -> Decision:
    """With its range given, a histogram of a sharded tensor is the sum of its shards' histograms: a pending sum
    over the mesh dims sharding the input. With `min = max = 0` torch bins over the data's own range, which
    every device must see whole: the input is gathered."""
    x = call.specs[0]
    data_range = arg(call, "min") == 0 and arg(call, "max") == 0
    axes = (None,) * x.rank if data_range else x.axes
    sharded = tuple(m for m in axes if m is not None)

    def kernel(locals_, args, kwargs):  # one histogram per device
        return torch.stack([aten.histc.default(t, *args[1:], **kwargs) for t in locals_[0]])
    return Decision((axes,), ((None,),), kernel, reduce=(sharded,) if sharded else ())


@register(aten.segment_reduce.default, aten._segment_reduce_backward.default)
def segment_reduce_rule(call: OpCall) -> Decision:
    """Segments run along `axis` (their lengths or offsets batched over the axes before it): `axis` and the axes
    before it are whole, the axes after it keep their sharding, each device reducing its columns' segments; the
    lengths and offsets are replicated, so their stacked components batch the op over the devices."""
    data = arg(call, "data")
    axis = arg(call, "axis") % data.rank
    axes = (None,) * (axis + 1) + data.axes[axis + 1:]
    segments = {id(arg(call, n)) for n in ("lengths", "indices", "offsets")}
    inputs = tuple((None,) * s.rank if id(s) in segments else axes for s in call.specs)
    kernel = generic_kernel(call.func, kwarg_overrides={"axis": axis + 1})
    return Decision(inputs, (axes,), kernel)


_ARG = {aten.max.dim: "max", aten.min.dim: "min", aten.argmax.default: "max", aten.argmin.default: "min"}


@register(*_ARG)
def arg_extreme_rule(call: OpCall) -> Decision:
    """max/min along a dim with its index, argmax/argmin, over a sharded axis: each device's extreme and its
    global index (its block's first index added), all-gathered along the axis (one small value per device), then
    the extreme of those — the first device's on a tie, so the first index of the whole axis, as torch's."""
    spec = call.specs[0]
    dim = arg(call, "dim")
    mesh_dim = None if dim is None or spec.rank == 0 else spec.axes[norm_dim(dim, spec.rank)]
    if mesh_dim is None or call.mesh.dim_size(mesh_dim) == 1:
        return reduce_rule(call, "gather")
    axis, keepdim = norm_dim(dim, spec.rank), bool(arg(call, "keepdim", False))
    decision = reduce_rule(call, "max", dims=(axis,))
    block = spec.shape[axis] // call.shards(mesh_dim)
    starts = shard_starts(call, mesh_dim, block, spec.rank)
    pick = torch.max if _ARG[call.func] == "max" else torch.min
    values_too = call.func in (aten.max.dim, aten.min.dim)

    def kernel(locals_, args, kwargs, run):
        values, indices = pick(locals_[0], axis + 1, keepdim=True)
        values, indices = run(0, values), run(1, indices + starts(indices))
        best, where = pick(values, axis + 1, keepdim=True)
        index = indices.gather(axis + 1, where)
        best, index = (best, index) if keepdim else (best.squeeze(axis + 1), index.squeeze(axis + 1))
        return (best, index) if values_too else index
    gather = Collective(Kind.ALL_GATHER, (mesh_dim,), axis)
    return replace(decision, kernel=kernel, reduce=(), collectives=(gather, gather), fixed=(mesh_dim,))


@register(aten.prod.dim_int, aten.prod.default)
def prod_rule(call: OpCall) -> Decision:
    """A product over sharded axes: each device's product of its block, all-gathered along each sharded reduced
    axis (one value per device and row, where gathering the axes would move them whole), and the product of those
    (zeros and signs carry through a product of products)."""
    spec = call.specs[0]
    r = spec.rank
    dims = tuple(range(r)) if call.func is aten.prod.default else (norm_dim(arg(call, "dim"), r),) if r else ()
    sharded = [(d, spec.axes[d]) for d in dims if spec.axes[d] is not None and call.mesh.dim_size(spec.axes[d]) > 1]
    if not sharded:
        return reduce_rule(call, "gather")
    keepdim, dtype = bool(arg(call, "keepdim", False)), arg(call, "dtype")

    def kernel(locals_, args, kwargs, run):
        x = locals_[0]
        for i, d in enumerate(dims):
            x = torch.prod(x, d + 1, keepdim=True, dtype=dtype if i == 0 else None)
        for i, (d, _) in enumerate(sharded):
            x = torch.prod(run(i, x), d + 1, keepdim=True)
        return x if keepdim else x.squeeze(tuple(d + 1 for d in dims))
    gathers = tuple(Collective(Kind.ALL_GATHER, (m,), d) for d, m in sharded)
    decision = reduce_rule(call, "sum", dims=dims, keepdim=keepdim)
    return replace(decision, kernel=kernel, reduce=(), collectives=gathers, fixed=tuple(m for _, m in sharded))
