"""`Layout`: how each axis of a tensor is sharded over a `Mesh` (the seeds' `dtensor.Layout`).

One sharding spec per tensor axis: the name of a mesh dimension (the axis is split evenly over it), several
mesh dimensions (the axis is split over their product, block index row-major over them in the order given, as
JAX's `P(("x", "y"))`: spec `"x+y"`, or a tuple), or `UNSHARDED`. The tensor is replicated over every mesh
dimension its layout does not name.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spmd import jax_sharding, torch_placements
from spmd.errors import IndivisibleError, LayoutError
from spmd.hlo_sharding import OpSharding, from_mesh_axes, to_mesh_axes
from spmd.mesh import Mesh, axis_dims

UNSHARDED = "unsharded"
MATCH = "match"  # only meaningful in `relayout`: keep the axis as it is
MULTI = "+"  # joins the mesh dims of one spec: "x+y" shards an axis over x (major) and y


class Layout:
    """The sharding of a tensor of rank `len(sharding_specs)` on `mesh`.

    Args:
      sharding_specs: per tensor axis, a mesh dimension name, several (a tuple, or their names joined by `+`:
        the axis is split over their product, row-major in the order given), `UNSHARDED`, or (for `relayout`)
        `MATCH`.
      mesh: the `Mesh`.

    Raises:
      ValueError: if `mesh` is not a Mesh, a spec is unknown, or a mesh dimension is used twice.

    >>> mesh = create_mesh([("x", 2), ("y", 4)])
    >>> layout = Layout(["y", UNSHARDED], mesh)
    >>> layout.num_shards(0), layout.local_shape_from_global_shape([8, 6])
    (4, (2, 6))
    >>> layout.to_string()[:33]
    'sharding_specs:y,unsharded, mesh:'
    >>> both = Layout([("x", "y"), UNSHARDED], mesh)
    >>> both.sharding_specs, both.axes, both.num_shards(0)
    (['x+y', 'unsharded'], (('x', 'y'), None), 8)
    """

    __slots__ = ("_specs", "_mesh", "axes", "outer_axes", "multi_axis", "_dims", "_shards", "_hash", "_string")

    def __init__(self, sharding_specs: Sequence[str | Sequence[str]], mesh: Mesh):
        if not isinstance(mesh, Mesh):
            raise LayoutError(f"mesh is not a valid Mesh object: got {type(mesh).__name__} {mesh!r}.")
        if isinstance(sharding_specs, str) or not all(_is_spec(s) for s in sharding_specs):
            raise LayoutError(f"sharding_specs must be a list of strings (or tuples of mesh dimension names for an "
                              f"axis sharded over several), got {sharding_specs!r}")
        # Per tensor axis: None, the mesh dimension it is sharded over, or a tuple of several (major first).
        axes = tuple(_axis(s, mesh) for s in sharding_specs)
        specs = tuple(s if isinstance(s, str) and MULTI not in s else _spec(a) for s, a in zip(sharding_specs, axes))
        dims = tuple(d for a in axes for d in axis_dims(a) if d != MATCH)
        for name in dims:
            if dims.count(name) > 1:
                raise LayoutError(f"Mesh dimension {name} was repeated in sharding specification {list(specs)}. "
                                  "Mesh dimensions must be unique in a layout.")
        self._specs = specs
        self._mesh = mesh
        self.axes = axes
        self.multi_axis = any(type(a) is tuple for a in axes)
        # what a sharding rule sees of a multi-axis layout: each axis sharded over its major mesh dim only
        self.outer_axes = tuple(a[0] if type(a) is tuple else a for a in axes) if self.multi_axis else axes
        self._dims = dims  # the mesh dims sharding some axis
        self._shards = tuple(_shards(a, mesh) for a in axes)
        self._string = "sharding_specs:" + "".join(s + "," for s in specs) + " mesh:" + mesh.to_string()
        self._hash = None  # hashed when first asked: Dynamo of torch 2.11 cannot trace `hash` (a Layout in a trace)
        if _ON_INNER_AXIS_SHARDED and _shards_an_inner_axis(self._shards):
            _inner_axis_sharded_seen()

    # -- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> "Layout":
        """A layout of `rank` axes replicated on every device of `mesh`."""
        _check_rank(rank)
        return cls([UNSHARDED] * rank, mesh)

    @classmethod
    def batch_sharded(cls, mesh: Mesh, batch_dim: str, rank: int, axis: int = 0) -> "Layout":
        """A layout sharding tensor axis `axis` over mesh dimension `batch_dim`, other axes unsharded."""
        _check_rank(rank)
        if not 0 <= axis < rank:
            raise LayoutError(f"axis {axis} is out of range for a layout of rank {rank}")
        return cls([UNSHARDED] * axis + [batch_dim] + [UNSHARDED] * (rank - axis - 1), mesh)

    @classmethod
    def inner_sharded(cls, mesh: Mesh, inner_dim: str, rank: int) -> "Layout":
        """A layout sharding the last tensor axis over `inner_dim`."""
        return cls.batch_sharded(mesh, inner_dim, rank, axis=rank - 1)

    @classmethod
    def from_axes(cls, axes: Sequence[str | tuple[str, ...] | None], mesh: Mesh) -> "Layout":
        """Builds a layout from per-axis mesh dimension names (a tuple for several), `None` meaning unsharded."""
        return cls([UNSHARDED if a is None else a for a in axes], mesh)

    # -- members -------------------------------------------------------------------------------------------------
    @property
    def sharding_specs(self) -> list[str]:
        return list(self._specs)

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def rank(self) -> int:
        return len(self._specs)

    @property
    def shape(self) -> list[int]:
        """The mesh shape (as in TF; not the tensor shape)."""
        return self._mesh.shape()

    def num_shards(self, idx: int) -> int:
        """How many pieces tensor axis `idx` is split into."""
        if not -self.rank <= idx < self.rank:
            raise LayoutError(f"axis {idx} is out of range for {self!r} of rank {self.rank}")
        return self._shards[idx]

    def num_shards_per_axis(self) -> list[int]:
        return list(self._shards)

    def is_fully_replicated(self) -> bool:
        return all(s == UNSHARDED for s in self._specs)

    def is_batch_parallel(self) -> bool:
        return bool(self._specs) and self._specs[0] != UNSHARDED and all(s == UNSHARDED for s in self._specs[1:])

    def is_single_device(self) -> bool:
        return False

    def local_shape_from_global_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Per-device component shape (floor division, as TF; `check_divisible` raises instead)."""
        return tuple(s if s == -1 else s // n for s, n in zip(global_shape, self.num_shards_per_axis()))

    def global_shape_from_local_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(s * n for s, n in zip(local_shape, self.num_shards_per_axis()))

    def check_concrete(self) -> None:
        """Raises `LayoutError` if an axis is `MATCH`, which only `relayout` understands."""
        if MATCH in self._specs:
            raise LayoutError(
                f"layout {self.sharding_specs} has MATCH on axis {self._specs.index(MATCH)}: MATCH only serves "
                "relayout (keep that axis's sharding); a tensor is created, packed or copied with a mesh dimension "
                "or UNSHARDED on each axis")

    def check_divisible(self, global_shape: Sequence[int]) -> None:
        """Raises `IndivisibleError` unless every sharded axis of `global_shape` splits evenly (and `LayoutError`
        for a `MATCH` axis: see `check_concrete`)."""
        self.check_concrete()
        if len(global_shape) != self.rank:
            raise LayoutError(f"a tensor of shape {list(global_shape)} (rank {len(global_shape)}) cannot take "
                              f"layout {self.sharding_specs} of rank {self.rank}")
        for axis, (size, spec) in enumerate(zip(global_shape, self._specs)):
            n = self.num_shards(axis)
            if size % n:
                raise IndivisibleError(
                    f"axis {axis} of a tensor of shape {list(global_shape)} has size {size}, which does not divide "
                    f"by the {n} shards of mesh dimension{'s' * (MULTI in spec)} {spec!r} (layout "
                    f"{self.sharding_specs}); spmd shards "
                    f"evenly, so pick a size divisible by {n} or leave that axis UNSHARDED")

    def offset_to_shard(self) -> list[tuple[int, ...]]:
        """For each device of the mesh (row-major), the index of the shard it holds along each tensor axis."""
        return [self.shard_index(self._mesh.device_location(device)) for device in range(self._mesh.size)]

    def shard_index(self, location: Sequence[int]) -> tuple[int, ...]:
        """The index of the block the device at mesh coordinates `location` holds, per tensor axis (row-major over
        the mesh dims of an axis sharded over several)."""
        mesh = self._mesh
        out = []
        for axis in self.axes:
            index = 0
            for d in axis_dims(axis):
                index = index * mesh.dim_size(d) + location[mesh.axis_index(d)]
            out.append(index)
        return tuple(out)

    def is_first_replica(self, location) -> bool:
        """Whether the device at mesh coordinates `location` holds the first copy of its shard (coordinate 0 on
        every mesh dimension this layout does not shard): the copy that is read, written and checkpointed."""
        return all(c == 0 for name, c in zip(self._mesh.dim_names, location) if name not in self._dims)

    @property
    def sharded_mesh_dims(self) -> tuple[str, ...]:
        """The mesh dims that shard some axis, in tensor-axis order (major first within an axis)."""
        return self._dims

    def offset_tuple_to_global_index(self, offset_tuple: Sequence[int]) -> int:
        index = 0
        for offset, shards in zip(offset_tuple, self.num_shards_per_axis()):
            index = index * shards + offset
        return index

    def delete(self, dims: int | Sequence[int]) -> "Layout":
        """A new layout without the tensor axes `dims`."""
        dims = [dims] if isinstance(dims, int) else list(dims)
        bad = [d for d in dims if not -self.rank <= d < self.rank]
        if bad:
            raise LayoutError(f"cannot delete axes {bad} from a layout of rank {self.rank} ({self.sharding_specs})")
        drop = {d % self.rank for d in dims}
        return Layout([s for i, s in enumerate(self._specs) if i not in drop], self._mesh)

    # -- JAX and torch.distributed.tensor ------------------------------------------------------------------------
    def to_jax(self, jax_mesh=None):
        """This layout as a `jax.sharding.NamedSharding`: its `PartitionSpec` has one entry per tensor axis (the
        mesh dim, a tuple of several, or None). `jax_mesh` defaults to `self.mesh.to_jax()`; one given must have the mesh's axis
        names and sizes."""
        self.check_concrete()
        if jax_mesh is None:
            jax_mesh = self._mesh.to_jax()
        else:
            jax_sharding.check_same_mesh(jax_mesh, self._mesh.dim_names, self._mesh.shape(), f"layout {self!r}")
        return jax_sharding.named_sharding(jax_mesh, self.axes)

    @classmethod
    def from_jax(cls, sharding, mesh: Mesh | None = None, rank: int | None = None) -> "Layout":
        """The layout of a jax `NamedSharding` or `PartitionSpec` (which needs `mesh`) for a tensor of rank `rank`
        (default: the spec's length; missing trailing entries are unsharded). `mesh` defaults to
        `Mesh.from_jax(sharding.mesh)`.

        Raises:
          LayoutError: an entry is UNCONSTRAINED or names an axis the mesh lacks; or `mesh` does not match the
            sharding's mesh. (An entry of several mesh axes shards the axis over all of them, as in JAX.)
        """
        jax_mesh, spec = jax_sharding.split_sharding(sharding)
        if mesh is None:
            if jax_mesh is None:
                raise LayoutError(f"Layout.from_jax({spec}) needs mesh=: a PartitionSpec names mesh axes but "
                                  "carries no mesh")
            mesh = Mesh.from_jax(jax_mesh)
        elif jax_mesh is not None:
            jax_sharding.check_same_mesh(jax_mesh, mesh.dim_names, mesh.shape(), f"mesh {mesh!r}")
        return cls.from_axes(jax_sharding.axes_from_spec(spec, mesh.dim_names, rank), mesh)

    def to_torch(self) -> tuple:
        """torch DTensor placements, one per mesh dim in the mesh's order: `Shard(i)` where tensor axis i is
        sharded over that dim, else `Replicate()`.

        >>> mesh = create_mesh([("x", 2), ("y", 4)])
        >>> Layout(["y", UNSHARDED], mesh).to_torch()
        (Replicate(), Shard(dim=0))
        """
        self.check_concrete()
        return torch_placements.to_placements(self._mesh.dim_names, self.axes)

    @classmethod
    def from_torch(cls, mesh: Mesh, placements, rank: int) -> "Layout":
        """The layout on `mesh` of a rank-`rank` tensor with torch DTensor `placements` (one per mesh dim).

        Raises:
          LayoutError: a `Partial` placement (a pending reduction: convert the tensor with
            `spmd.interop.from_torch_dtensor`) or a `_StridedShard`. `Shard(i)` on several mesh dims splits axis
            i over them in mesh order (the first major), as torch does.

        >>> from torch.distributed.tensor import Replicate, Shard
        >>> Layout.from_torch(create_mesh([("x", 2), ("y", 4)]), [Shard(1), Replicate()], rank=2).sharding_specs
        ['unsharded', 'x']
        """
        _check_rank(rank)
        return cls.from_axes(torch_placements.layout_axes(mesh.dim_names, placements, rank), mesh)

    # -- XLA HLO shardings ---------------------------------------------------------------------------------------
    def to_hlo_sharding(self, device_ids=None) -> str:
        """XLA's text for this layout, as JAX prints it for the same `NamedSharding`. Devices are numbered by the
        mesh's global ids, or by `device_ids` (one per mesh position, in row-major mesh order).

        >>> mesh = create_mesh([("x", 2), ("y", 4)])
        >>> Layout(["y", UNSHARDED], mesh).to_hlo_sharding()
        '{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}'
        >>> Layout(["x", "y"], mesh).to_hlo_sharding(device_ids=[7, 6, 5, 4, 3, 2, 1, 0])
        '{devices=[2,4]7,6,5,4,3,2,1,0}'
        """
        self.check_concrete()
        return from_mesh_axes(self._mesh, self.axes, device_ids).to_text()

    def to_op_sharding(self, device_ids=None) -> OpSharding:
        """This layout as the fields of XLA's `OpSharding` proto (see `to_hlo_sharding`).

        >>> Layout(["y", "x"], create_mesh([("x", 2), ("y", 4)])).to_op_sharding().iota_transpose_perm
        (1, 0)
        """
        self.check_concrete()
        return from_mesh_axes(self._mesh, self.axes, device_ids).to_op_sharding()

    @classmethod
    def from_hlo_sharding(cls, sharding, mesh: Mesh, device_ids=None, rank: int | None = None) -> "Layout":
        """The layout on `mesh` of XLA's sharding `sharding`: its text, or an `OpSharding`-like object (jax's
        proto). `rank` is needed for `{replicated}` and checked otherwise; `device_ids` as in `to_hlo_sharding`.

        Raises:
          LayoutError: the sharding is maximal (on more than one device) or manual, splits a tensor axis over a
            subset of a mesh dim (or over several, not row-major in some order of them), uses devices not of the
            mesh, or tiles another rank.

        >>> Layout.from_hlo_sharding("{devices=[1,2,4]<=[8] last_tile_dim_replicate}",
        ...                          create_mesh([("x", 2), ("y", 4)])).sharding_specs
        ['unsharded', 'x']
        """
        return cls.from_axes(to_mesh_axes(sharding, mesh, rank, device_ids), mesh)

    # -- string format, value semantics --------------------------------------------------------------------------
    def to_string(self) -> str:
        """TF's format: `sharding_specs:x,unsharded, mesh:<mesh string>` (every spec followed by a comma)."""
        return self._string

    @classmethod
    def from_string(cls, layout_str: str) -> "Layout":
        if not isinstance(layout_str, str):
            raise TypeError(f"Layout.from_string expects a str, got {type(layout_str).__name__}")
        head, sep, mesh_str = layout_str.partition(" mesh:")
        if not sep or not head.startswith("sharding_specs:"):
            raise LayoutError(f"Expected 'sharding_specs:<specs>, mesh:<mesh>', got {layout_str!r}")
        specs = head[len("sharding_specs:"):]
        if specs and not specs.endswith(","):
            raise LayoutError(f"every sharding spec must be followed by ',' in {layout_str!r}")
        return cls([s for s in specs.split(",")[:-1]] if specs else [], Mesh.from_string(mesh_str))

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Layout) and self._specs == other._specs
                                 and self._mesh == other._mesh)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self._specs, self._mesh))
        return self._hash

    def __repr__(self) -> str:
        return f"Layout.from_string({self._string})"

    __str__ = __repr__

    def __reduce__(self):
        return Layout.from_string, (self._string,)

    def __copy__(self):  # an immutable value: compared by identity first (torch.compile's guards deep-copy it)
        return self

    def __deepcopy__(self, memo):
        return self


