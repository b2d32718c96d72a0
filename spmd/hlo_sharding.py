"""XLA's HLO shardings as values: the text format, the `OpSharding` proto's fields, and their mapping to the
per-axis mesh dims of a `Mesh` (what `Layout.to_hlo_sharding`/`from_hlo_sharding` use).

A tiled sharding (`{devices=[2,1,4]... last_tile_dim_replicate}`) splits tensor axis `i` into `tile_dims[i]`
tiles; the tile at multi-index `t` lives on device `devices[ravel(t)]`. Trailing tile dims that are not tensor
axes are subgroups: with `last_tile_dim_replicate` the devices along the last one hold copies of one tile, and
`last_tile_dims={manual, replicated}` names the kind of each trailing subgroup dim. XLA writes a device array
that is an iota reshaped and transposed compactly: `<=[2,4]T(1,0)` is `arange(8).reshape(2, 4).T`, flattened.

>>> s = HloSharding.parse("{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}")
>>> s.tile_dims, s.devices[:4], s.to_text()
((4, 1, 2), (0, 4, 1, 5), '{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}')
>>> s == HloSharding.parse(s.to_text())
True
>>> mesh = create_mesh([("x", 2), ("y", 4)])
>>> to_mesh_axes(s, mesh)
('y', None)
>>> from_mesh_axes(mesh, ("y", None)) == s
True
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import re
from typing import Any, Sequence

import numpy as np

from spmd.errors import LayoutError
from spmd.mesh import Mesh, axis_dims


class OpShardingType(enum.IntEnum):
    """`OpSharding.Type`, numbered as XLA numbers it."""
    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    OTHER = 3  # tiled
    MANUAL = 4
    UNKNOWN = 5
    UNREDUCED = 6


_SUBGROUP_NAMES = {OpShardingType.MANUAL: "manual", OpShardingType.REPLICATED: "replicated"}
_SUBGROUP_TYPES = {name: kind for kind, name in _SUBGROUP_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class OpSharding:
    """The fields of XLA's `OpSharding` proto that describe the sharding of one array (not of a tuple).

    A tiled sharding gives its device array either explicitly (`tile_assignment_devices`) or as an iota
    reshaped to `iota_reshape_dims` and transposed by `iota_transpose_perm`.
    """
    type: OpShardingType = OpShardingType.REPLICATED
    tile_assignment_dimensions: tuple[int, ...] = ()
    tile_assignment_devices: tuple[int, ...] = ()
    replicate_on_last_tile_dim: bool = False
    last_tile_dims: tuple[OpShardingType, ...] = ()
    iota_reshape_dims: tuple[int, ...] = ()
    iota_transpose_perm: tuple[int, ...] = ()

    def __post_init__(self):
        _set(self, "type", _sharding_type(self.type))
        for name in ("tile_assignment_dimensions", "tile_assignment_devices", "iota_reshape_dims",
                     "iota_transpose_perm"):
            _set(self, name, tuple(int(v) for v in getattr(self, name)))
        _set(self, "replicate_on_last_tile_dim", bool(self.replicate_on_last_tile_dim))
        _set(self, "last_tile_dims", tuple(_sharding_type(t) for t in self.last_tile_dims))

    @classmethod
    def of(cls, proto: Any) -> "OpSharding":
        """Reads the fields of any object that has them: jax's `xla_client.OpSharding`, a protobuf message.

        >>> OpSharding.of(OpSharding(3, [2, 2], iota_reshape_dims=[4], iota_transpose_perm=[0])).type.name
        'OTHER'
        """
        if isinstance(proto, OpSharding):
            return proto
        if not hasattr(proto, "type"):
            raise TypeError(f"expected an HLO sharding text or an OpSharding (an object with the proto's fields "
                            f"type, tile_assignment_dimensions, ...), got {type(proto).__name__} {proto!r}")
        return cls(**{field.name: getattr(proto, field.name, field.default)
                      for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class HloSharding:
    """One array's HLO sharding: `type` REPLICATED, MANUAL, MAXIMAL (`devices` holds the one device) or OTHER
    (tiled: `tile_dims`, the explicit `devices` in row-major order over them, and the trailing subgroup dims
    described by `replicate_on_last_tile_dim` or `last_tile_dims`).

    Equal values mean equal shardings however the text wrote the devices (a list or an iota).
    """
    type: OpShardingType
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    replicate_on_last_tile_dim: bool = False
    last_tile_dims: tuple[OpShardingType, ...] = ()

    def __post_init__(self):
        _set(self, "type", _sharding_type(self.type))
        _set(self, "tile_dims", tuple(int(d) for d in self.tile_dims))
        _set(self, "devices", tuple(int(d) for d in self.devices))
        _set(self, "replicate_on_last_tile_dim", bool(self.replicate_on_last_tile_dim))
        _set(self, "last_tile_dims", tuple(_sharding_type(t) for t in self.last_tile_dims))
        problem = _tiled_problem(self) if self.type == OpShardingType.OTHER else _untiled_problem(self)
        if problem:
            raise LayoutError(f"invalid HLO sharding {self!r}: {problem}")

    # -- reading -------------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "HloSharding":
        """Parses XLA's text: `{replicated}`, `{manual}`, `{maximal device=N}`, `{devices=[dims]<ids or iota>}`
        with an optional `last_tile_dim_replicate` or `last_tile_dims={...}` (a `metadata={...}` is skipped).

        >>> HloSharding.parse("{devices=[2,4]<=[8]}") == HloSharding.parse("{devices=[2,4]0,1,2,3,4,5,6,7}")
        True
        """
        if not isinstance(text, str):
            raise TypeError(f"an HLO sharding text must be a str, got {type(text).__name__}")
        body = text.strip()
        if not (body.startswith("{") and body.endswith("}")):
            raise LayoutError(f"cannot parse HLO sharding {text!r}: XLA writes one in braces, such as "
                              "'{replicated}' or '{devices=[2,1]0,1}'")
        body = body[1:-1].strip()
        if body.startswith("{"):
            raise LayoutError(f"HLO sharding {text!r} is a tuple sharding (one per element of a tuple); a Layout "
                              "describes one array: convert each element's sharding")
        return _build(_attributes(body, text), text)

    @classmethod
    def from_op_sharding(cls, proto: Any) -> "HloSharding":
        """The sharding an `OpSharding` (or any object with its fields, such as jax's proto) describes."""
        op = OpSharding.of(proto)
        if op.type in (OpShardingType.REPLICATED, OpShardingType.MANUAL):
            return cls(op.type)
        if op.type == OpShardingType.MAXIMAL:
            return cls(op.type, devices=op.tile_assignment_devices)
        if op.type != OpShardingType.OTHER:
            raise LayoutError(f"an OpSharding of type {op.type.name} has no Layout: spmd reads REPLICATED, MAXIMAL, "
                              "MANUAL and OTHER (tiled) shardings of one array")
        devices = op.tile_assignment_devices
        if op.iota_reshape_dims and not devices:
            devices = _iota_devices(op.iota_reshape_dims, op.iota_transpose_perm, op.tile_assignment_dimensions)
        return cls(op.type, op.tile_assignment_dimensions, devices, op.replicate_on_last_tile_dim,
                   op.last_tile_dims)

    # -- members -------------------------------------------------------------------------------------------------
    @property
    def num_subgroup_dims(self) -> int:
        """How many trailing tile dims are subgroups (replicated or manual), not tensor axes."""
        return len(self.last_tile_dims) + self.replicate_on_last_tile_dim

    @property
    def data_tile_dims(self) -> tuple[int, ...]:
        """The number of tiles along each tensor axis."""
        return self.tile_dims[:len(self.tile_dims) - self.num_subgroup_dims]

    def subgroups(self) -> tuple[tuple[OpShardingType, int], ...]:
        """The kind and size of each trailing subgroup dim."""
        types = (OpShardingType.REPLICATED,) if self.replicate_on_last_tile_dim else self.last_tile_dims
        return tuple(zip(types, self.tile_dims[len(self.data_tile_dims):]))

    def iota(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """`(reshape_dims, transpose_perm)` in XLA's canonical form if `devices` is an iota reshaped and transposed.

        >>> HloSharding.parse("{devices=[2,4]0,4,1,5,2,6,3,7}").iota()
        ((2, 4), (1, 0))
        """
        return _find_iota(self.devices) if self.type == OpShardingType.OTHER else None

    # -- writing -------------------------------------------------------------------------------------------------
    def to_text(self, iota: bool = True) -> str:
        """XLA's text; the device array as an iota when it is one, unless `iota=False` (an explicit list, as
        PyTorch/XLA prints it).

        >>> HloSharding.parse("{devices=[2,1,2]<=[4] last_tile_dim_replicate}").to_text(iota=False)
        '{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}'
        """
        if self.type != OpShardingType.OTHER:
            return f"{{maximal device={self.devices[0]}}}" if self.type == OpShardingType.MAXIMAL else \
                f"{{{self.type.name.lower()}}}"
        found = self.iota() if iota else None
        devices = _join(self.devices) if found is None else _iota_text(*found)
        suffix = " last_tile_dim_replicate" if self.replicate_on_last_tile_dim else ""
        if self.last_tile_dims:
            suffix += " last_tile_dims={" + ", ".join(_SUBGROUP_NAMES[t] for t in self.last_tile_dims) + "}"
        return f"{{devices=[{_join(self.tile_dims)}]{devices}{suffix}}}"

    def to_op_sharding(self, iota: bool = True) -> OpSharding:
        """The proto's fields; a tiled device array as iota fields when it is one, unless `iota=False`."""
        if self.type != OpShardingType.OTHER:
            return OpSharding(self.type, tile_assignment_devices=self.devices)
        found = self.iota() if iota else None
        return OpSharding(self.type, self.tile_dims, self.devices if found is None else (),
                          self.replicate_on_last_tile_dim, self.last_tile_dims, *(found or ((), ())))

    def __str__(self) -> str:
        return self.to_text()


def as_hlo_sharding(sharding: Any) -> HloSharding:
    """An `HloSharding` from XLA's text, an `HloSharding`, or an `OpSharding`-like object."""
    if isinstance(sharding, HloSharding):
        return sharding
    if isinstance(sharding, str):
        return HloSharding.parse(sharding)
    return HloSharding.from_op_sharding(sharding)


# -- layouts <-> shardings --------------------------------------------------------------------------------------
def from_mesh_axes(mesh: Mesh, axes: Sequence, device_ids=None) -> HloSharding:
    """The sharding of a tensor whose axis `i` is split over mesh dim `axes[i]` (None: not split; a tuple: split
    over those mesh dims, row-major with the first major, as XLA tiles an axis over merged mesh axes).

    Device ids are the mesh's global ids, or `device_ids` (one per mesh position, in row-major mesh order; JAX
    numbers a mesh's devices by position, `range(mesh.size)`). The mesh dims no axis names become the replicated
    last tile dim, each copy group sorted as XLA keeps it; a layout that splits nothing (mesh dims of size 1
    split nothing) is `{replicated}`.

    >>> from_mesh_axes(create_mesh([("x", 2), ("y", 4)]), [None, "x"]).to_text()
    '{devices=[1,2,4]<=[8] last_tile_dim_replicate}'
    """
    ids = _device_ids(_checked_mesh(mesh), device_ids)
    axes = _checked_axes(mesh, axes)
    tiles = tuple(mesh.shard_count(a) for a in axes)
    if math.prod(tiles) == 1:
        return HloSharding(OpShardingType.REPLICATED)
    sharded = [mesh.axis_index(d) for a in axes for d in axis_dims(a)]  # tile order: row-major over these
    rest = [k for k in range(ids.ndim) if k not in sharded]
    copies = math.prod(ids.shape[k] for k in rest)
    groups = np.sort(ids.transpose(sharded + rest).reshape(-1, copies), axis=1)
    if copies == 1:
        return HloSharding(OpShardingType.OTHER, tiles, groups.ravel())
    return HloSharding(OpShardingType.OTHER, tiles + (copies,), groups.ravel(), replicate_on_last_tile_dim=True)


def to_mesh_axes(sharding: Any, mesh: Mesh, rank: int | None = None, device_ids=None) -> tuple:
    """Per tensor axis, the mesh dim `sharding` splits it over (None: not split; a tuple of mesh dims where the
    tiles run row-major over several, the first major); the inverse of `from_mesh_axes`. `rank` is the tensor's
    rank: needed for `{replicated}`, checked otherwise. An axis split into one tile reads as None (a mesh dim of
    size 1 leaves no trace in XLA's sharding).

    Raises:
      LayoutError: for what a Layout cannot express (maximal on more than one device, manual, an axis split over
        part of a mesh dim or over several in no row-major order, devices not of the mesh, a rank that differs),
        naming the part.

    >>> to_mesh_axes("{devices=[4,2,1]<=[2,4]T(1,0)}", create_mesh([("x", 2), ("y", 4)]))
    ('y', 'x', None)
    """
    s = as_hlo_sharding(sharding)
    where = f"XLA sharding {s.to_text()} on {_describe(_checked_mesh(mesh))}"
    if s.type == OpShardingType.REPLICATED:
        return (None,) * _rank_of(rank, where)
    if s.type == OpShardingType.MAXIMAL:
        return _maximal_axes(s, mesh, rank, device_ids, where)
    if s.type == OpShardingType.MANUAL:
        raise LayoutError(f"{where}: a manual sharding leaves each device its own values (inside a shard_map), "
                          "which no Layout describes; convert the values after the manual region")
    manual = [size for kind, size in s.subgroups() if kind == OpShardingType.MANUAL and size > 1]
    if manual:
        raise LayoutError(f"{where}: its last tile dims hold manual subgroups of {manual} devices (each keeps its "
                          "own values), which no Layout describes; convert the values after the manual region")
    data = s.data_tile_dims
    if rank is not None and _rank_of(rank, where) != len(data):
        raise LayoutError(f"{where}: it tiles {len(data)} tensor axes but the tensor has rank {rank}")
    positions = _mesh_positions(s, mesh, _device_ids(mesh, device_ids), where)
    tile_index = np.indices(s.tile_dims).reshape(len(s.tile_dims), -1)
    return tuple(_mesh_dim_of(axis, count, tile_index[axis], positions, mesh, where)
                 for axis, count in enumerate(data))


def _maximal_axes(s: HloSharding, mesh: Mesh, rank, device_ids, where: str) -> tuple[None, ...]:
    ids = _device_ids(mesh, device_ids).ravel().tolist()
    if ids == list(s.devices):
        return (None,) * _rank_of(rank, where)
    raise LayoutError(f"{where}: a maximal sharding puts the whole tensor on device {s.devices[0]}, while a Layout "
                      f"spreads it over every device of its mesh (ids {ids}); use a mesh of that one device")


def _mesh_dim_of(axis: int, count: int, tile_index: np.ndarray, positions: np.ndarray, mesh: Mesh,
                 where: str) -> str | tuple[str, ...] | None:
    """The mesh dim(s) whose coordinates, row-major, are the tile index along tensor axis `axis` for every
    device."""
    if count == 1:
        return None
    grid = np.empty(mesh.size, dtype=np.int64)
    grid[positions] = tile_index
    grid = grid.reshape(mesh.shape())
    varying = [k for k in range(grid.ndim) if np.any(np.diff(grid, axis=k))]
    coords = np.indices(grid.shape)
    for order in itertools.permutations(varying):
        index = np.zeros_like(grid)
        for k in order:
            index = index * grid.shape[k] + coords[k]
        if np.array_equal(grid, index):
            names = tuple(mesh.dim_names[k] for k in order)
            return names if len(names) > 1 else names[0]
    raise LayoutError(f"{where}: {_why_not(axis, count, grid, varying, mesh)}")


def _why_not(axis: int, count: int, grid: np.ndarray, varying: list[int], mesh: Mesh) -> str:
    limit = ("a Layout splits a tensor axis over whole mesh dims, its tiles row-major over them in some order of "
             "the mesh dims")
    names = [mesh.dim_names[k] for k in varying]
    if len(varying) > 1:
        sizes = ", ".join(f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape()))
        return (f"tensor axis {axis} is split {count} ways over mesh dims {names} ({sizes}) but its tiles do not "
                f"run row-major over them in any order: {limit}")
    name, size = names[0], grid.shape[varying[0]]
    if count != size:
        return (f"tensor axis {axis} is split {count} ways over a subset of mesh dim {name!r} (size {size}): "
                f"{limit}")
    order = np.moveaxis(grid, varying[0], 0).reshape(size, -1)[:, 0].tolist()
    return (f"the {count} tiles of tensor axis {axis} lie along mesh dim {name!r} in the order {order} of its "
            "coordinates, not in order: pass the device_ids that number the mesh as the sharding does")


def _mesh_positions(s: HloSharding, mesh: Mesh, ids: np.ndarray, where: str) -> np.ndarray:
    """The row-major mesh position of each device of `s.devices`."""
    position = {int(d): i for i, d in enumerate(ids.ravel())}
    unknown = sorted(set(s.devices) - position.keys())
    if unknown:
        raise LayoutError(f"{where}: devices {unknown} are not in this mesh, whose device ids are "
                          f"{list(position)}; pass device_ids= to number the mesh's devices as the sharding does")
    if len(s.devices) != mesh.size:
        raise LayoutError(f"{where}: the sharding uses {len(s.devices)} devices but the mesh has {mesh.size}")
    return np.array([position[d] for d in s.devices], dtype=np.int64)


def _device_ids(mesh: Mesh, device_ids) -> np.ndarray:
    """The device id of each mesh position, shaped like the mesh."""
    if device_ids is None:
        return mesh.global_device_ids()
    ids = np.asarray(device_ids)
    if ids.size != mesh.size or (ids.ndim > 1 and list(ids.shape) != mesh.shape()):
        raise LayoutError(f"device_ids of shape {list(ids.shape)} do not fit {_describe(mesh)}: give one id per "
                          f"device, {mesh.size} in all, in row-major mesh order")
    if not np.issubdtype(ids.dtype, np.integer) or len(set(ids.ravel().tolist())) != ids.size or ids.min() < 0:
        raise LayoutError(f"device_ids must be distinct non-negative integers, got {ids.ravel().tolist()}")
    return ids.reshape(mesh.shape()).astype(np.int64)


def _checked_mesh(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"expected a spmd Mesh, got {type(mesh).__name__} {mesh!r}")
    return mesh


def _checked_axes(mesh: Mesh, axes: Sequence) -> tuple:
    axes = tuple(axes)
    used = [d for a in axes for d in axis_dims(a)]
    for a in used:
        if a not in mesh:
            raise LayoutError(f"{a!r} is not a dim of {_describe(mesh)}: an axis names a mesh dim (or a tuple of "
                              "them) or is None")
    if len(set(used)) != len(used):
        raise LayoutError(f"axes {list(axes)} name a mesh dim twice; each mesh dim splits at most one tensor axis")
    return axes


def _rank_of(rank, where: str) -> int:
    if rank is None:
        raise LayoutError(f"{where}: the sharding does not tell the tensor's rank; pass rank=")
    if not isinstance(rank, int) or rank < 0:
        raise LayoutError(f"rank must be a non-negative integer, got {rank!r}")
    return rank


def _describe(mesh: Mesh) -> str:
    dims = ",".join(f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape()))
    return f"mesh {mesh.name + '|' if mesh.name else ''}{dims}"


