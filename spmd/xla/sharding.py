"""`mark_sharding`, `clear_sharding` and `shard_module`: PyTorch/XLA's annotate-and-propagate API on spmd.

`mark_sharding(t, mesh, partition_spec)` lays `t` out on the mesh at once (eager: a relayout, with its
collectives) and makes `t` itself the sharded tensor — a plain tensor, an `nn.Parameter` (the module and its
optimizer keep the same object) or a DTensor — as an annotation on an XLA tensor changes that tensor. Inside
`spmd.function` the annotation is a layout constraint of the traced graph; there, use the returned tensor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from spmd.api import copy_to_mesh, relayout
from spmd.dtensor import DTensor
from spmd.errors import LayoutError
from spmd.layout import MULTI, UNSHARDED, Layout
from spmd.mesh import Mesh as SpmdMesh
from spmd.xla.mesh import Mesh
from spmd.xla.sharded_tensor import XLAShardedTensor, wrap

__all__ = ["mark_sharding", "clear_sharding", "shard_module", "layout_of_partition_spec"]

PartitionSpec = Sequence[int | str | None | tuple]


def mark_sharding(t: torch.Tensor, mesh: Mesh | SpmdMesh, partition_spec: PartitionSpec) -> XLAShardedTensor:
    """Shards `t` over `mesh` as `partition_spec` says, in place, and returns it as an `XLAShardedTensor`.

    Args:
      t: a plain tensor, an `nn.Parameter` (also one inside a module), a DTensor or an `XLAShardedTensor`.
      mesh: a `spmd.xla.Mesh` (or an `spmd.Mesh`).
      partition_spec: one entry per dimension of `t`: a mesh axis index, an axis name, `None` (replicated), or a
        tuple of one axis.

    >>> import spmd.xla as xs
    >>> mesh = xs.Mesh(range(8), (2, 4), ("x", "y"))
    >>> t = torch.randn(8, 4)
    >>> sharded = xs.mark_sharding(t, mesh, (0, 1))
    >>> sharded is t, type(t).__name__, t.sharding_spec, t.local_shards[5].indices
    (True, 'XLAShardedTensor', '{devices=[2,4]<=[8]}', (slice(4, 8, 1), slice(1, 2, 1)))
    """
    layout = layout_of_partition_spec(mesh, partition_spec, t.dim())
    if isinstance(t, XLAShardedTensor) and t._layout == layout:
        return t
    return _annotate(t, _sharded_value(t, layout))


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Makes an annotated tensor replicated on its mesh again, in place (a tensor nobody annotated is
    replicated); a plain tensor is returned as it is."""
    if not isinstance(t, DTensor):
        return t
    return mark_sharding(t, t._layout.mesh, (None,) * t.dim())


def shard_module(module: nn.Module, mesh: Mesh | SpmdMesh,
                 partition_spec_fn: Callable[[str, torch.Tensor], PartitionSpec | None]) -> nn.Module:
    """Annotates every parameter and buffer of `module` in place: `partition_spec_fn(name, tensor)` gives its
    partition spec (names as `named_parameters()` gives them), `None` for replicated. Returns `module`.

    Every parameter needs an annotation (replicated at least) before the optimizer is built: a plain parameter
    cannot take a gradient that lives on the mesh.
    """
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for name, tensor in tensors:
        spec = partition_spec_fn(name, tensor)
        mark_sharding(tensor, mesh, (None,) * tensor.dim() if spec is None else spec)
    return module


def layout_of_partition_spec(mesh: Mesh | SpmdMesh, partition_spec: PartitionSpec, rank: int) -> Layout:
    """The spmd `Layout` of a PyTorch/XLA partition spec for a tensor of rank `rank`."""
    xla_mesh = mesh if isinstance(mesh, Mesh) else Mesh.from_spmd(mesh) if isinstance(mesh, SpmdMesh) else None
    if xla_mesh is None:
        raise LayoutError(f"mesh must be a spmd.xla.Mesh or an spmd.Mesh, got {type(mesh).__name__}")
    spec = tuple(partition_spec)
    if len(spec) != rank:
        raise LayoutError(f"partition_spec {spec} has {len(spec)} entries for a tensor of rank {rank}: give one per "
                          "tensor dimension (None for a replicated one)")
    names = xla_mesh.to_spmd().dim_names
    specs = [_mesh_dim(entry, xla_mesh, names, spec) for entry in spec]
    used = [d for s in specs if s != UNSHARDED for d in s.split(MULTI)]
    if len(set(used)) != len(used):
        raise LayoutError(f"partition_spec {spec} uses a mesh axis twice; each mesh axis shards at most one tensor "
                          "dimension")
    return Layout(specs, xla_mesh.to_spmd())


def _mesh_dim(entry, mesh: Mesh, names: list[str], spec: tuple) -> str:
    """A layout spec of one partition spec entry; a tuple of several axes shards the dimension over all of them
    (row-major, the first major), as XLA does."""
    if isinstance(entry, tuple):
        if len(entry) > 1:
            if None in entry:
                raise LayoutError(f"partition_spec {spec}: {entry} mixes None with mesh axes; a tuple lists the "
                                  "mesh axes that shard one tensor dimension")
            return MULTI.join(_mesh_dim(e, mesh, names, spec) for e in entry)
        entry = entry[0] if entry else None
    if entry is None:
        return UNSHARDED
    if isinstance(entry, str):
        if mesh.get_axis_name_idx(entry) is None:
            raise LayoutError(f"partition_spec {spec} names axis {entry!r}, but the mesh's axes are "
                              f"{mesh.axis_names}")
        return entry
    if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < len(names):
        return names[entry]
    raise LayoutError(f"partition_spec {spec}: {entry!r} is not a mesh axis; use an index in "
                      f"0..{len(names) - 1}, an axis name, or None")


def _sharded_value(t: torch.Tensor, layout: Layout) -> DTensor:
    """`t`'s value laid out by `layout` (differentiable, so an intermediate keeps its gradient path)."""
    if not isinstance(t, DTensor):
        return copy_to_mesh(t, layout)
    if t._layout.mesh != layout.mesh:
        raise LayoutError(f"the tensor lives on another mesh ({t._layout.mesh}) than the partition spec's "
                          f"({layout.mesh}); move it first with spmd.relayout(t, layout)")
    return t if t._layout == layout else relayout(t, layout)


def _annotate(t: torch.Tensor, value: DTensor) -> XLAShardedTensor:
    """Makes `t` itself the sharded tensor `value` (every reference to `t` sees it); in a trace, where a tensor
    cannot change in place, returns `value` (a layout constraint of the traced graph)."""
    if torch.compiler.is_compiling():
        return value
    if t.is_leaf:  # a parameter (or any leaf) stays a leaf, as after `param.data = ...`
        value = wrap(value.detach())
        value = nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else \
            value.requires_grad_(t.requires_grad)
        if value.requires_grad:
            value.register_hook(_sharded_gradient)
        t.grad = None  # a plain gradient cannot be kept by a sharded parameter
    else:
        value = wrap(value)
    if value is not t:
        torch.utils.swap_tensors(t, value)
    return t


def _sharded_gradient(grad: torch.Tensor) -> torch.Tensor:
    """A sharded leaf's gradient is an `XLAShardedTensor` too (spmd's own autograd functions return DTensors)."""
    return wrap(grad) if isinstance(grad, DTensor) else grad
