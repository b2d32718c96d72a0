"""Where a reshape keeps an axis's sharding: the layouts of `view`/`reshape` (see `reshape_axes`)."""

from __future__ import annotations

import math

from spmd.layout import axis_dims


def _segments(a: tuple, b: tuple) -> list[tuple[range, range]]:
    """Splits shapes `a` and `b` (same numel) into runs of axes with equal products."""
    i = j = 0
    segs = []
    while i < len(a) or j < len(b):
        i0, j0, pa, pb = i, j, 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
        if j < len(b):
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
            elif j < len(b):
                pb, j = pb * b[j], j + 1
            else:
                pa, i = pa * a[i], i + 1
        segs.append((range(i0, i), range(j0, j)))
    return segs


def reshape_axes(in_shape: tuple, in_axes: tuple, out_shape: tuple, shards) -> tuple[tuple, tuple]:
    """(required input axes, output axes) for reshaping `in_shape` to `out_shape`; `shards(m)`: how many blocks
    an axis sharded over `m` has.

    In each run of axes with equal products, a device's elements stay one block of the run's flattened order
    while every sharded axis but the last has one element per device and every axis after it is whole: the run's
    mesh dims, major to minor, then shard the output axes in order (an axis takes dims while their blocks divide
    it, the next only once it holds one element per device). Merging a batch sharded to one row per device with a
    sharded sequence keeps both; with two rows per device the batch first takes the sequence's dims (see
    `_run_dims`); dims that fit nowhere are gathered."""
    if math.prod(in_shape) == 0:
        return (None,) * len(in_shape), (None,) * len(out_shape)
    need, out = list(in_axes), [None] * len(out_shape)
    for ins, outs in _segments(tuple(in_shape), tuple(out_shape)):
        dims = _run_dims(ins, in_shape, need, shards)  # clears the input axes that cannot stay sharded
        placed = 0
        for j in (j for j in outs if out_shape[j] > 1):
            taken = _taken(dims[placed:], out_shape[j], shards)
            if taken:
                out[j] = taken[0] if len(taken) == 1 else tuple(taken)
            placed += len(taken)
            if math.prod(shards(d) for d in taken) != out_shape[j]:
                break  # this axis holds several elements per device: the next ones stay whole
        _gather_minor(ins, need, dims[placed:])
    return tuple(need), tuple(out)


def _run_dims(ins: range, in_shape: tuple, need: list, shards) -> list:
    """The mesh dims sharding a run of input axes that may stay sharded (see `reshape_axes`), major to minor. A
    sharded axis behind the first of several elements per device (the open axis) hands its mesh dims to the open
    axis where they divide its blocks, an all-to-all after which each device holds one block of the run (two batch
    rows per device and a sharded sequence: the batch takes the sequence's dims too, the sequence becomes whole);
    where they do not, it is gathered (set in `need`)."""
    dims, open_axis = [], None
    for i in ins:
        if in_shape[i] == 1 or need[i] is None:
            need[i] = None
        elif open_axis is None:
            dims.extend(axis_dims(need[i]))
        else:
            moved = axis_dims(need[open_axis]) + axis_dims(need[i])
            if in_shape[open_axis] % shards(moved) == 0:
                need[open_axis] = moved[0] if len(moved) == 1 else tuple(moved)
                dims.extend(axis_dims(need[i]))
            need[i] = None
            if in_shape[open_axis] == shards(need[open_axis]):
                open_axis = None  # (it holds one element per device now: this axis, whole, is the next open one)
        if open_axis is None and in_shape[i] != shards(need[i]):
            open_axis = i
    return dims


def _taken(dims: list, size: int, shards) -> list:
    """The leading mesh dims of `dims` whose blocks together divide `size`."""
    taken, blocks = [], 1
    for d in dims:
        if size % (blocks * shards(d)):
            break
        taken.append(d)
        blocks *= shards(d)
    return taken


def _gather_minor(ins: range, need: list, dropped: list) -> None:
    """Removes the mesh dims `dropped` (the run's minor ones, which no output axis takes) from the run's input axes."""
    for i in reversed(ins):
        if not dropped or need[i] is None:
            continue
        dims = list(axis_dims(need[i]))
        while dims and dropped and dims[-1] == dropped[-1]:
            dims.pop()
            dropped = dropped[:-1]
        need[i] = None if not dims else dims[0] if len(dims) == 1 else tuple(dims)
