"""Input pipelines: `DTensorDataset` (TF's `tf.experimental.dtensor.DTensorDataset`) and the RFC's
`create_dtensor_iterable`.

A torch dataset of examples becomes an iterable of global batches whose tensors are DTensors with the given
layouts. Each client loads only the rows its local devices hold (computed from the mesh's local device
locations); devices that hold the same rows (replicas over the mesh dimensions the batch is not split over) share
one load, and each DTensor is built from per-device components, so a sharded batch never exists globally.

Rows are numbered as plain batching would number them: global batch `k` holds rows `k*G .. (k+1)*G - 1` and the
remainder is dropped (TF's `drop_remainder=True`); shard `s` of a batch axis split `n` ways holds the `s`-th
contiguous block of `G // n` rows, as TF's per-replica batching followed by concatenation does.

On a controller mesh (spmd.controller) the workers hold the devices: the dataset is sent to them and they make the
batches (spmd/controller/datasets.py); the controller's DTensorDataset only yields their shadows.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from typing import Any, Iterable, Iterator

import torch

from spmd.dtensor import DTensor, make
from spmd.errors import IndivisibleError, LayoutError
from spmd.layout import Layout
from spmd.mesh import Mesh, axis_dims

TensorSpec = collections.namedtuple("TensorSpec", ["shape", "dtype", "layout"])
TensorSpec.__doc__ = "The global shape, dtype and layout of one tensor of the batches a DTensorDataset yields."


# -- nested structures: a tensor, or tuples/lists/dicts of them --------------------------------------------------
def _flatten(value: Any, is_leaf, path: str = "") -> tuple[list[tuple[str, Any]], Any]:
    """(path, leaf) pairs in order and a structure definition to rebuild from."""
    if isinstance(value, dict):
        pairs, children = [], []
        for key, item in value.items():
            p, d = _flatten(item, is_leaf, f"{path}[{key!r}]")
            pairs += p
            children.append(d)
        return pairs, ("dict", type(value), tuple(value), tuple(children))
    if isinstance(value, (tuple, list)) and not is_leaf(value):
        pairs, children = [], []
        for i, item in enumerate(value):
            p, d = _flatten(item, is_leaf, f"{path}[{i}]")
            pairs += p
            children.append(d)
        return pairs, ("seq", type(value), len(value), tuple(children))
    return [(path, value)], None


def _unflatten(definition, leaves: Iterator) -> Any:
    if definition is None:
        return next(leaves)
    kind, cls, keys, children = definition
    if kind == "dict":
        items = [(k, _unflatten(d, leaves)) for k, d in zip(keys, children)]
        return cls(items) if cls is not dict else dict(items)
    items = [_unflatten(d, leaves) for d in children]
    return cls._make(items) if hasattr(cls, "_make") else cls(items)


def _describe(definition) -> str:
    """A short picture of a structure: `(*, {'x': *, 'y': *})`."""
    if definition is None:
        return "*"
    kind, cls, keys, children = definition
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_describe(d)}" for k, d in zip(keys, children)) + "}"
    inner = ", ".join(_describe(d) for d in children)
    return f"[{inner}]" if cls is list else f"({inner}{',' if len(children) == 1 else ''})"


def _same_structure(a, b) -> bool:
    """Equal structures; tuple and list count as the same (layouts are often written as lists)."""
    if a is None or b is None:
        return a is None and b is None
    if a[0] != b[0]:
        return False
    if a[0] == "dict":
        if set(a[2]) != set(b[2]):
            return False
        order = dict(zip(b[2], b[3]))
        return all(_same_structure(d, order[k]) for k, d in zip(a[2], a[3]))
    return a[2] == b[2] and all(_same_structure(x, y) for x, y in zip(a[3], b[3]))


def _layouts_like(layouts: Any, definition, path: str = "") -> list[Layout]:
    """`layouts` flattened in the order of an element's structure (dicts matched by key)."""
    if definition is None:
        return [layouts]
    kind, _, keys, children = definition
    if kind == "dict":
        return [x for k, d in zip(keys, children) for x in _layouts_like(layouts[k], d, f"{path}[{k!r}]")]
    return [x for i, d in enumerate(children) for x in _layouts_like(layouts[i], d, f"{path}[{i}]")]


def _as_tensor(value: Any, path: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            raise TypeError(f"dataset element{path or ''} is a DTensor; DTensorDataset takes plain examples")
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"dataset element{path or ''} of type {type(value).__name__} cannot be made a tensor "
                        f"({e}); elements must be tensors, arrays or numbers, in tuples, lists or dicts") from None


