"""spmd's own operators, so that a traced program records them like any aten op.

`spmd::relayout(Tensor x, str layout)` is `relayout` within a mesh. Under `torch.compile` Dynamo puts it in the
graph as an opaque op with a string argument (the layout in TF's format); AOTAutograd then dispatches it to the
DTensor, whose rule (engine/rules/tensor_ops.py) plans the collectives. Its gradient is the relayout back.

`spmd::batched_matmul(Tensor a, Tensor b)` is a batched matrix product that keeps its batch axes apart.

`born_with_layout` does the same for the functions that make a DTensor from plain values and a `layout=` (the
factories, `copy_to_mesh`): Dynamo cannot trace a DTensor's construction, so under `torch.compile` such a call
enters the graph whole, as one node holding the layout's string, and AOTAutograd runs the function itself,
recording the plain ops by which each device makes its own shard.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from spmd.errors import UnsupportedOpError
from spmd.layout import Layout
from spmd.mesh import Mesh, get_default_mesh, pop_default_mesh, push_default_mesh


@functools.lru_cache(maxsize=1024)
def parse_layout(layout_str: str) -> Layout:
    return Layout.from_string(layout_str)


@functools.lru_cache(maxsize=64)
def parse_mesh(mesh_str: str) -> Mesh:
    return Mesh.from_string(mesh_str)


@torch.library.custom_op("spmd::relayout", mutates_args=())
def relayout_op(x: torch.Tensor, layout: str) -> torch.Tensor:
    # reached only by a plain tensor (a DTensor is handled by its rule): it has no layout to change
    return x.clone()


@relayout_op.register_fake
def _(x, layout):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.source = getattr(inputs[0], "_layout", None)


def _backward(ctx, grad):
    if ctx.source is None or getattr(grad, "_layout", None) == ctx.source:
        return grad, None
    return relayout_op(grad, ctx.source.to_string()), None


relayout_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("spmd::batched_matmul", mutates_args=())
def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of two tensors of one batch shape `(*batch, m, k) @ (*batch, k, n)`, as one op: torch's `matmul`
    folds the batch axes into one, which a DTensor whose batch axes are sharded over several mesh dims cannot hold
    (engine/rules/sharded_folds.py); this op's rule keeps each batch axis as it is."""
    return torch.matmul(a, b)


@batched_matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[:-1] + b.shape[-1:])


def _batched_matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return (batched_matmul(grad, b.mT) if ctx.needs_input_grad[0] else None,
            batched_matmul(a.mT, grad) if ctx.needs_input_grad[1] else None)


def _save_operands(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


batched_matmul.register_autograd(_batched_matmul_backward, setup_context=_save_operands)


_BORN_WITH_LAYOUT: dict[str, Callable] = {}  # "module.qualname" -> a function decorated with born_with_layout


def born_with_layout(fn: Callable) -> Callable:
    """Decorates `fn`, which makes a DTensor from plain arguments and a `layout=` parameter, so that under
    torch.compile a call with a layout is one node of the graph (see the module's docstring)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name in _BORN_WITH_LAYOUT:
        raise ValueError(f"born_with_layout: {name} is registered already")
    parameters = list(inspect.signature(fn).parameters.values())
    position = next(i for i, p in enumerate(parameters) if p.name == "layout")
    if parameters[position].kind is inspect.Parameter.KEYWORD_ONLY:
        position = None
    _BORN_WITH_LAYOUT[name] = fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        # what Dynamo reads while it traces, for the node to hold: the layout (where it is) and the default mesh
        if isinstance(kwargs.get("layout"), Layout):
            where, layout = -1, kwargs["layout"]
            kwargs = {**kwargs, "layout": layout.to_string()}
        elif position is not None and len(args) > position and isinstance(args[position], Layout):
            where, layout = position, args[position]
            args = args[:position] + (layout.to_string(),) + args[position + 1:]
        else:
            where, layout = None, None
        scope = get_default_mesh()
        if layout is None and scope is None:
            return fn(*args, **kwargs)
        on_controller = (layout.mesh if layout is not None else scope).remote is not None
        return call_born_with_layout(name, where, None if scope is None else scope.to_string(), on_controller,
                                     *args, **kwargs)
    return call


def call_born_with_layout(name: str, position: int | None, scope: str | None, on_controller: bool, *args, **kwargs):
    """The graph's node for a call of a `born_with_layout` function: the layout, given as a string at `position`
    of `args` (or as the keyword when -1), is parsed back, and the `default_mesh` scope open where the call was
    traced (`scope`, a mesh string) is open again. Dynamo puts calls of this function in graphs whole
    (`tracing.prepare_dynamo`)."""
    if on_controller:
        raise UnsupportedOpError(
            f"{name.rpartition('.')[2]}(..., layout=) inside spmd.function on a single-controller mesh: the "
            "controller traces on shadows of the workers' values and cannot make one; make the tensor outside the "
            "function and pass it in")
    if position == -1:
        kwargs["layout"] = parse_layout(kwargs["layout"])
    elif position is not None:
        args = args[:position] + (parse_layout(args[position]),) + args[position + 1:]
    if scope is None:
        return _BORN_WITH_LAYOUT[name](*args, **kwargs)
    push_default_mesh(parse_mesh(scope))
    try:
        return _BORN_WITH_LAYOUT[name](*args, **kwargs)
    finally:
        pop_default_mesh()
