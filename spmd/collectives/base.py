"""The interface every collective backend implements (see the package docstring for the conventions)."""

from __future__ import annotations

import abc
import enum
from typing import NamedTuple

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


def kept_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a sum of partial results keeps: the components' own (torch's sum widens an int32 one to int64);
    None (torch's choice) for bool."""
    return None if x.dtype == torch.bool else x.dtype


class Kind(str, enum.Enum):
    """What a step of a relayout or a decision moves. A `str` enum: `Kind.ALL_REDUCE == "all_reduce"`."""
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    PERMUTE = "permute"
    SHARD = "shard"  # each device keeps its block: a local slice, no traffic

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class Collective(NamedTuple):
    """One collective as a value (the planner's steps, a rule's declared collectives); `planner.run` executes it.
    `axis` is the gathered axis (all_gather, all_to_all) or the sharded one (shard, reduce_scatter, permute);
    `to_axis` the axis an all_to_all shards; `op` the reduction of all_reduce / reduce_scatter. A permute reorders
    the mesh dims sharding `axis` from `from_dims` to `mesh_dims` (each device's block moves whole).

    On an axis sharded over several mesh dims, all_gather and all_to_all take its minor (last) mesh dim away, and
    shard, reduce_scatter and all_to_all add one as the new minor dim."""
    kind: Kind
    mesh_dims: tuple[str, ...]
    axis: int = -1
    to_axis: int = -1
    op: str = "sum"
    from_dims: tuple[str, ...] = ()

    @property
    def moves_data(self) -> bool:
        return self.kind is not Kind.SHARD


class Collectives(abc.ABC):
    """Collectives over the dimensions of a mesh, on stacked components `(L, *local_shape)`."""

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, mesh, mesh_dims: tuple[str, ...], op: str = "sum",
                   donate: bool = False) -> torch.Tensor:
        """Every device gets the reduction (`sum`, `avg`, `max`, `min`) of the components along `mesh_dims`.
        `donate`: the caller gives `x` up, so the reduction may be written into its memory."""

    @abc.abstractmethod
    def all_gather(self, x: torch.Tensor, mesh, mesh_dim: str, axis: int) -> torch.Tensor:
        """Concatenates the shards of tensor axis `axis` along `mesh_dim` (sharded -> replicated)."""

    @abc.abstractmethod
    def shard(self, x: torch.Tensor, mesh, mesh_dim: str, axis: int) -> torch.Tensor:
        """Each device keeps its block of tensor axis `axis` along `mesh_dim` (replicated -> sharded; no traffic)."""

    @abc.abstractmethod
    def all_to_all(self, x: torch.Tensor, mesh, mesh_dim: str, gather_axis: int, shard_axis: int) -> torch.Tensor:
        """Moves the sharding over `mesh_dim` from tensor axis `gather_axis` to `shard_axis`."""

    @abc.abstractmethod
    def reduce_scatter(self, x: torch.Tensor, mesh, mesh_dim: str, axis: int, op: str = "sum") -> torch.Tensor:
        """Reduces along `mesh_dim` and leaves each device its block of tensor axis `axis`."""

    @abc.abstractmethod
    def permute(self, x: torch.Tensor, mesh, from_dims: tuple[str, ...], to_dims: tuple[str, ...]) -> torch.Tensor:
        """Moves blocks between devices: the device whose coordinates over `to_dims` (row-major) are `i` gets the
        component of the device, equal to it on every other mesh dim, whose coordinates over `from_dims` are `i`
        (the same mesh dims in another order)."""

    @abc.abstractmethod
    def assemble(self, x: torch.Tensor, mesh, axes: tuple) -> torch.Tensor:
        """The global value (a plain tensor) of stacked components laid out by per-axis mesh dims `axes` (a
        `Layout.axes`: an entry may be a tuple of mesh dims); each shard is copied once."""
