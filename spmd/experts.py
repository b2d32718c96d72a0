"""Expert parallelism for mixture-of-experts layers: each device holds some of the experts, and the tokens routed
to an expert travel to its device and back by all-to-all (GShard's and Megatron's expert parallelism).

`expert_parallel(experts, mesh_dim)` takes an experts module of HuggingFace's interface — the experts' weights
stacked along dim 0 and sharded there over `mesh_dim`, `forward(hidden [tokens, h], top_k_index [tokens, k],
top_k_weights [tokens, k]) -> [tokens, h]` — and replaces its forward with these steps:

1. on each device (`local_map`), its own tokens copied into a buffer `[experts, capacity, h]`: the slots each
   expert receives from this device, in token order (with one more column marking the filled slots);
2. the buffers, one per device along `mesh_dim`, relayouted from their senders to the experts' devices (an
   all-to-all over `mesh_dim`);
3. on each device, its experts over the filled slots it received, by the module's own forward on the device's
   components (an empty slot's row goes to the expert id past the device's experts, which HuggingFace's forwards
   skip, as in its own expert parallelism);
4. the results back to their senders (the reverse all-to-all);
5. on each device, each token's results weighted by its routing weights and summed.

Backward runs the same in reverse (an all-to-all's gradient is the reverse all-to-all). An expert's weight gradient
stays on the expert's device: no expert gradient is all-reduced over `mesh_dim`, and each device stores 1/N of the
experts.

Capacity: by default no token is dropped: a buffer holds as many slots per expert as the most tokens one device
sends to one expert, found by one small all-reduce per call (balanced routing needs k/E of a device's tokens; skewed
routing pads more). Traced by `spmd.function` (static shapes) it holds a device's every token per expert. With
`capacity_factor=f` it holds f·k·tokens/E slots, and an expert drops the tokens beyond them (GShard and Switch
Transformer's capacity): the layer then computes something other than the model, by choice.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from spmd.api import relayout
from spmd.dtensor import DTensor
from spmd.errors import LayoutError
from spmd.layout import UNSHARDED as U, Layout
from spmd.local_functions import local_map

__all__ = ["expert_parallel"]


def expert_parallel(experts: nn.Module, mesh_dim: str, *, token_dims: Sequence[str] | None = None,
                    capacity_factor: float | None = None) -> nn.Module:
    """Runs `experts` expert-parallel over `mesh_dim`, in place; returns `experts`.

    Args:
      experts: a module of HuggingFace's experts interface (`MixtralExperts`, `Qwen3MoeExperts`, ...): every
        parameter stacks the experts along dim 0, `forward(hidden, top_k_index, top_k_weights)`. Its parameters
        must be DTensors sharded along dim 0 over `mesh_dim` (and replicated over the other mesh dims):
        `distribute_module(model, mesh, {r"\\.experts\\.\\w*bias$": [mesh_dim, UNSHARDED],
        r"\\.experts\\.": [mesh_dim, UNSHARDED, UNSHARDED]})`.
      mesh_dim: the mesh dimension the experts are spread over.
      token_dims: the mesh dims the tokens' rows are sharded over, major first, `mesh_dim` among them (default: it
        alone). The arguments are relayouted to rows sharded so, which is free where they already are. With
        `("data", mesh_dim)` each group of devices along `mesh_dim` exchanges its tokens (expert parallel within
        data parallel): the experts are copies over "data", and their gradients are summed over it as a
        replicated parameter's.
      capacity_factor: None (default): no token is dropped. A number f: each expert takes at most
        ceil(f · k · tokens / experts) tokens from each device, and drops the rest.

    >>> from transformers import MixtralConfig
    >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    >>> mesh = create_mesh([("batch", 2)])
    >>> layer = MixtralExperts(MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4))
    >>> _ = torch.nn.init.normal_(layer.gate_up_proj), torch.nn.init.normal_(layer.down_proj)
    >>> hidden, top_k = torch.randn(6, 8), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    >>> weights = torch.rand(6, 2)
    >>> expected = layer(hidden, top_k, weights)
    >>> layer = expert_parallel(distribute_module(layer, mesh, {".": ["batch", UNSHARDED, UNSHARDED]}), "batch")
    >>> rows = Layout(["batch", UNSHARDED], mesh)
    >>> got = layer(*(copy_to_mesh(t, rows) for t in (hidden, top_k, weights)))
    >>> torch.allclose(to_global(got), expected, atol=1e-5)
    True
    """
    if isinstance(experts.forward, _ExpertParallel):
        raise ValueError(f"expert_parallel: {type(experts).__name__} is already expert parallel")
    mesh, count = _check_sharded(experts, mesh_dim)
    token_dims = tuple(token_dims or (mesh_dim,))
    if mesh_dim not in token_dims or not set(token_dims) <= set(mesh.dim_names):
        raise LayoutError(f"expert_parallel: token_dims {token_dims} must be dimensions of the mesh "
                          f"({mesh.dim_names}), {mesh_dim!r} among them")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"expert_parallel: capacity_factor must be positive (or None: no token dropped), got "
                         f"{capacity_factor}")
    experts.forward = _ExpertParallel(experts, mesh, mesh_dim, token_dims, count, capacity_factor)
    return experts


def _check_sharded(experts: nn.Module, mesh_dim: str):
    """The mesh of `experts`' parameters and the number of experts; raises unless every parameter stacks them
    along dim 0 sharded over `mesh_dim` alone."""
    params = dict(experts.named_parameters())
    if not params or not all(isinstance(p, DTensor) for p in params.values()):
        raise TypeError(f"expert_parallel: the parameters of {type(experts).__name__} must be DTensors sharded over "
                        f"{mesh_dim!r} along dim 0; distribute the model first (spmd.distribute_module with a layout "
                        f"map giving them [{mesh_dim!r}, UNSHARDED, ...])")
    first = next(iter(params.values()))
    mesh = first._layout.mesh
    if mesh_dim not in mesh.dim_names:
        raise LayoutError(f"expert_parallel: the mesh has no dimension {mesh_dim!r}; its dimensions are "
                          f"{mesh.dim_names}")
    count = getattr(experts, "num_experts", first.shape[0])
    for name, p in params.items():
        layout = p._layout
        if layout.mesh != mesh or p.shape[0] != count or layout.axes[0] != mesh_dim or \
                layout.sharded_mesh_dims != (mesh_dim,):
            raise LayoutError(
                f"expert_parallel: parameter {name!r} of {type(experts).__name__} (shape {list(p.shape)}, layout "
                f"{layout.sharding_specs} on {layout.mesh!r}) must stack the {count} experts along dim 0, sharded "
                f"there over {mesh_dim!r} and nowhere else; give it [{mesh_dim!r}, UNSHARDED, ...] when "
                "distributing the model")
    return mesh, count


class _ExpertParallel:
    """The forward of an expert-parallel experts module (see the module's docstring for its steps)."""

    def __init__(self, experts: nn.Module, mesh, mesh_dim: str, token_dims: tuple, count: int,
                 capacity_factor: float | None):
        self.count, self.capacity_factor = count, capacity_factor
        self.shards = math.prod(mesh.dim_size(d) for d in token_dims)  # (of the tokens)
        senders = _axis(token_dims)
        rows = Layout([senders, U], mesh)
        self.sent = Layout([senders, U, U, U], mesh)  # [senders, experts, capacity, h]: a sender's slots
        # the same, each expert's slots on its device (the senders along mesh_dim moved to the experts' axis)
        self.received = Layout([_axis(tuple(d for d in token_dims if d != mesh_dim)), mesh_dim, U, U], mesh)
        self.counts = local_map(functools.partial(_tokens_per_expert, count=count), out_layouts=rows,
                                in_layouts=(rows,))
        self.run_experts = local_map(_LocalExperts(experts, experts.forward), out_layouts=self.received)
        self.dispatch = local_map(functools.partial(_to_slots, count=count), out_layouts=(self.sent, rows),
                                  in_layouts=(rows, rows, None))
        self.combine = local_map(_from_slots, out_layouts=rows, in_layouts=(self.sent, rows, rows))

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        room = torch.empty(0, self._capacity(hidden.shape[0], top_k_index))  # (its shape: the slots per expert)
        sent, slots = self.dispatch(hidden, top_k_index, room)
        done = self.run_experts(relayout(sent, self.received))  # all-to-all there, experts, all-to-all back
        return self.combine(relayout(done, self.sent), slots, top_k_weights)

    def _capacity(self, tokens: int, top_k_index) -> int:
        per_device = tokens // self.shards
        if self.capacity_factor is not None:
            return max(1, math.ceil(self.capacity_factor * per_device * top_k_index.shape[1] / self.count))
        if torch.compiler.is_compiling():  # (a graph's shapes are static: room for all of a device's tokens)
            return max(1, per_device)
        return max(1, int(self.counts(top_k_index).max()))


def _axis(dims: tuple):
    """One axis's sharding over `dims`: unsharded, one mesh dim, or several (major first)."""
    return U if not dims else dims[0] if len(dims) == 1 else dims


def _tokens_per_expert(top_k_index: torch.Tensor, count: int) -> torch.Tensor:
    return F.one_hot(top_k_index.reshape(-1), count).sum(0, keepdim=True)


def _to_slots(hidden: torch.Tensor, top_k_index: torch.Tensor, room: torch.Tensor, count: int):
    """A device's tokens in their experts' slots, `[1, experts, capacity, h + 1]` (capacity: `room.shape[1]`; the
    last column is 1 in a filled slot, 0 in an empty one), and each (token, choice)'s slot (`experts * capacity`,
    past the end, where its expert is full)."""
    capacity = room.shape[1]
    expert = top_k_index.reshape(-1)
    position = (F.one_hot(expert, count).cumsum(0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1)
    slot = torch.where(position < capacity, expert * capacity + position, count * capacity)
    filled = torch.cat([hidden, hidden.new_ones(hidden.shape[0], 1)], 1)
    copies = filled.repeat_interleave(top_k_index.shape[1], 0)
    slots = filled.new_zeros(count * capacity + 1, filled.shape[1]).index_copy(0, slot, copies)
    return slots[:-1].view(1, count, capacity, -1), slot.view(top_k_index.shape)


def _from_slots(done: torch.Tensor, slot: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each token's results from its experts' slots, weighted by its routing weights and summed (a dropped
    choice's result is zero)."""
    flat = done.reshape(-1, done.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    picked = flat[slot.reshape(-1)].view(*slot.shape, -1)
    return (picked * top_k_weights.unsqueeze(-1)).sum(1).to(done.dtype)


class _LocalExperts(nn.Module):
    """A device's experts over the slots it received, `[senders, its experts, capacity, h + 1]`, by the experts
    module's own forward: a filled slot's row routed to its one expert with weight 1, an empty slot's to the id past
    the device's experts with weight 0 (HuggingFace's expert-parallel protocol: its forwards skip those rows)."""

    def __init__(self, experts: nn.Module, forward):
        super().__init__()
        self.experts, self.experts_forward = experts, forward

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        senders, mine, capacity, width = received.shape
        rows = received.transpose(0, 1).reshape(-1, width)
        rows, filled = rows[:, :-1], rows[:, -1:] > 0
        ids = torch.arange(mine, device=rows.device).repeat_interleave(senders * capacity).unsqueeze(1)
        with _device_experts(self.experts, mine):
            out = self.experts_forward(rows, torch.where(filled, ids, mine), filled.to(rows.dtype))
        out = torch.where(filled, out, 0)  # (whatever a forward leaves in the rows it skips)
        return out.view(mine, senders, capacity, width - 1).transpose(0, 1)


@contextlib.contextmanager
def _device_experts(experts: nn.Module, count: int):
    """For a call: `experts.num_experts` (which HuggingFace's forwards read) set to the experts a device holds, and
    HuggingFace's `_is_expert_parallel` (its forwards then skip the ids from `num_experts` on) to True."""
    during = {"num_experts": count, "_is_expert_parallel": True}
    saved = {name: getattr(experts, name) for name in during if hasattr(experts, name)}
    for name in saved:
        setattr(experts, name, during[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(experts, name, value)