# -- iota device arrays -----------------------------------------------------------------------------------------
def _iota_devices(reshape_dims: Sequence[int], perm: Sequence[int], tile_dims: Sequence[int] = ()) -> tuple:
    """`arange(N).reshape(reshape_dims).transpose(perm)`, flattened (no `perm`: no transpose)."""
    perm = tuple(perm) or tuple(range(len(reshape_dims)))
    if sorted(perm) != list(range(len(reshape_dims))) or min(reshape_dims, default=0) < 1:
        raise LayoutError(f"invalid iota <={list(reshape_dims)}T{perm}: the transpose must permute the "
                          f"{len(reshape_dims)} positive reshape dims")
    if tile_dims and math.prod(tile_dims) != math.prod(reshape_dims):
        raise LayoutError(f"an iota of {math.prod(reshape_dims)} devices ({list(reshape_dims)}) cannot fill "
                          f"{math.prod(tile_dims)} tiles {list(tile_dims)}")
    return tuple(np.arange(math.prod(reshape_dims)).reshape(reshape_dims).transpose(perm).ravel().tolist())


def _find_iota(devices: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The canonical `(reshape_dims, perm)` whose iota is `devices`, or None.

    Read from the minor end: each transposed axis is a run `0, w, 2w, ...` at positions `0, b, 2b, ...` where `b`
    is the size of the axes read so far; the axes ordered by stride `w` give the reshape dims. Each run is as long
    as it goes, so no axis has size 1 and no two neighbours stay neighbours in the reshape (they would have been
    one run): XLA's canonical form (`[3,4,5]T(1,2,0)` is written `[3,20]T(1,0)`, `[3,4,5]` is `[60]`).
    """
    flat = np.asarray(devices, dtype=np.int64)
    n = flat.size
    if not np.array_equal(np.sort(flat), np.arange(n)):
        return None
    if n == 1:
        return (1,), (0,)
    axes, block = [], 1  # (stride, size) from the minor-most transposed axis outwards
    while block < n:
        stride, size = int(flat[block]), 1
        while block * size < n and flat[block * size] == size * stride:
            size += 1
        axes.append((stride, size))
        block *= size
    order = sorted(range(len(axes)), key=lambda i: -axes[i][0])  # reshape dims, major first
    reshape = tuple(axes[i][1] for i in order)
    perm = tuple(order.index(i) for i in reversed(range(len(axes))))
    return (reshape, perm) if _iota_devices(reshape, perm) == tuple(flat.tolist()) else None


def _iota_text(reshape: Sequence[int], perm: Sequence[int]) -> str:
    return f"<=[{_join(reshape)}]" + (f"T({_join(perm)})" if len(reshape) > 1 else "")


# -- text -------------------------------------------------------------------------------------------------------
_ATTRIBUTE = re.compile(r"""
    (?P<flag> replicated | manual | last_tile_dim_replicate ) (?![\w=])
  | maximal \s+ device= (?P<device> \d+ )
  | devices= \[ (?P<dims> [^\]]* ) \] \s*
      (?: <= \[ (?P<reshape> [^\]]* ) \] (?: T\( (?P<perm> [^)]* ) \) )? | (?P<list> \d+ (?: \s*,\s* \d+ )* ) )
  | last_tile_dims= \{ (?P<types> [^}]* ) \}
  | (?P<metadata> metadata= )
