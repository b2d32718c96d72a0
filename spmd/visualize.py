"""`spmd.visualize`: which device holds which block of a DTensor, as a table in the terminal."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from spmd.dtensor import DTensor, fetch_layout
from spmd.mesh import short_device_names

_COLORS = ["on dark_blue", "on dark_green", "on dark_red", "on purple4", "on dark_orange3", "on deep_sky_blue4",
           "on dark_olive_green3", "on grey37"]


def _holders(t: DTensor) -> dict[tuple, list[str]]:
    """Shard index (per tensor axis) -> names of the devices holding that block, in mesh order."""
    mesh = fetch_layout(t).mesh
    names = dict(zip(mesh.local_device_ids(), short_device_names(mesh.local_devices())))
    holders: dict[tuple, list[str]] = {}
    for offset, shard in enumerate(fetch_layout(t).offset_to_shard()):
        device_id = mesh.min_global_device_id() + offset
        holders.setdefault(shard, []).append(names.get(device_id, f"#{device_id}"))
    return holders


def _block(shard: tuple, local: tuple) -> str:
    return "[" + ", ".join(f"{i * n}:{(i + 1) * n}" for i, n in zip(shard, local)) + "]"


def sharding_table(t: DTensor) -> Table:
    """The table `visualize` prints: a grid of blocks for rank 1 and 2, one row per block otherwise."""
    layout = fetch_layout(t)
    local = layout.local_shape_from_global_shape(tuple(t.shape))
    holders = _holders(t)
    color = {shard: _COLORS[i % len(_COLORS)] for i, shard in enumerate(holders)}
    title = f"shape {tuple(t.shape)}, layout {layout.sharding_specs}"
    if t.dim() in (1, 2):
        rows, cols = (1, layout.num_shards(0)) if t.dim() == 1 else (layout.num_shards(0), layout.num_shards(1))
        table = Table(title=title, show_header=False, box=box.SQUARE, show_lines=True, min_width=len(title))
        for _ in range(cols):
            table.add_column(justify="center")
        for r in range(rows):
            cells = []
            for c in range(cols):
                shard = (c,) if t.dim() == 1 else (r, c)
                cells.append(f"[{color[shard]}] {' '.join(holders[shard])} [/]\n{_block(shard, local)}")
            table.add_row(*cells)
        return table
    table = Table(title=title, box=box.SQUARE, min_width=len(title))
    table.add_column("block")
    table.add_column("devices")
    for shard, names in holders.items():
        table.add_row(_block(shard, local), f"[{color[shard]}] {' '.join(names)} [/]")
    return table


def visualize(t: DTensor, console: Console | None = None) -> None:
    """Prints which device holds which block of `t` (as `jax.debug.visualize_array_sharding` does).

    >>> from rich.console import Console
    >>> mesh = create_mesh([("x", 2), ("y", 2)])
    >>> visualize(zeros((4, 6), layout=Layout(["x", UNSHARDED], mesh)), Console(width=60, color_system=None))
    shape (4, 6), layout ['x', 'unsharded']
    ┌─────────────────────────────────────┐
    │             CPU:0 CPU:1             │
    │             [0:2, 0:6]              │
    ├─────────────────────────────────────┤
    │             CPU:2 CPU:3             │
    │             [2:4, 0:6]              │
    └─────────────────────────────────────┘
    """
    if not isinstance(t, DTensor):
        raise TypeError(f"visualize expects a DTensor, got {type(t).__name__}")
    (console or Console()).print(sharding_table(t))
