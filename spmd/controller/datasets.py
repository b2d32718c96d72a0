"""`spmd.DTensorDataset` on a controller mesh: the workers make the batches, the controller holds their shadows.

The dataset object is pickled once and sent to every worker, which builds its own `DTensorDataset` on its side
of the mesh: as in multi-client mode, each worker reads only the rows its devices hold. Iterating on the
controller yields `RemoteDTensor`s whose shadows follow from the dataset's `element_spec` (a batch's components
are stacked contiguously, as the workers' `make` does); each `next` is one instruction to the workers, and no row
goes through the controller (it reads the first element once, to learn the shapes, as in local mode).

A dataset with a length (map-style, a `DataLoader`) sends its batches without waiting: the number of batches is
known here. An iterable without one asks the workers for each batch (a round trip), to learn where it ends.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import torch

from spmd.controller import protocol
from spmd.controller.errors import ControllerError
from spmd.controller.remote import RemoteDTensor, shadow
from spmd.data import _unflatten
from spmd.dtensor import DTensor


class OnWorkers:
    """The workers' copy of one `DTensorDataset` (freed on the workers with it)."""

    def __init__(self, dataset):
        self._session = session = dataset.mesh.remote
        try:
            payload = pickle.dumps((dataset._dataset, dataset._structure), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError...
            kind = "a one-shot iterator" if isinstance(dataset._dataset, Iterator) else type(dataset._dataset).__name__
            raise ControllerError(_UNPICKLABLE.format(kind=kind, error=e)) from None
        self.id = session.new_id(dataset)
        options = dict(batch_dim=dataset._batch_dim, dataset_already_batched=dataset._batched,
                       prefetch=dataset._prefetch, _elements_per_batch=dataset._elements_per_batch)
        try:
            seen = session.call("dataset", self.id, payload, dataset._layouts, options)[0]
        except Exception as e:  # noqa: BLE001 - a WorkerError: unpickling or building it failed there
            raise ControllerError(f"DTensorDataset on a controller mesh: the workers could not build the dataset "
                                  f"({e}). {_REQUIRED}") from None
        mine = (dataset._row_shapes, dataset._dtypes, dataset._elements_per_batch)
        if seen != mine:
            raise ControllerError(f"DTensorDataset on a controller mesh: the workers' copy of the dataset has other "
                                  f"elements (row shapes, dtypes, elements per batch {seen}) than this process's "
                                  f"{mine}; the dataset must give the same elements wherever it is unpickled")
        self._specs = [(layout, torch.Size((dataset.global_batch_size,) + shape), dtype)
                       for layout, shape, dtype in zip(dataset._layouts, dataset._row_shapes, dataset._dtypes)]
        self._structure = dataset._structure
        try:
            self._length = len(dataset)
        except TypeError:
            self._length = None

    def batches(self):
        return _Batches(self)

    def _shadows(self) -> list:
        """The new controller DTensors of one batch, with their handles."""
        out = []
        with shadow():
            for layout, shape, dtype in self._specs:
                local = layout.local_shape_from_global_shape(shape)
                stack = torch.empty((layout.mesh.num_local_devices(), *local), dtype=dtype, device="meta")
                t = DTensor.__new__(RemoteDTensor, stack, layout, shape)
                self._session._new_handle(t)
                out.append(t)
        return out


class _Batches:
    """One epoch: a worker-side iterator of the dataset, and the batches asked of it so far."""

    def __init__(self, on_workers: OnWorkers):
        self._on = on_workers
        self._session = on_workers._session
        self.id = self._session.new_id(self)
        self._session.send((protocol.ITER, on_workers.id, self.id))
        self._count = 0
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        on = self._on
        if self._done or (on._length is not None and self._count >= on._length):
            self._done = True
            raise StopIteration
        leaves = on._shadows()
        handles = [t._handle for t in leaves]
        if on._length is not None:
            self._session.send((protocol.BATCH, self.id, handles))
        elif not self._session.call("next_batch", self.id, handles)[0]:
            self._done = True
            raise StopIteration
        self._count += 1
        return _unflatten(on._structure, iter(leaves))


_REQUIRED = ("The dataset is pickled and sent to every worker: it must be picklable (no generator, lambda or open "
             "file) and its class, and the classes of its elements, importable by the workers (defined at the top "
             "level of a module on their path, not in __main__ or inside a function), and it must give the same "
             "elements there; or build the batches here with spmd.copy_to_mesh (sent through the controller)")
_UNPICKLABLE = "DTensorDataset on a controller mesh: the dataset ({kind}) cannot be pickled: {error}. " + _REQUIRED