def _spec_of(row_shape, dtype, batched: bool, rows: int) -> str:
    return f"shape {((rows,) if batched else ()) + tuple(row_shape)} and dtype {dtype}"


def _spec(t: torch.Tensor) -> str:
    return f"TensorSpec(shape={tuple(t.shape)}, dtype={t.dtype})"


# -- the dataset ---------------------------------------------------------------------------------------------------
class DTensorDataset:
    """Batches a dataset of examples into global batches of DTensors (TF's `DTensorDataset`).

    Args:
      dataset: a map-style dataset (`__getitem__` and `__len__`: a `torch.utils.data.Dataset`, a list, a range, a
        tensor), an iterable (an `IterableDataset`, a generator) or a `torch.utils.data.DataLoader`. Its elements
        are a tensor (or array or number), or tuples, lists or dicts of them.
      mesh: the `Mesh` the batches live on.
      layouts: a `Layout` per tensor of an element, in the element's structure (one Layout for a plain tensor).
        A layout has one more axis than an example (axis 0 is the batch); with `dataset_already_batched` it has the
        element's rank.
      global_batch_size: rows per global batch; the remainder of the dataset is dropped.
      batch_dim: the mesh dimension the batch is split over (or a tuple of several, major first, as a layout
        names an axis split over several); every layout's axis 0 must then be sharded over exactly `batch_dim`.
      dataset_already_batched: the elements are batches, each of `global_batch_size // replicas` rows (`replicas`:
        the size of `batch_dim`; one replica's batch, as in TF; consecutive ones make a global batch) or of
        `global_batch_size` rows.
      prefetch: how many batches a background thread prepares ahead (None or 0: none).

    Each client reads only the rows its local devices hold; replicas of a shard share one read. Iterating again
    starts a new epoch.

    Raises:
      ValueError: layouts that do not fit the elements (rank, structure, mesh, `batch_dim`), a batch size that does
        not divide by the batch shards, an axis that does not divide by its shards, a batch of the wrong size.
    """

    def __init__(self, dataset: Any, *, mesh: Mesh, layouts: Any, global_batch_size: int | None,
                 batch_dim: str | tuple[str, ...] | None = None, dataset_already_batched: bool = False,
                 prefetch: int | None = None, _elements_per_batch: int | None = None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a spmd.Mesh, got {type(mesh).__name__}")
        if isinstance(dataset, (dict, str, bytes)) or not (hasattr(dataset, "__iter__")
                                                          or hasattr(dataset, "__getitem__")):
            raise TypeError(f"dataset must be a map-style dataset (__getitem__ and __len__), an iterable or a "
                            f"DataLoader, got {type(dataset).__name__}")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 0):
            raise ValueError(f"prefetch must be None or a non-negative number of batches, got {prefetch!r}")
        if isinstance(batch_dim, list):
            batch_dim = tuple(batch_dim)
        if batch_dim is not None and not all(d in mesh for d in axis_dims(batch_dim)):
            raise LayoutError(f"batch_dim {batch_dim!r} is not a dimension of the mesh (dimensions "
                              f"{mesh.dim_names}): {mesh!r}")
        if _elements_per_batch is None:
            _check_batch_size(global_batch_size)  # before reading anything
        self._dataset = dataset
        self._mesh = mesh
        self._batch_dim = batch_dim
        self._batched = dataset_already_batched  # None (create_dtensor_iterable): decided by the first element
        self._prefetch = prefetch or 0
        self._map_style = _is_map_style(dataset)
        self._started = None  # an iteration of `dataset` begun by `_peek`, for the first epoch
        if isinstance(dataset, torch.utils.data.DataLoader) and self._batched:
            _check_loader_drops_last(dataset)

        first = self._peek()
        pairs, self._structure = _flatten(first, lambda v: False)
        leaves = [(path, _as_tensor(v, path)) for path, v in pairs]
        if self._batched is None:
            self._batched = _batched_from(leaves, layouts, self._structure)
        self._batched = bool(self._batched)
        self._paths = [path for path, _ in leaves]
        flat_layouts = self._match_layouts(layouts, leaves)
        self._layouts = flat_layouts
        self._layouts_arg = layouts

        # rows per element (`c`) and the global batch size `G`
        if self._batched:
            sizes = {t.shape[0] if t.dim() else None for _, t in leaves}
            if None in sizes or len(sizes) != 1:
                raise ValueError(f"dataset_already_batched=True but the element's tensors do not share a batch "
                                 f"axis 0: {[_spec(t) for _, t in leaves]}")
            self._rows = sizes.pop()
        else:
            self._rows = 1
        if _elements_per_batch is not None:
            global_batch_size = _elements_per_batch * self._rows
        _check_batch_size(global_batch_size)
        self._global_batch_size = G = global_batch_size
        replicas = mesh.shard_count(batch_dim)
        if G % replicas:
            raise ValueError(f"global_batch_size {G} is not divisible by the {replicas} shards of batch_dim "
                             f"{batch_dim!r} of mesh {mesh.dim_names} {mesh.shape()}; use a multiple of "
                             f"{replicas} (e.g. {max(replicas, G - G % replicas)})")
        if self._batched and _elements_per_batch is None and self._rows not in (G // replicas, G):
            raise ValueError(
                f"per_replica_batch_size does not matched expected size based on the mesh, got {self._rows} but "
                f"expected {G // replicas}. With dataset_already_batched=True each element must be one replica's "
                f"batch of global_batch_size // replicas of batch_dim = {G} // {replicas} = {G // replicas} "
                f"rows (or a whole global batch of {G} rows); batch the dataset with that size and "
                f"drop_remainder/drop_last=True")
        if G % self._rows:
            raise ValueError(f"elements of {self._rows} rows cannot make global batches of {G} rows")
        self._elements_per_batch = G // self._rows

        # global shapes, checked against their layouts
        row_shapes = [tuple(t.shape[1:]) if self._batched else tuple(t.shape) for _, t in leaves]
        self._row_shapes = row_shapes
        self._dtypes = [t.dtype for _, t in leaves]
        for (path, t), layout, row_shape in zip(leaves, flat_layouts, row_shapes):
            try:
                layout.check_divisible((G,) + row_shape)
            except IndivisibleError as e:
                raise IndivisibleError(f"DTensorDataset: the batches of element{path} (global shape "
                                       f"{[G, *row_shape]}, layout {layout.sharding_specs}) cannot be sharded: "
                                       f"{e}") from None
        self._plan = self._make_plan()
        # a controller mesh (spmd.controller): the workers read the rows and make the batches
        self._workers = None if mesh.remote is None else mesh.remote.dataset_on_workers(self)
        if self._workers is not None:  # (they iterate their own copy of the dataset)
            self._started = None

    # -- setup -----------------------------------------------------------------------------------------------------
    def _peek(self):
        """The first element, to learn the structure, shapes and dtypes (a one-shot iterator gets it back)."""
        source = self._dataset
        if self._map_style:
            if len(source) == 0:
                raise ValueError("DTensorDataset got an empty dataset: cannot infer the element shapes")
            return source[0]
        it = iter(source)
        try:
            first = next(it)
        except StopIteration:
            raise ValueError("DTensorDataset got an empty dataset: cannot infer the element shapes") from None
        # the first epoch goes on from this element: starting another would draw another shuffle (a DataLoader's)
        self._started = itertools.chain([first], it)
        return first

    def _match_layouts(self, layouts, leaves) -> list[Layout]:
        _, layout_structure = _flatten(layouts, lambda v: isinstance(v, Layout))
        if not _same_structure(layout_structure, self._structure):
            raise ValueError(f"the structure of layouts {_describe(layout_structure)} does not match the structure "
                             f"of the dataset elements {_describe(self._structure)}; give one Layout per tensor, "
                             f"nested the same way (a single Layout for an element that is a single tensor)")
        flat = _layouts_like(layouts, self._structure)
        for (path, t), layout in zip(leaves, flat):
            if not isinstance(layout, Layout):
                raise TypeError(f"layouts{path} must be a spmd.Layout, got {type(layout).__name__}")
            if layout.mesh != self._mesh:
                raise LayoutError(f"layouts{path} is on mesh {layout.mesh!r}, not on the DTensorDataset's mesh "
                                  f"{self._mesh!r}")
            expected = t.dim() if self._batched else t.dim() + 1
            if layout.rank != expected:
                hint = ("; with dataset_already_batched=True the layout has the element's rank"
                        if self._batched else
                        "; a layout has one more axis than an example (axis 0 is the batch), or pass "
                        "dataset_already_batched=True for a batched dataset")
                raise LayoutError(f"Expected layout with rank {expected} for element spec {_spec(t)}, got layout "
                                  f"{layout}. Check that the dataset is not batched before passing to "
                                  f"DTensorDataset{hint}. (element{path})")
            if self._batch_dim is not None and axis_dims(layout.axes[0]) != axis_dims(self._batch_dim):
                raise LayoutError(f"batch_dim {self._batch_dim} was specified but at least one layout did not "
                                  f"contain it: {layout} (layouts{path} has sharding specs "
                                  f"{layout.sharding_specs}; its axis 0 must be sharded over {self._batch_dim!r}, "
                                  "a tuple for an axis split over several mesh dims)")
        return flat

    def _make_plan(self):
        """Per tensor: the row ranges local devices need, and per local device (range index, slices)."""
        mesh, G = self._mesh, self._global_batch_size
        locations = mesh.local_device_locations()  # this client's devices, in local_devices() order
        plan, needed = [], set()
        for layout, row_shape in zip(self._layouts, self._row_shapes):
            shape = (G,) + row_shape
            ranges, devices = [], []
            for loc in locations:
                slices = []
                index = layout.shard_index([loc[name] for name in mesh.dim_names])
                for axis, (dim, i) in enumerate(zip(layout.axes, index)):
                    if dim is None:
                        slices.append(slice(None))
                    else:
                        size = shape[axis] // layout.num_shards(axis)
                        slices.append(slice(i * size, (i + 1) * size))
                rows = (slices[0].start or 0, G if slices[0].stop is None else slices[0].stop)
                if rows not in ranges:
                    ranges.append(rows)
                devices.append((ranges.index(rows), (slice(None),) + tuple(slices[1:])))
            plan.append((ranges, devices))
            for start, stop in ranges:
                needed.update(range(start // self._rows, (stop - 1) // self._rows + 1))
        self._needed = sorted(needed)  # element indices within a batch this client reads
        return plan

    # -- public ----------------------------------------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def layouts(self):
        return self._layouts_arg

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @property
    def element_spec(self):
        """The structure of a batch with a `TensorSpec(shape, dtype, layout)` per tensor (global shapes)."""
        G = self._global_batch_size
        specs = [TensorSpec(torch.Size((G,) + s), d, l)
                 for s, d, l in zip(self._row_shapes, self._dtypes, self._layouts)]
        return _unflatten(self._structure, iter(specs))

    def __len__(self) -> int:
        """The number of global batches per epoch (TypeError when the dataset has no length)."""
        try:
            n = len(self._dataset)
        except TypeError:
            kind = "a one-shot iterator" if isinstance(self._dataset, Iterator) else type(self._dataset).__name__
            raise TypeError(f"DTensorDataset: the dataset ({kind}) has no length") from None
        return n // self._elements_per_batch

    def __iter__(self) -> Iterator:
        if self._workers is not None:
            return self._workers.batches()
        batches = self._batches()
        return _Prefetcher(batches, self._prefetch) if self._prefetch else batches

    def __repr__(self) -> str:
        return (f"DTensorDataset(global_batch_size={self._global_batch_size}, batch_dim={self._batch_dim!r}, "
                f"element_spec={self.element_spec!r})")

    # -- iteration -------------------------------------------------------------------------------------------------
    def _batches(self) -> Iterator:
        per_batch, needed = self._elements_per_batch, self._needed
        if self._map_style:
            dataset = self._dataset
            getitems = getattr(dataset, "__getitems__", None)
            for k in range(len(dataset) // per_batch):
                indices = [k * per_batch + j for j in needed]
                elements = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
                yield self._assemble(dict(zip(needed, elements)), k)
        else:
            wanted = set(needed)
            it, self._started = self._started or iter(self._dataset), None
            k = 0
            while True:
                elements = {}
                for j in range(per_batch):
                    try:
                        element = next(it)
                    except StopIteration:
                        return  # drop_remainder
                    if j in wanted:
                        elements[j] = element
                yield self._assemble(elements, k)
                k += 1

    def _assemble(self, elements: dict, k: int):
        """Builds the DTensors of batch `k` from the elements (index within the batch -> element) it needs."""
        leaves = {j: self._leaves(element, k, j) for j, element in elements.items()}
        device = self._mesh.torch_device
        out = []
        for i, (layout, (ranges, devices)) in enumerate(zip(self._layouts, self._plan)):
            blocks = [self._rows_of(leaves, i, start, stop, k).to(device) for start, stop in ranges]
            components = [blocks[r][slices] for r, slices in devices]
            out.append(make(torch.stack(components), layout))
        return _unflatten(self._structure, iter(out))

    def _leaves(self, element, k: int, j: int) -> list[torch.Tensor]:
        pairs, structure = _flatten(element, lambda v: False)
        where = f"element {k * self._elements_per_batch + j} of the dataset"
        if not _same_structure(structure, self._structure):
            raise ValueError(f"{where} has structure {_describe(structure)}, but the first had "
                             f"{_describe(self._structure)}")
        leaves = [_as_tensor(v, path) for path, v in pairs]
        for path, t, row_shape, dtype in zip(self._paths, leaves, self._row_shapes, self._dtypes):
            if self._batched and (t.dim() == 0 or t.shape[0] != self._rows):
                raise ValueError(
                    f"{where} is a batch of the wrong size: element{path} has shape {tuple(t.shape)} but "
                    f"every batch must have {self._rows} rows, as the first; batch with a fixed size and "
                    f"drop_remainder (DataLoader(..., drop_last=True))")
            shape = tuple(t.shape[1:]) if self._batched else tuple(t.shape)
            if shape != row_shape or t.dtype != dtype:
                raise ValueError(
                    f"{where} cannot be batched with the first: element{path} has shape {tuple(t.shape)} and "
                    f"dtype {t.dtype}, the first had {_spec_of(row_shape, dtype, self._batched, self._rows)}; "
                    f"every example must have the shape and dtype of the first (pad or convert them)")
        return leaves

    def _rows_of(self, leaves: dict, i: int, start: int, stop: int, k: int) -> torch.Tensor:
        """Rows `start:stop` of tensor `i` of the batch."""
        c = self._rows
        first, last = start // c, (stop - 1) // c
        parts = [leaves[j][i] for j in range(first, last + 1)]
        if not self._batched:  # shapes and dtypes were checked by `_leaves`
            return torch.stack(parts)
        block = parts[0] if len(parts) == 1 else torch.cat(parts)
        return block[start - first * c:stop - first * c]


def _check_batch_size(size) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"global_batch_size must be a positive integer, got {size!r}")


def _is_map_style(dataset) -> bool:
    if isinstance(dataset, (torch.utils.data.IterableDataset, torch.utils.data.DataLoader, Iterator)):
        return False
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _check_loader_drops_last(loader) -> None:
    """A DataLoader whose last batch would be short: say so now rather than at the end of the first epoch."""
    try:
        n = len(loader.dataset)
    except TypeError:
        return
    size = loader.batch_size
    if size and not loader.drop_last and n % size:
        raise ValueError(f"the DataLoader's last batch has {n % size} rows, not batch_size={size} ({n} examples); "
                         f"DTensorDataset needs batches of a fixed size: pass drop_last=True to the DataLoader")


class _Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead; re-raises its exceptions in the caller.

    The thread holds only the queue and the stop event, not this object: dropping the iterator (e.g. `break` out
    of a loop) garbage-collects it, which stops the thread.
    """

    def __init__(self, source: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop),
                                        name="spmd-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item, error = self._queue.get()
        if item is _END:
            self._done = True
            self._thread.join()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops the background thread (also done when the iterator is garbage collected)."""
        self._done = True
        self._stop.set()
        self._thread.join()

    def __del__(self):
        self._stop.set()


_END = object()


def _produce(source: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put((item, None)):
                return
        put((_END, None))
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        put((_END, e))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def create_dtensor_iterable(dataset: Iterable, element_layouts: Any, batch_dimension: str | None,
                            num_elements_per_batch: int, *, prefetch: int | None = None) -> DTensorDataset:
    """The RFC's input function: global batches made of `num_elements_per_batch` consecutive dataset elements
    concatenated along axis 0, with the layouts `element_layouts` (their mesh is the batches' mesh).

    The elements are usually batches already (the RFC batches by 32 and concatenates 8 of them into global
    batches of 256 rows); each then goes to one shard of `batch_dimension` when `num_elements_per_batch` is its
    size. Elements of rank one less than their layouts are single examples, stacked into batches of
    `num_elements_per_batch` rows.
    """
    if not isinstance(num_elements_per_batch, int) or num_elements_per_batch <= 0:
        raise ValueError(f"num_elements_per_batch must be a positive integer, got {num_elements_per_batch!r}")
    pairs, _ = _flatten(element_layouts, lambda v: isinstance(v, Layout))
    if not pairs or not all(isinstance(layout, Layout) for _, layout in pairs):
        raise TypeError(f"element_layouts must be a Layout or a structure of Layouts, got {element_layouts!r}")
    mesh = pairs[0][1].mesh
    return DTensorDataset(dataset, mesh=mesh, layouts=element_layouts, global_batch_size=None,
                          batch_dim=batch_dimension, dataset_already_batched=None, prefetch=prefetch,
                          _elements_per_batch=num_elements_per_batch)


def _batched_from(leaves, layouts, structure) -> bool:
    """Whether the first tensor of an element has the rank of its layout (a batch) or one less (an example)."""
    _, layout_structure = _flatten(layouts, lambda v: isinstance(v, Layout))
    if not _same_structure(layout_structure, structure):
        return False  # reported by the structure check
    layout = _layouts_like(layouts, structure)[0]
    return isinstance(layout, Layout) and leaves[0][1].dim() == layout.rank
