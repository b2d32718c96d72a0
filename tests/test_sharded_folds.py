"""linear, matmul and einsum, which torch folds into one matrix product: a sharded axis behind a whole one among
the folded axes (sequence-first activations with a sharded batch, sequence-parallel rows, attention heads sharded
over a whole batch), or behind a sharded one of several rows per device (context parallelism), stays sharded, with
no collective — values and gradients in every layout as plain torch's."""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U, Layout
from sweep import MESH, check_op, issued, rand, reduce_gradients

CASES = {
    "linear [S, B, E]": (lambda x, w, b: F.linear(x, w, b), [rand(4, 4, 6), rand(8, 6), rand(8)]),
    "linear 4-D, no bias": (lambda x, w: F.linear(x, w), [rand(2, 2, 4, 6), rand(8, 6)]),
    "matmul 3-D @ 2-D": (torch.matmul, [rand(4, 4, 6), rand(6, 4)]),
    "matmul 3-D @ 1-D": (torch.matmul, [rand(4, 4, 6), rand(6)]),
    "matmul batched 4-D": (torch.matmul, [rand(2, 4, 3, 6), rand(2, 4, 6, 3)]),
    "matmul batched, broadcast": (torch.matmul, [rand(4, 3, 6), rand(2, 4, 6, 3)]),
    "einsum attention scores": (lambda q, k: torch.einsum("bhld,bhsd->bhls", q, k),
                                [rand(2, 4, 3, 6), rand(2, 4, 3, 6)]),
    "einsum seq-first linear": (lambda x, w: torch.einsum("sbe,oe->sbo", x, w), [rand(4, 4, 6), rand(8, 6)]),
    "einsum attention values": (lambda p, v: torch.einsum("bhls,bhsd->blhd", p, v),
                                [rand(2, 4, 3, 3), rand(2, 4, 3, 6)]),
}


@pytest.mark.parametrize("case", CASES)
def test_every_layout_equals_torch(case):
    fn, inputs = CASES[case]
    assert check_op(fn, inputs, sample=40) > 1


def _dist(x, specs, mesh=MESH):
    return spmd.copy_to_mesh(x, Layout(specs, mesh)).requires_grad_()


# (function, inputs with their layouts, the output's expected layout)
NO_GATHER = {
    "seq-first linear, batch sharded": (lambda x, w: F.linear(x, w), [(rand(4, 4, 6), [U, "x", U]),
                                                                       (rand(8, 6), [U, U])], [U, "x", U]),
    "sequence-parallel linear": (lambda x, w: F.linear(x, w), [(rand(4, 4, 6), [U, "y", U]),
                                                               (rand(8, 6), [U, U])], [U, "y", U]),
    "heads sharded, batch whole": (torch.matmul, [(rand(2, 4, 3, 6), [U, "y", U, U]),
                                                  (rand(2, 4, 6, 3), [U, "y", U, U])], [U, "y", U, U]),
    "einsum heads sharded": (lambda q, k: torch.einsum("bhld,bhsd->bhls", q, k),
                             [(rand(2, 4, 3, 6), [U, "x", U, U]), (rand(2, 4, 3, 6), [U, "x", U, U])],
                             [U, "x", U, U]),
    "batch and heads sharded": (torch.matmul, [(rand(4, 4, 3, 6), ["x", "y", U, U]),
                                               (rand(4, 4, 6, 3), ["x", "y", U, U])], ["x", "y", U, U]),
    "einsum batch and heads sharded": (lambda q, k: torch.einsum("bhld,bhsd->bhls", q, k),
                                       [(rand(4, 4, 3, 6), ["x", "y", U, U]), (rand(4, 4, 3, 6), ["x", "y", U, U])],
                                       ["x", "y", U, U]),
    "einsum batch and heads sharded, values": (lambda p, v: torch.einsum("bhls,bhsd->blhd", p, v),
                                               [(rand(4, 4, 3, 3), ["x", "y", U, U]),
                                                (rand(4, 4, 3, 6), ["x", "y", U, U])], ["x", U, "y", U]),
    # two rows per device and a sharded sequence: no order of the axes keeps each device's rows one block of the
    # fold; the sharded axes are split into their shards and each shard's rows, the shards first
    "batch and sequence sharded, linear": (lambda x, w: F.linear(x, w), [(rand(4, 4, 6), ["x", "y", U]),
                                                                         (rand(8, 6), [U, U])], ["x", "y", U]),
    "batch and sequence sharded, matmul": (torch.matmul, [(rand(4, 4, 6), ["x", "y", U]), (rand(6, 8), [U, U])],
                                           ["x", "y", U]),
    "batch and sequence sharded, einsum": (lambda x, w: torch.einsum("bsh,oh->bso", x, w),
                                           [(rand(4, 4, 6), ["x", "y", U]), (rand(8, 6), [U, U])], ["x", "y", U]),
    # (torch merges a pair's batch labels apart from each operand's own: nothing to split)
    "batch and sequence sharded, einsum with a batch label": (lambda x, y: torch.einsum("bsh,bhd->bsd", x, y),
                                                              [(rand(4, 4, 6), ["x", "y", U]),
                                                               (rand(4, 6, 3), ["x", U, U])], ["x", "y", U]),
    "two sharded axes around a whole one, linear": (lambda x, w: F.linear(x, w),
                                                    [(rand(4, 3, 4, 6), ["x", U, "y", U]), (rand(8, 6), [U, U])],
                                                    ["x", U, "y", U]),
}


