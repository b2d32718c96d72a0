"""The seeds' functions that move data: pack, unpack, relayout, relayout_like, copy_to_mesh, to_global (all
differentiable)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from spmd.engine import planner
from spmd.collectives import backend_for
from spmd.dtensor import DTensor, make
from spmd.errors import LayoutError
from spmd.layout import MATCH, UNSHARDED, Layout
from spmd.ops import born_with_layout, relayout_op


class Pack(torch.autograd.Function):
    """Components -> DTensor. The DTensor's value is the first replica of each shard (what `numpy`/`to_global`
    read), so the gradient goes to that component; the other copies get zeros. This makes Pack and Unpack
    adjoint: `pack(unpack(t))` passes gradients through unchanged, and `pack([w] * n, replicated)` gives `w` the
    gradient of its value, not n times it."""

    @staticmethod
    def forward(ctx, layout: Layout, *components):
        ctx.layout = layout
        ctx.devices = [c.device for c in components]
        device = layout.mesh.torch_device
        local = torch.stack([c.detach().to(device) for c in components])
        layout.check_concrete()
        layout.check_divisible(layout.global_shape_from_local_shape(local.shape[1:]))
        return make(local, layout)

    @staticmethod
    def backward(ctx, grad):
        grad = relayout(grad, ctx.layout)
        first = _first_replicas(ctx.layout)
        return (None, *(g.to(d) if keep else torch.zeros_like(g, device=d)
                        for g, keep, d in zip(grad._local.unbind(0), first, ctx.devices)))


class Unpack(torch.autograd.Function):
    """DTensor -> components. A component of a replicated (or partly replicated) DTensor is one of several copies
    of the same values, so the gradient of the DTensor sums the gradients of the copies (an all-reduce over the
    mesh dimensions the layout does not shard)."""

    @staticmethod
    def forward(ctx, tensor: DTensor):
        ctx.layout = tensor._layout
        return tuple(tensor._local.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        local = torch.stack([torch.zeros_like(ref) if g is None else g for g in grads])
        layout = ctx.layout
        replicas = tuple(d for d in layout.mesh.dim_names if d not in layout.sharded_mesh_dims)
        steps = planner.plan_on(layout.mesh, layout.axes, layout.axes, replicas)
        return make(planner.run(local, layout.mesh, steps), layout)


def _first_replicas(layout: Layout) -> list[bool]:
    """Per local device: whether it holds the first copy of its shard."""
    mesh = layout.mesh
    base = mesh.min_global_device_id()
    return [layout.is_first_replica(mesh.device_location(i - base)) for i in mesh.local_device_ids()]


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, layout: Layout):
        ctx.source = tensor._layout
        # a pending reduction over a mesh dim the target shards becomes a reduce-scatter
        steps = planner.plan_on(layout.mesh, tensor._layout.axes, layout.axes, tensor._pending, tensor._pending_op)
        return make(planner.run(tensor._stack, layout.mesh, steps), layout)

    @staticmethod
    def backward(ctx, grad):  # (spmd::relayout's rule keeps a gradient's pending sum where it can)
        return relayout_op(grad, ctx.source.to_string()), None


def _distribute(value: torch.Tensor, layout: Layout) -> DTensor:
    """A plain global value -> a DTensor: each device keeps its shard (one copy per shard, never an alias)."""
    return make(planner.distribute(value, layout.mesh, layout.axes), layout)


def _assemble(tensor: DTensor) -> torch.Tensor:
    layout = tensor._layout
    return backend_for(layout.mesh).assemble(tensor._local, layout.mesh, layout.axes)


class _CopyToMesh(torch.autograd.Function):
    """A plain tensor -> a DTensor; the gradient is the global value of the DTensor's gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, layout: Layout):
        ctx.device = tensor.device
        return _distribute(tensor, layout)

    @staticmethod
    def backward(ctx, grad):
        return _assemble(grad).to(ctx.device), None


