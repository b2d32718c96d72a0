"""Grouped matrix products (`torch._grouped_mm`, the experts of HuggingFace's mixture-of-experts layers): every
layout gives torch's values and gradients; experts sharded over a mesh dim (expert parallelism) compute only their
own rows and leave one pending sum."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, Const, check_op, issued, rand

OFFSETS = torch.tensor([2, 2, 5, 8], dtype=torch.int32)  # 4 experts over 8 rows, expert 1 without any


def _layout(*specs):
    return Layout(list(specs), MESH)


def _grouped(a, b, offs=None):
    return torch._grouped_mm(a, b, offs=offs)


@pytest.mark.parametrize("shapes, offsets", [
    (((8, 4), (4, 4, 4)), True),  # rows sorted by expert @ each expert's weight
    (((4, 8), (8, 4)), True),  # each expert's columns @ its rows: the experts' weight gradient
    (((2, 4, 4), (2, 4, 4)), False),  # batched
], ids=["rows_by_expert", "columns_by_expert", "batched"])
def test_grouped_mm_matches_torch_for_every_layout(shapes, offsets):
    inputs = [rand(*shapes[0], dtype=torch.float32), rand(*shapes[1], dtype=torch.float32, seed=1)]
    if offsets:
        inputs.append(Const(OFFSETS))
    assert check_op(_grouped, inputs, sample=40) >= 30


def test_sharded_experts_multiply_their_own_rows_and_leave_one_sum():
    x, w = rand(8, 4, dtype=torch.float32), rand(4, 4, 8, dtype=torch.float32, seed=1)
    dx = spmd.copy_to_mesh(x, _layout(U, U))
    dw = spmd.copy_to_mesh(w, _layout("y", U, "x"))  # experts over y, output features over x
    offs = spmd.copy_to_mesh(OFFSETS, _layout(U))
    out, collectives = issued(lambda: _grouped(dx, dw, offs))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == [U, "x"]
    assert out._pending == ("y",)
    # device (x=0, y=1) holds experts 2 and 3: rows 2..7, zeros in expert 0's rows
    component = out._stack[1]
    assert torch.equal(component[:2], torch.zeros(2, 4))
    torch.testing.assert_close(component[2:], _grouped(x[2:], w[2:, :, :4].contiguous(), OFFSETS[2:] - 2))
    total, collectives = issued(lambda: spmd.to_global(out))
    assert ("all_reduce", ("y",)) in collectives
    torch.testing.assert_close(total, _grouped(x, w, OFFSETS))


def test_rows_sharded_are_gathered_for_the_offsets():
    """The offsets index the rows as a whole: rows sharded over x are all-gathered first (nothing else moves)."""
    x, w = rand(8, 4, dtype=torch.float32), rand(4, 4, 4, dtype=torch.float32, seed=1)
    dx, dw = spmd.copy_to_mesh(x, _layout("x", U)), spmd.copy_to_mesh(w, _layout(U, U, "y"))
    out, collectives = issued(lambda: _grouped(dx, dw, spmd.copy_to_mesh(OFFSETS, _layout(U))))
    assert collectives == [("all_gather", ("x",))]
    assert spmd.fetch_layout(out).sharding_specs == [U, "y"]
    torch.testing.assert_close(spmd.to_global(out), _grouped(x, w, OFFSETS))


def test_unsupported_forms_say_what_they_are():
    dx = spmd.copy_to_mesh(rand(8, 4, dtype=torch.float32), _layout(U, U))
    dw = spmd.copy_to_mesh(rand(4, 4, 4, dtype=torch.float32), _layout(U, U, U))
    with pytest.raises(spmd.UnsupportedOpError, match="2-D @ 3-D without offsets"):
        _grouped(dx, dw)

def test_plain_offsets_are_replicated_when_short():
    """As TF DTensor takes small integer tensors (indices, shapes): a layer of a few experts may pass plain offsets;
    a long plain tensor beside DTensors is an error."""
    x, w = rand(8, 4, dtype=torch.float32), rand(4, 4, 4, dtype=torch.float32, seed=1)
    dx, dw = spmd.copy_to_mesh(x, _layout("x", U)), spmd.copy_to_mesh(w, _layout("y", U, U))
    torch.testing.assert_close(spmd.to_global(_grouped(dx, dw, OFFSETS)), _grouped(x, w, OFFSETS))
    many = spmd.copy_to_mesh(rand(32, 4, 4, dtype=torch.float32), _layout(U, U, U))
    with pytest.raises(spmd.MixedTensorError):
        _grouped(dx, many, torch.arange(32, dtype=torch.int32) // 4)


def test_sharded_experts_trace_as_they_run():
    """The expert-parallel kernel reads no offset on the host: `spmd.function` traces it, forward and backward (in
    bfloat16: torch compiles no other dtype of it)."""
    x, w = rand(8, 8, dtype=torch.bfloat16), rand(4, 8, 8, dtype=torch.bfloat16, seed=1)
    dx = spmd.copy_to_mesh(x, _layout(U, U)).requires_grad_()
    dw = spmd.copy_to_mesh(w, _layout("y", U, "x")).requires_grad_()
    offs = spmd.copy_to_mesh(OFFSETS, _layout(U))

    def loss(a, b, o):
        return (_grouped(a, b, o) ** 2).sum()
    got = spmd.function(loss, backend="aot_eager", fullgraph=True)(dx, dw, offs)
    got.backward()
    px, pw = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = loss(px, pw, OFFSETS)
    want.backward()
    torch.testing.assert_close(got.item(), want.item(), rtol=1e-2, atol=0)
    for got_grad, want_grad in ((dx.grad, px.grad), (dw.grad, pw.grad)):  # (bfloat16's rounding, summed apart)
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(spmd.to_global(got_grad), want_grad, rtol=0, atol=0.02 * scale)
