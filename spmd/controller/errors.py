"""The errors of single-controller mode."""

from __future__ import annotations


class ControllerError(RuntimeError):
    """Single-controller mode cannot do what was asked (no engine, a controller already shut down, ...)."""


class WorkerError(ControllerError):
    """An instruction failed on a worker; raised at the controller's next read, naming the op."""


class WorkerDiedError(ControllerError):
    """A worker process is gone (or stopped answering); the controller has shut the others down."""
