"""Meshes and layouts in JAX's terms: `jax.sharding.Mesh`, `NamedSharding` and `PartitionSpec` (jax is optional).

The functions here work on plain values (dim names, shapes, device names, per-axis mesh dims) so that `Mesh` and
`Layout` can call them; `Mesh.to_jax`/`from_jax` and `Layout.to_jax`/`from_jax` are the public entry points, and
`spmd.interop` converts DTensors to and from `jax.Array`s.

A JAX `PartitionSpec` entry names the mesh axes one array dim is split over: `None` (replicated), one axis
name, or a tuple of axes. spmd shards one tensor axis over at most one mesh dim, so a tuple of one axis is that
axis, and a tuple of several is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from spmd.errors import LayoutError


def import_jax():
    """jax, or an ImportError that says how to install it."""
    try:
        import jax
        import jax.sharding  # noqa: F401 - the submodule the conversions use
    except ImportError as e:
        raise ImportError(f"converting to or from JAX needs jax (`pip install jax`): {e}") from e
    return jax


def make_jax_mesh(dim_names: Sequence[str], shape: Sequence[int], device_indices: Sequence[int] | None,
             devices=None):
    """A `jax.sharding.Mesh` with these axis names and shape.

    `devices`: jax devices, as many as the mesh has (flat or shaped like it). Without them, position k gets the
    jax device whose id is `device_indices[k]` (the index of spmd's device `TYPE:i`) when jax has all of those,
    else jax's first devices in order.
    """
    jax = import_jax()
    size = int(np.prod(shape))
    if devices is None:
        devices = _default_devices(jax, size, device_indices)
    devices = np.asarray(devices, dtype=object)
    if devices.size != size:
        raise LayoutError(f"a mesh of shape {list(shape)} ({dict(zip(dim_names, shape))}) needs {size} jax "
                          f"devices, got {devices.size}")
    return jax.sharding.Mesh(devices.reshape(tuple(shape)), tuple(dim_names))


def _default_devices(jax, size: int, device_indices: Sequence[int] | None) -> list:
    available = jax.devices()
    if len(available) < size:
        raise LayoutError(
            f"the mesh has {size} devices but jax sees {len(available)} ({available[0].platform}): pass devices=, "
            f"or for CPU set XLA_FLAGS=--xla_force_host_platform_device_count={size} before jax is imported")
    by_id = {d.id: d for d in available}
    if device_indices is not None and len(set(device_indices)) == size and set(device_indices) <= set(by_id):
        return [by_id[i] for i in device_indices]
    return available[:size]


def mesh_from_jax(mesh, device_type: str) -> tuple[list[str], list[int], list[str]]:
    """`(dim_names, shape, device names)` of an in-process spmd mesh like the jax mesh `mesh`: position k is
    named after the id of jax's device at position k (`'CPU:<id>'`)."""
    jax = import_jax()
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}: {mesh!r}")
    names = list(mesh.axis_names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise LayoutError(f"spmd mesh dimensions are named by strings; the jax mesh {mesh} has axis names {bad}")
    devices = [f"{device_type}:{d.id}" for d in mesh.devices.flat]
    return names, list(mesh.devices.shape), devices


def check_same_mesh(jax_mesh: Any, dim_names: Sequence[str], shape: Sequence[int], what: str) -> None:
    """Raises LayoutError unless the jax mesh has exactly these axis names and sizes."""
    theirs = dict(zip(jax_mesh.axis_names, jax_mesh.devices.shape))
    mine = dict(zip(dim_names, shape))
    if list(theirs.items()) != list(mine.items()):
        raise LayoutError(f"the jax mesh {theirs} does not match {what} {mine}: the axis names, sizes and order "
                          "must be the same")


def partition_spec(axes: Sequence[str | None]):
    """`PartitionSpec` of per-axis mesh dims (`None`: unsharded); it has one entry per tensor axis."""
    return import_jax().sharding.PartitionSpec(*axes)


def named_sharding(jax_mesh: Any, axes: Sequence[str | None]):
    return import_jax().sharding.NamedSharding(jax_mesh, partition_spec(axes))


def split_sharding(sharding) -> tuple[Any, Any]:
    """`(jax mesh or None, PartitionSpec)` of a `NamedSharding` or a `PartitionSpec`."""
    jax = import_jax()
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh, sharding.spec
    if isinstance(sharding, jax.sharding.PartitionSpec):
        return None, sharding
    raise TypeError(f"expected a jax NamedSharding or PartitionSpec, got {type(sharding).__name__}: {sharding!r}; "
                    "spmd layouts correspond to named shardings (a mesh and a PartitionSpec)")


def _none_in(entry, i: int, spec):
    raise LayoutError(f"entry {i} of {spec} is {tuple(entry)}: a tuple lists the mesh axes sharding one tensor "
                      "axis, None is not one")


def axes_from_spec(spec, dim_names: Sequence[str], rank: int | None) -> list:
    """Per tensor axis the mesh dim of a `PartitionSpec` (`None`: unsharded; a tuple of names for an axis split
    over several, the first major), padded with `None` to `rank`."""
    jax = import_jax()
    entries = list(spec)
    rank = len(entries) if rank is None else rank
    if len(entries) > rank:
        raise LayoutError(f"{spec} has {len(entries)} entries, more than the rank {rank} of the tensor")
    axes = [_axis(entry, i, spec, dim_names, jax) for i, entry in enumerate(entries)]
    return axes + [None] * (rank - len(axes))


def _axis(entry, i: int, spec, dim_names: Sequence[str], jax) -> str | tuple[str, ...] | None:
    if entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
        raise LayoutError(f"entry {i} of {spec} is UNCONSTRAINED (the compiler's choice): a layout says how each "
                          "axis is sharded; use None for unsharded or a mesh axis name")
    if isinstance(entry, (tuple, list)):
        if len(entry) > 1:  # the axis is split over all of them, the first major: the same in a Layout
            return tuple(_axis(e, i, spec, dim_names, jax) if e is not None else _none_in(entry, i, spec)
                         for e in entry)
        entry = entry[0] if entry else None
    if entry is None:
        return None
    if not isinstance(entry, str) or entry not in dim_names:
        raise LayoutError(f"entry {i} of {spec} is {entry!r}, which is not an axis of the mesh "
                          f"(axes {list(dim_names)})")
    return entry
