"""This process's client state: set by `spmd.runtime.initialize_accelerator_system`, read here by the modules
below the runtime (a mesh's CUDA device, the collectives' timeout) so that they need not import it."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class _State:
    device_type: str
    client_id: int
    num_clients: int
    num_local: int  # devices of `device_type` per client
    local_rank: int
    timeout: datetime.timedelta
    backend: str | None  # 'gloo' / 'nccl'; None in single-client mode
    control: object = None  # a gloo process group for control messages (mesh agreement, barriers)


_STATE: _State | None = None


def current() -> _State | None:
    """This client's state, or None before `initialize_accelerator_system` (and after its shutdown)."""
    return _STATE


def set_current(state: _State | None) -> None:
    global _STATE
    _STATE = state


def is_initialized() -> bool:
    return _STATE is not None


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for the other clients (`SPMD_COLLECTIVE_TIMEOUT` seconds, default 300)."""
    if _STATE is not None:
        return _STATE.timeout
    return datetime.timedelta(seconds=float(os.environ.get("SPMD_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S)))


def local_cuda_index() -> int | None:
    """The CUDA device of this process in multi-client GPU mode (`LOCAL_RANK`), else None."""
    if _STATE is not None and _STATE.num_clients > 1 and _STATE.device_type == "GPU":
        return _STATE.local_rank % max(torch.cuda.device_count(), 1)
    return None
