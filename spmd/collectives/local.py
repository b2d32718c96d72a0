"""In-process collectives: every device of the mesh is local, so a collective is a tensor op.

The stacked components `(L, *local)` are viewed as `(*mesh_shape, *local)`: a reduction over a mesh dimension
is a reduction over that axis, a gather moves the mesh axis next to the tensor axis and merges them. One kernel
per collective, whatever the number of virtual devices.

A result that is the same on every device of the mesh (an all-reduce or all-gather over every mesh dim) is one
copy expanded over the stack axis (stride 0): replicated values are held, and updated, once (see
`spmd/engine/dispatch.py`).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from spmd.collectives.base import Collectives, kept_dtype
from spmd.layout import axis_dims


def _grid(x: torch.Tensor, mesh) -> torch.Tensor:
    return x.reshape(tuple(mesh.shape()) + tuple(x.shape[1:]))  # (*mesh, *local)


def shared(stack: torch.Tensor) -> bool:
    """Whether stacked components are one copy that every device shares (stride 0 over the stack axis)."""
    return stack.stride()[0] == 0 and stack.shape[0] > 1  # (`stride()` is cheaper than `stride(0)`)


def traced(t: torch.Tensor) -> bool:
    """Whether `t` stands for a tensor in a graph being traced."""
    return type(t) is not torch.Tensor and isinstance(t, (FakeTensor, FunctionalTensor))  # (the common case first)


def share(one: torch.Tensor, n: int) -> torch.Tensor:
    """The stacked components of `n` devices that all hold `one` `(1, *local)`: `one` expanded (stride 0 over the
    stack axis). In a traced graph the stack remembers `one`, and a write goes there (`one_copy`): a write through
    the expanded view would be replayed as a sum over the devices (functionalization's inverse of `expand`)."""
    stack = one.expand((n,) + tuple(one.shape[1:]))
    if traced(one):
        stack._spmd_one = one
    return stack


def one_copy(stack: torch.Tensor) -> torch.Tensor:
    """The one copy `(1, *local)` that the devices of a shared stack hold (see `share`)."""
    one = getattr(stack, "_spmd_one", None)
    return stack[:1] if one is None else one


def spread(part: torch.Tensor, mesh_shape: tuple, stack_shape: tuple) -> torch.Tensor:
    """`part` (*mesh, *local), of size 1 along the mesh axes whose devices hold the same values, as the stacked
    components `stack_shape`: one shared copy when every device holds the same, else each device's own memory."""
    if all(n == 1 for n in part.shape[:len(mesh_shape)]):
        return share(part.reshape((1,) + tuple(stack_shape[1:])), stack_shape[0])
    return part.expand(mesh_shape + tuple(stack_shape[1:])).contiguous().view(stack_shape)


def _reduce(grid: torch.Tensor, axes: tuple[int, ...], op: str) -> torch.Tensor:
    if op == "sum":
        return grid.sum(dim=axes, keepdim=True, dtype=kept_dtype(grid))
    if op == "avg":
        return grid.mean(dim=axes, keepdim=True)
    if op == "max":
        return grid.amax(dim=axes, keepdim=True)
    if op == "min":
        return grid.amin(dim=axes, keepdim=True)
    raise ValueError(f"unknown reduction {op!r}")


class InProcessCollectives(Collectives):
    """Collectives for a mesh whose devices all belong to this process (virtual CPUs or one GPU)."""

    def all_reduce(self, x, mesh, mesh_dims, op="sum", donate=False):
        if not mesh_dims or op == "same":  # (every device already holds its group's value)
            return x
        reduced = _reduce(_grid(x, mesh), tuple(mesh.axis_index(d) for d in mesh_dims), op)
        return spread(reduced, tuple(mesh.shape()), x.shape)

    def _merge(self, grid, nm, d, axis):
        # (*mesh, *local) -> (*mesh without d, *local with `axis` concatenated over d)
        moved = grid.movedim(d, nm - 1 + axis)
        shape = list(moved.shape)
        shape[nm - 1 + axis: nm + 1 + axis] = [shape[nm - 1 + axis] * shape[nm + axis]]
        return moved.reshape(shape)

    def _split(self, full, nm, d, axis, k):
        # (*mesh without d, *local with full `axis`) -> (*mesh, *local with `axis` split over d)
        shape = list(full.shape)
        at = nm - 1 + axis
        shape[at: at + 1] = [k, shape[at] // k]
        return full.reshape(shape).movedim(at, d)

    def all_gather(self, x, mesh, mesh_dim, axis):
        grid, nm, d = _grid(x, mesh), len(mesh.shape()), mesh.axis_index(mesh_dim)
        full = self._merge(grid, nm, d, axis).unsqueeze(d)
        return spread(full, tuple(mesh.shape()), (x.shape[0],) + tuple(full.shape[nm:]))

    def shard(self, x, mesh, mesh_dim, axis):
        grid, nm, d = _grid(x, mesh), len(mesh.shape()), mesh.axis_index(mesh_dim)
        k = grid.shape[d]
        shape = list(grid.shape)
        shape[nm + axis: nm + axis + 1] = [k, shape[nm + axis] // k]
        # device at coordinate c along d keeps block c: the diagonal of (mesh axis d, block axis)
        mine = torch.diagonal(grid.reshape(shape), dim1=d, dim2=nm + axis).movedim(-1, d)
        return mine.contiguous().view((x.shape[0],) + tuple(mine.shape[nm:]))  # never aliases the input

    def all_to_all(self, x, mesh, mesh_dim, gather_axis, shard_axis):
        grid, nm, d = _grid(x, mesh), len(mesh.shape()), mesh.axis_index(mesh_dim)
        full = self._merge(grid, nm, d, gather_axis)
        out = self._split(full, nm, d, shard_axis, grid.shape[d])
        return out.contiguous().view((x.shape[0],) + tuple(out.shape[nm:]))

    def reduce_scatter(self, x, mesh, mesh_dim, axis, op="sum"):
        if op == "same":
            return self.shard(x, mesh, mesh_dim, axis)
        grid, nm, d = _grid(x, mesh), len(mesh.shape()), mesh.axis_index(mesh_dim)
        total = _reduce(grid, (d,), op).squeeze(d)
        out = self._split(total, nm, d, axis, grid.shape[d])
        return out.reshape((x.shape[0],) + tuple(out.shape[nm:]))

    def permute(self, x, mesh, from_dims, to_dims):
        # index the group's devices row-major over `from_dims`; the same flat index read over `to_dims` is where
        # each component goes: two reshapes of the grid, no index tensor
        grid = _grid(x, mesh)
        src = [mesh.axis_index(d) for d in from_dims]
        dst = [mesh.axis_index(d) for d in to_dims]
        moved = grid.movedim(src, list(range(len(src))))
        rest = tuple(moved.shape[len(src):])
        out = moved.reshape(tuple(mesh.dim_size(d) for d in to_dims) + rest).movedim(list(range(len(dst))), dst)
        return out.contiguous().view(x.shape)

    def assemble(self, x, mesh, axes):
        grid = _grid(x, mesh)
        sharding = [axis_dims(a) for a in axes]
        used = {d for dims in sharding for d in dims}
        # one replica of each shard: coordinate 0 along every mesh dim that shards nothing
        grid = grid[tuple(slice(None) if name in used else 0 for name in mesh.dim_names)]
        kept = [name for name in mesh.dim_names if name in used]  # the remaining mesh axes, in mesh order
        order, shape = [], []
        for a, dims in enumerate(sharding):  # each sharded tensor axis becomes (shard indices, major first; block)
            order.extend(kept.index(m) for m in dims)
            order.append(len(kept) + a)
            shape.append(x.shape[a + 1] * mesh.shard_count(dims))
        return grid.permute(order).reshape(shape)
