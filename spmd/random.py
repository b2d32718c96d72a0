"""Layout-invariant random numbers: values are a function of (seed, global element index) only.

A counter-based generator (the splitmix64 mixer over the global linear index) lets every device generate
exactly its own shard, and gives the same global tensor for every layout, mesh and number of devices.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from spmd.collectives.groups import tracing
from spmd.dtensor import make
from spmd.layout import Layout, axis_dims
from spmd.ops import born_with_layout

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_KEY_START, _FNV_PRIME = 0x5EED, 0x100000001B3  # a key starts from 0x5EED; FNV-1's prime mixes in each part


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiply; logical shifts emulated with masks)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(z: int) -> int:
    """`_mix` on one Python int (as a signed 64-bit value): a seed's key, which eager random ops derive at each
    call (5 µs in Python; 160 through one-element tensors)."""
    z &= _MASK64
    z ^= z >> 30
    z = z * _M1 & _MASK64
    z ^= z >> 27
    z = z * _M2 & _MASK64
    return _signed(z ^ z >> 31)


def _seed_parts(seed) -> list[int]:
    if isinstance(seed, torch.Tensor):
        seed = seed.tolist()
    parts = list(seed) if isinstance(seed, (list, tuple)) else [seed]
    if not 1 <= len(parts) <= 2 or not all(isinstance(p, int) or hasattr(p, "__index__") for p in parts):
        raise TypeError(f"seed must be an int or a pair of ints (as TF's seed=(1, 2), of shape [2]), got {seed!r}")
    return [int(p) for p in parts]


def _key(seed, stream: int) -> int:
    """One 64-bit key from a seed (an int, or a pair of ints as in TF) and a stream number."""
    key = _KEY_START
    for p in _seed_parts(seed) + [stream]:
        key = _mix_int(key * _FNV_PRIME ^ p)
    return key


def global_index(shape: Sequence[int], axes: Sequence, mesh, device) -> torch.Tensor:
    """int64 tensor `(L, *local_shape)`: the global row-major index of every element each local device holds."""
    n_local = mesh.num_local_devices()
    locations = [mesh.device_location(i - mesh.min_global_device_id()) for i in mesh.local_device_ids()]
    index = torch.zeros((n_local,) + (1,) * len(shape), dtype=torch.int64, device=device)
    stride = 1
    shards = [math.prod(mesh.dim_size(m) for m in axis_dims(axis)) for axis in axes]
    for a in reversed(range(len(shape))):
        local = shape[a] // shards[a]
        first = torch.tensor([_block(loc, axes[a], mesh) * local for loc in locations]).to(device)
        view = [1] * (len(shape) + 1)
        view[a + 1] = local
        index = index + (first.view((n_local,) + (1,) * len(shape)) + torch.arange(
            local, device=device).view(view)) * stride
        stride *= shape[a]
    return index.expand((n_local,) + tuple(s // n for s, n in zip(shape, shards)))


def _block(location, axis, mesh) -> int:
    """The index of the block along one tensor axis sharded over `axis` (row-major over its mesh dims)."""
    index = 0
    for m in axis_dims(axis):
        index = index * mesh.dim_size(m) + location[mesh.axis_index(m)]
    return index


def uniform_bits(index: torch.Tensor, seed, stream: int) -> torch.Tensor:
    """64 random bits (int64) for each global element index in `index`, from `seed` and a stream number."""
    if tracing(index):
        if not (isinstance(seed, torch.Tensor) and tracing(seed)):  # a constant of the graph
            seed = torch.tensor(_seed_parts(seed))
        return counter_bits(index, seed, stream)
    return _mix(index * _GOLDEN + _key(seed, stream))


@torch.library.custom_op("spmd::counter_bits", mutates_args=())
def counter_bits(index: torch.Tensor, seed: torch.Tensor, stream: int) -> torch.Tensor:
    """`uniform_bits` as one opaque op of a traced graph (`seed` holds a seed's parts, or a 0-d seed drawn in the
    graph). The mixer relies on int64 multiplication wrapping around; inductor's C++ code takes signed overflow as
    impossible, and its optimised loops then give wrong values."""
    return _mix(index * _GOLDEN + _key(seed, stream)).contiguous()


@counter_bits.register_fake
def _(index, seed, stream):
    return index.new_empty(index.shape)


def uniform01(index: torch.Tensor, seed, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """Uniform floats in [0, 1), as many random bits as `dtype` holds exactly (53 for float64, 24 for float32, 8 for
    bfloat16): more would round the largest values up to 1."""
    bits = uniform_bits(index, seed, stream)
    if dtype == torch.float64:
        return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0 ** -53
    n = min(round(-math.log2(torch.finfo(dtype).eps)) + 1, 24)  # (the significand's bits)
    return (((bits >> (64 - n)) & ((1 << n) - 1)).to(torch.float32) * 2.0 ** -n).to(dtype)


def normal01(index: torch.Tensor, seed, dtype: torch.dtype, round_: int = 0) -> torch.Tensor:
    """Standard normal values by Box-Muller over two uniform streams."""
    u1 = uniform01(index, seed, 2 * round_ + 1, torch.float64)
    u2 = uniform01(index, seed, 2 * round_ + 2, torch.float64)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def truncated01(index: torch.Tensor, seed, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values restricted to [-2, 2]: each element takes its first draw that falls inside."""
    out = normal01(index, seed, torch.float64, 0)
    for r in range(1, 64):
        bad = out.abs() > 2
        if not tracing(out) and not bad.any():  # a traced graph cannot branch on values: it runs every round
            break
        out = torch.where(bad, normal01(index, seed, torch.float64, r), out)
    return out.clamp(-2, 2).to(dtype)


