"""A small GPT-style language model in plain torch (nothing spmd-specific), and its Megatron layout map."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from spmd.layout import UNSHARDED as U


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # separate q/k/v projections: sharding their output features shards whole heads
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (f(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                   for f in (self.q, self.k, self.v))
        # one fused op: batch and head axes keep their sharding (a 4-D matmul would merge them into one axis)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx, positions, targets):
        x = self.drop(self.tok(idx) + self.pos(positions))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def megatron_layouts(model: str | None = "model") -> dict[str, list[str]]:
    """Parameter-name regex -> sharding specs: column-parallel q/k/v/fc, row-parallel proj/fc2,
    vocabulary-parallel token embedding and LM head. Anything unmatched is replicated."""
    if model is None:
        return {}
    return {r"attn\.(q|k|v)\.weight$": [model, U], r"attn\.(q|k|v)\.bias$": [model],
            r"attn\.proj\.weight$": [U, model], r"mlp\.fc\.weight$": [model, U], r"mlp\.fc\.bias$": [model],
            r"mlp\.fc2\.weight$": [U, model], r"^tok\.weight$": [model, U], r"^head\.weight$": [model, U]}
