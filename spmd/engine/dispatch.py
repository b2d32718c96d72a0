"""Eager SPMD expansion: `__torch_dispatch__` -> cached rule -> relayout inputs -> local kernel -> wrap.

The cache key is (op, and per argument: the layout and global shape of a DTensor, the value of an int, bool,
str, dtype or float; for pointwise ops only the type of a float, which their kernels read at run time). A cache hit costs a key build, a dict lookup, the kernel and the wraps.
"""

from __future__ import annotations

import warnings

import torch

from spmd import explain
from spmd.engine import foreach, planner
from spmd.dtensor import DTensor
from spmd.errors import MeshMismatchError, MixedTensorError, UnsupportedOpError
from spmd.layout import Layout
from spmd.engine.rules import lookup
from spmd.engine.rules.common import OpCall, TensorSpec

_CACHE: dict = {}
_CACHE_LIMIT = 100_000
_STATS = {"misses": 0}


class _Plan:
    __slots__ = ("decision", "in_steps", "out_layouts", "out_steps", "mesh", "copied_view")

    def __init__(self, decision, in_steps, out_layouts, out_steps, mesh, copied_view=False):
        self.decision = decision
        # a view op whose input had to be relayouted: its outputs do not share memory with the input
        self.copied_view = copied_view
        self.in_steps = in_steps  # [(input index, steps)] for the inputs that must be relayouted
        self.out_layouts = out_layouts
        self.out_steps = out_steps  # per output: the steps resolving its pending reduction
        self.mesh = mesh


def cache_stats() -> dict:
    """Misses of the sharding-decision cache and its size (for benchmarks and tests)."""
    return dict(_STATS, size=len(_CACHE))


def _sig(a, tensors, blind=False):
    t = type(a)
    if t is float:
        return float if blind else a
    if t is int or t is bool or a is None or t is str:
        return a
    if isinstance(a, DTensor):
        tensors.append(a)
        return a._key
    if t is list or t is tuple:
        return tuple(_sig(x, tensors, blind) for x in a)
    if isinstance(a, torch.Tensor):
        if a.dim() == 0:  # autobroadcast: a 0-d tensor acts as a replicated scalar
            return "scalar", a.dtype
        raise MixedTensorError(
            f"a plain torch.Tensor of shape {list(a.shape)} was mixed with DTensors; only Python scalars and 0-d "
            "tensors are broadcast automatically. Distribute it first: spmd.copy_to_mesh(tensor, layout)")
    return a


def dispatch(cls, func, types, args=(), kwargs=None):
    """`DTensor.__torch_dispatch__`: the whole hot path of a cache hit is this function and `_execute`."""
    tensors: list[DTensor] = []
    key = [id(func)]  # OpOverloads live as long as torch: their id is stable and cheaper than their hash
    blind = _FLOAT_BLIND.get(id(func))
    if blind is None:
        blind = _float_blind(func)
    try:
        for a in args:  # the common argument kinds inline; the rest through _sig
            if isinstance(a, DTensor):
                tensors.append(a)
                key.append(a._key)
            elif type(a) is float:
                key.append(float if blind else a)
            else:
                key.append(_sig(a, tensors, blind))
        if kwargs:
            key.append(tuple([(k, _sig(v, tensors, blind)) for k, v in kwargs.items()]))
    except MixedTensorError:
        if foreach.is_foreach(func):  # e.g. per-parameter scalars given as one plain tensor
            return foreach.run(func, args, kwargs or {})
        if func is torch.ops.aten.copy_.default and isinstance(args[0], DTensor):
            return _copy_from_plain(func, args, kwargs)
        raise
    key = tuple(key)
    plan = _CACHE.get(key)
    if plan is None:
        plan = _miss(key, func, args, kwargs or {}, tensors)
    if explain.RECORDERS:
        return _recorded(plan, func, args, kwargs or {}, tensors)
    return _execute(plan, func, args, kwargs or {}, tensors)


DTensor.__torch_dispatch__ = classmethod(dispatch)

