"""Single-controller mode: one Python program (the controller) drives DTensors whose components live in worker
processes, over an actor engine (Monarch or Ray). See docs/controller.md."""

from spmd.controller.controller import Controller
from spmd.controller.errors import ControllerError, WorkerDiedError, WorkerError
from spmd.controller.remote import ControllerMesh, RemoteDTensor

__all__ = ["Controller", "ControllerError", "ControllerMesh", "RemoteDTensor", "WorkerDiedError", "WorkerError"]
