"""In-place ops: through views (a view that needed a relayout holds a copy, written back into its base), under
autograd, refused where no write-back exists, and `out=` variants — in every layout, on 2x2 and 1-D meshes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from sweep import MESH, all_layouts, check_replicas, distribute, gather, rand

MESH_LINE = spmd.create_mesh([("x", 2)])

WRITES_THROUGH_VIEWS = {
    "diagonal().add_": lambda t: t.diagonal().add_(1.0),
    "fill_diagonal_": lambda t: t.fill_diagonal_(0.5),
    "[:, 1:3].mul_": lambda t: t[:, 1:3].mul_(2),
    "[:, 1:3] *= 2": lambda t: t.__setitem__((slice(None), slice(1, 3)), t[:, 1:3] * 2),
    "[1].zero_": lambda t: t[1].zero_(),
    "[1:3, 1:3].diagonal().add_": lambda t: t[1:3, 1:3].diagonal().add_(1.0),  # a view of a view
    "[:, 1:4][0].zero_": lambda t: t[:, 1:4][0].zero_(),
    "as_strided().mul_": lambda t: t.as_strided((2, 2), (1, 6), 1).mul_(3),
    "[0, 1] = 7.0": lambda t: t.__setitem__((0, 1), 7.0),  # (torch: copy_ from a plain 0-d tensor)
    "[3][2] = -1.0": lambda t: t[3].__setitem__(2, -1.0),
    "[:, 0] = 2.5": lambda t: t.__setitem__((slice(None), 0), 2.5),
    "view(24).add_": lambda t: t.view(24).add_(1.0),  # a reshape across shards: shaped back
    "view(24)[2:5].mul_": lambda t: t.view(24)[2:5].mul_(3),
    "view(2, 12)[1].zero_": lambda t: t.view(2, 12)[1].zero_(),
    "flatten()[::5].add_": lambda t: t.flatten()[::5].add_(1.0),
}


@pytest.mark.parametrize("layout", all_layouts(MESH, (4, 6)) + all_layouts(MESH_LINE, (4, 6)),
                         ids=lambda l: "x".join(map(str, l.mesh.shape())) + ":" + ",".join(l.sharding_specs))
@pytest.mark.parametrize("name", list(WRITES_THROUGH_VIEWS))
def test_an_in_place_op_on_a_view_reaches_its_base_in_every_layout(name, layout):
    """A view that needed a relayout (a diagonal, row or column block across shards) holds a copy; an in-place op
    on it writes the copy back into its base through the view's scatter (diagonal_scatter, select_scatter, ...),
    as torch's functionalization does: the base keeps its layout and every component equals plain torch's. (On a
    1-D mesh the copy is one that every device shares, written once.)"""
    fn, x = WRITES_THROUGH_VIEWS[name], rand(4, 6)
    want = x.clone()
    fn(want)
    d = distribute(x, layout)
    fn(d)
    assert spmd.fetch_layout(d) == layout
    torch.testing.assert_close(gather(d), want, rtol=0, atol=0)
    check_replicas(d)


@pytest.mark.parametrize("view", [lambda y: y.diagonal(), lambda y: y.view(-1)], ids=["diagonal", "view(-1)"])
def test_gradients_flow_through_an_in_place_op_on_a_copied_view(view):
    """Also where autograd replays the view on a gradient that needs a relayout for it (`view(-1)` of a gradient
    sharded by `w`), and writes into it."""
    x, w = rand(4, 4), rand(4, 4, seed=1)

    def f(t, w):
        y = t * 2
        view(y).mul_(3)
        return (y ** 2 * w).sum()
    ref = x.clone().requires_grad_()
    f(ref, w).backward()
    d = distribute(x, spmd.Layout(["x", "y"], MESH)).requires_grad_()
    loss = f(d, distribute(w, spmd.Layout([spmd.UNSHARDED, "x"], MESH)))
    loss.backward()
    torch.testing.assert_close(gather(loss), f(x, w))
    torch.testing.assert_close(gather(d.grad), ref.grad)


@pytest.mark.parametrize("mesh", [MESH, MESH_LINE], ids=["2x2", "2"])
def test_in_place_op_on_a_computed_view_is_refused(mesh):
    """A view copied by an op with no scatter to write it back (conj), or a view of such a copy, refuses an in-place
    op before anything is written (also on a 1-D mesh, where the copy is one that every device shares)."""
    z = spmd.copy_to_mesh(torch.randn(4, 4, dtype=torch.complex128), spmd.Layout(["x", spmd.UNSHARDED], mesh))
    before = gather(z).clone()
    for view in (z.conj(), z.conj()[1:3]):
        with pytest.raises(spmd.UnsupportedOpError, match="in-place op on a view"):
            view.add_(1)
        assert torch.equal(gather(z), before)


def test_out_variants_write_the_functional_result_into_out_in_its_layout():
    """`op(..., out=t)` (torch's own `F.normalize(..., out=)` in spectral norm's power iteration): the functional op,
    then a copy into `t`, which keeps its layout; a result of another shape is refused."""
    x, y = rand(4, 4), rand(4, 4, seed=1)
    dx, dy = distribute(x, spmd.Layout(["x", spmd.UNSHARDED], MESH)), distribute(y, spmd.Layout(["y", "x"], MESH))
    out = distribute(torch.zeros(4, 4, dtype=x.dtype), spmd.Layout([spmd.UNSHARDED, "y"], MESH))
    assert torch.div(dx, dy, out=out) is out
    torch.testing.assert_close(gather(out), x / y)
    F.normalize(dx, dim=1, out=out)
    torch.testing.assert_close(gather(out), F.normalize(x, dim=1))
    assert spmd.fetch_layout(out).sharding_specs == [spmd.UNSHARDED, "y"]
    with pytest.raises(spmd.UnsupportedOpError, match="out="):
        torch.sum(dx, 0, out=out)
