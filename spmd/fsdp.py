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
   again when backward unpacks it, as FSDP gathers again before a unit's backward.

Peak memory is then the shards plus the gathered parameters of the units in flight (one at a time, unless units
nest). Gathers are synchronous: nothing is prefetched yet.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import nn

from spmd.api import relayout
from spmd.dtensor import DTensor, make
from spmd.errors import LayoutError
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


class _Regather(NamedTuple):
    """A saved view of a gathered parameter, kept as what gathers it again (see the module's docstring, 3.)."""
    param: DTensor
    layout: Layout  # the compute layout the parameter is gathered to
    view_layout: Layout  # the saved tensor's own layout, size, strides and offset into the gathered components
    size: tuple
    stride: tuple
    offset: int


_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its _Unit
_LIVE: dict[int, tuple] = {}  # storage address of gathered components in use -> (param, compute layout, offset)


def _pack(saved: torch.Tensor):
    if isinstance(saved, DTensor) and not saved._pending:
        stack = saved._stack
        live = _LIVE.get(stack.untyped_storage().data_ptr())
        if live is not None:
            param, layout, base = live
            return _Regather(param, layout, saved._layout, tuple(stack.shape), stack.stride(),
                             stack.storage_offset() - base)
    return saved


def _unpack(saved):
    if type(saved) is not _Regather:
        return saved
    with torch.no_grad():
        stack = relayout(saved.param.detach(), saved.layout)._stack
    return make(stack.as_strided(saved.size, saved.stride, stack.storage_offset() + saved.offset), saved.view_layout)


class _Unit:
    """The hooks of one module that owns sharded parameters: gather before its forward, put back after."""

    def __init__(self, module: nn.Module, params: dict[str, tuple[DTensor, Layout]]):
        self.params = params
        self.live: list[list[int]] = []  # per forward in flight (a unit may run again inside itself)
        self.saved_hooks: list = []
        self.handles = [module.register_forward_pre_hook(self.gather),
                        module.register_forward_hook(self.release, always_call=True)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def gather(self, module: nn.Module, args) -> None:
        # traced by spmd.function, the compiled graph decides what backward keeps (no saved-tensor hooks there)
        track = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        keys = []
        for name, (param, layout) in self.params.items():
            gathered = relayout(param, layout)
            module._parameters[name] = gathered  # not a Parameter: seen under the name during this forward only
            stack = gathered._stack
            if track and stack is not param._stack and stack.is_contiguous():
                keys.append(stack.untyped_storage().data_ptr())
                _LIVE[keys[-1]] = (param, layout, stack.storage_offset())
        self.live.append(keys)
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack) if track else None
        if hooks is not None:
            hooks.__enter__()
        self.saved_hooks.append(hooks)

    def release(self, module: nn.Module, args, output) -> None:
        hooks = self.saved_hooks.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for key in self.live.pop():
            _LIVE.pop(key, None)
        for name, (param, _) in self.params.items():
            module._parameters[name] = param


def gather_on_use(module: nn.Module, compute_layouts: dict[int, Layout]) -> None:
    """Registers a `_Unit` on every submodule owning parameters whose layout differs from their compute layout
    (`compute_layouts`: id of the parameter -> the layout its name maps to)."""
    for sub in module.modules():
        old = _UNITS.pop(sub, None)
        if old is not None:
            old.remove()
        params = {name: (p, compute_layouts[id(p)]) for name, p in sub._parameters.items()
                  if p is not None and id(p) in compute_layouts and p._layout != compute_layouts[id(p)]}
        if params:
            _UNITS[sub] = _Unit(sub, params)


__all__ = ["sharded_layout", "gather_on_use"]
