"""Sharded parameters (FSDP, ZeRO-3) from layouts alone: `distribute_module(..., shard_parameters="batch")`.

Each parameter gets, besides the layout its name maps to (its *compute layout*), a sharding over the batch mesh
dim on its first free axis that divides (`sharded_layout`). Its gradient and the optimizer's state take that
layout too (a gradient has its leaf's layout; `zeros_like` keeps it), so each device holds 1/N of them. Around the
forward of each module that owns such parameters (a *unit*):

1. before it, each parameter is relayouted to its compute layout, an all-gather over the batch dim, and the module
   sees the gathered tensor under the parameter's name;
2. backward runs that relayout's backward: the gradient arrives as a pending sum over the batch dim (the
   contraction over the batch left it), and a pending sum relayouted to a layout sharded over its dims is one
   reduce-scatter, so nothing but the gather needs to be written here;
3. after it, the parameters are put back and the gathered copies freed: what autograd saves of them for backward
   (a weight, for its input's gradient) is saved as a note (`_Regather`, through saved-tensor hooks) and gathered
   again when backward unpacks it, as FSDP gathers again before a unit's backward — unless
   `reshard_after_forward=False` (FSDP2's option, ZeRO-2's memory): autograd then keeps what it saved, one gather
   per parameter and step, the gathered weights held from forward to backward.

Prefetch: each unit learns which unit's forward came next (in the first forward of its distributed module) and,
once it has its own parameters, starts that unit's gathers asynchronously, so they travel while this unit
computes — where a gather is one direct torch.distributed call (multi-client meshes with one member of each group
per client, as under torchrun); elsewhere (in-process meshes) the next unit gathers when it starts. A prefetched
parameter changed in place since (an optimizer step) is gathered again. Backward prefetches the same way, in the
other direction: when a unit's backward gathers its first saved weight again, the gathers of the weights the unit
before it saved start (FSDP2's backward prefetch). Every client starts the same gathers in the same order, so
collectives stay matched.

Peak memory is then the shards plus the gathered parameters of the units in flight (this one and the next).

Gradient accumulation (`spmd.no_sync(module)`, FSDP2's `set_requires_gradient_sync(False)`): a backward inside it
reduces nothing. Each gathered parameter's gradient, a pending sum over the batch dim in the compute layout, is
kept by its unit and summed locally over the micro-batches; the first backward after the context adds the kept sum
to its own gradient before the one reduce-scatter. Each device then holds a whole (compute-layout) gradient per
parameter between micro-batches: fewer collectives for more memory, as FSDP2's.

Mixed precision (`mp_policy`, torch FSDP2's `MixedPrecisionPolicy`): a shard is cast to `param_dtype` before its
gather (half the bytes for bfloat16), so the module computes in it, each unit's floating inputs are cast to it too
(`cast_forward_inputs`); in backward each device's partial gradient is cast to `reduce_dtype` before the
reduce-scatter (the sum is taken in it), then to the parameter's own dtype: parameters, gradients and optimizer
state stay in theirs (float32 masters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from spmd import explain, function_mode
from spmd.api import relayout
from spmd.collectives import Kind, backend_for
from spmd.collectives.local import shared
from spmd.dtensor import DTensor, make
from spmd.engine import planner
from spmd.errors import LayoutError, UnsupportedOpError
from spmd.layout import Layout
from spmd.mesh import axis_dims


def sharded_layout(layout: Layout, shape: tuple[int, ...], mesh_dim: str) -> Layout:
    """`layout` with `mesh_dim` added where it divides: on the first unsharded axis, else as the minor mesh dim of
    the first sharded one; `layout` itself when `mesh_dim` already shards an axis, has size 1, or fits nowhere
    (the parameter then stays as mapped, its gradient reduced as data-parallel gradients are)."""
    mesh = layout.mesh
    if mesh_dim not in mesh:
        raise LayoutError(f"shard_parameters={mesh_dim!r} is not a dimension of the mesh (dimensions: "
                          f"{mesh.dim_names})")
    size = mesh.dim_size(mesh_dim)
    if size == 1 or any(mesh_dim in axis_dims(a) for a in layout.axes):
        return layout
    free = [i for i, a in enumerate(layout.axes) if a is None and shape[i] % size == 0]
    sharded = [i for i, a in enumerate(layout.axes)
               if a is not None and shape[i] % (layout.num_shards(i) * size) == 0]
    if not free and not sharded:
        return layout
    axes = list(layout.axes)
    i = free[0] if free else sharded[0]
    axes[i] = mesh_dim if free else (*axis_dims(axes[i]), mesh_dim)
    return Layout.from_axes(axes, mesh)


class Precision(NamedTuple):
    """The dtypes of a mixed-precision policy (FSDP2's `MixedPrecisionPolicy`; None: the parameter's own)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def of(cls, policy) -> Precision | None:
        """`policy` (torch's `MixedPrecisionPolicy`, or anything with its attributes) as a Precision; None for None."""
        if policy is None:
            return None
        try:
            fields = {name: getattr(policy, name) for name in cls._fields}
        except AttributeError as e:
            raise TypeError(f"mp_policy takes torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., "
                            f"reduce_dtype=...), not {type(policy).__name__}: {e}") from None
        for name in cls._fields[:3]:
            if fields[name] is not None and not (isinstance(fields[name], torch.dtype)
                                                 and fields[name].is_floating_point):
                raise TypeError(f"mp_policy.{name} must be a floating dtype or None, not {fields[name]!r}")
        return cls(**fields)

    def compute_dtype(self, param: DTensor) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None and param.is_floating_point() else param.dtype

    def cast(self, value, dtype: torch.dtype | None):
        """Every floating tensor in `value` (nested args, outputs) cast to `dtype`."""
        if dtype is None:
            return value
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


