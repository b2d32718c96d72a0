"""Collective backends behind one interface.

Every backend works on *stacked* components: a tensor of shape `(L, *local_shape)` holding the components of
this client's `L` local devices in `mesh.local_devices()` order. Tensor axes are numbered as in the DTensor
(the stack axis is not counted). Conjugate pairs, for the transpose of each step:
  all_reduce(sum) <-> identity, all_gather <-> shard (reduce_scatter for a pending sum), all_to_all <-> its inverse.
"""

from spmd.collectives.base import Collectives
from spmd.collectives.local import InProcessCollectives

_IN_PROCESS = InProcessCollectives()


def backend_for(mesh) -> Collectives:
    """The backend that runs collectives over `mesh` from this process."""
    if mesh.is_fully_local():
        return _IN_PROCESS
    raise NotImplementedError(
        f"{mesh!r} spans devices of other clients; multi-client collectives need the torch.distributed "
        "backend, which this version of spmd does not have yet")


__all__ = ["Collectives", "InProcessCollectives", "backend_for"]
