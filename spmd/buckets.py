"""Gradient buckets: the cross-client part of gradients' pending sums, reduced during backward as DDP does.

After backward a replicated parameter's gradient is a pending sum over the batch mesh dims; unbucketed, each one
is all-reduced on its own when the optimizer reads it. With a `GradBuckets` on the module, each gradient whose
pending sum crosses clients is, as soon as it is accumulated (a post-accumulate-grad hook):
  1. summed over this client's own members of each group (the in-process part of the all-reduce),
  2. appended to the open bucket of its (mesh, pending dims, dtype, device); a bucket that reaches its size is
     flattened and summed across clients by ONE asynchronous `all_reduce`, overlapped with the rest of backward
     (the first bucket of a backward is smaller, so communication starts early),
  3. resolved when something reads it (`dispatch.resolve`): the wait for its own bucket, then its slice copied
     back to the local members.
Open buckets are flushed when backward ends. Buckets form in the order gradients arrive, which is the same on
every client (SPMD), so every client issues the same collectives in the same order. A bucket sums into the buffer of
the last backward's bucket of its size once no gradient reads from that buffer any more (DDP keeps its buckets too):
memory fresh from the system costs a page fault per page, more than the copy into it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from spmd.collectives import backend_for
from spmd.collectives.distributed import DistributedCollectives
from spmd.dtensor import DTensor
from spmd.fsdp import gradients_kept

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's bucket_cap_mb
FIRST_BUCKET_MB = 1.0  # DDP's first bucket
_MB = 1024 * 1024
_REDUCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its GradBuckets


class _Bucket:
    """Gradients of one (mesh, pending dims, dtype, device), their partial sums, and the collective once started."""

    def __init__(self, comm: DistributedCollectives, mesh, dims, batch):
        self.comm, self.mesh, self.dims, self.batch = comm, mesh, dims, batch
        self.slots: dict[int, tuple] = {}  # id(grad) -> (components, their version, offset, partial's shape)
        self.partials: list[torch.Tensor] = []
        self.nbytes = 0
        self.handle = None
        self.users = 0  # the tensors holding the buffer's memory when it was filled (the buffer's own)

    def add(self, grad: DTensor) -> None:
        partial = self.comm.partial_sums(grad._stack, self.batch)
        offset = self.nbytes // partial.element_size()
        self.slots[id(grad)] = (grad._stack, grad._stack._version, offset, partial.shape)
        self.partials.append(partial)
        self.nbytes += partial.numel() * partial.element_size()
        grad._bucket = self

    def launch(self, spare: torch.Tensor | None = None) -> None:
        """Starts the sum of the partial sums, flattened into `spare` (a free buffer of their size) or new memory."""
        flat = torch.cat([p.reshape(-1) for p in self.partials], out=spare)
        self.partials = []
        self.users = _users(flat)
        self.handle = self.comm.sum_async(flat, self.mesh, self.dims, self.batch)

    def free_buffer(self) -> torch.Tensor | None:
        """Its (summed) buffer once every gradient took its part and none holds it any more (a gradient whose
        client holds one member of its group is a view of it); else None."""
        if self.handle is None or self.slots:
            return None
        flat = self.handle.wait()
        return flat if _users(flat) <= self.users else None

    def settle(self, grad: DTensor) -> bool:
        """Resolves `grad` from this bucket's sum; False (and nothing done) when the bucket does not hold its
        current components (written in place since), and the caller must reduce it unbucketed."""
        grad._bucket = None
        slot = self.slots.pop(id(grad), None)
        if slot is None or slot[0] is not grad._stack or slot[1] != grad._stack._version:
            return False
        if self.handle is None:  # read during backward, before its bucket filled
            self.launch()
        _, _, offset, shape = slot
        flat = self.handle.wait()
        grad._settle(self.comm.spread(flat[offset:offset + shape.numel()].view(shape), self.batch))
        return True


class GradBuckets:
    """Buckets the gradients of `module`'s parameters (see the module's docstring); `bucket_cap_mb` per bucket."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive to bucket gradients, got {bucket_cap_mb}")
        self.cap = int(bucket_cap_mb * _MB)
        self.first_cap = min(self.cap, int(FIRST_BUCKET_MB * _MB))
        self.sync = True  # False inside `no_sync`
        self._open: dict[tuple, _Bucket] = {}
        self._launched: list[_Bucket] = []  # this backward's buckets, awaited when the next one starts
        self._previous: list[_Bucket] = []  # the last backward's: their free buffers take this one's sums
        self._in_backward = False
        self._routes: dict[tuple, tuple | None] = {}
        params = [p for p in module.parameters() if isinstance(p, DTensor) and p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in reversed(params)]

    def remove(self) -> None:
        """Takes the hooks off the parameters: gradients are reduced one by one again."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _route(self, mesh, dims):
        """(backend, batch) for a sum over `dims` that one call across clients does; None otherwise."""
        key = (mesh, dims)
        if key not in self._routes:
            comm = backend_for(mesh)
            batch = comm.cross_client_batch(mesh, dims) if isinstance(comm, DistributedCollectives) else None
            self._routes[key] = None if batch is None else (comm, batch)
        return self._routes[key]

    def _ready(self, param: DTensor) -> None:
        grad = param.grad
        if not (self.sync and isinstance(grad, DTensor) and grad._pending and grad._pending_op == "sum"
                and type(grad._stack) is torch.Tensor):  # (a traced gradient is resolved by its graph)
            return
        mesh = grad._layout.mesh
        route = self._route(mesh, grad._pending)
        if route is None:
            return
        if not self._in_backward:
            self._start_backward()
        key = (mesh, grad._pending, grad.dtype, grad.device)
        bucket = self._open.get(key)
        if bucket is None:
            bucket = self._open[key] = _Bucket(route[0], mesh, grad._pending, route[1])
        bucket.add(grad)
        if bucket.nbytes >= (self.first_cap if not self._launched else self.cap):
            self._launch(key)

    def _start_backward(self) -> None:
        for bucket in self._launched:  # long done: surfaces a failure
            bucket.handle.wait()
        self._previous, self._launched = self._launched, []
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _launch(self, key) -> None:
        bucket = self._open.pop(key)
        bucket.launch(self._spare(bucket))
        self._launched.append(bucket)

    def _spare(self, bucket: _Bucket) -> torch.Tensor | None:
        """A free buffer of the last backward for `bucket`'s partial sums (the same model makes the same buckets)."""
        first = bucket.partials[0]
        numel = bucket.nbytes // first.element_size()
        for i, old in enumerate(self._previous):
            flat = old.free_buffer()
            if flat is not None and flat.numel() == numel and flat.dtype == first.dtype and flat.device == first.device:
                del self._previous[i]
                return flat
        return None

    def _flush(self) -> None:
        """At the end of backward: the partly filled buckets."""
        for key in list(self._open):
            self._launch(key)
        self._in_backward = False


