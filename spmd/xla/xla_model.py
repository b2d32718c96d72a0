"""The few `torch_xla.core.xla_model` (`xm`) functions that SPMD programs call, so that they port unchanged.

spmd's components live on the mesh's torch device (host memory for virtual CPU devices), so the "XLA device" a
program moves its tensors to is that device: `.to(xm.xla_device())` keeps a tensor where it is until
`mark_sharding` lays it out.
"""

from __future__ import annotations

import torch

from spmd.xla import runtime

__all__ = ["xla_device", "get_xla_supported_devices", "mark_step"]


def xla_device(n: int | None = None) -> torch.device:
    """The torch device tensors are made on before they are annotated: `cuda` on GPUs, else `cpu`."""
    if runtime.device_type() == "GPU":
        return torch.device("cuda", torch.cuda.current_device() if n is None else n)
    return torch.device("cpu")


def get_xla_supported_devices(devkind: str | None = None) -> list[str]:
    """The names of this process's devices (`'CPU:0'`, ...): one per device a mesh may use."""
    kind = (devkind or runtime.device_type()).upper()
    return [f"{kind}:{i}" for i in range(runtime.addressable_runtime_device_count())]


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Nothing to do: spmd runs each op as it is called (PyTorch/XLA's lazy tensors run the graph built so far
    here). Kept so that training loops port unchanged."""
