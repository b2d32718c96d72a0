"""Which distinct shards of a DTensor this client's devices hold, and DCP's tensor-subclass protocol built on that.

`spmd.checkpoint`'s planners and the DTensor's protocol methods (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, which `torch.distributed.checkpoint.save/load` call without spmd's planners) share these.
A tensor here is anything with `._local` (the stacked components), `._layout` and `.shape`, so this module sits
below the DTensor class. `torch.distributed.checkpoint` is imported inside the functions: it costs ~0.5 s, and
`import spmd` does not pay it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from spmd.layout import Layout

__all__ = ["Block", "local_blocks", "block_at", "create_write_items", "create_chunk_list",
           "get_tensor_shard"]


@dataclasses.dataclass(frozen=True)
class Block:
    """One distinct shard of a DTensor held by this client's devices.

    `offsets`/`sizes`: the block in global coordinates. `positions`: the positions in `t._local` (i.e. in
    `mesh.local_device_ids()` order) of the local devices holding it, the first one being where it is read from
    and written from. `writer`: True when one of them holds the block's first replica (coordinate 0 on every mesh
    dimension the layout does not shard), that device being `positions[0]`; exactly one client writes each block.
    """
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    positions: tuple[int, ...]
    writer: bool


def local_blocks(layout: Layout, shape) -> list[Block]:
    """The distinct shards that this client's devices hold of a tensor of global `shape` with `layout`
    (`mesh.local_device_ids()` decides which; a block's replicas on other clients are not listed).

    >>> mesh = create_mesh([("x", 2), ("y", 2)])
    >>> [(b.offsets, b.sizes, b.positions, b.writer) for b in local_blocks(Layout(["x", UNSHARDED], mesh), (4, 6))]
    [((0, 0), (2, 6), (0, 1), True), ((2, 0), (2, 6), (2, 3), True)]
    """
    return list(_local_blocks(layout, tuple(shape)))


@functools.lru_cache(maxsize=4096)
def _local_blocks(layout: Layout, shape: tuple[int, ...]) -> tuple[Block, ...]:
    mesh = layout.mesh
    local_shape = layout.local_shape_from_global_shape(tuple(shape))
    base = mesh.min_global_device_id()
    found: dict[tuple[int, ...], list] = {}  # offsets -> [first-replica position or None, other positions]
    for position, device in enumerate(mesh.local_device_ids()):
        location = mesh.device_location(device - base)
        index = layout.shard_index(location)
        offsets = tuple(i * s for i, s in zip(index, local_shape))
        entry = found.setdefault(offsets, [None, []])
        if entry[0] is None and layout.is_first_replica(location):
            entry[0] = position
        else:
            entry[1].append(position)
    blocks = []
    for offsets, (first, others) in found.items():
        positions = ((first,) if first is not None else ()) + tuple(sorted(others))
        blocks.append(Block(offsets, tuple(local_shape), positions, first is not None))
    return tuple(blocks)


def block_at(tensor, offset) -> Block:
    """The block of `tensor` at global `offset` (None: the origin) that this client holds; ValueError if none."""
    offset = tuple(offset) if offset is not None else (0,) * len(tensor.shape)
    for block in _local_blocks(tensor._layout, tuple(tensor.shape)):
        if block.offsets == offset:
            return block
    raise ValueError(f"this client holds no shard at offset {list(offset)} of a DTensor of shape "
                     f"{list(tensor.shape)} with layout {tensor._layout.sharding_specs}")


# -- DCP's tensor-subclass protocol (spmd's save planner writes with create_write_items too) ----------------------
def create_write_items(tensor, fqn: str, obj=None) -> list:
    """`tensor.__create_write_items__(fqn, obj)`: DCP's write items for `tensor` saved as `fqn`, one
    `WriteItemType.SHARD` chunk per block this client writes (each block is written by one client)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    properties = TensorProperties(dtype=tensor.dtype)
    items = []
    for block in _local_blocks(tensor._layout, tuple(tensor.shape)):
        if not block.writer:
            continue
        offsets, sizes = torch.Size(block.offsets), torch.Size(block.sizes)
        items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                           properties=properties, size=tensor.shape)))
    return items


def create_chunk_list(tensor) -> list:
    """`tensor.__create_chunk_list__()`: one chunk per local device, in `tensor._local` order (the protocol's load
    path has no hook to copy a block to its replicas, so every local device reads its shard itself)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    chunks = [None] * tensor._local.shape[0]
    for block in _local_blocks(tensor._layout, tuple(tensor.shape)):
        for position in block.positions:
            chunks[position] = ChunkStorageMetadata(torch.Size(block.offsets), torch.Size(block.sizes))
    return chunks


def get_tensor_shard(tensor, index) -> torch.Tensor:
    """`tensor.__get_tensor_shard__(index)`: the component holding the chunk at `index.offset`."""
    try:
        block = block_at(tensor, index.offset)
    except ValueError as e:
        raise ValueError(f"{index.fqn!r}: {e}") from None
    # a read names the local chunk (= position) in `index.index`; a write's hint is a global chunk number, but any
    # local replica of the offset holds the same values
    return tensor._local[index.index if index.index in block.positions else block.positions[0]]
