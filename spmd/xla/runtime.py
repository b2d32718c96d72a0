"""PyTorch/XLA's runtime queries (`torch_xla.runtime`, usually imported as `xr`), answered by spmd's runtime.

How many devices there are: the initialised runtime's (`spmd.initialize_accelerator_system`), else, as PyTorch/XLA
on CPU, the `CPU_NUM_DEVICES` environment variable (default 1) — or the visible GPUs when `PJRT_DEVICE` is `CUDA`
or `GPU`.
"""

from __future__ import annotations

import os

import torch

from spmd import clients
from spmd import runtime as spmd_runtime

__all__ = ["global_runtime_device_count", "addressable_runtime_device_count", "use_spmd", "is_spmd",
           "process_index", "process_count", "device_type"]


def device_type() -> str:
    """`'CPU'` or `'GPU'`: the initialised runtime's type, else `PJRT_DEVICE`'s (CPU by default)."""
    state = clients.current()
    if state is not None:
        return state.device_type
    return "GPU" if os.environ.get("PJRT_DEVICE", "CPU").upper() in ("CUDA", "GPU") else "CPU"


def addressable_runtime_device_count() -> int:
    """The devices this process holds."""
    state = clients.current()
    if state is not None:
        return state.num_local
    if device_type() == "GPU":
        return torch.cuda.device_count()
    return int(os.environ.get("CPU_NUM_DEVICES", "1"))


def global_runtime_device_count() -> int:
    """The devices of all processes."""
    return addressable_runtime_device_count() * process_count()


def process_index() -> int:
    return spmd_runtime.client_id()


def process_count() -> int:
    return spmd_runtime.num_clients()


def use_spmd() -> None:
    """PyTorch/XLA switches its runtime to SPMD mode here; spmd always runs SPMD, so there is nothing to switch
    (kept so that ported programs run unchanged)."""


def is_spmd() -> bool:
    return True
