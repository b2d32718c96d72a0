"""`XLAShardedTensor` (seed 001): a DTensor that behaves as the unpartitioned tensor, with PyTorch/XLA's view of
its shards (`local_shards`, `sharding_spec`, `sharding_type`).

As on an XLA device, a tensor nobody annotated is replicated: a plain tensor that meets an `XLAShardedTensor` in
an op is taken as replicated on its mesh, and the op's results are `XLAShardedTensor`s too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from spmd.api import to_global
from spmd.dtensor import DTensor
from spmd.engine import dispatch
from spmd.scope import EAGER_IMPLICIT_REPLICATION
from spmd.xla.mesh import device_ids_of

__all__ = ["XLAShardedTensor", "XLAShard", "ShardingType", "wrap"]


class ShardingType(enum.IntEnum):
    """PyTorch/XLA's sharding types (numbered as XLA's `OpSharding.Type` plus PARTIAL)."""
    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5  # tiled over some mesh axes, replicated over the others
    UNKNOWN = 6


@dataclass(frozen=True)
class XLAShard:
    """One device's shard: `data` (its component), `indices` (the global slices it holds, `Ellipsis` when the
    tensor is replicated), `replica_id` (which copy of that slice), `shard_device` (the device's name)."""
    data: torch.Tensor
    indices: Any
    replica_id: int
    shard_device: str

    @property
    def unpadded_data(self) -> torch.Tensor:
        """`data` without padding: spmd shards evenly, so it is `data`."""
        return self.data


class XLAShardedTensor(DTensor):
    """A DTensor annotated with `spmd.xla.mark_sharding`: torch ops and `nn` layers use it as the global tensor.

    Ops that meet one take plain tensors as replicated (the XLA device's rule) and return `XLAShardedTensor`s.
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with EAGER_IMPLICIT_REPLICATION:
            out = dispatch.torch_dispatch(DTensor, func, types, args, kwargs)
        inputs = {id(a) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)}
        return pytree.tree_map_only(DTensor, lambda t: t if id(t) in inputs else _retyped(t), out)

    @property
    def global_tensor(self) -> torch.Tensor:
        """The whole value as a plain tensor (gathered from the shards on each access)."""
        return to_global(self)

    @property
    def local_shards(self) -> list[XLAShard]:
        """The shards of this process's devices, in mesh order."""
        layout, mesh = self._layout, self._layout.mesh
        base = mesh.min_global_device_id()
        shards = []
        for component, device_id, name in zip(self._local.detach().unbind(0), mesh.local_device_ids(),
                                              mesh.local_devices()):
            location = mesh.device_location(device_id - base)
            shards.append(XLAShard(component, self._indices(location), _replica_id(layout, location),
                                   name.rsplit('/device:', 1)[-1]))
        return shards

    @property
    def sharding_spec(self) -> str:
        """The HLO sharding text, as PyTorch/XLA prints it (`{devices=[2,4]<=[8]}`, `{replicated}`, ...)."""
        return self._layout.to_hlo_sharding(device_ids=device_ids_of(self._layout.mesh))

    @property
    def sharding_type(self) -> ShardingType:
        used = self._layout.sharded_mesh_dims
        if not used:
            return ShardingType.REPLICATED
        return ShardingType.TILED if len(used) == len(self._layout.mesh.dim_names) else ShardingType.PARTIAL

    def cpu(self, *args, **kwargs) -> torch.Tensor:
        """The global value on the host as a plain tensor (an XLA tensor sent to the CPU)."""
        return self.global_tensor.cpu(*args, **kwargs)

    def _indices(self, location) -> Any:
        layout = self._layout
        if layout.is_fully_replicated():
            return Ellipsis
        out = []
        for axis, (size, index) in enumerate(zip(self.shape, layout.shard_index(location))):
            block = size // layout.num_shards(axis)
            out.append(slice(index * block, index * block + block, 1))
        return tuple(out)

    def __repr__(self, *, tensor_contents=None) -> str:
        return "XLAShardedTensor" + super().__repr__()[len("DTensor"):]


def wrap(t: DTensor) -> XLAShardedTensor:
    """`t` as an `XLAShardedTensor` (differentiable: gradients flow back to `t`)."""
    if isinstance(t, XLAShardedTensor):
        return t
    if t.requires_grad and torch.is_grad_enabled():
        return _AsSharded.apply(t)
    return _rewrap(t)


class _AsSharded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return _rewrap(t)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _rewrap(t: DTensor) -> XLAShardedTensor:
    """A new `XLAShardedTensor` over `t`'s components (no copy); only below autograd, or for detached values."""
    return DTensor.__new__(XLAShardedTensor, t._stack, t._layout, t.shape, t.requires_grad, t._pending,
                           t._pending_op)


def _retyped(t: DTensor) -> XLAShardedTensor:
    """An op's fresh result as an `XLAShardedTensor`, in place: it keeps everything the engine set on it (a view
    that had to copy keeps what writes through it need to reach its base, see engine/dispatch.py)."""
    t.__class__ = XLAShardedTensor
    return t


def _replica_id(layout, location) -> int:
    """The index of this copy among the devices holding the same slice: row-major over the replicated dims."""
    mesh = layout.mesh
    replicated = [i for i, name in enumerate(mesh.dim_names) if name not in layout.sharded_mesh_dims]
    shape = [mesh.shape()[i] for i in replicated]
    return int(np.ravel_multi_index([location[i] for i in replicated], shape)) if replicated else 0
