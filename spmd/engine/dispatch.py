"""Eager SPMD expansion: `__torch_dispatch__` -> cached plan -> relayout inputs -> local kernel -> wrap.

A plan is a rule's `Decision` made concrete for one cache key: the planner's steps per input (including the
resolution of pending reductions), the kernel specialised to the call's argument shapes, output layouts and
shapes. The cache key is (op, and per argument: the layout, global shape, dtype and pending reduction of a
DTensor, the value of an int, bool, str, dtype or float; for rules that read floats at run time only their type).
A cache hit costs a key build, a dict lookup, the kernel and the wraps. Plans and decisions are never edited
after they are made.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.utils._mode_utils import no_dispatch

from spmd import dtensor, explain
from spmd.collectives import Kind, backend_for
from spmd.collectives.local import one_copy, share, shared
from spmd.dtensor import DTensor
from spmd.engine import foreach, multi_axis, planner, registry
from spmd.engine import rules  # noqa: F401  (registers every rule)
from spmd.engine.decision import Decision, OpCall, TensorSpec, returns_alias, written_arguments
from spmd.engine.fallback import FELL_BACK, fallback_decision, warn_gathered
from spmd.engine.plain_operands import mixed_tensor_error, small_integers, write_into_plain, writes_plain
from spmd.engine.rules.indexing import identity_first_index_as_slice
from spmd.engine.rules.view import REARRANGING_VIEWS
from spmd.engine.validate import check_like_torch, name_the_user_dim
from spmd.errors import MeshMismatchError, MixedTensorError, UnsupportedOpError
from spmd.layout import Layout

_DETACH = torch.ops.aten.detach.default
_INDEX = torch.ops.aten.index.Tensor
_OVERWRITES = {torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor,
               torch.ops.aten.zero_.default}  # in-place ops writing their whole target
_CACHE: dict = {}
_CACHE_LIMIT = 100_000
_STATS = {"misses": 0}


class _Plan:
    __slots__ = ("decision", "kernel", "settle", "in_steps", "out_layouts", "out_pending", "out_steps",
                 "out_shapes", "mesh", "copied_view", "writes", "once", "written", "write_back", "reduce_op")

    def __init__(self, decision, kernel, settle, in_steps, out_layouts, out_pending, out_steps, mesh, copied_view,
                 written=(), write_back=(), reduce_op="sum"):
        self.decision = decision
        self.kernel = kernel  # (locals, args, kwargs) -> local outputs
        self.settle = settle  # input indices whose pending reduction is resolved in place first
        self.in_steps = in_steps  # [(input index, steps)]: inputs relayouted for the kernel
        self.out_layouts = out_layouts
        self.out_pending = out_pending  # per output: the mesh dims of the reduction it leaves pending, or None
        self.out_steps = out_steps  # per output: the steps resolving its reduction now (before an epilogue), or None
        self.out_shapes = None  # the outputs' global shapes, filled by the first execution (unless value-shaped)
        self.mesh = mesh
        # for a view op, whether its input had to be relayouted (its outputs do not share memory with the input);
        # None for other ops
        self.copied_view = copied_view
        self.writes = decision.inplace or decision.rebinds
        # the kernel for one device's stack, where every input and output is replicated over the whole mesh: the
        # op then runs once and its outputs are one copy shared by every device (see `_execute_once`)
        self.once = None
        self.written = written  # the inputs the op writes (their components must be each device's own)
        # [(input index, steps)]: written inputs the kernel wrote relayouted, relayouted back into their components
        self.write_back = write_back
        self.reduce_op = reduce_op  # of the outputs' pending reduction


def cache_stats() -> dict:
    """Misses of the sharding-decision cache, its size, and `fallbacks`: the ops that ran on replicated inputs
    for want of a sharding rule (each gathers its sharded inputs on every device)."""
    return dict(_STATS, size=len(_CACHE), fallbacks=sorted(str(f) for f in FELL_BACK))


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
        raise mixed_tensor_error(a)
    return a


def _detached(t: DTensor) -> DTensor | None:
    """A detach without the dispatcher: the same components; a gradient on its way into `.grad` still pending
    there, for spmd/buckets.py to reduce. None for another pending tensor: the general path resolves it once, into
    the tensor both share."""
    if t._pending and torch._C._current_graph_task_id() == -1:
        return None
    return DTensor(t._stack.detach(), t._layout, t.shape, pending=t._pending, pending_op=t._pending_op,
                   strides=t.stride())


def dispatch(func, args=(), kwargs=None):
    """Runs an aten op on DTensors."""
    return torch_dispatch(DTensor, func, (), args, kwargs)


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """`DTensor.__torch_dispatch__`: the whole hot path of a cache hit is this function and `_execute`."""
    if func is _DETACH:  # autograd detaches every gradient
        out = _detached(args[0])
        if out is not None:
            if explain.RECORDERS:  # (recorded as the general path records an op)
                explain.RECORDERS[-1].op_started(func, args)
                explain.RECORDERS[-1].op_finished(out)
            return out
    elif func in _OVERWRITES and isinstance(args[0], DTensor) and args[0]._pending and args[0]._bucket is None \
            and not _shares_pending_base(args[0]) and _writes_back(args[0]):
        # its values are overwritten whole: its pending sum is never needed (but a pending base's, which the write
        # must reach, is resolved first; a write that would be refused leaves the target as it is)
        args[0]._settle(args[0]._stack)
    tensors: list[DTensor] = []
    key = [id(func)]  # OpOverloads live as long as torch: their id is stable and cheaper than their hash
    blind = _FLOAT_BLIND.get(id(func))
    if blind is None:
        blind = _float_blind(func)
    if blind is _MULTI_TENSOR:
        return _multi_tensor(func, args, kwargs or {})
    if blind is _COMPOSITE:
        return func.decompose(*args, **(kwargs or {}))
    if blind is _OUT_VARIANT:
        return _into_out(func, args, kwargs)
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
    except MixedTensorError as e:
        if func is torch.ops.aten.copy_.default and isinstance(args[0], DTensor):
            return _copy_from_plain(func, args, kwargs)
        if writes_plain(func, args):
            return write_into_plain(func, args, kwargs or {}, e, _replicates_plain())
        if not (_replicates_plain() or small_integers(args, kwargs)):
            raise MixedTensorError(f"{func}: {e}") from None
        if func is _INDEX:
            leading = identity_first_index_as_slice(args)
            if leading is not None:
                return dispatch(func, leading, kwargs)
        return dispatch(func, *_replicated_plain(func, args, kwargs or {}))
    key = tuple(key)
    plan = _CACHE.get(key)
    if plan is None:
        if writes_plain(func, args):  # into a plain 0-d tensor (a scalar operand elsewhere): never a cached plan
            return write_into_plain(func, args, kwargs or {}, MixedTensorError(
                "DTensor values cannot be written into a plain 0-d tensor; make it a DTensor"), _replicates_plain())
        plan = _miss(key, func, args, kwargs or {}, tensors)
    try:
        if explain.RECORDERS:
            return _recorded(func, tensors, lambda: _execute(plan, func, args, kwargs or {}, tensors))
        return _execute(plan, func, args, kwargs or {}, tensors)
    except (IndexError, RuntimeError) as e:
        name_the_user_dim(e)
        raise


def resolve(tensor: DTensor) -> None:
    """Resolves `tensor`'s pending reduction in place (an all-reduce over its pending mesh dims, or the wait for
    the gradient bucket already reducing it)."""
    if tensor._bucket is not None and tensor._bucket.settle(tensor):
        return
    if _shares_pending_base(tensor) and _resolved_through_base(tensor):
        return
    axes, mesh = tensor._layout.axes, tensor._layout.mesh
    steps = planner.plan_on(mesh, axes, axes, tensor._pending, tensor._pending_op)
    donate = _sole_holder(tensor)
    if explain.RECORDERS and tensor._key[-1] is True:  # a gradient's sum, reduced where it is read: backward's work
        with explain.RECORDERS[-1].as_backward():
            tensor._settle(planner.run(tensor._stack, mesh, steps, donate))
    else:
        tensor._settle(planner.run(tensor._stack, mesh, steps, donate))


def _shares_pending_base(view: DTensor) -> bool:
    """Whether `view`, pending, kept its base's pending sum in the base's components (engine/rules/view.py's
    `keeps_pending`; a gradient's view is reduced on its own: spmd/buckets.py)."""
    return view._copied_view and view._view_of is not None and view._view_of[1] in REARRANGING_VIEWS \
        and view._key[-1] is not True


def _resolved_through_base(view: DTensor) -> bool:
    """Resolves such a view by resolving its base, unless a reader did already, and taking the view of it again:
    view and base then share the reduced memory, as torch's do, and one reduction serves both. False where it is
    no longer such a view."""
    base, func, rest, kwargs = view._view_of
    if base._pending:
        if (base._pending, base._pending_op) != (view._pending, view._pending_op):
            return False
        view._stack = None  # (taken again below: the base's reduction may then run in its own memory)
        resolve(base)
    again = dispatch(func, (base, *rest), kwargs)
    if again.shape != view.shape or again._layout != view._layout or again._copied_view:
        return False
    view._settle(again._stack)
    view._copied_view, view._view_of = False, None
    return True


def _sole_holder(tensor: DTensor) -> bool:
    """Whether nothing but `tensor` holds its components' memory (no view, alias or bucket): its reduction may then
    be written there, where gloo's in-place all-reduce would otherwise reduce a copy. Components that view the whole
    of a temporary nothing else holds (a matrix product's result, reshaped by `_unsafe_view`) count too."""
    stack = tensor._stack
    base = stack._base
    # references: tensor's attribute, `stack`, getrefcount's argument (a base: `base`, the argument); storage uses:
    # `stack`, its base if any, untyped_storage()
    if base is not None and (sys.getrefcount(base) != 2 or base.numel() != stack.numel()):
        return False
    return sys.getrefcount(stack) == 3 and \
        torch._C._storage_Use_Count(stack.untyped_storage()._cdata) == (2 if base is None else 3)


dtensor.install_engine(sys.modules[__name__])

# id(op) -> whether its plan ignores the values of float arguments (see engine/registry.py), or how it runs
# without a plan of its own: _MULTI_TENSOR, _COMPOSITE, _OUT_VARIANT
_FLOAT_BLIND: dict = {}
_MULTI_TENSOR = "multi-tensor"  # a foreach or fused op: no plan of its own (see engine/foreach.py)
# a composite op without a rule of its own, run as the ops it is made of: torch decomposes such ops above the
# DTensor's dispatch key, except where the autograd keys are skipped (`torch.inference_mode`)
_COMPOSITE = "composite"
_OUT_VARIANT = "out="  # an op writing its one result into `out=`: the functional op, then a copy into `out`


def _float_blind(func):
    entry = registry.lookup(func)
    if foreach.is_multi_tensor(func):
        blind = _MULTI_TENSOR
    elif entry is None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        blind = _COMPOSITE
    elif _writes_out(func):
        blind = _OUT_VARIANT
    else:
        blind = entry is not None and entry.floats_at_run_time
    _FLOAT_BLIND[id(func)] = blind
    return blind


def _writes_out(func) -> bool:
    schema = func._schema
    return len(schema.returns) == 1 and any(a.name == "out" and a.kwarg_only and a.alias_info is not None
                                            and a.alias_info.is_write for a in schema.arguments)


def _into_out(func, args, kwargs):
    """`op(..., out=t)` as torch's functional form of the op, copied into `t` (a DTensor keeps its layout; a plain
    scratch buffer where plain tensors hold global values, as in a chunked loss's backward, takes the global value)."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    result = func.overloadpacket(*args, **kwargs)
    if out.shape != result.shape or not (isinstance(out, DTensor) or _replicates_plain()):
        raise UnsupportedOpError(f"{func} into out= of shape {list(out.shape)} ({type(out).__name__}) for a result "
                                 f"of shape {list(result.shape)}: use the functional form")
    return out.copy_(result)


def _multi_tensor(func, args, kwargs):
    if not explain.RECORDERS:
        return foreach.run(func, args, kwargs)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
    return _recorded(func, tensors, lambda: foreach.run(func, args, kwargs))


def forget(func) -> None:
    """Drops what the dispatcher cached about `func` (how it runs, its plans): it has a new rule."""
    _FLOAT_BLIND.pop(id(func), None)
    for key in [k for k in _CACHE if k[0] == id(func)]:
        del _CACHE[key]


def _miss(key, func, args, kwargs, tensors) -> _Plan:
    _STATS["misses"] += 1
    if len(_CACHE) >= _CACHE_LIMIT:  # shapes that keep changing must not grow the cache forever
        _CACHE.clear()
    plan = _make_plan(func, args, kwargs, tensors)
    _CACHE[key] = plan
    return plan


# >0 inside `spmd.implicit_replication()`: plain tensors mixed with DTensors are taken as replicated
IMPLICIT_REPLICATION = [0]
# the same scope inside a trace, as an `fx.traceback.annotate` key: Dynamo defers the counter's updates (Python
# side effects) past the ops it traces, but runs the annotation eagerly and AOTAutograd replays it per node
TRACED_SCOPE = "spmd_implicit_replication"


def _replicates_plain() -> bool:
    # also while autograd's engine runs a derivative formula that made a plain tensor (prod's, copysign's): torch
    # made it, not the user, and it holds a global value
    if IMPLICIT_REPLICATION[0] > 0 or torch._C._current_graph_task_id() != -1:
        return True
    custom = fx_traceback.current_meta.get("custom")  # (a module global that torch rebinds: read it here)
    return bool(custom) and custom.get(TRACED_SCOPE, False)


def _replicated_plain(func, args, kwargs):
    """`args` and `kwargs` with every plain tensor of rank > 0 replaced by a replicated DTensor."""
    mesh = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor))._layout.mesh

    def replicated(a):
        if isinstance(a, DTensor) or not isinstance(a, torch.Tensor) or a.dim() == 0:
            return a
        if a.requires_grad and torch.is_grad_enabled():
            raise MixedTensorError(
                f"{func}: a plain tensor of shape {list(a.shape)} that requires grad met DTensors; its gradient "
                "would be a DTensor, which it cannot hold. A parameter added to a module after distribute_module? "
                "Distribute it too (spmd.distribute_module(module, mesh, ...) again, or spmd.DVariable). A plain "
                "buffer written with DTensors that require grad? Make it a DTensor (spmd.copy_to_mesh)")
        return distributed(a, Layout.replicated(mesh, a.dim()))

    return pytree.tree_map(replicated, (args, kwargs))


def _copy_from_plain(func, args, kwargs):
    """`dtensor.copy_(plain)` (e.g. `load_state_dict` from a plain checkpoint) distributes the value first."""
    target, src = args[0], args[1]
    if src.requires_grad and torch.is_grad_enabled():
        raise MixedTensorError(f"copy_ of a plain tensor that requires grad (shape {list(src.shape)}) into a "
                               "DTensor: distribute it first with spmd.copy_to_mesh(tensor, layout)")
    layout = target._layout
    value = distributed(src.expand(target.shape), layout)
    return dispatch(func, (target, value) + tuple(args[2:]), kwargs)


def distributed(value: torch.Tensor, layout: Layout) -> DTensor:
    """A plain global value as a DTensor laid out by `layout`: each device keeps its shard."""
    return DTensor(planner.distribute(value, layout.mesh, layout.axes), layout, value.shape)


def _execute(plan: _Plan, func, args, kwargs, tensors):
    locals_ = [t._stack for t in tensors]
    if plan.settle:
        _settle_inputs(plan, tensors, locals_)
    if plan.in_steps:
        for i, steps in plan.in_steps:
            locals_[i] = planner.run(locals_[i], plan.mesh, steps)
    if plan.once is not None and (not plan.writes or shared(locals_[0])) and \
            all(shared(locals_[i]) for i in plan.written):  # (a written input of per-device copies: each writes)
        return _execute_once(plan, args, kwargs, tensors, locals_)
    for i in plan.written:
        if tensors[i]._copied_view and not (i == 0 and plan.decision.inplace):  # (a target writes back)
            raise UnsupportedOpError(
                f"{func} writes a view (shape {list(tensors[i].shape)}) whose components are a copy, not its base's "
                "memory (the base's layout had to change when the view was taken): call .clone() on the view, "
                "or relayout the base so the view needs no relayout")
        if shared(locals_[i]) and locals_[i] is tensors[i]._stack:
            # one copy shared by every device, about to be written per device: each device takes its own
            tensors[i]._stack = locals_[i] = locals_[i].contiguous()
    if plan.writes:
        return _execute_writing(plan, func, args, kwargs, tensors, locals_)
    out = _wrap(plan, _run_kernel(plan, tensors, locals_, args, kwargs), locals_, args, kwargs)
    if plan.copied_view:
        return _mark_copied(out, func, args, kwargs)
    if plan.copied_view is False and tensors[0]._copied_view:  # a view sharing the memory of a copied view
        return _mark_copied(out, None, (tensors[0],), {})
    return out


def _run_kernel(plan: _Plan, tensors, locals_, args, kwargs):
    """The plan's kernel on `locals_`; the written inputs it got relayouted are relayouted back into their own
    components."""
    out = plan.kernel(locals_, args, kwargs)
    for i, steps in plan.write_back:
        written, t = planner.run(locals_[i], plan.mesh, steps), tensors[i]
        if shared(t._stack):  # (one copy every device shares, which no device may write: rebound)
            t._stack = written
        else:
            t._stack.copy_(written)
    return out


def _execute_once(plan: _Plan, args, kwargs, tensors, locals_):
    """A replicated op runs on the first device's components (every device holds the same); its outputs are that
    one copy, shared by every device. An in-place op writes the one copy its target shares."""
    if plan.writes:
        target = tensors[0]
        _check_written_view(plan, target)
        plan.once([one_copy(x) for x in locals_], args, kwargs)
        if target._copied_view:
            _write_back(target)
        return target
    out = plan.once([one_copy(x) for x in locals_], args, kwargs)
    n = locals_[0].shape[0]

    def shared_by_all(o):
        return share(o, n) if isinstance(o, torch.Tensor) else o

    out = shared_by_all(out) if plan.decision.single else tuple(shared_by_all(o) for o in out)
    return _wrap(plan, out, locals_, args, kwargs)


def _settle_inputs(plan: _Plan, tensors, locals_) -> None:
    for i in plan.settle:
        t = tensors[i]
        if t._pending:  # (one tensor may be several inputs: the first resolves it)
            locals_[i] = None  # (a reference here would keep resolve from reducing the components in place)
            resolve(t)
        locals_[i] = t._stack


def _execute_writing(plan: _Plan, func, args, kwargs, tensors, locals_):
    """An op that writes its first input: in place, or an in-place view op that rebinds it."""
    target = tensors[0]
    if plan.decision.inplace and target._copied_view:
        _check_written_view(plan, target)
        _run_kernel(plan, tensors, locals_, args, kwargs)  # into the view's own components
        _write_back(target)
        return target
    out = _run_kernel(plan, tensors, locals_, args, kwargs)
    if plan.decision.rebinds:
        return _rebind(plan, target, out, func, args, kwargs)
    return target


def _check_written_view(plan: _Plan, target: DTensor) -> None:
    """Refuses an in-place op on a copied view (or a view sharing one's memory) whose write could not reach its
    base: a view copied by an op with no scatter inverse, or an in-place view op rebinding it."""
    if target._copied_view and (not _writes_back(target) or plan.decision.rebinds):
        raise UnsupportedOpError(
            f"in-place op on a view (shape {list(target.shape)}, layout {target._layout.sharding_specs}) that "
            "could not share memory with its base because the base's layout had to change when the view was "
            "taken; the update would not reach the base. Call .clone() on the view first, or relayout the base "
            "so the view needs no relayout")


# view op -> the op that writes a view's values into its base (torch's own inverses, which functionalization uses)
_SCATTERS = {torch.ops.aten.diagonal.default: torch.ops.aten.diagonal_scatter.default,
             torch.ops.aten.select.int: torch.ops.aten.select_scatter.default,
             torch.ops.aten.slice.Tensor: torch.ops.aten.slice_scatter.default,
             torch.ops.aten.as_strided.default: torch.ops.aten.as_strided_scatter.default}


def _reshaped_back(view, base, rest):
    return dispatch(torch.ops.aten.view.default, (view, list(base.shape)))


def _permuted_back(view, base, rest):
    dims = [d % base.dim() for d in rest[0]]
    return dispatch(torch.ops.aten.permute.default, (view, sorted(range(len(dims)), key=dims.__getitem__)))


# view ops whose view is their whole base, rearranged: view op -> (view, base, the op's other arguments) -> the
# base's values (a gradient autograd transposes, `torch.autograd.grad`'s, is such a view of a pending sum)
_INVERSES = {torch.ops.aten.view.default: _reshaped_back, torch.ops.aten._unsafe_view.default: _reshaped_back,
             torch.ops.aten.reshape.default: _reshaped_back, torch.ops.aten._reshape_alias.default: _reshaped_back,
             torch.ops.aten.t.default: lambda view, base, rest: dispatch(torch.ops.aten.t.default, (view,)),
             torch.ops.aten.transpose.int: lambda view, base, rest: dispatch(torch.ops.aten.transpose.int,
                                                                             (view, *rest)),
             torch.ops.aten.permute.default: _permuted_back}


def _writes_back(view: DTensor) -> bool:
    """Whether a write into `view`, a copied view or a view sharing one's memory, can reach the tensor it was taken
    from, through every copied view between them."""
    while view._copied_view:
        if view._view_of is None:
            return False
        view = view._view_of[0]
    return True


def _write_back(view: DTensor) -> None:
    """An in-place op wrote into a view whose components are a copy (its base's layout had to change when it was
    taken), or share a copy's memory: the copy's values go into its base through its view op's scatter (a reshape's
    or transpose's: the values rearranged back), as torch's functionalization writes a mutated view back (a base
    that is such a view itself writes on into its own)."""
    while view._view_of[1] is None:
        view = view._view_of[0]
    base, func, rest, kwargs = view._view_of
    if func in _INVERSES:
        value = _INVERSES[func](view, base, rest)
    else:
        value = dispatch(_SCATTERS[func], (base, view, *rest), kwargs)
    dispatch(torch.ops.aten.copy_.default, (base, value))


def _rebind(plan: _Plan, target: DTensor, local, func, args, kwargs) -> DTensor:
    """An in-place view op (`squeeze_`): the DTensor takes the new components and layout; its wrapper's sizes
    and strides follow the op run on the wrapper itself."""
    with no_dispatch():
        func(*args, **kwargs)
    target._settle(local, plan.out_layouts[0])
    return target


def _recorded(func, tensors, run):
    """`run()`, the expansion of `func` on `tensors`, reported to the active `explain` recorder."""
    recorder = explain.RECORDERS[-1]
    recorder.op_started(func, tensors)
    out = run()
    recorder.op_finished(out)
    return out


def _mark_copied(out, func, args, kwargs):
    """The outputs of a view op whose components are a copy (`func` None: that share a copied view's memory,
    `args[0]`). One with a scatter inverse, or sharing a copy's memory, remembers its base (and the view's
    arguments), for an in-place op on it to write back (`_write_back`)."""
    for t in (out if isinstance(out, tuple) else (out,)):
        if isinstance(t, DTensor):
            t._copied_view = True
            if func is None or func in _SCATTERS or func in _INVERSES:
                t._view_of = (args[0], func, args[1:], kwargs)
    return out


def _wrap(plan: _Plan, out, locals_, args, kwargs):
    decision = plan.decision
    if decision.single and plan.out_steps is None and plan.out_pending is None and decision.epilogue is None:
        layout = plan.out_layouts[0]
        if layout is None:
            return out
        shapes = plan.out_shapes
        if shapes is None:
            shapes = [layout.global_shape_from_local_shape(out.shape[1:])]
            if not decision.value_shaped:
                plan.out_shapes = shapes
        return DTensor(out, layout, shapes[0])
    if decision.single:
        out = (out,)
    elif not decision.outputs:  # an op writing its arguments and returning nothing
        return None
    pending = plan.out_pending
    if plan.out_steps and pending is None:
        out = [planner.run(o, plan.mesh, s) if s else o for o, s in zip(out, plan.out_steps)]
    if decision.epilogue is not None:
        out = decision.epilogue(out, locals_, args, kwargs)
    shapes = plan.out_shapes
    if shapes is None:
        shapes = [None if l is None or o is None else l.global_shape_from_local_shape(o.shape[1:])
                  for o, l in zip(out, plan.out_layouts)]  # (None: an output torch's op leaves out)
        if not decision.value_shaped:
            plan.out_shapes = shapes
    pending = pending or ((),) * len(out)
    wrapped = [o if s is None else DTensor(o, l, s, pending=p, pending_op=plan.reduce_op)
               for o, l, s, p in zip(out, plan.out_layouts, shapes, pending)]
    return wrapped[0] if decision.single else tuple(wrapped)


def _make_plan(func, args, kwargs, tensors) -> _Plan:
    check_like_torch(func, args, kwargs)
    mesh = tensors[0]._layout.mesh
    for t in tensors[1:]:
        if t._layout.mesh != mesh:
            raise MeshMismatchError(
                f"{func} got DTensors on different meshes: {mesh!r} and {t._layout.mesh!r}. Move one with "
                "spmd.relayout_like / spmd.copy_to_mesh first.")
    entry = registry.lookup(func)
    native = multi_axis.sees_whole(entry, func, args)  # else rules see a multi-axis input's outer dims only

    # a `same` sum (each device already holds its group's sum: engine/rules/contraction.py) passes through ops
    # linear in it as a `sum` does, unless it meets a `sum`: then it is resolved first (one sum is kept per op)
    summable = {"sum"} if any(t._pending_op == "sum" for t in tensors if t._pending) else {"sum", "same"}

    multi = any(t._layout.multi_axis for t in tensors)
    call = OpCall(func, tuple(_spec(a, native, summable) for a in args),
                  {k: _spec(v, native, summable) for k, v in kwargs.items()}, mesh, mesh.num_local_devices(),
                  multi_axis=multi and not native)
    decide = fallback_decision if entry is None else entry.rule
    decision = decide(call)
    if multi:  # rules saw each multi-axis input sharded over its outer dim
        decision = multi_axis.adapt(decision, entry, tensors, native)
    plan = _plan_from_decision(decision, call, tensors, args, kwargs)
    if decision.value_shaped and plan.in_steps and entry is not None:  # (the fallback warns on its own)
        warn_gathered(func)
    if _replicated(func, plan, tensors):
        # rules are pure: the same op on a stack of one device's components decides the kernel for that stack
        plan.once = _kernel(decide(dataclasses.replace(call, num_local=1)), mesh, args, kwargs)
    return plan


def _spec(a, native: bool, summable: set):
    """An argument as its rule sees it: a DTensor as its TensorSpec (lists of them too). (A module-level function:
    a closure calling itself would be a reference cycle, keeping the call's DTensors alive until a collection.)"""
    if isinstance(a, DTensor):
        pending = a._pending if a._pending_op in summable else ()
        return TensorSpec(a._layout.axes if native else a._layout.outer_axes, tuple(a.shape), a.dtype,
                          pending, bool(pending) and a._key[-1] is True)
    if isinstance(a, (list, tuple)) and any(isinstance(x, DTensor) for x in a):
        return type(a)(_spec(x, native, summable) for x in a)
    return a


def _replicated(func, plan: _Plan, tensors) -> bool:
    """Whether the op reads and writes only values replicated over the whole mesh of several local devices, and
    runs no collective: then every device computes the same, once is enough. (Not a view: its result must alias
    each device's components, which need not be one copy.)"""
    decision = plan.decision
    is_view = returns_alias(func) and not decision.inplace
    if (plan.mesh.num_local_devices() == 1 or is_view or decision.rebinds or decision.collectives
            or plan.out_pending or plan.out_steps or plan.write_back or decision.epilogue is not None
            or torch.Tag.nondeterministic_seeded in func.tags):
        return False
    inputs_replicated = all(all(m is None for m in (t._layout.axes if want is None else want))
                            for t, want in zip(tensors, decision.inputs))
    return inputs_replicated and all(layout is None or not layout.sharded_mesh_dims for layout in plan.out_layouts)


def _plan_from_decision(decision: Decision, call: OpCall, tensors, args, kwargs) -> _Plan:
    mesh = call.mesh
    settle, in_steps = [], []
    written = _written_inputs(call.func, args, kwargs, tensors) + decision.writes
    write_back = []
    for i, (t, want) in enumerate(zip(tensors, decision.inputs)):
        have = t._layout.axes
        want = t._layout.outer_axes if want is None else tuple(want)
        if want != have and decision.inplace and i == 0:
            _refuse_relayouted_target(call, t, want)
        if want != have and i in written:  # written in the kernel's layout: its values go back after
            write_back.append((i, planner.plan_on(mesh, want, have)))
        pending = () if i in decision.keeps else t._pending  # a kept sum is relayouted unreduced: still a sum
        steps = planner.plan_on(mesh, have, want, pending, t._pending_op)
        if pending and not any(s.kind is Kind.REDUCE_SCATTER for s in steps) and steps[0].kind is not Kind.SHARD:
            # resolved into the tensor itself, so that other consumers (and views) do not reduce it again (unless
            # the plan reduce-scatters, or slices first: a block's sum moves a fraction of the whole's)
            settle.append(i)
            steps = planner.plan_on(mesh, have, want)
        if steps:
            in_steps.append((i, steps))
    out_layouts = [None if axes is None else Layout.from_axes(axes, mesh) for axes in decision.outputs]
    out_pending = out_steps = None
    reduced = [tuple(m for m in red if mesh.dim_size(m) > 1) for red in decision.reduce]
    # ops linear in `same` sums leave a `same` sum
    reduce_op = "same" if any(tensors[i]._pending_op == "same" for i in decision.keeps) else decision.reduce_op
    if any(reduced):
        out_steps = [planner.plan_on(mesh, axes, axes, red, reduce_op) if red else ()
                     for axes, red in zip(decision.outputs, reduced)]
        if decision.epilogue is None:  # left pending: the consumer decides between all-reduce and reduce-scatter
            out_pending = reduced
    if settle or in_steps or out_steps:
        backend_for(mesh)  # a mesh this process cannot communicate over fails here, not where it is consumed
    is_view = returns_alias(call.func)
    return _Plan(decision, _kernel(decision, mesh, args, kwargs), settle, in_steps, out_layouts, out_pending,
                 out_steps, mesh, copied_view=(bool(in_steps) or decision.copies) if is_view else None,
                 written=written, write_back=write_back, reduce_op=reduce_op)


def _refuse_relayouted_target(call: OpCall, t: DTensor, want):
    """The error for an in-place op whose rule computes its target in another layout."""
    computed = Layout.from_axes(want, call.mesh).sharding_specs
    way_out = (f"this op shards an axis over one mesh dim only: relayout the target to such a layout first "
               f"(e.g. {computed}), and back after" if want == t._layout.outer_axes else
               "use the out-of-place form (`y = y * w` for `y.mul_(w)`), or relayout the operands first")
    raise UnsupportedOpError(
        f"{call.describe()}: in-place op would change the layout of its target (layout "
        f"{t._layout.sharding_specs}; this op computes it as {computed}); {way_out}")


def _written_inputs(func, args, kwargs, tensors) -> tuple[int, ...]:
    """The positions in `tensors` of the DTensor arguments that `func`'s schema says it writes."""
    if not func._schema.is_mutable:
        return ()
    written, names = [], written_arguments(func)
    for i, argument in enumerate(func._schema.arguments):
        if argument.name not in names:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, DTensor):
                written.append(next(j for j, u in enumerate(tensors) if u is t))
    return tuple(written)


def _kernel(decision: Decision, mesh, args, kwargs):
    """The decision's kernel for this call: specialised to the argument shapes where it can be, and given a
    runner for the collectives it declared."""
    kernel = decision.kernel
    if decision.collectives:
        comm, declared = backend_for(mesh), decision.collectives

        def run(i, x):
            return planner.execute(comm, declared[i], x, mesh)
        return lambda l, a, k: kernel(l, a, k, run)
    specialize = getattr(kernel, "specialize", None)
    return kernel if specialize is None else specialize(args, kwargs)