class _ToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor):
        ctx.layout = tensor._layout
        return _assemble(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _distribute(grad, ctx.layout)


def _move(tensor: DTensor, layout: Layout) -> DTensor:
    """`tensor` onto `layout`'s mesh. Between multi-client meshes each client receives only the parts of its own
    target shards; otherwise the shards are assembled once and each target shard is cut once."""
    src = tensor._layout
    comm = backend_for(src.mesh)
    if hasattr(comm, "move") and not layout.mesh.is_fully_local() and not layout.mesh.is_remote() and \
            src.mesh.torch_device == layout.mesh.torch_device and backend_for(layout.mesh) is comm:
        return make(comm.move(tensor._local, src.mesh, src.axes, layout.mesh, layout.axes, tuple(tensor.shape)),
                    layout)
    return _distribute(_assemble(tensor), layout)


class _CrossMesh(torch.autograd.Function):
    """A DTensor onto another mesh (see `_move`)."""

    @staticmethod
    def forward(ctx, tensor: DTensor, layout: Layout):
        ctx.source = tensor._layout
        return _move(tensor, layout)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad, ctx.source), None


def pack(tensors: Sequence[Any], layout: Layout) -> DTensor:
    """Packs one component per local device (in `layout.mesh.local_devices()` order) into a DTensor.

    Components may be tensors or array-likes; they are moved to the mesh's device. Differentiable: gradients
    flow back to components that require grad.

    Raises:
      ValueError: wrong number of components, or components whose rank, shape or dtype disagree.

    >>> mesh = create_mesh([("x", 2)], devices=["CPU:0", "CPU:1"])
    >>> t = pack([[1, 2], [3, 4]], Layout(["x"], mesh))
    >>> t.shape, [c.tolist() for c in unpack(t)]
    (torch.Size([4]), [[1, 2], [3, 4]])
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"pack expects a Layout, got {type(layout).__name__}")
    if isinstance(tensors, DTensor) or any(isinstance(t, DTensor) for t in tensors):
        raise LayoutError("pack expects plain components; this is already a DTensor (use relayout to change "
                          "its layout)")
    mesh = layout.mesh
    expected = mesh.num_local_devices()
    if len(tensors) != expected:
        share = "" if mesh.is_fully_local() else (
            f"; this client holds {expected} of the mesh's {mesh.size} devices and packs only their components")
        dims = ",".join(f"{n}={k}" for n, k in zip(mesh.dim_names, mesh.shape()))
        raise LayoutError(f"pack expected {expected} components (one per local device of the mesh {dims}), "
                          f"but got {len(tensors)}{share}")
    components = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
    first = components[0]
    for i, c in enumerate(components):
        if c.dim() != layout.rank:
            raise LayoutError(f"Packed layout should have the same rank as each component: component {i} has "
                              f"rank {c.dim()} (shape {list(c.shape)}) while layout {layout.sharding_specs} has "
                              f"rank {layout.rank}")
        if c.shape != first.shape:
            raise LayoutError(f"Components of a DTensor must all have the same shape: component 0 has "
                              f"{list(first.shape)}, component {i} has {list(c.shape)}")
        if c.dtype != first.dtype:
            raise LayoutError(f"Components of a DTensor must all have the same dtype: component 0 is "
                              f"{first.dtype}, component {i} is {c.dtype}")
    return Pack.apply(layout, *components)


def unpack(tensor: DTensor) -> list[torch.Tensor]:
    """The components of `tensor`, one per local device in `mesh.local_devices()` order (differentiable)."""
    if not isinstance(tensor, DTensor):
        raise TypeError(f"unpack expects a DTensor, got {type(tensor).__name__}")
    return list(Unpack.apply(tensor))


def to_global(tensor: DTensor) -> torch.Tensor:
    """The global value of a DTensor as a plain tensor on the mesh's device (differentiable; each shard is
    copied once).

    >>> mesh = create_mesh([("x", 2), ("y", 2)])
    >>> to_global(copy_to_mesh(torch.arange(8).reshape(2, 4), Layout(["x", "y"], mesh))).tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if not isinstance(tensor, DTensor):
        raise TypeError(f"to_global expects a DTensor, got {type(tensor).__name__}")
    return _ToGlobal.apply(tensor)


