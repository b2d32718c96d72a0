"""Many meshes: relayout between meshes for any source layout, and the RFC's distributed embedding."""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import all_layouts

COMPUTE = spmd.create_mesh([("batch", 2), ("model", 2)])
EMBEDDING = spmd.create_mesh([("e", 2)], mesh_name="embedding", devices=["CPU:8", "CPU:9"])


@pytest.mark.parametrize("src", all_layouts(COMPUTE, (4, 8)), ids=str)
@pytest.mark.parametrize("dst", all_layouts(EMBEDDING, (4, 8)), ids=str)
def test_relayout_between_meshes_any_source_layout(src, dst):
    value = torch.randn(4, 8, dtype=torch.float64)
    t = spmd.copy_to_mesh(value, src).requires_grad_()
    moved = spmd.relayout(t, dst)
    assert spmd.fetch_layout(moved) == dst
    torch.testing.assert_close(spmd.to_global(moved), value, rtol=0, atol=0)
    weights = torch.randn(4, 8, dtype=torch.float64)
    (spmd.to_global(moved) * weights).sum().backward()
    assert spmd.fetch_layout(t.grad) == src  # the gradient comes back to the source mesh and layout
    torch.testing.assert_close(spmd.to_global(t.grad), weights, rtol=0, atol=0)


def test_distributed_embedding_on_its_own_mesh():
    """The RFC's example: the table lives on a 2-device mesh sharded on the embedding axis; the lookup runs
    there; the activations move to the compute mesh with relayout_like; gradients flow back across meshes."""
    torch.manual_seed(0)
    table_value, proj_value = torch.randn(16, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    ids = torch.randint(0, 16, (4, 5))
    table = spmd.DVariable(table_value, layout=Layout([U, "e"], EMBEDDING))
    proj = spmd.DVariable(proj_value, layout=Layout([U, "model"], COMPUTE))
    batch = spmd.copy_to_mesh(ids, Layout(["batch", U], COMPUTE))
    like = spmd.zeros((4, 5, 6), dtype=torch.float64, layout=Layout(["batch", U, U], COMPUTE))

    looked_up = F.embedding(spmd.relayout(batch, Layout([U, U], EMBEDDING)), table)
    assert spmd.fetch_layout(looked_up).sharding_specs == [U, U, "e"]
    x = spmd.relayout_like(looked_up, like)
    loss = (x @ proj).square().sum()
    loss.backward()

    ref_table, ref_proj = table_value.clone().requires_grad_(), proj_value.clone().requires_grad_()
    ref_loss = (F.embedding(ids, ref_table) @ ref_proj).square().sum()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert spmd.fetch_layout(table.grad) == Layout([U, "e"], EMBEDDING)
    torch.testing.assert_close(spmd.to_global(table.grad), ref_table.grad)
    torch.testing.assert_close(spmd.to_global(proj.grad), ref_proj.grad)


def test_relayout_like_use_mesh_only_keeps_specs():
    t = spmd.copy_to_mesh(torch.arange(8.0), Layout(["batch"], COMPUTE))
    other = spmd.create_mesh([("batch", 4)], devices=[f"CPU:{i}" for i in range(4, 8)])
    moved = spmd.relayout_like(t, spmd.zeros((3,), layout=Layout([U], other)), use_mesh_only=True)
    assert spmd.fetch_layout(moved) == Layout(["batch"], other)
    assert spmd.to_global(moved).tolist() == list(range(8))