""", re.X)


def _attributes(body: str, text: str) -> dict[str, re.Match]:
    """The attributes of a single sharding's body, by name (a flag by its word)."""
    found, pos = {}, 0
    while pos < len(body):
        match = _ATTRIBUTE.match(body, pos)
        if match is None:
            raise LayoutError(f"cannot parse HLO sharding {text!r} at {body[pos:]!r}: expected replicated, manual, "
                              "maximal device=N, devices=[...]<ids or <=[...]T(...)>, last_tile_dim_replicate or "
                              "last_tile_dims={...}")
        pos = _skip_braces(body, match.end(), text) if match["metadata"] else match.end()
        name = match["flag"] or next(k for k in ("device", "dims", "types", "metadata") if match[k] is not None)
        if name in found:
            raise LayoutError(f"HLO sharding {text!r} gives {name} twice")
        found[name] = match
        pos = len(body) - len(body[pos:].lstrip())
    return found


def _build(found: dict[str, re.Match], text: str) -> HloSharding:
    kinds = [k for k in ("replicated", "manual", "device", "dims") if k in found]
    if len(kinds) != 1:
        raise LayoutError(f"HLO sharding {text!r} must be exactly one of replicated, manual, maximal or "
                          f"devices=[...], got {kinds or 'none'}")
    extras = [k for k in ("last_tile_dim_replicate", "types") if k in found]
    if extras and kinds != ["dims"]:
        raise LayoutError(f"in HLO sharding {text!r}, last_tile_dim_replicate and last_tile_dims only qualify "
                          "devices=[...]")
    if kinds == ["replicated"]:
        return HloSharding(OpShardingType.REPLICATED)
    if kinds == ["manual"]:
        return HloSharding(OpShardingType.MANUAL)
    if kinds == ["device"]:
        return HloSharding(OpShardingType.MAXIMAL, devices=(int(found["device"]["device"]),))
    match = found["dims"]
    dims = _ints(match["dims"], text)
    if match["list"] is not None:
        devices = _ints(match["list"], text)
    else:
        devices = _iota_devices(_ints(match["reshape"], text), _ints(match["perm"] or "", text), dims)
    types = _subgroup_types(found["types"]["types"], text) if "types" in found else ()
    return HloSharding(OpShardingType.OTHER, dims, devices, "last_tile_dim_replicate" in found, types)