class _Regather(NamedTuple):
    """A saved view of a gathered parameter, kept as what gathers it again (see the module's docstring, 3.)."""
    unit: _Unit  # whose forward gathered it
    name: str
    param: DTensor
    layout: Layout  # the compute layout the parameter is gathered to
    dtype: torch.dtype  # and the dtype
    view_layout: Layout  # the saved tensor's own layout, size, strides and offset into the gathered components
    size: tuple
    stride: tuple
    offset: int


_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its _Unit
# distributed module -> its hooks: the forward-start one (and the outputs' cast of a mixed-precision policy)
_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# storage address of gathered components in use -> (unit, name, param, compute layout, compute dtype, offset)
_LIVE: dict[int, tuple] = {}
_LAST: list = [None]  # the unit that gathered last in the current forward of a distributed module


def _pack(saved: torch.Tensor):
    if isinstance(saved, DTensor) and not saved._pending:
        stack = saved._stack
        live = _LIVE.get(stack.untyped_storage().data_ptr())
        if live is not None:
            unit, name, param, layout, dtype, base = live
            unit.saved.add(name)
            return _Regather(unit, name, param, layout, dtype, saved._layout, tuple(stack.shape), stack.stride(),
                             stack.storage_offset() - base)
    return saved


def _unpack(saved):
    if type(saved) is not _Regather:
        return saved
    stack = saved.unit.regathered(saved)
    return make(stack.as_strided(saved.size, saved.stride, stack.storage_offset() + saved.offset), saved.view_layout)


class _Gathered(torch.autograd.Function):
    """A parameter's components gathered in `dtype` (`stack`: ahead, by a prefetch; None: now) as the gathered
    DTensor. Backward is relayout's, each device's partial gradient first cast to `reduce_dtype` (None: as it is),
    and, where `unit` accumulates gradients (see the module's docstring), kept by it or added to what it kept."""

    @staticmethod
    def forward(ctx, param: DTensor, stack: torch.Tensor | None, layout: Layout, dtype: torch.dtype,
                reduce_dtype: torch.dtype | None, unit: _Unit | None = None, name: str | None = None):
        ctx.source, ctx.dtype, ctx.reduce_dtype = param._layout, param.dtype, reduce_dtype
        ctx.unit, ctx.name = unit, name
        if stack is None:
            return relayout(param.to(dtype), layout)
        return make(stack, layout)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_dtype is not None and grad.dtype != ctx.reduce_dtype:
            grad = DTensor(grad._stack.to(ctx.reduce_dtype), grad._layout, grad.shape, pending=grad._pending,
                           pending_op=grad._pending_op)  # (each partial sum cast: the sum is taken in the new dtype)
        if ctx.unit is not None:
            grad = ctx.unit.accumulated(ctx.name, grad)
            if grad is None:
                return (None,) * 7
        return relayout(grad, ctx.source).to(ctx.dtype), None, None, None, None, None, None


def _gatherer(param: DTensor, layout: Layout, precision: Precision | None) -> Callable[[DTensor], DTensor]:
    """What gathers `param` to `layout` before its unit's forward: its relayout, or the cast one of a mixed-precision
    policy — one node for Dynamo, which AOTAutograd traces through (Dynamo cannot build its backward's DTensor)."""
    if precision is None:
        return functools.partial(relayout, layout=layout)
    dtype, reduce_dtype = precision.compute_dtype(param), precision.reduce_dtype

    def gather(p: DTensor) -> DTensor:
        return _Gathered.apply(p, None, layout, dtype, reduce_dtype)
    torch.compiler.allow_in_graph(gather)
    return gather


