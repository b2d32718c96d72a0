"""What every multi-client collective module shares: which client holds which device, the process group of a rank
set, the wire format of a component, and the errors a failed collective raises."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from spmd.clients import collective_timeout
from spmd.errors import CollectiveError

_GROUPS: dict[tuple[int, ...], object] = {}


def owners(mesh) -> list[int]:
    """The rank (client) holding each global device, by row-major position."""
    n, per = mesh.size, mesh.num_local_devices()
    rank, world = dist.get_rank(), dist.get_world_size()
    if mesh.global_devices():
        holders = [int(re.search(r"/task:(\d+)/", d).group(1)) for d in mesh.global_devices()]
    elif per and n == per * world:
        holders = [p // per for p in range(n)]
    else:
        raise NotImplementedError(
            f"spmd cannot tell which client holds which device of {mesh!r}: a multi-client mesh must have "
            f"{world} clients x {per} local devices = {n} devices (use spmd.create_distributed_mesh)")
    base = mesh.min_global_device_id()
    expected = [p + base for p in range(n) if holders[p] == rank]
    if expected != mesh.local_device_ids():
        raise NotImplementedError(
            f"client {rank} holds the devices {mesh.local_device_ids()} of {mesh!r}, but a multi-client mesh gives "
            f"client r the ids r*L..(r+1)*L-1 (here {expected}); create it with spmd.create_distributed_mesh")
    return holders


def group(ranks: tuple[int, ...]):
    if len(ranks) == 1:
        return None
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), timeout=collective_timeout())
    return _GROUPS[ranks]


def wire(x: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.uint8) if x.dtype == torch.bool else x).contiguous()


# eager (into a buffer) or traced (functional)
def tracing(x: torch.Tensor) -> bool:
    return type(x) is not torch.Tensor  # a fake or functional tensor: a trace is recording the ops


def const(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A plan's index tensor on `like`'s device. Inside a trace it is made anew from its values: a trace records a
    constant it creates, but refuses a real tensor made outside it."""
    if not tracing(like):
        return index.to(like.device)
    with _disable_current_modes():
        values = index.tolist()
    made = torch.tensor(values, dtype=index.dtype, device=like.device)
    if isinstance(like, FakeTensor) and not isinstance(made, FakeTensor):  # Dynamo flattens its fake values
        made = like.fake_mode.from_tensor(made)  # outside its fake mode (see DTensor.__tensor_flatten__)
    return made


def all_gather(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(n, *x.shape): member i's `x` at index i, for the `n` clients of `group`."""
    if tracing(x):
        return funcol.all_gather_tensor(x, 0, group).view((n,) + tuple(x.shape))
    out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.unbind(0)), x, group=group)
    return out


def failure(e: Exception, what: str, mesh, dims, ranks) -> CollectiveError:
    """The error of collective `what` over `dims` of `mesh` among the clients `ranks` that failed with `e`."""
    rank = dist.get_rank()
    peers = [r for r in ranks if r != rank]
    return CollectiveError(
        f"client {rank} of {dist.get_world_size()}: {what} over mesh dim(s) {list(dims)} of mesh "
        f"{mesh.name + ' ' if mesh.name else ''}{dict(zip(mesh.dim_names, mesh.shape()))} with clients "
        f"{list(ranks)} failed (waiting for client(s) {peers}; the collective timeout is "
        f"{collective_timeout().total_seconds():g}s, SPMD_COLLECTIVE_TIMEOUT): {type(e).__name__}: {e}")


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a communication failure of torch.distributed: a peer closed its connection, or did not
    answer within the timeout."""
    text = str(error)
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        word in text for word in ("Connection reset", "Connection closed", "Timed out", "timed out", "gloo"))


def unreachable(what: str, error: BaseException) -> CollectiveError:
    """The error of `what`, a call every client makes together, when the other clients could not be reached."""
    return CollectiveError(
        f"client {dist.get_rank()} of {dist.get_world_size()}: {what} failed: the other clients could not be "
        f"reached: one died or stalled, or runs another part of the program (every client must make this call; "
        f"the collective timeout is {collective_timeout().total_seconds():g}s, SPMD_COLLECTIVE_TIMEOUT; with "
        f"SPMD_CHECK_COLLECTIVES=1 on every client, the error names what each runs): {type(error).__name__}: {error}")