def _users(t: torch.Tensor) -> int:
    """How many tensors (views included) hold `t`'s memory."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def bucket_gradients(module: nn.Module, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> GradBuckets | None:
    """Buckets the gradients of `module` (replacing earlier buckets); `bucket_cap_mb=0` turns bucketing off.
    Returns the `GradBuckets`, or None when off."""
    old = _REDUCERS.pop(module, None)
    if old is not None:
        old.remove()
    if not bucket_cap_mb:
        return None
    _REDUCERS[module] = GradBuckets(module, bucket_cap_mb)
    return _REDUCERS[module]


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Gradient accumulation over micro-batches, as DDP's `no_sync`: inside, backward leaves the gradients pending
    (summed locally, nothing communicated); the first backward after it reduces the accumulated sums. Sharded
    parameters (`shard_parameters`) keep their gathered gradients the same way, reduce-scattered once after it
    (spmd/fsdp.py). A module without gradient buckets or sharded parameters needs no change: it does nothing."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_sync expects an nn.Module, got {type(module).__name__}")
    buckets = _REDUCERS.get(module)
    before = buckets is not None and buckets.sync
    if buckets is not None:
        buckets.sync = False
    try:
        with gradients_kept(module):
            yield
    finally:
        if buckets is not None:
            buckets.sync = before


__all__ = ["DEFAULT_BUCKET_CAP_MB", "GradBuckets", "bucket_gradients", "no_sync"]
