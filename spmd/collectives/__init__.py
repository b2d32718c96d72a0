"""Collective backends behind one interface.

Every backend works on *stacked* components: a tensor of shape `(L, *local_shape)` holding the components of
this client's `L` local devices in `mesh.local_devices()` order. Tensor axes are numbered as in the DTensor
(the stack axis is not counted). Conjugate pairs, for the transpose of each step:
  all_reduce(sum) <-> identity, all_gather <-> shard (reduce_scatter for a pending sum), all_to_all <-> its inverse.
"""

from spmd.collectives.base import Collective, Collectives, Kind
from spmd.collectives.distributed import DistributedCollectives
from spmd.collectives.local import InProcessCollectives

_IN_PROCESS = InProcessCollectives()
_DISTRIBUTED = None


def backend_for(mesh) -> Collectives:
    """The backend that runs collectives over `mesh` from this process."""
    if mesh.is_fully_local():
        return _IN_PROCESS
    if mesh.is_remote():
        raise NotImplementedError(f"{mesh!r} has no device on this client: spmd runs ops only on meshes that "
                                  "include a device of every client")
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise NotImplementedError(
                f"{mesh!r} spans devices of other clients, but this process is not part of a multi-client job: "
                "call spmd.initialize_accelerator_system() in every client (launched with torchrun, or with "
                "DTENSOR_JOBS/DTENSOR_CLIENT_ID set) and create the mesh with spmd.create_distributed_mesh")
        _DISTRIBUTED = DistributedCollectives()
    return _DISTRIBUTED


__all__ = ["Collective", "Collectives", "Kind", "InProcessCollectives", "backend_for"]
