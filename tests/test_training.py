"""End-to-end parity: a transformer block and an MLP train on sharded meshes exactly as in plain torch."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED, Layout

U = UNSHARDED


class Block(nn.Module):
    """A GPT-style block: embeddings, causal self-attention, MLP, layer norms, a tied-free LM head."""

    def __init__(self, vocab=32, d=16, heads=2, seq=8):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, positions, causal):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(positions)
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = F.softmax(att.masked_fill(causal == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, -1)  # (B, T, C)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x))


MEGATRON = {"qkv.weight": ["model", U], "qkv.bias": ["model"], "proj.weight": [U, "model"],
            "fc.weight": ["model", U], "fc.bias": ["model"], "fc2.weight": [U, "model"],
            "tok.weight": [U, "model"]}


def _distribute(module, mesh, layouts):
    for name, p in list(module.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        specs = layouts.get(name, [U] * p.dim())
        setattr(owner, attr, spmd.DVariable(p.detach().clone(), layout=Layout(specs, mesh)))
    return module


def _step_losses(model, idx, targets, positions, causal, opt_cls, steps, **opt_kwargs):
    opt = opt_cls(model.parameters(), **opt_kwargs)
    losses = []
    for _ in range(steps):
        logits = model(idx, positions, causal)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mesh_dims,batch", [([("batch", 2), ("model", 2)], "batch"),
                                             ([("batch", 4)], "batch"), ([("model", 2)], U)])
@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                            (torch.optim.AdamW, {"lr": 1e-2})])
def test_transformer_block_matches_plain_torch(mesh_dims, batch, opt_cls, kwargs):
    torch.manual_seed(0)
    ref = Block().double()
    mesh = spmd.create_mesh(mesh_dims)
    model = _distribute(Block().double(), mesh, MEGATRON if "model" in dict(mesh_dims) else {})
    for p, q in zip(model.parameters(), ref.parameters()):  # same initial values
        p.assign(spmd.copy_to_mesh(q.detach(), spmd.fetch_layout(p)))
    idx, targets = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    causal = torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8)
    data = Layout([batch, U], mesh)
    d_losses = _step_losses(model, spmd.copy_to_mesh(idx, data), spmd.copy_to_mesh(targets, data),
                            spmd.copy_to_mesh(torch.arange(8), Layout([U], mesh)),
                            spmd.copy_to_mesh(causal, Layout.replicated(mesh, 4)), opt_cls, 3, **kwargs)
    r_losses = _step_losses(ref, idx, targets, torch.arange(8), causal, opt_cls, 3, **kwargs)
    assert d_losses == pytest.approx(r_losses, rel=1e-9)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        expected = MEGATRON.get(name, [U] * p.dim()) if "model" in dict(mesh_dims) else [U] * p.dim()
        assert spmd.fetch_layout(p).sharding_specs == expected, name  # training keeps every layout
        torch.testing.assert_close(spmd.to_global(p), q.detach(), rtol=1e-9, atol=1e-12)


def test_gradients_from_autograd_grad_can_be_scaled_in_place():
    """`torch.autograd.grad`'s weight gradient of a batch-sharded step is autograd's transpose of a pending sum (a
    view that resolves apart from its base): an in-place op on it (manual clipping, scaling) writes through."""
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 4)
    model = spmd.distribute_module(copy.deepcopy(plain), mesh)
    x = torch.randn(8, 8)
    got = torch.autograd.grad(model(spmd.copy_to_mesh(x, Layout(["batch", UNSHARDED], mesh))).pow(2).mean(),
                              [model.weight, model.bias])
    want = torch.autograd.grad(plain(x).pow(2).mean(), [plain.weight, plain.bias])
    for grads in (got, want):
        grads[0].mul_(2)
        torch._foreach_mul_(list(grads), 0.5)
    for g, w in zip(got, want):
        torch.testing.assert_close(spmd.to_global(g), w)
