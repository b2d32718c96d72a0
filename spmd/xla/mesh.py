"""PyTorch/XLA's `Mesh` (seed 001): device ids in a custom order, reshaped in C order, with optional axis names.

It wraps an `spmd.Mesh`: position k of the logical mesh is the device `CPU:<device_ids[k]>` (or `GPU:`), so the
devices keep the order the user gave, as on an XLA device mesh.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np

from spmd import mesh as spmd_mesh
from spmd import runtime as spmd_runtime
from spmd.errors import LayoutError
from spmd.xla import runtime

__all__ = ["Mesh", "get_1d_mesh"]


class Mesh:
    """A logical mesh of devices (PyTorch/XLA's `Mesh`).

    Args:
      device_ids: a raveled list (or array) of device ids in a custom order; reshaped to `mesh_shape` in C order.
      mesh_shape: the number of devices along each mesh axis.
      axis_names: optional names, one per axis (a partition spec may then name axes instead of indexing them).
      device_type: `'CPU'` (virtual devices) or `'GPU'`; default: the initialised runtime's type, else CPU.

    >>> import spmd.xla as xs
    >>> mesh = xs.Mesh(range(8), (4, 2), ("x", "y"))
    >>> mesh.get_logical_mesh().tolist()
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> dict(mesh.shape()), mesh.size()
    ({'x': 4, 'y': 2}, 8)
    """

    def __init__(self, device_ids: Sequence[int] | np.ndarray, mesh_shape: Sequence[int],
                 axis_names: Sequence[str] | None = None, *, device_type: str | None = None):
        ids = np.asarray(device_ids).ravel()
        shape = tuple(int(s) for s in mesh_shape)
        if not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
            raise LayoutError(f"device_ids must be non-negative integers, got {np.asarray(device_ids).tolist()}")
        if len(set(ids.tolist())) != ids.size:
            raise LayoutError(f"device_ids must be unique, got {ids.tolist()}")
        if ids.size != math.prod(shape) or any(s <= 0 for s in shape):
            raise LayoutError(f"{ids.size} device ids do not fill a mesh of shape {shape} "
                              f"({math.prod(shape)} devices)")
        if axis_names is not None and len(axis_names) != len(shape):
            raise LayoutError(f"{len(axis_names)} axis names {tuple(axis_names)} for a mesh of rank {len(shape)}")
        self.device_ids = ids
        self.mesh_shape = shape
        self.axis_names = None if axis_names is None else tuple(str(n) for n in axis_names)
        self._spmd = _spmd_mesh(ids, shape, self._dim_names(), device_type or runtime.device_type())

    @classmethod
    def from_spmd(cls, mesh: spmd_mesh.Mesh) -> "Mesh":
        """The same devices and dims as an XLA-style mesh; device ids are the devices' ordinals where they are
        distinct (virtual devices), else the global device ids."""
        out = cls.__new__(cls)
        out.device_ids = device_ids_of(mesh)
        out.mesh_shape = tuple(mesh.shape())
        out.axis_names = tuple(mesh.dim_names)
        out._spmd = mesh
        return out

    def to_spmd(self) -> spmd_mesh.Mesh:
        """The `spmd.Mesh` this mesh wraps: use it with spmd's own API (`Layout`, `copy_to_mesh`, ...)."""
        return self._spmd

    def size(self) -> int:
        return int(self.device_ids.size)

    def shape(self) -> collections.OrderedDict:
        """Axis name (or index, without names) -> size."""
        keys = self.axis_names or range(len(self.mesh_shape))
        return collections.OrderedDict(zip(keys, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        """The device ids reshaped to the mesh shape (C order)."""
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        """The index of the axis called `name`, None when there is no such axis."""
        return self.axis_names.index(name) if self.axis_names and name in self.axis_names else None

    def _dim_names(self) -> list[str]:
        """spmd's mesh dims: the axis names, or `axis_<i>` for a mesh without names."""
        return list(self.axis_names) if self.axis_names else [f"axis_{i}" for i in range(len(self.mesh_shape))]

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self._spmd == other._spmd and self.axis_names == other.axis_names

    def __hash__(self) -> int:
        return hash((self._spmd, self.axis_names))

    def __repr__(self) -> str:
        return (f"Mesh(device_ids={self.device_ids.tolist()}, mesh_shape={self.mesh_shape}, "
                f"axis_names={self.axis_names})")


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A mesh of one axis over all devices of the runtime (`runtime.global_runtime_device_count()`)."""
    n = runtime.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), None if axis_name is None else (axis_name,))


def device_ids_of(mesh: spmd_mesh.Mesh) -> np.ndarray:
    """XLA device ids of an spmd mesh's positions: the device ordinals if distinct (an in-process mesh), else
    the global device ids (a multi-client mesh: ordinals repeat across clients)."""
    ordinals = mesh._device_indices() or []
    if len(ordinals) == mesh.size and len(set(ordinals)) == mesh.size:
        return np.array(ordinals)
    return mesh.global_device_ids().ravel()


def _spmd_mesh(ids: np.ndarray, shape: tuple, names: list[str], device_type: str) -> spmd_mesh.Mesh:
    if runtime.process_count() > 1:  # each client holds its share of the ids, in mesh order
        if ids.tolist() != list(range(ids.size)):
            raise LayoutError(f"on a multi-client runtime the device ids must be 0..{ids.size - 1} in order (each "
                              f"client holds a consecutive block), got {ids.tolist()}")
        return spmd_runtime.create_distributed_mesh(list(zip(names, shape)), device_type=device_type)
    positions = np.arange(ids.size).reshape(shape)
    return spmd_mesh.Mesh(names, positions, list(range(ids.size)), [f"{device_type}:{i}" for i in ids.tolist()])
