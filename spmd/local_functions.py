"""`local_map`: a function of plain tensors run on each device's components — torch's `local_map`, JAX's
`shard_map` — for code whose global form spmd cannot see through: a mixture-of-experts layer routing each device's
own tokens, a custom kernel, a per-device loop.

The function runs once per local device, on that device's components of the DTensor arguments (after relayouting
them to `in_layouts` where given), and its results become DTensors of `out_layouts`: each result's component on a
device is what the function returned there. `axis_index(mesh_dim)` tells the function where it runs.

Gradients flow as through any torch code. A DTensor argument replicated over a mesh dim is a copy on each device,
and each copy's gradient is only that device's contribution: its gradient is their sum, left pending over those
mesh dims (resolved when read, or bucketed like DDP's across clients). A result replicated over a mesh dim holds
one value in several copies; its gradient goes to the first copy only, so that those sums count it once. Over the
mesh dims that replicate every argument and every result the function computes the same on every copy, and
neither applies: nothing is summed there.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from spmd import explain
from spmd.api import relayout
from spmd.dtensor import DTensor, make
from spmd.errors import LayoutError, MeshMismatchError, MixedTensorError
from spmd.layout import Layout

_running: list = []  # (mesh, mesh coordinates) of the device whose call of a local function is running


def running() -> bool:
    """Whether a device's call of a function that `local_map` runs is under way."""
    return bool(_running)


