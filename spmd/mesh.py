"""`Mesh`: a cartesian grid of devices with named dimensions (the seeds' `dtensor.Mesh`).

A mesh is an immutable value: equal by value, hashable, picklable, and printed in TensorFlow's exact
string format so meshes can be exchanged with TF DTensor.
"""

from __future__ import annotations

import collections
import math
import re
import threading
from typing import Iterable, Sequence

import numpy as np
import torch

from spmd.clients import current as current_client, local_cuda_index
from spmd import jax_sharding
from spmd.errors import LayoutError

MeshDimension = collections.namedtuple("MeshDimension", ["name", "size"])

_JOB_PREFIX = "/job:localhost/replica:0/task:0"
# `/job:J/replica:R/task:T/device:TYPE:I` or the short forms `TYPE:I`, `device:TYPE:I`.
_FULL_DEVICE = re.compile(r"^/job:([^/]+)/replica:(\d+)/task:(\d+)/device:([A-Za-z_]+):(\d+)$")
_SHORT_DEVICE = re.compile(r"^(?:/?device:)?([A-Za-z_]+):(\d+)$")
_DEVICE_TYPES = {"CPU": "CPU", "GPU": "GPU", "CUDA": "GPU", "TPU": "TPU"}
MAX_VIRTUAL_DEVICES = 1 << 16  # virtual devices of one in-process mesh (each holds a component in this process)
_RESERVED_NAMES = frozenset({"unsharded", "match"})  # layout.UNSHARDED and layout.MATCH (layout imports mesh)
_SEPARATORS = frozenset(",|=+")  # "+" joins the mesh dims of a layout spec sharding one axis over several


def axis_dims(axis) -> tuple[str, ...]:
    """The mesh dims sharding one tensor axis, as an entry of `Layout.axes` gives them (None, a mesh dim name, or
    a tuple of several, major first)."""
    if axis is None:
        return ()
    return axis if type(axis) is tuple else (axis,)


def canonical_device(device: str | torch.device, job_prefix: str = _JOB_PREFIX) -> str:
    """Returns the full TF device string for `device` (`'CPU:1'`, `'cuda:0'`, `torch.device(...)`, or full)."""
    if isinstance(device, torch.device):
        device = f"{device.type}:{device.index or 0}"
    if not isinstance(device, str):
        raise TypeError(f"a device must be a string such as 'CPU:0' or 'cuda:0', got {device!r}")
    full = _FULL_DEVICE.match(device)
    if full:
        job, replica, task, dtype, index = full.groups()
        return f"/job:{job}/replica:{replica}/task:{task}/device:{_device_type(dtype, device)}:{index}"
    short = _SHORT_DEVICE.match(device)
    if not short:
        raise LayoutError(f"cannot parse device {device!r}: expected 'CPU:i', 'GPU:i', 'cuda:i' or a full "
                          "'/job:.../replica:.../task:.../device:TYPE:i' name")
    dtype, index = short.groups()
    return f"{job_prefix}/device:{_device_type(dtype, device)}:{index}"


def _device_type(name: str, device: str) -> str:
    try:
        return _DEVICE_TYPES[name.upper()]
    except KeyError:
        raise LayoutError(f"unknown device type in {device!r}: use CPU, GPU (or cuda) or TPU") from None


def short_device_name(device: str) -> str:
    """`'/job:localhost/replica:0/task:0/device:CPU:3'` -> `'CPU:3'` (the key TF prints in a DTensor repr)."""
    return device.rsplit("/device:", 1)[-1]


def short_device_names(devices: Sequence[str]) -> list[str]:
    """Each device's short name where those are distinct (`'CPU:3'`); else with its task (`'task:1/CPU:3'`: the
    devices of several clients or workers), or the full names."""
    for short in ([short_device_name(d) for d in devices],
                  [d.rsplit("/", 2)[-2] + "/" + short_device_name(d) if d.count("/") >= 2 else d for d in devices]):
        if len(set(short)) == len(short):
            return short
    return list(devices)


