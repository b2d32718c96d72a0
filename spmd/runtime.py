"""The accelerator system: clients, their devices, and multi-client meshes (TF DTensor's `config.py`,
`accelerator_util.py` and `mesh_util.create_distributed_mesh`/`barrier`).

Single-process use needs none of this: `create_mesh` makes meshes of virtual CPU devices (or a GPU) directly.
Multi-client use runs the same program in N processes; each calls `initialize_accelerator_system()` and then
`create_distributed_mesh(...)`, and DTensors on that mesh hold this client's components only. The clients meet
over `torch.distributed` (gloo on CPU, NCCL on GPU), configured from

- torchrun's environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; or
- TF's: `DTENSOR_JOBS` (`host:port` per client; client 0's address is the rendezvous) and `DTENSOR_CLIENT_ID`.

Every collective waits at most `SPMD_COLLECTIVE_TIMEOUT` seconds (default 300, or `collective_timeout=` of
`initialize_accelerator_system`) for the other clients, then raises `spmd.CollectiveError`.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import sys
from typing import Sequence

import numpy as np
import torch

from spmd import clients
from spmd.api import pack
from spmd.collectives.groups import unreachable
# the client state lives in spmd.clients, below the mesh and the collectives that read it; its readers stay public here
from spmd.clients import DEFAULT_TIMEOUT_S, collective_timeout, is_initialized, local_cuda_index  # noqa: F401
from spmd.errors import CollectiveError
from spmd.layout import Layout
from spmd.mesh import Mesh, _device_type, canonical_device, short_device_name

_TYPES = ("CPU", "GPU", "TPU")


# -- config (TF's config.py): read the environment, never initialise anything ------------------------------------
def jobs() -> list[str]:
    """The `DTENSOR_JOBS` entries (`host:port`, one per client); `[]` in local mode."""
    value = os.environ.get("DTENSOR_JOBS", "")
    entries = value.split(",") if value else []
    if any(e.startswith("/bns/") for e in entries):
        tasks = [int(e.split("/")[3].split(":")[0]) if e.count("/") >= 3 else -1 for e in entries]
        if tasks != sorted(tasks):
            raise ValueError(f"Unexpected DTENSOR_JOBS content {value}. Sort entries in DTENSOR_JOBS because cluster "
                             "construction relies on the order.")
    return entries


def num_clients() -> int:
    """The number of clients (processes) of the job: 1 in single-client mode."""
    state = clients.current()
    if state is not None:
        return state.num_clients
    if jobs():
        return len(jobs())
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def client_id() -> int:
    """This client's index in `0..num_clients()-1` (`DTENSOR_CLIENT_ID`, else torchrun's `RANK`, else 0)."""
    state = clients.current()
    if state is not None:
        return state.client_id
    if "DTENSOR_CLIENT_ID" in os.environ or jobs():
        value = int(os.environ.get("DTENSOR_CLIENT_ID", "0") or 0)
    else:
        value = int(os.environ.get("RANK", "0") or 0)
    if value < 0:
        raise ValueError(f"Environment variable DTENSOR_CLIENT_ID must be >= 0, got {value}. ")
    n = num_clients()
    if value >= n:
        raise ValueError(f"Environment variable DTENSOR_CLIENT_ID must be < {n}, got {value}")
    return value


def job_name() -> str:
    """`DTENSOR_JOB_NAME`, else `'localhost'` with one client and `'worker'` with several."""
    return os.environ.get("DTENSOR_JOB_NAME") or ("localhost" if num_clients() == 1 else "worker")


def full_job_name(task_id: int | None = None) -> str:
    """`'<job>/replica:0/task:<task_id or client_id()>'`."""
    task = client_id() if task_id is None else task_id
    if num_clients() == 1 and task != 0:
        raise ValueError(f"Unexpected task ID {task} in local runs")
    return f"{job_name()}/replica:0/task:{task}"


def heartbeat_enabled() -> bool:
    return os.environ.get("DTENSOR_ENABLE_HEARTBEAT", "true").lower() in ("true", "1")


def preferred_device_type() -> str:
    """`'GPU'` when CUDA is available, else `'CPU'`."""
    return "GPU" if torch.cuda.is_available() else "CPU"


def _check_type(device_type: str | None) -> str:
    t = (device_type or preferred_device_type()).upper()
    if t not in _TYPES:
        raise ValueError(f"Device type {device_type} is not CPU, GPU, or TPU.")
    return t


def num_local_devices(device_type: str) -> int:
    """Devices of `device_type` per client: the logical CPU devices (`num_logical_cpu_devices`, default 1),
    the visible GPUs (one per process in multi-client mode)."""
    t = _check_type(device_type)
    state = clients.current()
    if state is not None and state.device_type == t:
        return state.num_local
    if t == "GPU":
        return 1 if num_clients() > 1 and torch.cuda.device_count() else torch.cuda.device_count()
    return 1 if t == "CPU" else 0


def num_global_devices(device_type: str) -> int:
    """`num_local_devices(device_type) * num_clients()`."""
    return num_local_devices(device_type) * num_clients()


def local_devices(device_type: str, for_client_id: int | None = None) -> list[str]:
    """This client's (or `for_client_id`'s) devices: `'/job:<job>/replica:0/task:<client>/device:<type>:<i>'`."""
    t = _check_type(device_type)
    task = client_id() if for_client_id is None else for_client_id
    return [f"/job:{job_name()}/replica:0/task:{task}/device:{t}:{i}" for i in range(num_local_devices(t))]


_config_local_devices = local_devices


# -- the accelerator system ----------------------------------------------------------------------------------------
def initialize_accelerator_system(device_type: str | None = None, enable_coordination_service: bool = True,
                                  num_logical_cpu_devices: int | None = None, experimental_reset_context: bool = False,
                                  experimental_enable_megcore: bool = False, *,
                                  collective_timeout: float | None = None) -> str:
    """Initialises this client: with several clients, joins the others over `torch.distributed`.

    Args:
      device_type: `'CPU'`, `'GPU'` (one GPU per process: `cuda:LOCAL_RANK`) or None for the preferred one.
      enable_coordination_service: accepted for TF compatibility (the rendezvous store plays that role).
      num_logical_cpu_devices: virtual CPU devices per client (default 1).
      experimental_reset_context, experimental_enable_megcore: accepted for TF compatibility.
      collective_timeout: seconds any collective waits for the other clients before it raises
        `spmd.CollectiveError` (default: `SPMD_COLLECTIVE_TIMEOUT`, else 300).

    Returns:
      The device type, upper-cased.

    Raises:
      ValueError: already initialised, an unknown device type, a bad client id, or an invalid device count.
    """
    if clients.is_initialized():
        raise ValueError("Accelerator system has already been initialized. Call "
                         "tf.experimental.dtensor.shutdown_accelerator_system() first.")
    if device_type is not None and str(device_type).upper() not in _TYPES:
        raise ValueError(f"Unknown device_type {device_type}. Allowed values are CPU, GPU, or TPU")
    t = (device_type or preferred_device_type()).upper()
    if t == "TPU":
        raise ValueError("spmd has no TPU backend: use device_type='CPU' or 'GPU'")
    n, cid = num_clients(), client_id()
    local_rank = int(os.environ.get("LOCAL_RANK", cid if jobs() else 0) or 0)
    if collective_timeout is None:
        collective_timeout = float(os.environ.get("SPMD_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))
    if collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be positive, got {collective_timeout}")
    timeout = datetime.timedelta(seconds=collective_timeout)
    if t == "CPU":
        if num_logical_cpu_devices is not None and num_logical_cpu_devices < 1:
            raise ValueError(f"num_logical_cpu_devices must be >= 1, got {num_logical_cpu_devices}")
        num_local = num_logical_cpu_devices or 1
    else:
        count = torch.cuda.device_count()
        if not count:
            raise ValueError("device_type='GPU' needs a CUDA device, and torch sees none")
        if num_logical_cpu_devices is not None and num_logical_cpu_devices < 1:
            raise ValueError(f"num_logical_cpu_devices must be >= 1, got {num_logical_cpu_devices}")
        num_local = 1 if n > 1 else count
        torch.cuda.set_device(local_rank % count)
    backend = None
    control = None
    if n > 1:
        import torch.distributed as dist
        if jobs():
            host, _, port = jobs()[0].rpartition(":")
        else:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        backend = "nccl" if t == "GPU" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=cid, world_size=n,
                                    timeout=timeout)
        elif dist.get_rank() != cid or dist.get_world_size() != n:
            raise ValueError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, but this client is {cid} of {n}")
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        global _EXIT_GROUP
        _EXIT_GROUP = dist.new_group(backend="gloo", timeout=min(timeout, datetime.timedelta(seconds=30)))
        _watch_for_crashes()
        atexit.register(_leave)
    clients.set_current(clients._State(t, cid, n, num_local, local_rank, timeout, backend, control))
    return t


initialize_multi_client = initialize_accelerator_system


def shutdown_accelerator_system() -> None:
    """Forgets the single-client configuration (multi-client shutdown is not supported, as in TF)."""
    state = clients.current()
    if state is None:
        raise ValueError("Accelerator system is not initialized. Call "
                         "tf.experimental.dtensor.initialize_accelerator_system first.")
    if state.num_clients > 1:
        raise ValueError("Shutting down accelerator system under multi-client mode is not supported.")
    clients.set_current(None)


_EXIT_GROUP = None
_CRASHED = False


def _watch_for_crashes() -> None:
    hook = sys.excepthook

    def crashed(*exc_info):
        global _CRASHED
        _CRASHED = True
        hook(*exc_info)
    sys.excepthook = crashed


def _leave() -> None:
    """At exit: the clients meet once more, then tear down together (tearing down while a peer is still using
    the connections can abort the process). After a crash the client leaves at once, so that its peers' next
    collective fails now rather than after the timeout."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    try:
        if not _CRASHED:
            dist.barrier(group=_EXIT_GROUP)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer died or stalled: nothing left to do at exit
        pass