# id(op) -> whether its plan ignores the values of float arguments. Pointwise ops read them at run time, so
# e.g. Adam's step size, which changes every step, does not miss the cache; every other op keys on the value,
# because its rule may decide on it (dropout's p, a norm's order).
_FLOAT_BLIND: dict = {}


def _float_blind(func) -> bool:
    from spmd.engine.rules.pointwise import like_rule, pointwise_rule
    blind = _FLOAT_BLIND[id(func)] = foreach.is_foreach(func) or lookup(func) in (pointwise_rule, like_rule)
    return blind


def _miss(key, func, args, kwargs, tensors) -> "_Plan":
    _STATS["misses"] += 1
    if len(_CACHE) >= _CACHE_LIMIT:  # shapes that keep changing must not grow the cache forever
        _CACHE.clear()
    if foreach.is_foreach(func):
        plan = _Plan(None, (), None, None, None)  # no decision: `_execute` runs the element ops
    else:
        plan = _make_plan(func, args, kwargs, tensors)
    _CACHE[key] = plan
    return plan


def _copy_from_plain(func, args, kwargs):
    """`dtensor.copy_(plain)` (e.g. `load_state_dict` from a plain checkpoint) distributes the value first."""
    from spmd.api import copy_to_mesh
    src = args[1].expand(args[0].shape)
    return dispatch(DTensor, func, (), (args[0], copy_to_mesh(src, args[0]._layout)) + tuple(args[2:]), kwargs)


def _execute(plan: _Plan, func, args, kwargs, tensors):
    decision = plan.decision
    if decision is None:
        return foreach.run(func, args, kwargs)
    locals_ = [t._local for t in tensors]
    for i, steps in plan.in_steps:
        locals_[i] = planner.run(locals_[i], plan.mesh, steps)
    if decision.inplace and tensors[0]._copied_view:
        target = tensors[0]
        raise UnsupportedOpError(
            f"in-place op on a view (shape {list(target.shape)}, layout {target._layout.sharding_specs}) that could "
            "not share memory with its base because the base's layout had to change when the view was taken; the "
            "update would not reach the base. Call .clone() on the view first, or relayout the base so the view "
            "needs no relayout")
    out = decision.kernel(locals_, args, kwargs)
    if decision.inplace:
        return tensors[0]
    if plan.copied_view:
        return _mark_copied(_wrap(plan, out, locals_, args, kwargs))
    return _wrap(plan, out, locals_, args, kwargs)


def _recorded(plan: _Plan, func, args, kwargs, tensors):
    recorder = explain.RECORDERS[-1]
    recorder.op_started(func, tensors)
    out = _execute(plan, func, args, kwargs, tensors)
    recorder.op_finished(out)
    return out


def _mark_copied(out):
    for t in (out if isinstance(out, tuple) else (out,)):
        if isinstance(t, DTensor):
            t._copied_view = True
    return out


def _wrap(plan: _Plan, out, locals_, args, kwargs):
    decision = plan.decision
    if decision.single and plan.out_steps is None and decision.epilogue is None:
        shapes = decision.out_shapes
        layout = plan.out_layouts[0]
        if layout is None:
            return out
        if shapes is None:
            shapes = decision.out_shapes = [layout.global_shape_from_local_shape(out.shape[1:])]
        return DTensor(out, layout, shapes[0])
    if decision.single:
        out = (out,)
    if plan.out_steps:
        out = [planner.run(o, plan.mesh, s) if s else o for o, s in zip(out, plan.out_steps)]
    if decision.epilogue is not None:
        out = decision.epilogue(out, locals_, args, kwargs)
    shapes = decision.out_shapes
    if shapes is None:
        shapes = decision.out_shapes = [None if l is None else l.global_shape_from_local_shape(o.shape[1:])
                                        for o, l in zip(out, plan.out_layouts)]
    wrapped = [DTensor(o, l, s) if l is not None else o for o, l, s in zip(out, plan.out_layouts, shapes)]
    return wrapped[0] if decision.single else tuple(wrapped)


