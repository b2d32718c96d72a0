"""The CTC loss (`F.ctc_loss`, `nn.CTCLoss`) and its backward with the batch sharded.

Why the rules hold: each sample's loss is the alignment of its own log-probabilities `[T, C]` with its own targets,
so a device holding a block of the batch — its columns of `log_probs` `[T, N, C]`, its rows of the padded targets
`[N, S]` and of the lengths — computes those samples' losses (and their `log_alpha`) as torch does, and their
gradient, with no collective; the reduction of the per-sample losses (a mean over the batch) is ordinary ops after.
Time and classes are whole on each device (a sample's alignment reads all of them). Targets given concatenated
(1-D, as HuggingFace's CTC heads pass them) are whole on each device, which takes its samples' run of them by the
target lengths' values (read on the host, as torch's own kernels read them). Unbatched inputs run replicated.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.common import block_starts, replace_tensors

aten = torch.ops.aten

# each tensor argument's role, in order: a per-sample value, log_probs, targets, lengths, log_alpha
_ROLES = {aten._ctc_loss.Tensor: ("log_probs", "targets", "lengths", "lengths"),
          aten._ctc_loss.default: ("log_probs", "targets"),
          aten._ctc_loss_backward.Tensor: ("row", "log_probs", "targets", "lengths", "lengths", "row", "alpha"),
          aten._ctc_loss_backward.default: ("row", "log_probs", "targets", "row", "alpha")}
# the positions of the int[] lengths (input's, target's)
_LENGTH_LISTS = {aten._ctc_loss.default: (2, 3), aten._ctc_loss_backward.default: (3, 4)}
_FORWARD = (aten._ctc_loss.Tensor, aten._ctc_loss.default)


def _axes(role: str, rank: int, batch) -> tuple:
    """A tensor's axes: `log_probs` `[T, N, C]` has the batch second; the lengths are whole on every device (the
    widest target sets `log_alpha`'s width); the others (per-sample values, padded targets `[N, S]`, `log_alpha`
    `[N, T, 2S + 1]`) have the batch first."""
    if role == "log_probs":
        return (None, batch, None) if rank == 3 else (None,) * rank
    if role == "lengths" or (role == "targets" and rank == 1):  # (concatenated targets: cut by the lengths)
        return (None,)
    return (batch,) + (None,) * (rank - 1)


def _alpha_width(target_lengths) -> int:
    """The last axis of torch's `log_alpha`: `2 * max(target_lengths) + 1`."""
    return 2 * max(map(int, target_lengths)) + 1


def _batch_dim(call: OpCall, roles: tuple):
    """The mesh dim to shard the batch over (the log-probabilities', else the padded targets'), or None."""
    log_probs, targets = call.specs[roles.index("log_probs")], call.specs[roles.index("targets")]
    if log_probs.rank != 3:
        return None
    return log_probs.axes[1] if log_probs.axes[1] is not None or targets.rank == 1 else targets.axes[0]


@register(*_ROLES)
def ctc_loss_rule(call: OpCall) -> Decision:
    """Each device's samples, per device with torch's own kernel; nothing to reduce. `log_alpha`'s last axis is
    `2 * max(target_lengths) + 1` over the whole batch, as torch's (a device's own samples' padded with -inf)."""
    roles = _ROLES[call.func]
    batch = _batch_dim(call, roles)
    inputs = tuple(_axes(role, spec.rank, batch) for role, spec in zip(roles, call.specs))
    forward = call.func in _FORWARD
    block = None if batch is None else call.specs[roles.index("log_probs")].shape[1] // call.shards(batch)
    starts = None if batch is None else block_starts(call, batch, block)
    lists = _LENGTH_LISTS.get(call.func, ())
    target_lengths = roles.index("lengths") + 1 if "lengths" in roles else None  # (tensor variant)
    targets = roles.index("targets")
    concatenated = call.specs[targets].rank == 1

    def mine(x, device):  # a device's samples of a lengths tensor or list
        return x if block is None else x[starts[device]:starts[device] + block]

    def kernel(locals_, args, kwargs):
        results, width = [], None
        all_lengths = locals_[target_lengths][0] if target_lengths is not None else args[lists[1]] if lists else None
        if forward and block is not None:
            width = _alpha_width(all_lengths)
        if concatenated and block is not None:  # each device's samples' targets: from the first of its samples' own
            firsts = [0, *itertools.accumulate(map(int, all_lengths))]
        for device in range(locals_[0].shape[0]):  # (one copy where every input is replicated)
            tensors = [mine(x[device], device) if role == "lengths" else x[device] for x, role in zip(locals_, roles)]
            if concatenated and block is not None:
                first = starts[device]
                tensors[targets] = tensors[targets][firsts[first]:firsts[first + block]]
            if not forward and block is not None:  # its own samples' log_alpha width, as torch's kernel reads it
                lengths = tensors[target_lengths] if target_lengths is not None else mine(args[lists[1]], device)
                tensors[-1] = tensors[-1][..., :_alpha_width(lengths)]  # (log_alpha: the last tensor)
            device_args, device_kwargs = replace_tensors(args, kwargs, tensors)
            device_args = tuple(mine(a, device) if i in lists else a for i, a in enumerate(device_args))
            results.append(call.func(*device_args, **device_kwargs))
        if not forward:
            return torch.stack(results)
        alphas = [r[1] if width is None else F.pad(r[1], (0, width - r[1].shape[-1]), value=-math.inf)
                  for r in results]
        return torch.stack([r[0] for r in results]), torch.stack(alphas)

    log_probs_axes = inputs[roles.index("log_probs")]
    if not forward:
        return Decision(inputs, (log_probs_axes,), kernel)
    batched = len(log_probs_axes) == 3  # the losses `[N]` (a scalar unbatched) and `log_alpha`
    outputs = ((batch,), (batch, None, None)) if batched else ((), (None, None))
    return Decision(inputs, outputs, kernel, single=False)
