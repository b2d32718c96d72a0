"""The controller's side of a DTensor whose components live in worker processes.

A `RemoteDTensor` is a DTensor whose stacked components are a metadata *shadow*: `meta` tensors of the real
components' shapes, dtypes and strides on a `ControllerMesh` that holds every device of the job. spmd's own
engine runs each op on the shadows (layouts, shapes, collectives decided here, with no data and no round trip),
and the session ships the op to the workers, where the same engine runs it on the real components.

While the engine runs on shadows (`shadow()`), a controller mesh's torch device is `meta`; outside it, `cpu`:
code that builds components from data (factories, `copy_to_mesh`, `pack`) builds real ones, which
`DTensor.__new__` hands to the mesh's session (`mesh.remote.adopt`) to send to the workers.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from spmd import function_mode
from spmd.controller.errors import ControllerError
from spmd.dtensor import DTensor
from spmd.engine import dispatch
from spmd.mesh import Mesh
from spmd.tracing import register_constant_type

_SHADOW = [0]  # > 0 while spmd's engine runs on metadata shadows
_META, _CPU = torch.device("meta"), torch.device("cpu")


@contextmanager
def shadow():
    _SHADOW[0] += 1
    try:
        yield
    finally:
        _SHADOW[0] -= 1


class ControllerMesh(Mesh):
    """A mesh of a single-controller job: every device is local to the controller's engine (which sees their
    shadows), and each device's name says which worker holds it (`/job:worker/replica:0/task:<w>/device:CPU:<i>`).
    """

    __slots__ = ("_session", "mesh_id", "dims")

    def __init__(self, session, mesh_id: int, dims: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._session, self.mesh_id, self.dims = session, mesh_id, dims

    def __eq__(self, other) -> bool:
        # two controllers' meshes differ even where their devices are named alike (a notebook that starts a second
        # controller): the engine's plans and the shadow cache, keyed by layouts, must not mix their layouts. A
        # plain mesh parsed from a layout string (`spmd.relayout`'s argument) still equals this one
        return self is other or (isinstance(other, Mesh) and self._string == other._string
                                 and getattr(other, "_session", self._session) is self._session)

    __hash__ = Mesh.__hash__

    @property
    def torch_device(self) -> torch.device:
        return _META if _SHADOW[0] else _CPU

    @property
    def remote(self):
        """The session that holds this mesh's components (None while the engine runs on shadows)."""
        return None if _SHADOW[0] else self._session


register_constant_type(ControllerMesh)


class RemoteDTensor(DTensor):
    """A DTensor of a controller mesh: `_stack` is its shadow, `_handle` names the real one on the workers."""

    _handle: int
    _session: object

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        session = _session_of(args)
        # fakes of controller DTensors, traced by `spmd.function`, and the ops the engine runs itself on shadows
        # (a multi-tensor op position by position): the engine decides alone, the workers run the op called
        if session is None or _SHADOW[0]:
            with shadow():
                return DTensor.__torch_dispatch__(func, types, args, kwargs)
        return session.run_op(func, args, kwargs or {})

    def __getitem__(self, index):
        return super().__getitem__(_index_on_cpu(index))

    def __setitem__(self, index, value):
        if isinstance(value, (bool, int, float, complex)):  # (torch would make it a tensor on 'meta' too)
            value = torch.tensor(value, dtype=self.dtype)
        super().__setitem__(_index_on_cpu(index), value)

    @property
    def _local(self) -> torch.Tensor:
        """The engine (on shadows) reads the shadow; anyone else reads the real components, fetched."""
        if _SHADOW[0] or not hasattr(self, "_session"):  # (a fake, traced by spmd.function, has no session)
            return DTensor._local.fget(self)
        return self._session.fetch_stack(self)

    def __tensor_flatten__(self):
        if not function_mode.active():  # torch.compile alone would trace the shadows into meta kernels, sent nowhere
            raise ControllerError("torch.compile does not run on a controller mesh: use spmd.function, which "
                                  "traces on the controller and compiles on the workers")
        if self._pending:  # a compiled graph resolves its inputs: the workers' graph resolves theirs
            with shadow():
                dispatch.resolve(self)
        return super().__tensor_flatten__()

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        with shadow():  # a fake for Dynamo: nothing to send
            return super().__tensor_unflatten__(inner, meta, outer_size, outer_stride)

    def __deepcopy__(self, memo):
        with torch.no_grad():
            copy = self.clone()
        copy.requires_grad_(self.requires_grad)
        memo[id(self)] = copy
        return copy


_REMOTE_CLASSES: dict = {DTensor: RemoteDTensor}


def remote_class(cls: type) -> type:
    """The remote version of a DTensor class (`DVariable` -> a class that is both a DVariable and remote)."""
    if issubclass(cls, RemoteDTensor):
        return cls
    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = type(f"Remote{cls.__name__}", (RemoteDTensor, cls), {"__init__": lambda *a, **k: None})
    return _REMOTE_CLASSES[cls]


def _index_on_cpu(index):
    """torch makes an index given as a list into a tensor on the indexed tensor's device, which for a controller
    DTensor is 'meta', where the list's values are lost: such a list is made a CPU tensor first, as torch would make
    it (a list of numbers is one index tensor; a short list holding a list, slice, tensor, `...` or None is read as
    a tuple of indices)."""
    if isinstance(index, list):
        if len(index) >= 32 or not any(isinstance(i, (list, tuple, slice, torch.Tensor)) or i is None or i is ...
                                       for i in index):
            return torch.tensor(index)
        index = tuple(index)
    if isinstance(index, tuple):
        return tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
    return index


def _session_of(args):
    for a in args:
        if isinstance(a, RemoteDTensor):
            return getattr(a, "_session", None)
        if type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, RemoteDTensor):
                    return getattr(b, "_session", None)
    raise TypeError("a controller DTensor op without a controller DTensor argument")
