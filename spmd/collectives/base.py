"""The interface every collective backend implements (see the package docstring for the conventions)."""

from __future__ import annotations

import abc

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


class Collectives(abc.ABC):
    """Collectives over the dimensions of a mesh, on stacked components `(L, *local_shape)`."""

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, mesh, mesh_dims: tuple[str, ...], op: str = "sum") -> torch.Tensor:
        """Every device gets the reduction (`sum`, `avg`, `max`, `min`) of the components along `mesh_dims`."""

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
    def assemble(self, x: torch.Tensor, mesh, axes: tuple) -> torch.Tensor:
        """The global value (a plain tensor) of stacked components laid out by per-axis mesh dims `axes`;
        each shard is copied once."""
