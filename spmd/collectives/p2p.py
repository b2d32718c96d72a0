"""All-to-all and reduce-scatter as point-to-point messages, for the multi-client backend's direct case (eager).

In the direct case client `ranks[i]` holds member i of every group, so both collectives are one piece per
(sender, receiver): piece i of each client's components goes to client i. `all_to_all_single` needs all pieces
in one contiguous buffer split along dim 0 and returns one such buffer, which costs a copy of the whole
component on the way in (pieces along another axis) or out (an interleaving gather axis), and gloo copies the
piece a client keeps. Here each piece is sent on its own (`isend`; copied only when it is not contiguous) and
received straight into its slice of the output (`irecv`; through a buffer only when that slice is strided),
while the kept piece is copied locally as the messages travel.

A reduce-scatter is the same exchange followed by a local reduction of the k pieces of one's own block: it moves
(k-1)/k of the data, where an all-reduce then a slice moves 2(k-1)/k and copies the input first (gloo's own
`reduce_scatter_tensor` measured 2.5x slower than its `all_reduce`). The pieces are combined in member order,
so every client computes its block with the same arithmetic whichever client holds which member.

Each message has a fixed cost, so components under `SMALL` bytes keep one `all_to_all_single` call (the
reduce-scatter then reduces what it returns). Traced code (`torch.compile`) keeps the functional collectives of
distributed.py: these calls do not trace.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist


SMALL = 1 << 21  # bytes of a client's components below which one all_to_all_single call is faster (measured)


def small(x: torch.Tensor) -> bool:
    return x.numel() * x.element_size() < SMALL


def exchange(pieces: Sequence[torch.Tensor | None], slots: Sequence[torch.Tensor | None], ranks: Sequence[int],
             group, local: Callable[[], None] | None = None) -> None:
    """Sends `pieces[i]` to client `ranks[i]` and receives what it sends into `slots[i]`, for every other client
    (entries of this client are ignored); runs `local()` while the messages travel."""
    me = dist.get_rank()
    works, late = [], []
    for i, r in enumerate(ranks):  # receives first, so that no message waits for its buffer
        if r == me:
            continue
        slot = slots[i]
        buf = slot if slot.is_contiguous() else torch.empty_like(slot, memory_format=torch.contiguous_format)
        works.append(dist.irecv(buf, src=r, group=group))
        if buf is not slot:
            late.append((slot, buf))
    sent = []  # kept alive until the sends complete
    for i, r in enumerate(ranks):
        if r != me:
            sent.append(pieces[i].contiguous())
            works.append(dist.isend(sent[-1], dst=r, group=group))
    if local is not None:
        local()
    for w in works:
        w.wait()
    for slot, buf in late:
        slot.copy_(buf)


def all_to_all(mine: torch.Tensor, ranks: Sequence[int], group, gather_axis: int, shard_axis: int) -> torch.Tensor:
    """(groups, *local) -> (groups, *local with `shard_axis` split k ways and `gather_axis` concatenated k ways):
    piece i of `shard_axis` goes to client `ranks[i]`; what client i sends lands at block i of `gather_axis`."""
    k, me = len(ranks), ranks.index(dist.get_rank())
    p, q = mine.shape[1 + shard_axis] // k, mine.shape[1 + gather_axis]
    shape = list(mine.shape)
    shape[1 + shard_axis], shape[1 + gather_axis] = p, q * k
    out = torch.empty(shape, dtype=mine.dtype, device=mine.device)
    pieces = [mine.narrow(1 + shard_axis, i * p, p) for i in range(k)]
    slots = [out.narrow(1 + gather_axis, i * q, q) for i in range(k)]
    exchange(pieces, slots, ranks, group, local=lambda: slots[me].copy_(pieces[me]))
    return out


def _reduce(terms, op: str, k: int) -> torch.Tensor:
    """The reduction of `terms` in member order, in fresh contiguous memory."""
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    out = combine(terms[0], terms[1]).contiguous()
    for t in terms[2:]:
        combine(out, t, out=out)
    if op == "avg":
        out = out.div_(k) if out.is_floating_point() else out.floor_divide_(k)
    return out


def reduce_scatter(mine: torch.Tensor, ranks: Sequence[int], group, axis: int, op: str) -> torch.Tensor:
    """(groups, *local) -> (groups, *local with `axis` split k ways): client `ranks[i]` gets the reduction (`sum`,
    `avg`, `max`, `min`) over the clients of block i of their `mine`."""
    k, me = len(ranks), ranks.index(dist.get_rank())
    p = mine.shape[1 + axis] // k
    pieces = [mine.narrow(1 + axis, i * p, p) for i in range(k)]
    if small(mine):  # one call: piece i of every client arrives at block i of `recv`
        send = torch.stack(pieces) if axis or mine.shape[0] > 1 else mine.reshape((k,) + tuple(pieces[0].shape))
        recv = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv, send.contiguous(), group=group)
        terms = list(recv.unbind(0))
    else:
        terms = [pieces[me] if i == me else torch.empty_like(pieces[me], memory_format=torch.contiguous_format)
                 for i in range(k)]
        exchange(pieces, terms, ranks, group)
    return _reduce(terms, op, k)