def _start_gather(param: DTensor, layout: Layout, dtype: torch.dtype):
    """The all-gather of `param` in `dtype` to `layout` in flight, or None where it is not one asynchronous call."""
    steps = planner.plan_on(layout.mesh, param._layout.axes, layout.axes)
    if len(steps) != 1 or steps[0].kind is not Kind.ALL_GATHER:
        return None
    start = getattr(backend_for(layout.mesh), "all_gather_async", None)
    stack = param._stack.to(dtype)
    handle = start and start(stack, layout.mesh, steps[0].mesh_dims[0], steps[0].axis)
    if handle is not None and explain.RECORDERS:
        explain.collective(Kind.ALL_GATHER, steps[0].mesh_dims, stack)
    return handle


@dataclasses.dataclass
class _Frame:
    """One forward of a unit in flight: its gathered copies' storage addresses and its saved-tensor hooks."""
    live: list
    hooks: object


class _Unit:
    """The hooks of one module that owns sharded parameters: gather before its forward (or take what the unit
    before it prefetched), start the next unit's gathers, put the parameters back after."""

    def __init__(self, module: nn.Module, params: dict[str, tuple[DTensor, Layout]], precision: Precision | None,
                 reshard: bool):
        self.params = params
        self.precision = precision
        self.reshard = reshard  # whether backward gathers again what it needs (else autograd keeps the copies)
        self.gatherers = {name: _gatherer(param, layout, precision) for name, (param, layout) in params.items()}
        self.next: _Unit | None = None  # the unit whose forward came next, learned in the first forward
        self.previous: _Unit | None = None  # and the one before it: the next whose backward runs
        self.prefetched: dict[str, tuple] = {}  # name -> (gather in flight, the parameter's version then)
        self.saved: set[str] = set()  # the parameters whose gathered copies autograd saved (backward gathers them)
        self.regathering: dict[str, tuple] = {}  # name -> (backward's gather in flight, the parameter's version)
        self.frames: list[_Frame] = []  # per forward in flight (a unit may run again inside itself)
        self.sync = True  # False inside `spmd.no_sync`: backward keeps the gradients (see `accumulated`)
        self.kept: dict[str, DTensor] = {}  # name -> the gradient's pending sum kept over the micro-batches
        self.handles = [module.register_forward_pre_hook(self.gather, with_kwargs=True),
                        module.register_forward_hook(self.release, always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def gather(self, module: nn.Module, args, kwargs):
        # traced by spmd.function, the compiled graph decides what backward keeps (no saved-tensor hooks there)
        # and schedules its collectives itself (no prefetch)
        compiling = torch.compiler.is_compiling()
        track = self.reshard and torch.is_grad_enabled() and not compiling
        accumulating = not self.sync or bool(self.kept)
        if accumulating and (compiling or function_mode.active()):
            raise UnsupportedOpError("spmd.no_sync on a module with sharded parameters keeps its gradients in eager "
                                     "backward only: accumulate the micro-batches outside spmd.function (or let "
                                     "each micro-batch's backward reduce-scatter, without no_sync)")
        frame = _Frame([], None)  # pushed first: `release` runs even when this raises
        self.frames.append(frame)
        self._finish_regathers()
        precision = self.precision
        for name, (param, layout) in self.params.items():
            gathered = self._take(name, param, layout, accumulating)
            if gathered is None and accumulating:
                policy = precision or Precision()
                gathered = _Gathered.apply(param, None, layout, policy.compute_dtype(param), policy.reduce_dtype,
                                           self, name)
            elif gathered is None:
                gathered = self.gatherers[name](param)
            module._parameters[name] = gathered  # not a Parameter: seen under the name during this forward only
            stack = gathered._stack if track else None  # (a traced DTensor's components: not Dynamo's to read)
            if track and stack is not param._stack and (stack.is_contiguous() or shared(stack)):
                frame.live.append(stack.untyped_storage().data_ptr())
                _LIVE[frame.live[-1]] = (self, name, param, layout, gathered.dtype, stack.storage_offset())
        if track:
            frame.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            frame.hooks.__enter__()
        if not compiling:
            self._chain()
        if precision is not None and precision.cast_forward_inputs:
            return precision.cast((args, kwargs), precision.param_dtype)
        return None

    def _take(self, name: str, param: DTensor, layout: Layout, accumulating: bool) -> DTensor | None:
        """The prefetched gather of `name`, if one is in flight and the parameter has not changed since."""
        stack = _arrived(self.prefetched, name, param)
        if stack is None:
            return None
        precision = self.precision or Precision()
        return _Gathered.apply(param, stack, layout, stack.dtype, precision.reduce_dtype,
                               *((self, name) if accumulating else ()))

    def accumulated(self, name: str, grad: DTensor) -> DTensor | None:
        """In backward, the gradient of `name` (a pending sum) plus what earlier micro-batches kept: kept in turn
        inside `spmd.no_sync` (None: nothing to reduce now), else returned to be reduce-scattered."""
        kept = self.kept.pop(name, None)
        total = grad if kept is None else kept + grad
        if self.sync:
            return total
        self.kept[name] = total
        return None

    def _chain(self) -> None:
        """Learns which unit follows the last one, and prefetches the one that follows this one."""
        last = _LAST[0]
        if last is not None and last is not self and last.next is None:
            last.next, self.previous = self, last
        _LAST[0] = self
        after = self.next
        if after is not None and not after.prefetched:
            after._start_gathers(after.params, after.prefetched)

    def _start_gathers(self, names, in_flight: dict) -> None:
        """Starts the gathers of this unit's parameters `names` (in the order of `self.params`: the same on every
        client), each into `in_flight` as (its handle, the parameter's version)."""
        for name, (param, layout) in self.params.items():
            if name in names:
                handle = _start_gather(param, layout, (self.precision or Precision()).compute_dtype(param))
                if handle is not None:
                    in_flight[name] = (handle, param._version)

    def regathered(self, note: _Regather) -> torch.Tensor:
        """In backward, the components of `note`'s parameter gathered again: prefetched when the unit after this one
        in forward needed its own, or now; then the unit before this one starts gathering what it will need."""
        stack = _arrived(self.regathering, note.name, note.param)
        if stack is None:
            with torch.no_grad():
                stack = relayout(note.param.detach().to(note.dtype), note.layout)._stack
        before = self.previous
        if before is not None and not before.regathering:
            before._start_gathers(before.saved, before.regathering)
        return stack

    def _finish_regathers(self) -> None:
        """Waits for backward's gathers that backward did not take (a backward that stopped early)."""
        for handle, _ in self.regathering.values():
            handle.wait()
        self.regathering.clear()

    def release(self, module: nn.Module, args, output) -> None:
        frame = self.frames.pop()
        if frame.hooks is not None:
            frame.hooks.__exit__(None, None, None)
        for key in frame.live:
            _LIVE.pop(key, None)
        for name, (param, _) in self.params.items():
            module._parameters[name] = param


def _arrived(in_flight: dict, name: str, param: DTensor) -> torch.Tensor | None:
    """The components of `name`'s gather started ahead, if one is in flight and `param` has not changed since."""
    handle, version = in_flight.pop(name, (None, None))
    if handle is None:
        return None
    stack = handle.wait()  # also when stale: every client finishes the collective it started
    return stack if version == param._version else None


@contextlib.contextmanager
def gradients_kept(module: nn.Module):
    """Inside, the backward of `module`'s units keeps their gradients (see the module's docstring; `spmd.no_sync`)."""
    units = [_UNITS[sub] for sub in module.modules() if sub in _UNITS]
    before = [unit.sync for unit in units]
    for unit in units:
        unit.sync = False
    try:
        yield
    finally:
        for unit, sync in zip(units, before):
            unit.sync = sync


def _forward_starts(module: nn.Module, args) -> None:
    _LAST[0] = None  # a unit's successor is learned within one forward of the distributed module


def gather_on_use(module: nn.Module, compute_layouts: dict[int, Layout], precision: Precision | None = None,
                  reshard_after_forward: bool = True) -> None:
    """Registers a `_Unit` on every submodule owning parameters whose layout differs from their compute layout
    (`compute_layouts`: id of the parameter -> the layout its name maps to), gathering them in `precision`; without
    `reshard_after_forward`, what backward needs of the gathered copies stays from the forward."""
    for sub in module.modules():
        old = _UNITS.pop(sub, None)
        if old is not None:
            old.remove()
        params = {name: (p, compute_layouts[id(p)]) for name, p in sub._parameters.items()
                  if p is not None and id(p) in compute_layouts and p._layout != compute_layouts[id(p)]}
        if params:
            _UNITS[sub] = _Unit(sub, params, precision, reshard_after_forward)
    sharded = any(sub in _UNITS for sub in module.modules())
    for hook in _ROOTS.pop(module, ()):
        hook.remove()
    if sharded:  # (a module without sharded parameters gets no hook on its forward)
        _ROOTS[module] = [module.register_forward_pre_hook(_forward_starts, prepend=True)]
        if precision is not None and precision.output_dtype is not None:
            _ROOTS[module].append(module.register_forward_hook(
                lambda m, args, out: precision.cast(out, precision.output_dtype)))


__all__ = ["Precision", "sharded_layout", "gather_on_use", "gradients_kept"]