class Mesh:
    """A cartesian grid of devices whose dimensions have names.

    Args:
      dim_names: one name per mesh dimension.
      global_device_ids: an array (or nested list) of consecutive integer ids, shaped like the mesh.
      local_device_ids: the ids of the devices this client holds, in the order of `local_devices`.
      local_devices: device names (`'CPU:0'`, `'cuda:1'` or full TF names), one per local id.
      mesh_name: an optional name; it takes part in equality, as in TF.
      global_devices: optional names of every device of the mesh (multi-client meshes).

    Raises:
      ValueError: for inconsistent ids, devices or names (the message says which).

    Most users call `create_mesh` instead:

    >>> mesh = create_mesh([("x", 3), ("y", 2)], devices=[f"CPU:{i}" for i in range(6)])
    >>> mesh.dim_names, mesh.shape(), mesh.size
    (['x', 'y'], [3, 2], 6)
    >>> mesh.dim_size("y"), "x" in mesh, mesh.coords(5).tolist()
    (2, True, [2, 1])
    """

    __slots__ = ("_dim_names", "_shape", "_global_ids", "_local_ids", "_local_devices", "_name",
                 "_global_devices", "_hash", "_dim_index", "_string", "_torch_device")
    remote = None  # the session of a single-controller mesh (spmd.controller), whose workers hold the components

    def __init__(self, dim_names: Sequence[str], global_device_ids, local_device_ids: Sequence[int],
                 local_devices: Sequence[str], mesh_name: str = "", global_devices: Sequence[str] | None = None):
        ids = np.asarray(global_device_ids)
        if ids.size == 0:
            raise LayoutError("Variable global_device_ids must be non-empty.")
        if not np.issubdtype(ids.dtype, np.integer):
            raise LayoutError(f"global_device_ids must be integers, got {global_device_ids!r}")
        flat = ids.ravel()
        if not np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
            raise LayoutError(f"global_device_ids must sequentially increase: {flat.tolist()}")
        dim_names = [str(n) for n in dim_names]
        for n in dim_names:
            if n in _RESERVED_NAMES or not n or _SEPARATORS.intersection(n):
                raise LayoutError(
                    f"mesh dimension name {n!r} is not allowed: 'unsharded' and 'match' are layout keywords, and "
                    f"a name needs at least one character and none of {''.join(sorted(_SEPARATORS))!r} (they "
                    "separate the fields of a mesh's or a layout's string form)")
        if "|" in str(mesh_name):
            raise LayoutError(f"mesh name {mesh_name!r} is not allowed: '|' separates the fields of a mesh's string "
                              "form, which must read back")
        if len(dim_names) != ids.ndim:
            raise LayoutError(f"Number of mesh dimensions ({ids.ndim}, shape {list(ids.shape)}) does not match "
                              f"number of dimension names {dim_names}.")
        duplicated = sorted({n for n in dim_names if dim_names.count(n) > 1})
        if duplicated:
            raise LayoutError(f"mesh dimension names must be unique, got {dim_names} ({duplicated} repeated)")
        local_device_ids = list(local_device_ids)
        if not all(isinstance(i, (int, np.integer)) for i in local_device_ids):
            raise LayoutError(f"Variable local_device_ids must be a list of integers, got {local_device_ids!r}.")
        local_devices = [canonical_device(d) for d in local_devices]
        if len(local_device_ids) != len(local_devices):
            raise LayoutError(f"Variable local_device_ids ({len(local_device_ids)}) does not have same size as "
                              f"local_devices ({len(local_devices)}).")
        if len(local_device_ids) > flat.size:
            raise LayoutError("Cannot have more local than global device IDs.")
        if len(set(local_devices)) != len(local_devices):
            raise LayoutError(f"Duplicate devices found in mesh specification {local_devices}.")
        unknown = sorted(set(local_device_ids) - set(flat.tolist()))
        if unknown:
            raise LayoutError(f"local device ids {unknown} are not in the mesh's global ids {flat.tolist()}")
        global_devices = [canonical_device(d) for d in global_devices or ()]
        if global_devices and len(global_devices) != flat.size:
            raise LayoutError(f"global_devices has {len(global_devices)} devices but the mesh has {flat.size} "
                              f"global device ids: {global_devices}")
        types = {_FULL_DEVICE.match(d).group(4) for d in local_devices + global_devices}
        if len(types) > 1:
            raise LayoutError(f"Devices containing multiple device_types : {sorted(types)}")
        self._dim_names = tuple(dim_names)
        self._shape = tuple(int(s) for s in ids.shape)
        self._global_ids = tuple(int(i) for i in flat)
        self._local_ids = tuple(int(i) for i in local_device_ids)
        self._local_devices = tuple(local_devices)
        self._name = str(mesh_name)
        self._global_devices = tuple(global_devices)
        self._dim_index = {n: i for i, n in enumerate(self._dim_names)}
        self._string = self._format()
        self._hash = hash(self._string)
        self._torch_device = None

    # -- the TF members ------------------------------------------------------------------------------------------
    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return len(self._global_ids)

    @property
    def strides(self) -> list[int]:
        """Row-major strides of the mesh: `(2, 4, 2)` -> `[8, 2, 1]`."""
        strides, acc = [], 1
        for s in reversed(self._shape):
            strides.append(acc)
            acc *= s
        return strides[::-1]

    def shape(self) -> list[int]:
        return list(self._shape)

    def dim_size(self, dim_name: str) -> int:
        return self[dim_name].size

    def shard_count(self, axis) -> int:
        """How many blocks a tensor axis sharded over `axis` (None, a mesh dim name, or a tuple of several) has."""
        n = 1
        for d in axis_dims(axis):  # (a loop, not math.prod: Dynamo traces a Layout made inside spmd.function)
            n *= self.dim_size(d)
        return n

    def __getitem__(self, dim_name: str) -> MeshDimension:
        if dim_name not in self._dim_index:
            raise LayoutError(f"Dimension {dim_name} does not exist in mesh.Available dimensions: "
                              f"{','.join(self._dim_names)}")
        return MeshDimension(dim_name, self._shape[self._dim_index[dim_name]])

    def __contains__(self, dim_name: str) -> bool:
        return dim_name in self._dim_index

    def contains_dim(self, dim_name: str) -> bool:
        return dim_name in self

    def global_device_ids(self) -> np.ndarray:
        return np.array(self._global_ids, dtype=np.int64).reshape(self._shape)

    def local_device_ids(self) -> list[int]:
        return list(self._local_ids)

    def local_devices(self) -> list[str]:
        return list(self._local_devices)

    def num_local_devices(self) -> int:
        return len(self._local_devices)

    def global_devices(self) -> list[str]:
        return list(self._global_devices)

    def min_global_device_id(self) -> int:
        return self._global_ids[0]

    def is_remote(self) -> bool:
        return not self._local_devices

    def is_single_device(self) -> bool:
        return False

    def device_type(self) -> str:
        return _FULL_DEVICE.match((self._local_devices or self._global_devices)[0]).group(4)

    def coords(self, device_idx: int) -> torch.Tensor:
        """The mesh coordinates of the device at row-major offset `device_idx` (wraps modulo the size)."""
        return torch.tensor(self.device_location(device_idx), dtype=torch.int32)

    def device_location(self, device_idx: int) -> list[int]:
        return [(device_idx // stride) % size for stride, size in zip(self.strides, self._shape)]

    def unravel_index(self) -> dict[int, dict[str, int]]:
        base = self._global_ids[0]
        return {i: dict(zip(self._dim_names, self.device_location(i - base))) for i in self._global_ids}

    def local_device_locations(self) -> list[dict[str, int]]:
        locations = self.unravel_index()
        return [locations[i] for i in self._local_ids]

    def host_mesh(self) -> "Mesh":
        """The same ids on host CPUs (`/device:CPU:i`); as in TF the name is dropped."""
        def on_cpu(devices):
            return [d.rsplit("/device:", 1)[0] + "/device:CPU:" + d.rsplit(":", 1)[1] for d in devices]
        return Mesh(self._dim_names, self.global_device_ids(), self._local_ids, on_cpu(self._local_devices),
                    global_devices=on_cpu(self._global_devices))

    # -- JAX ------------------------------------------------------------------------------------------------------
    def to_jax(self, devices=None):
        """The `jax.sharding.Mesh` with this mesh's dim names and shape (jax must be installed).

        Args:
          devices: jax devices, one per mesh device (flat or shaped like the mesh). Default: for spmd device
            `TYPE:i` the jax device of id `i` (`create_mesh`'s `CPU:0..n-1` are jax's first n devices), or jax's
            first `size` devices when the mesh's device indices are not ids jax has.

        Raises:
          LayoutError: jax has fewer devices than the mesh (the message says how to get more CPU devices).
        """
        return jax_sharding.make_jax_mesh(self._dim_names, self._shape, self._device_indices(), devices)

    @classmethod
    def from_jax(cls, jax_mesh, device_type: str = "CPU") -> "Mesh":
        """An in-process mesh with the axis names and shape of the `jax.sharding.Mesh` `jax_mesh`; its device at
        position k is `'<device_type>:<id>'`, named after jax's device at position k (so a jax mesh over a permuted
        device array keeps its order through `to_jax`)."""
        names, shape, devices = jax_sharding.mesh_from_jax(jax_mesh, device_type)
        return cls(names, np.arange(len(devices)).reshape(shape), list(range(len(devices))), devices)

    def _device_indices(self) -> list[int] | None:
        """Per position, the index `i` of device `TYPE:i`, where this process knows every device of the mesh."""
        devices = self._global_devices or (self._local_devices if self.is_fully_local() else ())
        return [int(d.rsplit(":", 1)[1]) for d in devices] or None

    # -- string format, value semantics --------------------------------------------------------------------------
    def _format(self) -> str:
        parts = [self._name + "|" + ",".join(f"{n}={s}" for n, s in zip(self._dim_names, self._shape)),
                 ",".join(map(str, self._global_ids)), ",".join(map(str, self._local_ids)),
                 ",".join(self._local_devices)]
        if self._global_devices:
            parts.append(",".join(self._global_devices))
        return "|".join(parts)

    def to_string(self) -> str:
        """TF's format: `name|x=2,y=4|<global ids>|<local ids>|<local devices>[|<global devices>]`."""
        return self._string

    @classmethod
    def from_string(cls, mesh_str: str) -> "Mesh":
        if not isinstance(mesh_str, str):
            raise TypeError(f"Mesh.from_string expects a str, got {type(mesh_str).__name__}")
        parts = mesh_str.split("|")
        if len(parts) not in (5, 6) or "=" not in parts[1]:
            raise LayoutError(f"Input string is invalid: {mesh_str}")
        name, dims, global_ids, local_ids, local_devices = parts[:5]
        try:
            names, sizes = zip(*(d.split("=") for d in dims.split(",")))
            sizes = [int(s) for s in sizes]
            ids = [int(i) for i in global_ids.split(",")]
            local = [int(i) for i in local_ids.split(",")] if local_ids else []
        except ValueError as e:
            raise LayoutError(f"Input string is invalid: {mesh_str} ({e})") from None
        if any(size <= 0 for size in sizes):
            raise LayoutError(f"mesh dimension sizes must be positive, got {sizes} in {mesh_str}")
        if math.prod(sizes) != len(ids):
            raise LayoutError(f"mesh size doesn't match number of devices: {mesh_str}")
        devices = local_devices.split(",") if local_devices else []
        for d in devices:
            if not _FULL_DEVICE.match(d):
                raise LayoutError(f"Failed to either identify host or device type: {d!r} in {mesh_str}")
        global_devices = parts[5].split(",") if len(parts) == 6 and parts[5] else None
        return cls(list(names), np.array(ids).reshape(sizes), local, devices, name, global_devices)

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Mesh) and self._string == other._string)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Mesh.from_string({self._string})"

    __str__ = __repr__

    def __reduce__(self):
        return Mesh.from_string, (self._string,)

    def __copy__(self):  # an immutable value (a copy would also lose a controller mesh's session)
        return self

    def __deepcopy__(self, memo):
        return self

    # -- what the executor needs ---------------------------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        """The torch device that holds this client's components (virtual CPUs all live on `cpu`).

        spmd keeps the components of all local devices stacked in one tensor, so they must share a torch
        device: several GPUs are driven with one process per GPU (see the multi-client guide).
        """
        if self._torch_device is None:
            devices = {_to_torch_device(d) for d in self._local_devices}
            if len(devices) != 1:
                raise NotImplementedError(
                    f"the local devices of {self!r} map to several torch devices {sorted(map(str, devices))}; "
                    "spmd runs one torch device per process: launch one process per GPU with torchrun")
            self._torch_device = devices.pop()
        return self._torch_device

    def axis_index(self, dim_name: str) -> int:
        """The position of mesh dimension `dim_name` in `dim_names`."""
        return self._dim_index[dim_name]

    def is_fully_local(self) -> bool:
        """True when this process holds every device of the mesh (the in-process collective backend)."""
        return self._local_ids == self._global_ids


def _to_torch_device(device: str) -> torch.device:
    kind, index = short_device_name(device).split(":")
    if kind == "CPU":
        return torch.device("cpu")
    if kind == "GPU":
        index_in_job = local_cuda_index()
        if index_in_job is not None:  # multi-client: one GPU per process, cuda:LOCAL_RANK
            return torch.device("cuda", index_in_job)
        # like TF's logical GPUs: more GPU devices than CUDA devices are virtual devices sharing them
        count = torch.cuda.device_count()
        return torch.device("cuda", int(index) % count if count else int(index))
    raise NotImplementedError(f"spmd has no torch backend for {kind} devices ({device})")


def create_mesh(mesh_dims: Sequence[tuple[str, int]] | dict[str, int] | None = None, mesh_name: str = "",
                devices: Iterable[str] | None = None, device_type: str | None = None) -> Mesh:
    """Creates a single-client mesh.

    Args:
      mesh_dims: a list of `(name, size)` pairs or a dict; `None` means one dimension `'x'` over all devices,
        and one size of `-1` takes all the devices left (all: those `initialize_accelerator_system` made, as in TF).
      mesh_name: an optional name for the mesh.
      devices: device names such as `'CPU:0'` (a virtual CPU device: any number, nothing to configure) or
        `'cuda:0'`/`'GPU:0'`. Defaults to as many devices of `device_type` as the mesh needs (all visible GPUs
        for `'GPU'` when `mesh_dims` is None).
      device_type: `'CPU'` (default) or `'GPU'`.

    Returns:
      A `Mesh` whose global device ids are `0..n-1` in row-major order, all local.

    Raises:
      ValueError: when the number of devices does not match the mesh shape, or they conflict with `device_type`.

    >>> print(create_mesh([("x", 2)], devices=["CPU:0", "CPU:1"]))
    Mesh.from_string(|x=2|0,1|0,1|/job:localhost/replica:0/task:0/device:CPU:0,/job:localhost/replica:0/task:0/device:CPU:1)
    """
    dims = list(mesh_dims.items()) if isinstance(mesh_dims, dict) else list(mesh_dims or [])
    for dim in dims:
        if not (isinstance(dim, (tuple, list)) and len(dim) == 2 and isinstance(dim[0], str)
                and isinstance(dim[1], int) and not isinstance(dim[1], bool)):
            raise LayoutError(f"mesh_dims must be (name, size) pairs or a dict, got {mesh_dims!r}")
        if dim[1] == 0 or dim[1] < -1:
            raise LayoutError(f"mesh dimension {dim[0]!r} has size {dim[1]}: sizes must be positive (or -1 once, "
                              f"for all the devices left), got mesh_dims {mesh_dims!r}")
    wanted_type = _device_type(device_type, device_type) if device_type else None
    if devices is None:
        devices = _default_devices(dims, wanted_type or "CPU")
    devices = [canonical_device(d) for d in devices]
    if wanted_type and any(_FULL_DEVICE.match(d).group(4) != wanted_type for d in devices):
        raise LayoutError(f"Conflicting devices {devices} and device_type {device_type}")
    if not dims:
        dims = [("x", len(devices))]
    free = [i for i, (_, size) in enumerate(dims) if size == -1]
    if len(free) > 1:
        raise LayoutError(f"only one mesh dimension may have size -1 (all the devices left), got mesh_dims {dims}")
    known = math.prod(s for _, s in dims if s != -1)
    if len(free) == 1 and known > 0 and len(devices) % known == 0:
        dims[free[0]] = (dims[free[0]][0], len(devices) // known)
    shape = [size for _, size in dims]
    if len(devices) != math.prod(shape) or any(s <= 0 for s in shape):
        raise LayoutError(f"length of devices ({len(devices)}) must be equal to total size of the mesh of shape "
                          f"{shape}")
    ids = np.arange(len(devices)).reshape(shape)
    return Mesh([name for name, _ in dims], ids, list(range(len(devices))), devices, mesh_name)


_DEFAULT_MESHES = threading.local()  # `.meshes`: the meshes of this thread's open `default_mesh` scopes, innermost last


def get_default_mesh() -> Mesh | None:
    """The innermost `default_mesh` scope's mesh, or None outside every scope."""
    meshes = getattr(_DEFAULT_MESHES, "meshes", None)
    return meshes[-1] if meshes else None


def push_default_mesh(mesh: Mesh) -> None:
    """Makes `mesh` what `get_default_mesh()` returns until the matching `pop_default_mesh()` (`spmd.default_mesh`
    is the public scope, which also makes torch's factories create DTensors)."""
    if not hasattr(_DEFAULT_MESHES, "meshes"):
        _DEFAULT_MESHES.meshes = []
    _DEFAULT_MESHES.meshes.append(mesh)


def pop_default_mesh() -> None:
    _DEFAULT_MESHES.meshes.pop()


def _default_devices(dims: list, device_type: str) -> list[str]:
    if device_type == "GPU":
        count = torch.cuda.device_count()
    elif dims and all(size > 0 for _, size in dims):
        count = math.prod(size for _, size in dims)
        if count > MAX_VIRTUAL_DEVICES:
            raise LayoutError(f"a mesh of shape {[size for _, size in dims]} has {count:,} devices; this process "
                              f"holds every virtual device's component, and at most {MAX_VIRTUAL_DEVICES:,} of them")
    else:  # all of them: the devices `initialize_accelerator_system` made (one virtual CPU device by default)
        state = current_client()
        count = state.num_local if state is not None and state.device_type == device_type else 1
    return [f"{device_type}:{i}" for i in range(count)]