def _ints(text: str, whole: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",")) if text.strip() else ()
    except ValueError:
        raise LayoutError(f"cannot parse HLO sharding {whole!r}: {text!r} is not a list of integers") from None


def _subgroup_types(text: str, whole: str) -> tuple[OpShardingType, ...]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in _SUBGROUP_TYPES]
    if unknown:
        raise LayoutError(f"HLO sharding {whole!r}: last_tile_dims may hold manual and replicated, got {unknown}")
    return tuple(_SUBGROUP_TYPES[n] for n in names)


def _skip_braces(body: str, pos: int, text: str) -> int:
    """The position after the `{...}` that starts at `pos` (quoted strings may hold braces)."""
    depth, quoted, i = 0, False, pos
    while i < len(body):
        c = body[i]
        if quoted:
            i += c == "\\"
            quoted = c != '"'
        elif c == '"':
            quoted = True
        elif c in "{}":
            depth += 1 if c == "{" else -1
            if depth == 0:
                return i + 1
        elif depth == 0:
            break
        i += 1
    raise LayoutError(f"cannot parse HLO sharding {text!r}: metadata= must be followed by a balanced {{...}}")


# -- validation -------------------------------------------------------------------------------------------------
def _tiled_problem(s: HloSharding) -> str | None:
    if not s.tile_dims or min(s.tile_dims) < 1:
        return f"tile dims {list(s.tile_dims)} must be positive and at least one"
    if math.prod(s.tile_dims) != len(s.devices):
        return f"{math.prod(s.tile_dims)} tiles {list(s.tile_dims)} but {len(s.devices)} devices"
    if len(set(s.devices)) != len(s.devices) or min(s.devices) < 0:
        return f"devices {list(s.devices)} must be distinct non-negative ids"
    if s.replicate_on_last_tile_dim and s.last_tile_dims:
        return "last_tile_dim_replicate and last_tile_dims exclude each other"
    if s.num_subgroup_dims > len(s.tile_dims):
        return f"{s.num_subgroup_dims} subgroup dims but only {len(s.tile_dims)} tile dims"
    if any(t not in _SUBGROUP_NAMES for t in s.last_tile_dims):
        return f"last_tile_dims may hold MANUAL and REPLICATED, got {[t.name for t in s.last_tile_dims]}"
    return None