def _make_plan(func, args, kwargs, tensors) -> _Plan:
    mesh = tensors[0]._layout.mesh
    for t in tensors[1:]:
        if t._layout.mesh != mesh:
            raise MeshMismatchError(
                f"{func} got DTensors on different meshes: {mesh!r} and {t._layout.mesh!r}. Move one with "
                "spmd.relayout_like / spmd.copy_to_mesh first.")
    it = iter(tensors)

    def spec(a):
        if isinstance(a, DTensor):
            next(it)
            return TensorSpec(a._layout.axes, tuple(a.shape), a.dtype)
        if isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a):
            return type(a)(spec(x) for x in a)
        return a

    call = OpCall(func, tuple(spec(a) for a in args), {k: spec(v) for k, v in kwargs.items()}, mesh,
                  mesh.num_local_devices())
    rule = lookup(func)
    if rule is None:
        return _fallback_plan(call, tensors)
    decision = rule(call)
    specialize = getattr(decision.kernel, "specialize", None)
    if specialize is not None:
        decision.kernel = specialize(args, kwargs)
    return _plan_from_decision(decision, call, tensors)


def _plan_from_decision(decision, call, tensors) -> _Plan:
    mesh = call.mesh
    in_steps = []
    for i, (t, want) in enumerate(zip(tensors, decision.inputs)):
        have = t._layout.axes
        if want is not None and want != have:
            if decision.inplace and i == 0:
                raise UnsupportedOpError(f"{call.describe()}: in-place op would change the layout of its target")
            steps = planner.plan_on(mesh, have, tuple(want))
            if steps:
                in_steps.append((i, steps))
    out_layouts = [None if axes is None else Layout.from_axes(axes, mesh) for axes in decision.outputs]
    out_steps = None
    if decision.reduce and any(decision.reduce):
        out_steps = [planner.plan_on(mesh, axes, axes, tuple(red), decision.reduce_op) if red else ()
                     for axes, red in zip(decision.outputs, decision.reduce)]
        out_steps = out_steps if any(out_steps) else None
    is_view = any(r.alias_info is not None for r in call.func._schema.returns)
    return _Plan(decision, in_steps, out_layouts, out_steps, mesh, copied_view=is_view and bool(in_steps))


_WARNED: set = set()


def _fallback_plan(call: OpCall, tensors) -> _Plan:
    """An op without a rule runs once on replicated inputs, if that is safe; else a named error."""
    from spmd.engine.rules.common import Decision, generic_kernel, replace_tensors, unsupported
    func = call.func
    schema = func._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        raise unsupported(call, "it mutates its inputs or draws random numbers, so it cannot run replicated")
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        raise unsupported(call, "its outputs are not plain tensors")
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in call.specs]
    meta_args, meta_kwargs = replace_tensors(call.args, call.kwargs, metas)
    try:
        out = func(*meta_args, **meta_kwargs)
    except Exception as e:  # no meta kernel: we cannot tell the output shape without running it
        raise unsupported(call, f"it has no meta implementation ({type(e).__name__})") from None
    single = len(schema.returns) == 1
    outs = (out,) if single else tuple(out)
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(f"spmd: no sharding rule for {func}; running it on replicated inputs (this gathers "
                      "sharded inputs on every device)", stacklevel=3)
    local = generic_kernel(func)
    n = call.num_local

    def kernel(locals_, args, kwargs):  # run on component 0 and broadcast: the components are identical
        res = local([x[0] for x in locals_], args, kwargs)
        res = (res,) if single else tuple(res)
        res = tuple(r.unsqueeze(0).expand((n,) + tuple(r.shape)).contiguous() for r in res)
        return res[0] if single else res

    decision = Decision(tuple(tuple([None] * len(s.shape)) for s in call.specs),
                        tuple(tuple([None] * o.dim()) for o in outs), kernel, single=single)
    return _plan_from_decision(decision, call, tensors)