def _generate(shape, layout: Layout | None, device, fn):
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):  # torch's error for a negative size, before arange's about its step
        negative = next(s for s in shape if s < 0)
        raise RuntimeError(f"Trying to create tensor with negative dimension {negative}: {list(shape)}")
    if layout is None:
        index = torch.arange(math.prod(shape), dtype=torch.int64, device=device).view(shape)
        return fn(index)
    layout.check_divisible(shape)
    mesh = layout.mesh
    return make(fn(global_index(shape, layout.axes, mesh, mesh.torch_device)).contiguous(), layout)


@born_with_layout
def stateless_uniform(shape: Sequence[int], seed, minval=0, maxval=None, dtype=torch.float32,
                      layout: Layout | None = None, device=None):
    """Uniform values in [minval, maxval) that depend only on `seed` and the global index.

    Args:
      shape: the global shape. seed: an int or a pair of ints (as TF's `seed=(1, 2)`).
      minval, maxval: the range; `maxval` defaults to 1 for floating dtypes and is required for integers.
      dtype: the torch dtype. layout: a `Layout` to get a DTensor (each device generates only its shard).
      device: the device of a plain (layout-less) result.

    >>> a = stateless_uniform((4, 4), seed=(1, 2))
    >>> mesh = spmd.create_mesh([("x", 2), ("y", 2)])
    >>> b = stateless_uniform((4, 4), seed=(1, 2), layout=spmd.Layout(["x", "y"], mesh))
    >>> bool((spmd.relayout(b, spmd.Layout.replicated(mesh, 2)).numpy() == a.numpy()).all())
    True
    """
    if not dtype.is_floating_point:
        if maxval is None:
            raise ValueError("stateless_uniform with an integer dtype needs maxval")
        span = int(maxval) - int(minval)
        if span <= 0:
            raise ValueError(f"stateless_uniform needs minval < maxval, got minval={minval} and maxval={maxval}")
        return _generate(shape, layout, device, lambda i: ((uniform_bits(i, seed, 0) >> 1) % span
                                                           + int(minval)).to(dtype))
    maxval = 1 if maxval is None else maxval
    if minval > maxval:
        raise ValueError(f"stateless_uniform needs minval <= maxval, got minval={minval} and maxval={maxval}")
    def uniform(i):
        out = uniform01(i, seed, 0, dtype) * (maxval - minval) + minval
        if minval == maxval:
            return out
        # scaled to the range, a value can round up to maxval in a narrow dtype: the range is half-open
        top = torch.full((), maxval, dtype=dtype, device=out.device)
        return torch.minimum(out, torch.nextafter(top, torch.full_like(top, minval)))
    return _generate(shape, layout, device, uniform)


def _check_floating(name: str, dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise TypeError(f"{name}: dtype must be a floating type (as TF's: float16, bfloat16, float32, float64), got "
                        f"{dtype}")


@born_with_layout
def stateless_normal(shape: Sequence[int], seed, mean=0.0, stddev=1.0, dtype=torch.float32,
                     layout: Layout | None = None, device=None):
    """Normal values (mean, stddev) that depend only on `seed` and the global index (see `stateless_uniform`)."""
    _check_floating("stateless_normal", dtype)
    return _generate(shape, layout, device, lambda i: normal01(i, seed, dtype) * stddev + mean)


@born_with_layout
def stateless_truncated_normal(shape: Sequence[int], seed, mean=0.0, stddev=1.0, dtype=torch.float32,
                               layout: Layout | None = None, device=None):
    """Normal values re-drawn until within two standard deviations of the mean (TF's truncated normal)."""
    _check_floating("stateless_truncated_normal", dtype)
    return _generate(shape, layout, device, lambda i: truncated01(i, seed, dtype) * stddev + mean)


def draw_seed(generator: torch.Generator | None = None):
    """A fresh seed from torch's generator, so `torch.manual_seed` makes spmd's random ops reproducible: an int, or,
    inside a traced graph, the 0-d tensor that the graph draws anew at each call."""
    seed = torch.randint(0, 2 ** 62, (), generator=generator)
    return seed if tracing(seed) else int(seed)