def _state() -> clients._State:
    state = clients.current()
    if state is None:
        raise ValueError("Accelerators are uninitialized, please run dtensor.initialize_accelerator_system() first.")
    return state


# -- multi-client meshes --------------------------------------------------------------------------------------------
def create_distributed_mesh(mesh_dims: Sequence[tuple[str, int]] | dict[str, int], mesh_name: str = "",
                            local_devices: Sequence[str] | None = None, device_type: str | None = None,
                            use_xla_spmd: bool = False) -> Mesh:
    """Creates a mesh over the devices of all clients; a collective: every client must call it alike.

    The global device ids are `0..n-1` in row-major order over `mesh_dims`; client `c` holds the ids
    `c*L .. (c+1)*L - 1`, `L = len(local_devices)`, on `'/job:<job>/replica:0/task:<c>/device:<type>:<i>'`.

    Raises:
      ValueError: uninitialised; the mesh size is not `L * num_clients()`; or the clients disagree about the
        mesh (the message names this client's mesh and the other one).
    """
    state = _state()
    dims = list(mesh_dims.items()) if isinstance(mesh_dims, dict) else [tuple(d) for d in mesh_dims]
    if not dims or any(len(d) != 2 or not isinstance(d[1], (int, np.integer)) for d in dims):
        raise ValueError(f"mesh_dims must be (name, size) pairs or a dict, got {mesh_dims!r}")
    names, shape = [str(d[0]) for d in dims], [int(d[1]) for d in dims]
    prefix = f"/job:{job_name()}/replica:0/task:{state.client_id}"
    if local_devices is not None:
        devices = [canonical_device(d, prefix) for d in local_devices]
        if device_type is None and devices:
            device_type = short_device_name(devices[0]).split(":")[0]
    t = _device_type(str(device_type or state.device_type), str(device_type))
    if t == "TPU":
        raise ValueError("spmd has no TPU backend: create_distributed_mesh supports CPU and GPU meshes")
    if local_devices is None:
        devices = _config_local_devices(t)
    wrong = [d for d in devices if not d.rsplit("/device:", 1)[1].startswith(t + ":")]
    if wrong:
        raise ValueError(f"Conflicting devices {devices} and device_type {t}")
    per_client = len(devices)
    if state.num_clients > 1:  # first, so that a client whose request is invalid does not leave the others waiting
        _agree(_describe(mesh_name, names, shape, t, per_client))
    total = per_client * state.num_clients
    if total != math.prod(shape):
        raise ValueError(f"Global number of devices ({per_client} per client * {state.num_clients} clients = "
                         f"{total}) must be equal to total size of the mesh of shape {shape}")
    ids = np.arange(total).reshape(shape)
    local_ids = ids.ravel()[state.client_id * per_client:(state.client_id + 1) * per_client].tolist()
    return Mesh(names, ids, local_ids, devices, mesh_name)