_ON_INNER_AXIS_SHARDED: list = []  # callbacks waiting for the first such layout (see `on_inner_axis_sharded`)


def on_inner_axis_sharded(callback) -> None:
    """Calls `callback()` once, when a layout first shards an inner axis (neither the first nor the last: `[S, B, E]`
    with B sharded): the rule engine's handling of such layouts costs every op that could meet one, so it is
    switched on only when one exists (engine/rules/sharded_folds.py)."""
    _ON_INNER_AXIS_SHARDED.append(callback)


def _shards_an_inner_axis(shards: tuple) -> bool:
    """Whether an axis other than the first and the last is sharded: behind a whole one, or behind a sharded one
    (two sharded axes fold into one block per device only where the first is one row per device)."""
    return any(shards[i] > 1 for i in range(1, len(shards) - 1))


def _inner_axis_sharded_seen() -> None:
    if torch.compiler.is_compiling():  # (a trace cannot register kernels: the next eager layout does)
        return
    while _ON_INNER_AXIS_SHARDED:
        _ON_INNER_AXIS_SHARDED.pop()()


def _shards(axis, mesh: Mesh) -> int:
    return 2 ** 64 - 1 if axis == MATCH else mesh.shard_count(axis)


def _is_spec(spec) -> bool:
    return isinstance(spec, str) or (isinstance(spec, (tuple, list)) and all(isinstance(d, str) for d in spec))


def _spec(axis) -> str:
    return UNSHARDED if axis is None else MULTI.join(axis_dims(axis))


def _axis(spec, mesh: Mesh):
    """One `Layout.axes` entry from a spec: `"x"`, `"x+y"`, `("x", "y")`, `UNSHARDED` or `MATCH`."""
    if isinstance(spec, str):
        if spec in (UNSHARDED, MATCH) or spec in mesh:
            return None if spec == UNSHARDED else spec
        dims = tuple(spec.split(MULTI)) if MULTI in spec else (spec,)
    else:
        dims = tuple(spec)
    for d in dims:
        if d not in mesh:
            raise LayoutError(f"{d}: A dimension sharding must either be a valid mesh dimension or "
                              f"UNSHARDED. Mesh dimensions: {mesh.dim_names}" +
                              (f" (in the multi-axis spec {spec!r})" if len(dims) > 1 else ""))
    if not dims:
        return None
    return dims if len(dims) > 1 else dims[0]


def _check_rank(rank: int) -> None:
    if not isinstance(rank, int) or rank < 0:
        raise LayoutError(f"rank must be a non-negative integer, got {rank!r}")