def _untiled_problem(s: HloSharding) -> str | None:
    if s.type not in (OpShardingType.REPLICATED, OpShardingType.MANUAL, OpShardingType.MAXIMAL):
        return f"spmd reads REPLICATED, MAXIMAL, MANUAL and OTHER (tiled) shardings, not {s.type.name}"
    if s.tile_dims or s.replicate_on_last_tile_dim or s.last_tile_dims:
        return f"a {s.type.name} sharding has no tile dims"
    wanted = 1 if s.type == OpShardingType.MAXIMAL else 0
    if len(s.devices) != wanted or min(s.devices, default=0) < 0:
        return f"a {s.type.name} sharding names {wanted} device(s), got {list(s.devices)}"
    return None


def _sharding_type(value: Any) -> OpShardingType:
    """A `OpShardingType` from a number, a member, or an enum with that name (jax's `OpSharding.Type`)."""
    try:
        return OpShardingType(int(value))
    except (TypeError, ValueError):
        name = getattr(value, "name", value)
        if isinstance(name, str) and name.upper() in OpShardingType.__members__:
            return OpShardingType[name.upper()]
        raise LayoutError(f"unknown OpSharding type {value!r}: XLA numbers them REPLICATED=0, MAXIMAL=1, TUPLE=2, "
                          "OTHER=3, MANUAL=4, UNKNOWN=5, UNREDUCED=6") from None


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its fields


def _join(values: Sequence[int]) -> str:
    return ",".join(str(int(v)) for v in values)