@pytest.mark.parametrize("case", NO_GATHER)
def test_no_collective_in_the_forward(case):
    fn, inputs, out_specs = NO_GATHER[case]
    args = [_dist(x, specs) for x, specs in inputs]
    out, collectives = issued(lambda: fn(*args))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == out_specs
    want = fn(*[x for x, _ in inputs])
    torch.testing.assert_close(spmd.to_global(out), want)
    assert out.stride() == want.stride()  # as torch's: a following view works where it works on torch's


def test_seq_first_training_step_reduces_only_the_weight_gradient():
    """A sequence-first linear with a batch-sharded input and a replicated weight: the backward's one collective
    is the weight gradient's sum over the batch."""
    x, w, g = rand(4, 4, 6), rand(8, 6), rand(4, 4, 8)
    dx, dw = _dist(x, [U, "x", U]), _dist(w, [U, U])
    dg = spmd.copy_to_mesh(g, Layout([U, "x", U], MESH))
    _, collectives = issued(lambda: ((F.linear(dx, dw) * dg).sum().backward(), reduce_gradients([dw])))
    assert collectives == [("all_reduce", ("x",))]  # (the loss stays a pending sum: nothing reads it)
    xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
    (F.linear(xp, wp) * g).sum().backward()
    torch.testing.assert_close(spmd.to_global(dw.grad), wp.grad)
    torch.testing.assert_close(spmd.to_global(dx.grad), xp.grad)
    assert spmd.fetch_layout(dx.grad).sharding_specs == [U, "x", U]


def test_batch_and_sequence_sharded_training_step_reduces_only_the_weight_gradient():
    """A linear layer on a batch of two rows per device with a sharded sequence (context parallelism): forward and
    backward keep both sharded, the one collective is the weight gradient's sum over both mesh dims."""
    x, w, g = rand(4, 4, 6), rand(8, 6), rand(4, 4, 8)
    dx, dw = _dist(x, ["x", "y", U]), _dist(w, [U, U])
    dg = spmd.copy_to_mesh(g, Layout(["x", "y", U], MESH))
    _, collectives = issued(lambda: ((F.linear(dx, dw) * dg).sum().backward(), reduce_gradients([dw])))
    assert collectives == [("all_reduce", ("x", "y"))]
    xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
    (F.linear(xp, wp) * g).sum().backward()
    torch.testing.assert_close(spmd.to_global(dw.grad), wp.grad)
    torch.testing.assert_close(spmd.to_global(dx.grad), xp.grad)
    assert spmd.fetch_layout(dx.grad).sharding_specs == ["x", "y", U]


def test_batch_and_sequence_sharded_linear_under_function_mode_moves_nothing_but_the_sums():
    """The same fold traced by spmd.function: forward reduces only the returned sum, backward only the weight's
    gradient; values as plain torch's."""
    x, w = rand(4, 4, 6), rand(8, 6)
    dx, dw = _dist(x, ["x", "y", U]), _dist(w, [U, U])

    def fn(a, b):
        return F.linear(a, b).pow(2).sum()
    step = spmd.function(fn, backend="aot_eager")
    explained = step.explain(dx, dw, backward=True)
    assert [(c.kind, c.mesh_dims, c.backward) for c in explained.collectives] == [
        ("all_reduce", ("x", "y"), False), ("all_reduce", ("x", "y"), True)]
    torch.testing.assert_close(spmd.to_global(step(dx, dw)), fn(x, w))


def test_attention_with_batch_and_heads_sharded_trains_without_a_collective():
    """Hand-written attention (nanoGPT's) on [B, H, T, hd] sharded over batch and heads, forward and backward,
    eager and under spmd.function: no collective, values and gradients as plain torch's."""
    q, k, v = rand(4, 4, 3, 6), rand(4, 4, 3, 6, seed=1), rand(4, 4, 3, 6, seed=2)

    def attention(q, k, v):
        return ((q @ k.transpose(-2, -1)) * 6 ** -0.5).softmax(-1) @ v
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    attention(*plain).pow(2).sum().backward()
    for run in (attention, spmd.function(attention)):
        dist = [_dist(x, ["x", "y", U, U]) for x in (q, k, v)]
        out, collectives = issued(lambda: run(*dist))
        assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y", U, U]
        torch.testing.assert_close(spmd.to_global(out), attention(q, k, v))
        out.pow(2).sum().backward()
        for d, p in zip(dist, plain):
            torch.testing.assert_close(spmd.to_global(d.grad), p.grad)
