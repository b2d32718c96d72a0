"""The actor engine interface the controller needs, and the engines it knows (imported only when chosen).

An engine starts N worker processes, each holding one `WorkerState`, and delivers messages to them: to all or
to each without waiting (in the order sent, per worker), or to all and gathering what they return. It never
carries collectives: those run worker to worker over `torch.distributed`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from spmd.controller.errors import ControllerError

ENGINES = {"monarch": ("spmd.controller.monarch_engine", "torchmonarch", "spmd[controller]"),
           "ray": ("spmd.controller.ray_engine", "ray", "spmd[ray]")}


class Engine(ABC):
    """Workers `0..N-1` (the multi-client ids of their processes) and the four ways to reach them."""

    @abstractmethod
    def start(self, num_workers: int, worker_kwargs: dict) -> None:
        """Starts the workers; each builds `WorkerState(rank=i, num_workers=N, **worker_kwargs)`."""

    @abstractmethod
    def send_all(self, payload: bytes) -> None:
        """`WorkerState.run(payload)` on every worker, without waiting."""

    @abstractmethod
    def send_each(self, payloads: list[bytes]) -> None:
        """`WorkerState.run(payloads[i])` on worker i, without waiting."""

    @abstractmethod
    def call_all(self, payload: bytes, timeout: float) -> list:
        """`WorkerState.call(payload)` on every worker; their results by rank. Raises `WorkerDiedError` when a
        worker is gone and `TimeoutError` after `timeout` seconds."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every worker process (idempotent)."""


def load_engine(name: str) -> Engine:
    """The engine called `name` ('monarch' or 'ray'), its package imported now."""
    if name not in ENGINES:
        raise ValueError(f"unknown controller engine {name!r}: use one of {sorted(ENGINES)}")
    module, package, extra = ENGINES[name]
    try:
        return importlib.import_module(module).make_engine()
    except ImportError as e:
        raise ControllerError(f"the {name!r} engine needs the package {package} ({e}); install it with "
                              f"pip install '{extra}'") from e
