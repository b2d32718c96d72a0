"""Contractions (mm, bmm, addmm, baddbmm, mv, dot) through one einsum-labelled rule.

Why the rule holds: a sharded contracted label turns each local product into a partial sum over that mesh
dim (one all-reduce completes it); a sharded free label simply carries to the output. Label priorities follow
TF DTensor's matmul rule: free labels beat contracted labels beat batch labels for a mesh dim, and two free
labels on one mesh dim both become unsharded.
"""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall

aten = torch.ops.aten
_FREE, _CONTRACTED, _BATCH = 2, 1, 0


def einsum_axes(equation: str, operands: list[tuple]) -> tuple[list[tuple], tuple, tuple]:
    """For an einsum `equation` and per-operand axes: (required axes per operand, output axes, reduced dims)."""
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    kind, choice = {}, {}
    for label in dict.fromkeys(lhs.replace(",", "")):
        users = sum(label in t for t in terms)
        kind[label] = _CONTRACTED if label not in out else (_BATCH if users > 1 else _FREE)
        sharded = [axes[t.index(label)] for t, axes in zip(terms, operands)
                   if label in t and axes[t.index(label)] is not None]
        # batch labels prefer the last operand's sharding (TF: "b's spec if sharded, else a's")
        choice[label] = (sharded[-1] if kind[label] == _BATCH else sharded[0]) if sharded else None
    by_dim: dict = {}
    for label, m in choice.items():
        if m is not None:
            by_dim.setdefault(m, []).append(label)
    for m, labels in by_dim.items():
        if len(labels) < 2:
            continue
        best = max(kind[l] for l in labels)
        winners = [l for l in labels if kind[l] == best]
        keep = None if (best == _FREE and len(winners) > 1) else winners[0]
        for l in labels:
            if l != keep:
                choice[l] = None
    required = [tuple(choice.get(l) for l in term) for term in terms]
    reduced = tuple(choice[l] for l in dict.fromkeys(lhs.replace(",", "")) if kind[l] == _CONTRACTED
                    and choice.get(l) is not None)
    return required, tuple(choice.get(l) for l in out), reduced


def _mm_kernel(locals_, args, kwargs):
    return torch.bmm(locals_[0], locals_[1])


def _bmm_kernel(locals_, args, kwargs):
    return torch.matmul(locals_[0], locals_[1])


def _contraction(call: OpCall, equation: str, kernel) -> Decision:
    specs = call.specs
    required, out_axes, reduced = einsum_axes(equation, [s.axes for s in specs])
    return Decision(tuple(required), (out_axes,), kernel, reduce=(reduced,) if reduced else ())


@register(aten.mm.default, blockwise=True)
def mm_rule(call: OpCall) -> Decision:
    return _contraction(call, "mk,kn->mn", _mm_kernel)


@register(aten.bmm.default, blockwise=True)
def bmm_rule(call: OpCall) -> Decision:
    return _contraction(call, "bmk,bkn->bmn", _bmm_kernel)


@register(aten.mv.default, blockwise=True)
def mv_rule(call: OpCall) -> Decision:
    return _contraction(call, "mk,k->m", lambda l, a, k: torch.matmul(l[0], l[1].unsqueeze(-1)).squeeze(-1))


@register(aten.dot.default, blockwise=True)
def dot_rule(call: OpCall) -> Decision:
    return _contraction(call, "k,k->", lambda l, a, k: (l[0] * l[1]).sum(-1))


@register(aten.addmm.default, aten.baddbmm.default)
def addmm_rule(call: OpCall) -> Decision:
    """out = beta * bias + alpha * (a @ b). With a pending sum the bias is added once, after the reduction."""
    batched = call.func is aten.baddbmm.default
    bias, a, b = call.specs
    required, out_axes, reduced = einsum_axes("bmk,bkn->bmn" if batched else "mk,kn->mn", [a.axes, b.axes])
    out_shape = (a.shape[0], a.shape[1], b.shape[2]) if batched else (a.shape[0], b.shape[1])
    r = len(out_shape)
    bias_axes = tuple(None if (bias.shape[j] == 1 and out_shape[j + r - bias.rank] != 1)
                      else out_axes[j + r - bias.rank] for j in range(bias.rank))
    bias_view = (call.num_local,) + (1,) * (r - bias.rank) + call.local_shape(bias, bias_axes)

    def product(locals_, args, kwargs):
        out = torch.matmul(locals_[1], locals_[2])
        alpha = kwargs.get("alpha", 1)
        return out if alpha == 1 else out.mul_(alpha)

    def add_bias(out, locals_, kwargs):
        beta = kwargs.get("beta", 1)
        return out if beta == 0 else out.add_(locals_[0].view(bias_view), alpha=beta)

    if reduced:
        return Decision((bias_axes, *required), (out_axes,), product, reduce=(reduced,),
                        epilogue=lambda outs, locals_, args, kwargs: [add_bias(outs[0], locals_, kwargs)])
    return Decision((bias_axes, *required), (out_axes,),
                    lambda locals_, args, kwargs: add_bias(product(locals_, args, kwargs), locals_, kwargs))