def _resolve(tensor: DTensor, layout: Layout) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"expected a Layout, got {type(layout).__name__}")
    if layout.rank != tensor.dim():
        raise LayoutError(f"cannot give a tensor of shape {list(tensor.shape)} (rank {tensor.dim()}) the layout "
                          f"{layout.sharding_specs} of rank {layout.rank}")
    specs = layout.sharding_specs
    if MATCH in specs:
        src = tensor._layout.sharding_specs
        layout = Layout([src[i] if s == MATCH else s for i, s in enumerate(specs)], layout.mesh)
    layout.check_divisible(tuple(tensor.shape))
    return layout


def relayout(tensor: DTensor, layout: Layout, name: str | None = None) -> DTensor:
    """Changes the layout of `tensor` to `layout` (an axis given as `MATCH` keeps its sharding). Differentiable.

    Within a mesh this runs the shortest list of collectives the planner finds (all-gather, all-to-all, a local
    slice). Onto another mesh the value is moved as a copy.

    Raises:
      TypeError: `tensor` is not a DTensor (use `copy_to_mesh`).
      ValueError: a rank mismatch, or an axis that does not divide by its new number of shards.

    >>> mesh = create_mesh([("x", 2), ("y", 2)])
    >>> t = copy_to_mesh(torch.arange(16.).reshape(4, 4), Layout.replicated(mesh, 2))
    >>> s = relayout(t, Layout(["x", "y"], mesh))
    >>> [c.tolist() for c in unpack(s)][1]
    [[2.0, 3.0], [6.0, 7.0]]
    >>> fetch_layout(relayout(s, Layout([MATCH, UNSHARDED], mesh))).sharding_specs
    ['x', 'unsharded']
    """
    if not isinstance(tensor, DTensor):
        raise TypeError(f"relayout expects a DTensor, got {type(tensor).__name__}; to distribute a plain tensor "
                        "use spmd.copy_to_mesh(tensor, layout)")
    layout = _resolve(tensor, layout)
    if layout.mesh != tensor._layout.mesh:
        return _CrossMesh.apply(tensor, layout)
    if layout == tensor._layout:
        return tensor
    # recorded in the traced graph as an op (spmd.ops); on a single-controller mesh, sent to the workers as one
    if torch.compiler.is_compiling() or layout.mesh.remote is not None:
        return relayout_op(tensor, layout.to_string())
    return _Relayout.apply(tensor, layout)


def relayout_like(tensor: DTensor, layout_tensor: DTensor, use_mesh_only: bool = False) -> DTensor:
    """Gives `tensor` the layout of `layout_tensor` (or, with `use_mesh_only`, only moves it to its mesh,
    keeping the sharding specs). Differentiable."""
    target = fetch_layout_of(layout_tensor)
    if use_mesh_only:
        target = Layout(fetch_layout_of(tensor).sharding_specs, target.mesh)
    return relayout(tensor, target)


def fetch_layout_of(t) -> Layout:
    if not isinstance(t, DTensor):
        raise TypeError(f"expected a DTensor, got {type(t).__name__}")
    return t._layout


@born_with_layout
def copy_to_mesh(tensor: Any, layout: Layout, source_layout: Layout | None = None) -> DTensor:
    """Copies a plain tensor (or array-like, or Python scalar) or a DTensor of another mesh onto `layout`.

    Each device receives only its shard. Differentiable: a plain tensor gets the gradient of its global value.
    `source_layout` is accepted for TF compatibility and ignored.

    >>> mesh = create_mesh([("x", 6)])
    >>> t = copy_to_mesh([0, 1], Layout([UNSHARDED], mesh))
    >>> print(t)  # doctest: +ELLIPSIS
    DTensor([0 1], layout="sharding_specs:unsharded, mesh:|x=6|...", shape=(2,), dtype=torch.int64)
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"copy_to_mesh expects a Layout, got {type(layout).__name__}")
    if isinstance(tensor, DTensor):
        return relayout(tensor, layout)
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(tensor)  # Python floats become the default dtype, as in torch.tensor
    if tensor.dim() != layout.rank:
        raise LayoutError(f"cannot give a tensor of shape {list(tensor.shape)} (rank {tensor.dim()}) the layout "
                          f"{layout.sharding_specs} of rank {layout.rank}")
    layout.check_divisible(tuple(tensor.shape))
    return _CopyToMesh.apply(tensor, layout)


__all__ = ["pack", "unpack", "relayout", "relayout_like", "copy_to_mesh", "to_global", "UNSHARDED"]