def axis_index(mesh_dim: str) -> int:
    """Inside a function that `local_map` runs: this device's coordinate along `mesh_dim` (JAX's `axis_index`).

    >>> mesh = create_mesh([("x", 2)])
    >>> where = local_map(lambda t: t + axis_index("x"), out_layouts=Layout(["x"], mesh))
    >>> to_global(where(copy_to_mesh(torch.zeros(4), Layout(["x"], mesh)))).tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    if not _running:
        raise RuntimeError("spmd.axis_index is defined only inside a function that spmd.local_map runs")
    mesh, location = _running[-1]
    if mesh_dim not in mesh.dim_names:
        raise LayoutError(f"axis_index: the mesh has no dimension {mesh_dim!r}; its dimensions are {mesh.dim_names}")
    return location[mesh.axis_index(mesh_dim)]


def local_map(fn: Callable | None = None, out_layouts: Any = None, *, in_layouts: Any = None) -> Callable:
    """`fn`, taking and returning plain tensors, as a function of DTensors run on each device's components.

    Args:
      fn: called once per local device with that device's components in place of the DTensor arguments (other
        arguments as they are: plain tensors are the same constant on every device and must not require grad).
        An `nn.Module`'s forward sees its DTensor parameters and buffers as that device's components too (the
        module itself is called as it was when `local_map` wrapped it, so `module.forward = local_map(module,
        ...)` maps a layer of a model in place).
      out_layouts: the layout of each result: a Layout for a single tensor, else a (nested) tuple or list shaped
        like `fn`'s results. Every device's results must have the same shapes.
      in_layouts: optionally, per positional argument, the Layout it is relayouted to first (None: as it is).

    Usable as a decorator: `@local_map(out_layouts=...)`. `spmd.function` and `torch.compile` trace it into their
    graphs (each device's plain ops on its components) where its arguments are all tensors, positional.

    >>> mesh = create_mesh([("batch", 2)])
    >>> rows = Layout(["batch", UNSHARDED], mesh)
    >>> @local_map(out_layouts=rows)
    ... def normalized(x):  # each device's rows alone: no collective
    ...     return x / x.sum(1, keepdim=True)
    >>> to_global(normalized(copy_to_mesh(torch.ones(4, 2), rows))).tolist()
    [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    """
    if fn is None:
        return functools.partial(local_map, out_layouts=out_layouts, in_layouts=in_layouts)
    if out_layouts is None:
        raise TypeError("local_map needs out_layouts: the Layout of each result of the function")

    module = fn if isinstance(fn, nn.Module) else None
    call = fn.forward if module is not None else fn  # (before a `module.forward = local_map(module, ...)`)

    def traceable(*flat):  # the positional arguments, then the module's state: a trace passes them all in
        state = _module_state(module)
        args, tensors = flat[:len(flat) - len(state)], flat[len(flat) - len(state):]
        state = [(owner, kind, name, t) for (owner, kind, name, _), t in zip(state, tensors)]
        return _run(call, out_layouts, in_layouts, args, {}, state)
    torch.compiler.allow_in_graph(traceable)  # one node for Dynamo; AOTAutograd traces through it

    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        if torch.compiler.is_compiling() and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            return traceable(*args, *[t for *_, t in _module_state(module)])  # (a graph node takes tensors only)
        return _untraced_run(call, out_layouts, in_layouts, args, kwargs, _module_state(module))
    return mapped


def _run(fn: Callable, out_layouts, in_layouts, args: tuple, kwargs: dict, state: list):
    """`fn` on each device's components of the DTensors in `args` and `kwargs`, with a module's `state` (see
    `_module_state`) swapped for them."""
    args = _relayouted(args, in_layouts)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    layouts, out_spec = pytree.tree_flatten(out_layouts)
    inputs = list({id(t): t for t in [x for x in leaves if isinstance(x, DTensor)] + [t for *_, t in state]}
                  .values())
    laid_out = [t._layout for t in inputs] + [layout for layout in layouts if layout is not None]
    mesh = _one_mesh(fn, laid_out)
    _check_plain(fn, leaves + [t for *_, t in state])
    # the mesh dims that replicate every argument and every result: every copy computes the same there
    repeated = tuple(d for d in mesh.dim_names if all(d not in layout.sharded_mesh_dims for layout in laid_out))
    components = {id(t): _Components.apply(t, repeated).unbind(0) for t in inputs}
    base = mesh.min_global_device_id()
    per_device = []
    for d, device in enumerate(mesh.local_device_ids()):
        local_args, local_kwargs = pytree.tree_unflatten(
            [components[id(x)][d] if isinstance(x, DTensor) else x for x in leaves], spec)
        _running.append((mesh, mesh.device_location(device - base)))
        try:
            with _swapped(state, components, d):
                result = fn(*local_args, **local_kwargs)
        finally:
            _running.pop()
        per_device.append(_results(fn, result, out_spec, len(layouts)))
    outs = [_assemble(fn, i, [r[i] for r in per_device], layout, repeated)
            for i, layout in enumerate(layouts)]
    if explain.RECORDERS:  # one row of `explain` (its plain ops are not DTensor ops)
        explain.RECORDERS[-1].op_started(f"local_map({_name(fn)})", [x for x in leaves if isinstance(x, DTensor)])
        explain.RECORDERS[-1].op_finished(tuple(o for o in outs if isinstance(o, DTensor)))
    return pytree.tree_unflatten(outs, out_spec)


def _module_state(module: nn.Module | None) -> list:
    """(owner, "_parameters" or "_buffers", name, tensor) for each DTensor parameter and buffer of `module`, and
    each plain one (refused later if it requires grad)."""
    if module is None:
        return []
    return [(owner, kind, name, t) for owner in module.modules() for kind in ("_parameters", "_buffers")
            for name, t in getattr(owner, kind).items() if t is not None]


@contextlib.contextmanager
def _swapped(state: list, components: dict, d: int):
    """The module's DTensor parameters and buffers replaced by device `d`'s components, for one call."""
    swapped = [(getattr(owner, kind), name, t) for owner, kind, name, t in state if isinstance(t, DTensor)]
    originals = [(held, name, held[name]) for held, name, _ in swapped]  # (what a trace passes in stands for them)
    for held, name, t in swapped:
        held[name] = components[id(t)][d]
    try:
        yield
    finally:
        for held, name, original in originals:
            held[name] = original


_untraced_run = torch.compiler.disable(_run, reason=(
    "a graph traces spmd.local_map's calls with tensors as the only arguments: pass the others through a closure "
    "(or under spmd.function pass fullgraph=False to run this one eagerly between the graphs)"))


def _relayouted(args: tuple, in_layouts) -> tuple:
    if in_layouts is None:
        return args
    if isinstance(in_layouts, Layout):
        in_layouts = (in_layouts,)
    if len(in_layouts) != len(args):
        raise TypeError(f"local_map: in_layouts has {len(in_layouts)} entries for {len(args)} positional arguments")
    out = []
    for i, (a, layout) in enumerate(zip(args, in_layouts)):
        if layout is not None and not isinstance(a, DTensor):
            raise TypeError(f"local_map: in_layouts[{i}] is a Layout, but argument {i} is a "
                            f"{type(a).__name__}, not a DTensor")
        out.append(a if layout is None or a._layout == layout else relayout(a, layout))
    return tuple(out)


def _one_mesh(fn: Callable, layouts: list[Layout]):
    if not layouts:
        raise TypeError(f"local_map({_name(fn)}): no DTensor argument and no out_layouts: nothing says the mesh")
    mesh = layouts[0].mesh
    for layout in layouts[1:]:
        if layout.mesh != mesh:
            raise MeshMismatchError(f"local_map({_name(fn)}): its arguments and out_layouts are on different meshes, "
                                    f"{mesh!r} and {layout.mesh!r}; relayout them onto one (spmd.copy_to_mesh)")
    if mesh.remote is not None:
        raise NotImplementedError("local_map runs a Python function on the components, which a single-controller "
                                  "mesh keeps on its workers; run it in the workers' program instead")
    return mesh


def _check_plain(fn: Callable, leaves: list) -> None:
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad and \
                torch.is_grad_enabled():
            raise MixedTensorError(
                f"local_map({_name(fn)}) got a plain tensor of shape {list(x.shape)} that requires grad: every "
                "device would use it as its own copy, and its gradient is not defined; pass it as a DTensor "
                "(spmd.copy_to_mesh with the layout it has)")


def _results(fn: Callable, result, out_spec, count: int) -> list:
    flat, spec = pytree.tree_flatten(result)
    if spec != out_spec or len(flat) != count:
        raise LayoutError(f"local_map({_name(fn)}) returned {pytree.treespec_pprint(spec)}, but out_layouts is "
                          f"shaped {pytree.treespec_pprint(out_spec)}: give one Layout per result")
    return flat


def _assemble(fn: Callable, i: int, components: list, layout: Layout | None, repeated: tuple):
    first = components[0]
    if layout is None:
        return first
    if not isinstance(first, torch.Tensor):
        raise LayoutError(f"local_map({_name(fn)}): result {i} is a {type(first).__name__}, but out_layouts gives "
                          f"it the layout {layout.sharding_specs}; give None for results that are not tensors")
    if first.dim() != layout.rank:
        raise LayoutError(f"local_map({_name(fn)}): result {i} has rank {first.dim()} (shape {list(first.shape)}), "
                          f"its layout {layout.sharding_specs} rank {layout.rank}")
    shapes = [tuple(c.shape) for c in components]
    if len(set(shapes)) > 1:
        raise LayoutError(f"local_map({_name(fn)}): result {i} has different shapes on the devices, {shapes}; a "
                          "DTensor's components all have one shape (pad them to one)")
    layout.check_divisible(layout.global_shape_from_local_shape(first.shape))
    return _FromComponents.apply(torch.stack(components), layout, repeated)


class _Components(torch.autograd.Function):
    """A DTensor -> its stacked components; their gradients, the copies' contributions, summed over the mesh dims
    that replicate it (but not over `repeated`), pending."""

    @staticmethod
    def forward(ctx, tensor: DTensor, repeated: tuple):
        ctx.layout, ctx.shape = tensor._layout, tensor.shape
        ctx.copies = tuple(d for d in tensor._layout.mesh.dim_names
                           if d not in tensor._layout.sharded_mesh_dims and d not in repeated)
        return tensor._local.detach()  # (the DTensor's own buffer keeps no autograd history)

    @staticmethod
    def backward(ctx, grad):
        return DTensor(grad.contiguous(), ctx.layout, ctx.shape, pending=ctx.copies), None


class _FromComponents(torch.autograd.Function):
    """Stacked components -> a DTensor; its gradient, relayouted to its layout, goes to the first copy of each
    shard along the mesh dims that replicate it (but not along `repeated`), zeros to the other copies."""

    @staticmethod
    def forward(ctx, stack: torch.Tensor, layout: Layout, repeated: tuple):
        mesh = layout.mesh
        copies = [mesh.axis_index(d) for d in mesh.dim_names if d not in layout.sharded_mesh_dims
                  and d not in repeated]
        base = mesh.min_global_device_id()
        first = [all(mesh.device_location(i - base)[k] == 0 for k in copies) for i in mesh.local_device_ids()]
        ctx.layout = layout
        ctx.keep = None if all(first) else torch.tensor(first, device=stack.device)
        return make(stack.detach(), layout)

    @staticmethod
    def backward(ctx, grad):
        local = relayout(grad, ctx.layout)._local
        if ctx.keep is not None:
            local = local * ctx.keep.view(-1, *(1,) * (local.dim() - 1)).to(local.dtype)
        return local, None, None


def _name(fn: Callable) -> str:
    """A function's name; a module's forward by its module's class."""
    owner = getattr(fn, "__self__", None) or getattr(fn, "module", None)  # (a distributed module's forward: .module)
    if isinstance(owner, nn.Module):
        return type(owner).__name__
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(fn, "__name__", type(fn).__name__)
