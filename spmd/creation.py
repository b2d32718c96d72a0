"""Creating DTensors with a layout: each device generates only its own shard, nothing global is materialised.

`zeros`, `ones`, `fill`, `empty`, `zeros_like`, `ones_like` take `layout=`; `call_with_layout` does the same
for torch's factories (`torch.ones`, `torch.rand`, ...) and for spmd's functions that take `layout=`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from spmd import api, random as srandom
from spmd.api import relayout
from spmd.dtensor import DTensor, make
from spmd.errors import LayoutError
from spmd.layout import Layout
from spmd.mesh import get_default_mesh, pop_default_mesh, push_default_mesh
from spmd.ops import born_with_layout


def _shape(args, kwargs) -> tuple[int, ...]:
    shape = kwargs.pop("shape", None)
    shape = kwargs.pop("size", shape)
    if shape is None:
        shape = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
    return tuple(int(s) for s in shape)


def _target(shape: Sequence[int], layout: Layout | None) -> Layout | None:
    if layout is None:
        mesh = get_default_mesh()
        return None if mesh is None else Layout.replicated(mesh, len(shape))
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a spmd.Layout, got {type(layout).__name__}")
    if layout.rank != len(shape):
        raise LayoutError(f"shape {list(shape)} (rank {len(shape)}) does not match layout {layout.sharding_specs} "
                          f"of rank {layout.rank}")
    if any(s < 0 for s in shape):  # torch's error, naming the global shape (not the stacked components')
        negative = next(s for s in shape if s < 0)
        raise RuntimeError(f"Trying to create tensor with negative dimension {negative}: {list(shape)}")
    layout.check_divisible(shape)
    return layout


def _local(shape, layout: Layout, build: Callable) -> DTensor:
    """Calls `build(stacked_local_shape, device)` and wraps the result with `layout`."""
    mesh = layout.mesh
    local_shape = (mesh.num_local_devices(),) + layout.local_shape_from_global_shape(shape)
    return make(build(local_shape, mesh.torch_device), layout)


def _factory(torch_fn):
    def create(*shape, dtype=None, layout: Layout | None = None, requires_grad=False, **kwargs):
        if len(shape) == 2 and isinstance(shape[1], torch.dtype) and dtype is None:  # TF's order: (shape, dtype)
            shape, dtype = shape[:1], shape[1]
        size = _shape(shape, kwargs)
        target = _target(size, layout)
        if target is None:
            return torch_fn(size, dtype=dtype, requires_grad=requires_grad, **kwargs)
        out = _local(size, target, lambda s, d: torch_fn(s, dtype=dtype, device=d))
        return out.requires_grad_() if requires_grad else out
    create.__name__ = create.__qualname__ = torch_fn.__name__
    create.__doc__ = (f"`torch.{torch_fn.__name__}` with a `layout=`: a DTensor whose devices each create "
                      "only their shard (a plain tensor without layout or default mesh).")
    return born_with_layout(create)


zeros = _factory(torch.zeros)
ones = _factory(torch.ones)
empty = _factory(torch.empty)


@born_with_layout
def fill(dims: Sequence[int], value, dtype=None, layout: Layout | None = None):
    """A tensor of shape `dims` filled with `value` (TF's `tf.fill`), with an optional layout.

    >>> mesh = create_mesh([("x", 3), ("y", 2)])
    >>> t = fill((6, 4), 7.0, layout=Layout(["x", "y"], mesh))
    >>> t.shape, unpack(t)[0].tolist()
    (torch.Size([6, 4]), [[7.0, 7.0], [7.0, 7.0]])
    """
    size = tuple(int(s) for s in dims)
    target = _target(size, layout)
    if target is None:
        return torch.full(size, value, dtype=dtype)
    return _local(size, target, lambda s, d: torch.full(s, value, dtype=dtype, device=d))


def full(size, fill_value, *, dtype=None, layout: Layout | None = None):
    return fill(size, fill_value, dtype=dtype, layout=layout)


def _like(fn):
    def create(tensor, dtype=None, layout: Layout | None = None):
        if layout is None:
            return fn(tensor.shape, dtype=dtype or tensor.dtype, layout=fetch(tensor))
        return fn(tensor.shape, dtype=dtype or tensor.dtype, layout=layout)
    create.__name__ = fn.__name__ + "_like"
    create.__doc__ = f"A {fn.__name__} tensor shaped like `tensor`, with its layout unless `layout=` is given."
    return create


def fetch(tensor) -> Layout | None:
    return tensor._layout if isinstance(tensor, DTensor) else None


zeros_like = _like(zeros)
ones_like = _like(ones)


def _rand(draw):
    def create(*shape, generator=None, dtype=None, layout: Layout | None = None, **kwargs):
        size = _shape(shape, kwargs)
        return draw(size, srandom.draw_seed(generator), dtype=dtype or torch.get_default_dtype(),
                    layout=_target(size, layout))
    create.__qualname__ = f"{draw.__name__}_drawing_a_seed"
    return born_with_layout(create)


@born_with_layout
def _arange(*args, dtype=None, layout: Layout | None = None, **kwargs):
    """`torch.arange` whose devices compute only their block: value = start + step * global index."""
    start, end, step = (0, args[0], 1) if len(args) == 1 else (tuple(args) + (1,))[:3]
    start, end, step = kwargs.pop("start", start), kwargs.pop("end", end), kwargs.pop("step", step)
    values = torch.arange(start, end, step, dtype=dtype, device="meta")  # the length and dtype torch gives
    n = values.numel()
    target = _target((n,), layout)
    if target is None:
        return torch.arange(start, end, step, dtype=dtype)
    mesh = target.mesh
    index = srandom.global_index((n,), target.axes, mesh, mesh.torch_device).contiguous()
    return make((index * step + start).to(values.dtype), target)


# torch factory -> the spmd implementation that generates only local shards
# factories whose values come from their arguments: made whole, then laid out
FROM_VALUES = frozenset({torch.tensor, torch.as_tensor, torch.eye, torch.linspace, torch.logspace})
TORCH_FACTORIES: dict = {
    torch.zeros: zeros, torch.ones: ones, torch.empty: empty,
    torch.full: lambda size, fill_value, dtype=None, layout=None, **kw: fill(size, fill_value, dtype, layout),
    torch.rand: _rand(srandom.stateless_uniform), torch.randn: _rand(srandom.stateless_normal),
    torch.arange: _arange,
}


class FactoryMode(TorchFunctionMode):
    """Inside `call_with_layout`/`default_mesh`: torch factories create DTensors (`layout` when the rank matches,
    else replicated on `mesh`). Without a layout it is a `default_mesh` scope: while it is active, `mesh` is also
    what `get_default_mesh()` returns, so spmd's own factories use it too."""

    def __init__(self, layout: Layout | None, mesh):
        super().__init__()
        self.layout, self.mesh = layout, mesh

    def __enter__(self):
        if self.layout is None:
            push_default_mesh(self.mesh)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self.layout is None:
                pop_default_mesh()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FROM_VALUES and "device" not in kwargs:  # a constant (TF: `constant` in a scope): replicated
            requires_grad = kwargs.pop("requires_grad", False)
            value = func(*args, **kwargs)
            use = self.layout if self.layout is not None and self.layout.rank == value.dim() else \
                Layout.replicated(self.mesh, value.dim())
            out = api.copy_to_mesh(value, use)
            return out.requires_grad_() if requires_grad else out
        factory = TORCH_FACTORIES.get(func)
        if factory is None or isinstance(kwargs.get("layout"), torch.layout) or "device" in kwargs:
            return func(*args, **kwargs)
        probe = dict(kwargs)
        size = (1,) if func is torch.arange else _shape(args[:1] if func is torch.full else args, probe)
        rank = 1 if func is torch.arange else len(size)
        use = self.layout if self.layout is not None and self.layout.rank == rank else \
            Layout.replicated(self.mesh, rank)
        kwargs.pop("requires_grad", None)
        return factory(*args, layout=use, **kwargs)


def call_with_layout(fn: Callable[..., Any], layout: Layout | None, *args, **kwargs):
    """Calls `fn` so that its result is born with `layout`, without materialising the global tensor.

    `fn` may be a torch factory (`torch.ones`, `torch.zeros`, `torch.full`, `torch.empty`, `torch.rand`,
    `torch.randn`, `torch.arange`), an spmd function that takes `layout=`, or any function built from those
    (its factories then create DTensors and its result is relayouted to `layout`). `layout=None` calls `fn`.

    >>> mesh = create_mesh([("x", 3), ("y", 2)])
    >>> ones = call_with_layout(torch.ones, Layout(["x", "y"], mesh), shape=(6, 4))
    >>> fetch_layout(ones).sharding_specs, unpack(ones)[0].shape
    (['x', 'y'], torch.Size([2, 2]))
    """
    if layout is None:
        return fn(*args, **kwargs)
    if not isinstance(layout, Layout):
        raise TypeError(f"call_with_layout expects a Layout, got {type(layout).__name__}")
    if fn in TORCH_FACTORIES:
        return TORCH_FACTORIES[fn](*args, layout=layout, **kwargs)
    if fn in SPMD_LAYOUT_FUNCTIONS:
        return fn(*args, layout=layout, **kwargs)
    with FactoryMode(layout, layout.mesh):
        out = fn(*args, **kwargs)
    if not isinstance(out, DTensor):
        raise NotImplementedError(
            f"call_with_layout({getattr(fn, '__name__', fn)!r}) returned a {type(out).__name__}, not a DTensor: "
            "it creates its tensor with something other than torch's factories. Use spmd.copy_to_mesh(fn(...), "
            "layout) (which materialises the value first).")
    return relayout(out, layout)


def _takes_layout(fn) -> bool:
    try:
        return "layout" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# spmd's own functions that take `layout=` (the factories, the stateless random ops, the seeds' pack, relayout and
# copy_to_mesh): call_with_layout looks a function up here rather than inspecting it, which torch.compile (2.11)
# cannot do for a function made inside the compiled one
SPMD_LAYOUT_FUNCTIONS: dict = {
    f: True for module in (sys.modules[__name__], srandom, api) for name, f in vars(module).items()
    if inspect.isfunction(f) and f.__module__ == module.__name__ and not name.startswith("_")
    and f is not call_with_layout and _takes_layout(f)}