def _describe(mesh_name: str, names: list[str], shape: list[int], device_type: str, per_client: int) -> str:
    dims = ",".join(f"{n}={s}" for n, s in zip(names, shape))
    return f"{mesh_name}|{dims}|{device_type}x{per_client} per client"


def _agree(mine: str) -> None:
    """All clients exchange what mesh they are creating (`mine`); any difference is a ValueError on every client."""
    import torch.distributed as dist
    state = _state()
    everyone: list = [None] * state.num_clients
    try:
        dist.all_gather_object(everyone, mine, group=state.control)
    except RuntimeError as e:
        raise unreachable(f"create_distributed_mesh({mine!r})", e) from e
    for other, theirs in enumerate(everyone):
        if theirs != mine:
            devices_only = theirs.rsplit("x", 1)[0] == mine.rsplit("x", 1)[0]  # (all but the count per client)
            raise ValueError(f"clients disagree about the mesh in create_distributed_mesh: client "
                             f"{state.client_id} creates '{mine}' but client {other} creates '{theirs}'; " + (
                                 "every client must hold as many devices (the same num_logical_cpu_devices in "
                                 "initialize_accelerator_system, or as many local_devices)" if devices_only else
                                 "every client must create the same meshes in the same order"))


def barrier(mesh: Mesh, barrier_name: str | None = None, timeout_in_ms: int | None = None) -> None:
    """Waits until every client reaches this barrier on `mesh` (as TF: a sum of ones over the mesh checks that
    all devices take part, then the clients meet).

    Raises:
      ValueError: the sum is not the mesh size.
      CollectiveError: a client did not arrive within `timeout_in_ms` (default: the collective timeout).
    """
    ones = [torch.ones([1] * len(mesh.shape()), dtype=torch.int64)] * mesh.num_local_devices()
    total = int(pack(ones, Layout(mesh.dim_names, mesh)).sum().item())
    if total != mesh.size:
        raise ValueError(f"Global barrier produced wrong mesh size : {total} while mesh has actual size : "
                         f"{mesh.size}")
    state = clients.current()
    if state is None or state.num_clients == 1:
        return
    import torch.distributed as dist
    timeout = datetime.timedelta(milliseconds=timeout_in_ms) if timeout_in_ms else state.timeout
    name = barrier_name or "barrier"
    try:
        dist.monitored_barrier(group=state.control, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        raise CollectiveError(f"client {state.client_id} of {state.num_clients}: barrier {name!r} on mesh "
                              f"{mesh.name or mesh.dim_names} failed within {timeout.total_seconds():g}s: {e}") from e


__all__ = ["initialize_accelerator_system", "initialize_multi_client", "shutdown_accelerator_system",
           "create_distributed_mesh", "barrier", "client_id", "num_clients", "job_name", "full_job_name", "jobs",
           "local_devices", "num_local_devices", "num_global_devices", "preferred_device_type", "heartbeat_enabled",
           "is_initialized", "collective_timeout"]
