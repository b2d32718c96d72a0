"""The Monarch engine (`torchmonarch`, PyTorch's single-controller system): its actor layer only.

The workers are one actor mesh on processes this host spawns (`this_host().spawn_procs`); a message to all is
an endpoint `broadcast`, a message to one worker a broadcast on its one-rank slice, a gathering call an endpoint
`call`. Monarch delivers the messages of one sender to one actor in order and runs them one at a time.
"""

from __future__ import annotations

import monarch.actor
from monarch.actor import Actor, current_rank, endpoint, this_host

from spmd.controller.engine import Engine
from spmd.controller.errors import WorkerDiedError
from spmd.controller.worker import WorkerState


class MonarchWorker(Actor):
    def __init__(self, num_workers: int, worker_kwargs: dict):
        self.state = WorkerState(rank=current_rank().rank, num_workers=num_workers, **worker_kwargs)

    @endpoint
    def run(self, payload: bytes) -> None:
        self.state.run(payload)

    @endpoint
    def call(self, payload: bytes):
        return self.state.call(payload)


class MonarchEngine(Engine):
    name = "monarch"

    def __init__(self):
        self._procs = self._actors = None
        self._ranks: list = []
        self._failure: str | None = None

    def start(self, num_workers: int, worker_kwargs: dict) -> None:
        # Monarch's default for a failure nobody handles is to end this process: the controller reports it instead
        monarch.actor.unhandled_fault_hook = self._failed
        self._procs = this_host().spawn_procs(per_host={"workers": num_workers}, name="spmd_workers")
        self._actors = self._procs.spawn("spmd_worker", MonarchWorker, num_workers, worker_kwargs)
        self._ranks = [self._actors.slice(workers=i) for i in range(num_workers)]

    def send_all(self, payload: bytes) -> None:
        self._actors.run.broadcast(payload)

    def send_each(self, payloads: list[bytes]) -> None:
        for actor, payload in zip(self._ranks, payloads):
            actor.run.broadcast(payload)

    def _failed(self, failure) -> None:
        self._failure = _first_line(failure)

    def call_all(self, payload: bytes, timeout: float) -> list:
        if self._failure is not None:
            raise WorkerDiedError(f"a worker process is gone: {self._failure}")
        try:
            results = self._actors.call.call(payload).get(timeout=timeout)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - Monarch reports a dead process as a supervision error
            raise WorkerDiedError(f"a worker process is gone: {type(e).__name__}: {_first_line(e)}") from e
        return [value for _, value in sorted(results.items(), key=lambda item: _rank(item[0]))]

    def shutdown(self) -> None:
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.stop().get(timeout=30)


def _rank(point) -> int:
    return point["workers"] if not isinstance(point, int) else point


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def make_engine() -> MonarchEngine:
    return MonarchEngine()


__all__ = ["MonarchEngine", "make_engine"]
