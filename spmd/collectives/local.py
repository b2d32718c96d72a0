"""In-process collectives: every device of the mesh is local, so a collective is a tensor op.

The stacked components `(L, *local)` are viewed as `(*mesh_shape, *local)`: a reduction over a mesh dimension
is a reduction over that axis, a gather moves the mesh axis next to the tensor axis and merges them. One kernel
per collective, whatever the number of virtual devices.
"""

from __future__ import annotations

import torch

from spmd.collectives.base import Collectives


def _grid(x: torch.Tensor, mesh) -> torch.Tensor:
    return x.reshape(tuple(mesh.shape()) + tuple(x.shape[1:]))  # (*mesh, *local)


def _reduce(grid: torch.Tensor, axes: tuple[int, ...], op: str) -> torch.Tensor:
    if op == "sum":
        return grid.sum(dim=axes, keepdim=True)
    if op == "avg":
        return grid.mean(dim=axes, keepdim=True)
    if op == "max":
        return grid.amax(dim=axes, keepdim=True)
    if op == "min":
        return grid.amin(dim=axes, keepdim=True)
    raise ValueError(f"unknown reduction {op!r}")


class InProcessCollectives(Collectives):
    """Collectives for a mesh whose devices all belong to this process (virtual CPUs or one GPU)."""

    def all_reduce(self, x, mesh, mesh_dims, op="sum"):
        if not mesh_dims:
            return x
        grid = _grid(x, mesh)
        reduced = _reduce(grid, tuple(mesh.axis_index(d) for d in mesh_dims), op)
        return reduced.expand(grid.shape).contiguous().view(x.shape)  # own memory per device

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
        shape = list(full.shape)
        shape[d] = grid.shape[d]
        return full.expand(shape).contiguous().view((x.shape[0],) + tuple(shape[nm:]))

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
        grid, nm, d = _grid(x, mesh), len(mesh.shape()), mesh.axis_index(mesh_dim)
        total = _reduce(grid, (d,), op).squeeze(d)
        out = self._split(total, nm, d, axis, grid.shape[d])
        return out.reshape((x.shape[0],) + tuple(out.shape[nm:]))

    def assemble(self, x, mesh, axes):
        grid = _grid(x, mesh)
        # one replica of each shard: coordinate 0 along every mesh dim that shards nothing
        grid = grid[tuple(slice(None) if name in axes else 0 for name in mesh.dim_names)]
        used = [name for name in mesh.dim_names if name in axes]  # the remaining mesh axes, in mesh order
        order, shape = [], []
        for a, m in enumerate(axes):  # each sharded tensor axis becomes (shard index, block)
            if m is not None:
                order.append(used.index(m))
            order.append(len(used) + a)
            shape.append(x.shape[a + 1] * (mesh.dim_size(m) if m is not None else 1))
        return grid.permute(order).reshape(shape)
