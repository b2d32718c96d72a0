"""`spmd.Controller`: one Python program drives DTensors whose components live in N worker processes.

    with spmd.Controller(num_workers=2, devices_per_worker=2, engine="monarch") as ctl:
        mesh = ctl.create_mesh([("batch", 2), ("model", 2)])   # 4 devices over 2 worker processes
        x = spmd.copy_to_mesh(torch.randn(8, 16), spmd.Layout(["batch", spmd.UNSHARDED], mesh))
        print(spmd.to_global((x * 2).sum()))                     # runs on the workers, fetched here
"""

from __future__ import annotations

import atexit
import math
import socket
from typing import Sequence

import numpy as np

from spmd.controller.engine import load_engine
from spmd.controller.errors import ControllerError
from spmd.controller.remote import ControllerMesh
from spmd.controller.session import Session

_DEVICE_TYPES = ("CPU", "GPU")


class Controller:
    """Starts `num_workers` worker processes with `devices_per_worker` devices each and drives them.

    Args:
      num_workers: worker processes (multi-client clients `0..N-1`), started on this host.
      devices_per_worker: virtual CPU devices per worker (`num_logical_cpu_devices`); with 'GPU', 1.
      device_type: 'CPU' (gloo between the workers) or 'GPU' (NCCL, one GPU per worker).
      engine: 'monarch' (`torchmonarch`, the default) or 'ray'.
      collective_timeout: seconds a worker's collective waits for the others; a read waits this long plus a
        margin before the controller declares the workers lost.
      imports: modules each worker imports when it starts (importable there: installed, or on the path): those
        that define the custom ops (`torch.library`) and the sharding rules (`spmd.register_sharding`) the program
        uses, which the workers run by name.

    Raises:
      ControllerError: the engine's package is missing, or the workers failed to start.
    """

    def __init__(self, num_workers: int = 2, devices_per_worker: int = 1, device_type: str = "CPU",
                 engine: str = "monarch", collective_timeout: float = 60.0, imports: Sequence[str] = ()):
        if isinstance(imports, str) or not all(isinstance(name, str) for name in imports):
            raise TypeError(f"imports takes a list of module names, got {imports!r}")
        if num_workers < 1 or devices_per_worker < 1:
            raise ValueError(f"num_workers and devices_per_worker must be >= 1, got {num_workers}, "
                             f"{devices_per_worker}")
        device_type = str(device_type).upper()
        if device_type not in _DEVICE_TYPES:
            raise ValueError(f"device_type must be 'CPU' or 'GPU', got {device_type!r}")
        self.num_workers, self.devices_per_worker, self.device_type = num_workers, devices_per_worker, device_type
        self.engine_name = engine
        self._engine = load_engine(engine)
        self._session = Session(self._engine, devices_per_worker, collective_timeout + 15.0)
        self._session.on_failure = self.shutdown
        self._meshes = 0
        atexit.register(self.shutdown)
        try:
            self._engine.start(num_workers, dict(devices_per_worker=devices_per_worker, device_type=device_type,
                                                 master_port=_free_port(), collective_timeout=collective_timeout,
                                                 imports=tuple(imports)))
            self._infos = self._session.call("info")
        except BaseException:
            self.shutdown()
            raise

    def create_mesh(self, mesh_dims: Sequence[tuple[str, int]] | dict[str, int], mesh_name: str = "") -> ControllerMesh:
        """A mesh over all workers' devices: global ids `0..n-1` row-major, worker `w` holding ids
        `w*L .. (w+1)*L - 1` (as `create_distributed_mesh` in multi-client mode)."""
        dims = list(mesh_dims.items()) if isinstance(mesh_dims, dict) else [tuple(d) for d in mesh_dims]
        shape = [int(size) for _, size in dims]
        total = self.num_workers * self.devices_per_worker
        if math.prod(shape) != total:
            raise ValueError(f"a controller mesh spans all {total} devices ({self.num_workers} workers x "
                             f"{self.devices_per_worker}); mesh shape {shape} has {math.prod(shape)}")
        kind = self.device_type
        devices = [f"/job:worker/replica:0/task:{i // self.devices_per_worker}/device:{kind}:"
                   f"{i % self.devices_per_worker}" for i in range(total)]
        mesh = ControllerMesh(self._session, self._meshes, [(str(n), int(s)) for n, s in dims],
                              [str(n) for n, _ in dims], np.arange(total).reshape(shape), list(range(total)),
                              devices, mesh_name)
        self._meshes += 1
        self._session.register_mesh(mesh)
        return mesh

    def worker_pids(self) -> list[int]:
        """The process ids of the workers, by worker index."""
        return [info["pid"] for info in self._infos]

    def sync(self) -> None:
        """Waits until the workers have run every op sent so far; raises a worker's failure (`WorkerError`)."""
        self._session.sync()

    def live_handles(self) -> list[int]:
        """Per worker, how many DTensors it holds (dropped controller DTensors are freed with the next message)."""
        return [info["handles"] for info in self._session.call("info")]

    def traffic(self) -> dict[str, int]:
        """Bytes of components that went through the controller so far: `sent` to the workers (`copy_to_mesh`,
        factories, `pack`; a replicated value counted once) and `fetched` from them (`to_global`, `unpack`...)."""
        return dict(self._session.traffic)

    def shutdown(self) -> None:
        """Stops every worker process; the controller's DTensors become unusable. Idempotent."""
        if self._session.closed and self._engine is None:
            return
        self._session.closed = True
        engine, self._engine = self._engine, None
        atexit.unregister(self.shutdown)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._session.closed else "running"
        return (f"Controller({self.num_workers} workers x {self.devices_per_worker} {self.device_type}, "
                f"engine={self.engine_name!r}, {state})")


def _free_port() -> int:
    """A free port on loopback for the workers' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["Controller", "ControllerError"]
