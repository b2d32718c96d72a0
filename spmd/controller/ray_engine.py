"""The Ray engine: each worker is a Ray actor on a Ray instance this controller starts for itself.

`ray.init` here starts a private local Ray instance (its dashboard off) unless one is already running in this
process; `shutdown` ends the actors and, when this engine started Ray, Ray itself. Ray runs the calls one caller
makes on one (synchronous) actor in the order they were made.
"""

from __future__ import annotations

import os

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from spmd.controller import reaper
from spmd.controller.engine import Engine
from spmd.controller.errors import WorkerDiedError
from spmd.controller.worker import WorkerState


class RayWorker:
    def __init__(self, rank: int, num_workers: int, worker_kwargs: dict):
        self.state = WorkerState(rank=rank, num_workers=num_workers, **worker_kwargs)

    def run(self, payload: bytes) -> None:
        self.state.run(payload)

    def call(self, payload: bytes):
        return self.state.call(payload)


class RayEngine(Engine):
    name = "ray"

    def __init__(self):
        self._actors: list = []
        self._owns_ray = False
        self._reaper = None

    def start(self, num_workers: int, worker_kwargs: dict) -> None:
        if not ray.is_initialized():
            before = set(reaper.tree([os.getpid()]))
            ray.init(num_cpus=max(num_workers, os.cpu_count() or 1), include_dashboard=False,
                     configure_logging=False, log_to_driver=True)
            self._owns_ray = True
            # Ray's daemons outlive a killed driver: a reaper ends them if this process dies without shutdown
            self._reaper = reaper.watch(sorted(set(reaper.tree([os.getpid()])) - before))
        remote = ray.remote(num_cpus=0, max_restarts=0)(RayWorker)
        self._actors = [remote.remote(i, num_workers, worker_kwargs) for i in range(num_workers)]

    def send_all(self, payload: bytes) -> None:
        ref = ray.put(payload) if len(payload) > 100_000 else payload  # one copy in the object store
        for actor in self._actors:
            actor.run.remote(ref)

    def send_each(self, payloads: list[bytes]) -> None:
        for actor, payload in zip(self._actors, payloads):
            actor.run.remote(payload)

    def call_all(self, payload: bytes, timeout: float) -> list:
        refs = [actor.call.remote(payload) for actor in self._actors]
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError as e:
            raise TimeoutError(f"the workers did not answer within {timeout:.0f} s") from e
        except RayActorError as e:
            raise WorkerDiedError(f"a worker process is gone: {str(e).strip().splitlines()[0]}") from e

    def shutdown(self) -> None:
        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        if self._reaper is not None:
            reaper.release(self._reaper)
            self._reaper = None


def make_engine() -> RayEngine:
    return RayEngine()
