"""One tensor axis sharded over several mesh dims (`Layout(["x+y", ...])`, JAX's `P(("x", "y"))`): the layout,
relayouts with their exact collectives, ops against plain torch, and the modules that read layouts."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import MATCH, UNSHARDED as U, Layout, LayoutError
from spmd.explain import Recorder
from spmd.random import stateless_uniform
from spmd.visualize import sharding_table
from sweep import all_layouts, check_op, check_replicas, rand
from test_relayout import check_components, expected_components, sweep_relayout

MESH = spmd.create_mesh([("x", 2), ("y", 2)])
MESH3 = spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])
XY, YX = Layout([("x", "y"), U], MESH), Layout([("y", "x"), U], MESH)


# -- the layout --------------------------------------------------------------------------------------------------------
def test_spec_forms_strings_and_values():
    assert Layout(["x+y", U], MESH) == XY == Layout([["x", "y"], U], MESH) == Layout.from_axes((("x", "y"), None), MESH)
    assert XY.sharding_specs == ["x+y", U] and XY.axes == (("x", "y"), None) and XY.multi_axis
    assert XY.outer_axes == ("x", None) and XY.sharded_mesh_dims == ("x", "y")
    assert XY.to_string().startswith("sharding_specs:x+y,unsharded, mesh:|x=2,y=2|")
    assert Layout.from_string(XY.to_string()) == XY and pickle.loads(pickle.dumps(XY)) == XY
    assert XY != YX and hash(XY) == hash(Layout(["x+y", U], MESH))
    # a tuple of one is that mesh dim; an ordinary layout is unchanged
    single = Layout([("x",), "y"], MESH)
    assert single == Layout(["x", "y"], MESH) and single.axes == ("x", "y") and not single.multi_axis
    assert single.to_string() == "sharding_specs:x,y, mesh:" + MESH.to_string()
    assert single.outer_axes is single.axes


def test_shapes_blocks_and_replicas():
    layout = Layout([("b", "a"), "c"], MESH3)
    assert layout.num_shards_per_axis() == [4, 2]
    assert layout.local_shape_from_global_shape((8, 6)) == (2, 3)
    assert layout.global_shape_from_local_shape((2, 3)) == (8, 6)
    # block index row-major over (b, a): b major
    assert layout.offset_to_shard() == [((b * 2 + a), c) for a, b, c in itertools.product(range(2), repeat=3)]
    partial = Layout([("c", "a"), U], MESH3)  # replicated over b
    assert [partial.is_first_replica(MESH3.device_location(i)) for i in range(8)] == \
        [b == 0 for a, b, c in itertools.product(range(2), repeat=3)]
    assert partial.delete(1) == Layout(["c+a"], MESH3)
    layout.check_divisible((8, 6))
    with pytest.raises(spmd.IndivisibleError, match=r"size 6, which does not divide by the 4 shards of mesh dimensions 'b\+a'"):
        Layout(["b+a", U], MESH3).check_divisible((6, 2))


@pytest.mark.parametrize("specs, words", [
    ([("x", "y"), "x"], "Mesh dimension x was repeated"),
    (["x+x", U], "Mesh dimension x was repeated"),
    (["x+z", U], r"z: A dimension sharding must .* \(in the multi-axis spec 'x\+z'\)"),
    ([("x", MATCH), U], "match: A dimension sharding"),
    ([("x", 1), U], "sharding_specs must be a list of strings"),
])
def test_layout_errors(specs, words):
    with pytest.raises(LayoutError, match=words):
        Layout(specs, MESH)


def test_plus_is_not_a_mesh_dim_character():
    with pytest.raises(LayoutError, match=r"mesh dimension name 'x\+y' is not allowed"):
        spmd.create_mesh([("x+y", 2)])


# -- relayout ----------------------------------------------------------------------------------------------------------
def test_every_pair_with_multi_axis_layouts_2x2():
    """values, every device's component and gradients, between all 11 layouts of a (4, 4) tensor on 2x2"""
    assert sweep_relayout(MESH, (4, 4), grad=True, multi=True) == 11 ** 2


def test_every_pair_with_multi_axis_layouts_2x2x2():
    assert sweep_relayout(MESH3, (8, 8), grad=False, multi=True) == 49 ** 2


def _kinds(fn):
    with Recorder() as explanation:
        out = fn()
    return out, [(str(c.kind), c.mesh_dims) for c in explanation.collectives]


@pytest.mark.parametrize("src, dst, expected", [
    ([("x", "y"), U], ["x", U], [("all_gather", ("y",))]),
    (["x", U], [("x", "y"), U], []),  # a local slice
    ([U, U], [("x", "y"), U], []),
    ([("x", "y"), U], [("y", "x"), U], [("permute", ("y", "x"))]),
    ([("x", "y"), U], ["y", U], [("permute", ("y", "x")), ("all_gather", ("x",))]),
    ([("x", "y"), U], [U, ("x", "y")], [("all_gather", ("y",)), ("all_to_all", ("x",))]),
    ([("x", "y"), U], [U, ("y", "x")], [("all_to_all", ("y",)), ("all_to_all", ("x",))]),
    (["x", "y"], [("x", "y"), U], [("all_to_all", ("y",))]),
    ([("x", "y"), U], ["x", "y"], [("all_to_all", ("y",))]),
])
def test_fewest_collectives(src, dst, expected):
    x = rand(8, 8)
    t = spmd.copy_to_mesh(x, Layout(src, MESH))
    out, kinds = _kinds(lambda: spmd.relayout(t, Layout(dst, MESH)))
    assert kinds == expected
    check_components(out, x)


def _close_components(t, x):
    for got, want in zip(spmd.unpack(t), expected_components(x, spmd.fetch_layout(t))):
        torch.testing.assert_close(got, want)


def test_pending_sums_reduce_scatter_into_a_multi_axis_shard():
    a, b = rand(8, 8), rand(8, 8, seed=1)
    da, db = spmd.copy_to_mesh(a, Layout([U, ("x", "y")], MESH)), spmd.copy_to_mesh(b, XY)
    product = da @ db  # a contraction over the (x, y)-sharded axis: pending over both
    assert product._pending == ("x", "y")
    out, kinds = _kinds(lambda: spmd.relayout(product, XY))
    assert kinds == [("reduce_scatter", ("x",)), ("reduce_scatter", ("y",))]
    _close_components(out, a @ b)
    # pending over y only: x is sliced locally, y reduce-scattered
    da, db = spmd.copy_to_mesh(a, Layout([U, "y"], MESH)), spmd.copy_to_mesh(b, Layout(["y", U], MESH))
    out, kinds = _kinds(lambda: spmd.relayout(da @ db, XY))
    assert kinds == [("reduce_scatter", ("y",))]
    _close_components(out, a @ b)


def test_pack_unpack_copy_to_mesh_and_other_meshes():
    x = rand(8, 4)
    comps = [x[i * 2:(i + 1) * 2] for i in range(4)]
    t = spmd.pack(comps, XY)
    assert torch.equal(spmd.to_global(t), x)
    assert all(torch.equal(a, b) for a, b in zip(spmd.unpack(t), comps))
    y = spmd.copy_to_mesh(x, YX)  # device (x, y) holds block y * 2 + x
    assert torch.equal(spmd.unpack(y)[1], x[4:6]) and torch.equal(spmd.unpack(y)[2], x[2:4])
    other = spmd.create_mesh([("p", 2), ("q", 2)], devices=[f"CPU:{i}" for i in range(4, 8)])
    moved = spmd.relayout(t, Layout([("q", "p"), U], other))
    check_components(moved, x)
    back = spmd.relayout(moved, Layout([MATCH, U], other))
    assert spmd.fetch_layout(back) == Layout(["q+p", U], other)
    assert torch.equal(spmd.to_global(spmd.copy_to_mesh(moved, XY)), x)


# -- ops ---------------------------------------------------------------------------------------------------------------
def _multi(*shapes, mesh=MESH):
    """Per input: the layouts of its shape with some axis sharded over several mesh dims, and replicated."""
    return [[l for l in all_layouts(mesh, s, multi=True) if l.multi_axis] + [Layout.replicated(mesh, len(s))]
            for s in shapes]


@pytest.mark.parametrize("name, fn, inputs", [
    ("matmul", torch.matmul, [rand(8, 4), rand(4, 8)]),
    ("sum0", lambda a: a.sum(0), [rand(8, 4)]),
    ("sum1", lambda a: a.sum(1), [rand(8, 4)]),
    ("mean", torch.mean, [rand(8, 4)]),
    ("softmax", lambda a: torch.softmax(a, -1), [rand(8, 4)]),
    ("softmax0", lambda a: torch.softmax(a, 0), [rand(8, 4)]),
    ("reshape", lambda a: a.reshape(4, 8), [rand(8, 4)]),
    ("view3", lambda a: a.view(2, 4, 4), [rand(8, 4)]),
    ("transpose", lambda a: a.t() * 2, [rand(8, 4)]),
    ("cat", lambda a, b: torch.cat([a, b], 0), [rand(8, 4), rand(8, 4)]),
    ("index", lambda a: a[1:5, 2], [rand(8, 4)]),
    ("gather_rows", lambda a: a[torch.tensor([0, 5, 7])], [rand(8, 4)]),
    ("add_bias", lambda a, b: a + b, [rand(8, 4), rand(4)]),
    ("layer_norm", lambda a, w: F.layer_norm(a, (4,), w), [rand(8, 4), rand(4)]),
    ("cross_entropy", lambda a: F.cross_entropy(a, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])), [rand(8, 4)]),
])
def test_ops_match_torch(name, fn, inputs):
    shapes = [t.shape for t in inputs]
    with spmd.implicit_replication():
        assert check_op(fn, inputs, layouts=_multi(*shapes)) > 1


_VIEWS = [
    ("view_same", lambda a: a.view(8, 8)),
    ("view_split0", lambda a: a.view(4, 2, 8)),
    ("view_split0_minor_gathered", lambda a: a.view(2, 4, 8)),
    ("view_split1", lambda a: a.view(8, 2, 4)),
    ("flatten", lambda a: a.reshape(64)),
    ("permute", lambda a: a.permute(1, 0).contiguous()),
    ("transpose", lambda a: a.transpose(0, 1) * 2),
    ("unsqueeze_squeeze", lambda a: a.unsqueeze(1).squeeze(1) + a.unsqueeze(0)[0]),
    ("full_slice", lambda a: a[:, :]),
    ("slice_rows", lambda a: a[2:6]),
    ("slice_cols", lambda a: a[:, 1:5]),
    ("select", lambda a: a[:, 3]),
    ("split", lambda a: torch.cat([p * i for i, p in enumerate(a.split(3, 1))], 1)),
    ("unbind", lambda a: torch.stack(a.unbind(1)[::2], 1)),
    ("cat_same", lambda a: torch.cat([a, a * 2], 1)),
    ("expand", lambda a: a[:, :1].expand(8, 8) + a),
    ("in_place_transpose", lambda a: (a * 1).t_() + 1),
]


@pytest.mark.parametrize("mesh", [MESH, MESH3], ids=["2x2", "2x2x2"])
@pytest.mark.parametrize("name, fn", _VIEWS, ids=[v[0] for v in _VIEWS])
def test_views_match_torch(name, fn, mesh):
    """The view and shape rules see multi-axis layouts whole (values, gradients and every device's component)."""
    assert check_op(fn, [rand(8, 8)], layouts=_multi((8, 8), mesh=mesh)) > 1


@pytest.mark.parametrize("specs, fn, out_specs, kinds", [
    ([("x", "y"), U], lambda a: a.view(8, 8), [("x", "y"), U], []),
    ([("x", "y"), U], lambda a: a[:, :], [("x", "y"), U], []),
    ([("x", "y"), U], lambda a: a[:, 1:5], [("x", "y"), U], []),
    ([U, ("y", "x")], lambda a: a[3], [("y", "x")], []),
    ([("x", "y"), U], lambda a: a.t(), [U, ("x", "y")], []),
    ([("x", "y"), U], lambda a: a.reshape(64), [("x", "y")], []),
    ([("x", "y"), U], lambda a: a.view(4, 2, 8), [("x", "y"), U, U], []),
    # 8 rows as 2 × 4: x's 2 blocks are the 2 (one each), y's the 4's halves: nothing moves
    ([("x", "y"), U], lambda a: a.view(2, 4, 8), ["x", "y", U], []),
    ([("x", "y"), U], lambda a: a.view(2, 2, 2, 8), ["x", "y", U, U], []),
    ([("x", "y"), U], lambda a: a.view(1, 2, 4, 8), [U, "x", "y", U], []),
    ([("x", "y"), U], lambda a: torch.cat([a, a], 1), [("x", "y"), U], []),
    ([("x", "y"), U], lambda a: a[2:6], [U, U], [("all_gather", ("y",)), ("all_gather", ("x",))]),
])
def test_views_keep_multi_axis_layouts(specs, fn, out_specs, kinds):
    """A view that moves a multi-axis sharded axis whole keeps its layout, with no collective (these rules used to
    see the outer mesh dim only and gathered the minor ones first)."""
    a = rand(8, 8)
    out, got = _kinds(lambda: fn(spmd.copy_to_mesh(a, Layout(specs, MESH))))
    assert spmd.fetch_layout(out) == Layout(out_specs, MESH) and got == kinds
    check_replicas(out)
    torch.testing.assert_close(spmd.to_global(out), fn(a))


@pytest.mark.parametrize("shape, specs, size, out_specs, kinds", [
    # a batch of one row per device and a sharded sequence, merged for a linear layer: both stay
    ((2, 8, 4), ["x", "y", U], (16, 4), [("x", "y"), U], []),
    ((2, 8, 4), ["x", "y", U], (2, 4, 2, 4), ["x", "y", U, U], []),
    # two rows per device: the sequence's blocks are not contiguous in the merged order; the batch takes y too (an
    # all-to-all), then each device's rows are one block
    ((4, 8, 4), ["x", "y", U], (32, 4), [("x", "y"), U], [("all_to_all", ("y",))]),
    # an unsharded axis of several elements first: it takes the mesh dim of the sharded one after it
    ((2, 8, 4), [U, "y", U], (16, 4), ["y", U], [("all_to_all", ("y",))]),
    # ... where its elements split over them; else the sharded axis is gathered
    ((6, 8, 4), ["x", "y", U], (48, 4), ["x", U], [("all_gather", ("y",))]),
    ((3, 8, 4), [U, "y", U], (24, 4), [U, U], [("all_gather", ("y",))]),
])
def test_merged_axes_keep_their_mesh_dims_where_each_device_holds_one_block(shape, specs, size, out_specs, kinds):
    a = rand(*shape)
    out, got = _kinds(lambda: spmd.copy_to_mesh(a, Layout(specs, MESH)).reshape(size))
    assert spmd.fetch_layout(out) == Layout(out_specs, MESH) and got == kinds
    check_replicas(out)
    torch.testing.assert_close(spmd.to_global(out), a.reshape(size))
    if not kinds:  # and back, as a linear layer's output is viewed back: nothing moves either
        back, got = _kinds(lambda: out.reshape(shape))
        assert got == [] and spmd.fetch_layout(back) == Layout(specs, MESH)


def test_complex_views_keep_multi_axis_layouts_and_take_in_place_ops():
    z = torch.randn(8, 4, dtype=torch.complex128)
    out, got = _kinds(lambda: torch.view_as_real(spmd.copy_to_mesh(z, XY)))
    assert spmd.fetch_layout(out) == Layout([("x", "y"), U, U], MESH) and got == []
    back = torch.view_as_complex(out)
    assert spmd.fetch_layout(back) == XY and torch.equal(spmd.to_global(back), z)
    d = spmd.copy_to_mesh(z, XY)
    d.real.add_(1)
    d.imag.mul_(2)
    z.real.add_(1)
    z.imag.mul_(2)
    assert spmd.fetch_layout(d) == XY and torch.equal(spmd.to_global(d), z)
    check_replicas(d)


def test_compiled_output_aliasing_a_multi_axis_input_keeps_its_layout():
    """AOTAutograd regenerates an output that aliases an input outside the graph (`_unsafe_view` of the input): it
    keeps the input's layout, as eagerly, with no collective."""
    a = rand(8, 8)
    x = spmd.copy_to_mesh(a, XY).requires_grad_()
    f = spmd.function(lambda v: v[:, :], backend="aot_eager")
    out, kinds = _kinds(lambda: f(x))
    assert spmd.fetch_layout(out) == XY and kinds == []
    out.sum().backward()
    assert spmd.fetch_layout(x.grad) == XY
    torch.testing.assert_close(spmd.to_global(x.grad), torch.ones_like(a))


def test_pointwise_and_sums_run_on_the_blocks_as_they_are():
    a, b = rand(8, 4), rand(8, 4, seed=1)
    da, db = spmd.copy_to_mesh(a, XY), spmd.copy_to_mesh(b, XY)
    out, kinds = _kinds(lambda: torch.relu(da * db + 1))
    assert kinds == [] and spmd.fetch_layout(out) == XY
    out, kinds = _kinds(lambda: da.sum(0))
    assert kinds == [] and out._pending == ("x", "y")
    torch.testing.assert_close(spmd.to_global(out), a.sum(0))
    # an op without a multi-axis rule sees the outer dim: y is gathered first
    out, kinds = _kinds(lambda: torch.cumsum(da, 1))
    assert kinds == [("all_gather", ("y",))] and spmd.fetch_layout(out) == Layout(["x", U], MESH)
    torch.testing.assert_close(spmd.to_global(out), torch.cumsum(a, 1))


def test_a_lower_rank_multi_axis_operand_broadcasts_on_its_blocks():
    """`h + b`, `b` of lower rank: the kernel right-aligns `b`'s components by their own shape, so the decision
    holds on the finer blocks (it used to gather `y` from both)."""
    h, b = rand(8, 4), rand(4, seed=1)
    dh, db = spmd.copy_to_mesh(h, Layout([U, "x+y"], MESH)), spmd.copy_to_mesh(b, Layout(["x+y"], MESH))
    out, kinds = _kinds(lambda: dh + db)
    assert kinds == [] and spmd.fetch_layout(out) == Layout([U, "x+y"], MESH)
    torch.testing.assert_close(spmd.to_global(out), h + b)
    assert check_op(lambda a, c: a * c, [h, b], layouts=[[Layout([U, "x+y"], MESH), Layout(["x", "y"], MESH)],
                                                          [Layout(["x+y"], MESH), Layout(["y+x"], MESH)]]) == 4


def test_pointwise_of_two_tuples_sharing_a_minor_mesh_dim_gathers_it():
    """("c", "a") on one axis and ("b", "a") on the other: renamed back, the output would shard over `a` twice (an
    AssertionError in the planner); the outer dims' decision stands, `a` gathered from both operands."""
    a, b = rand(4, 4), rand(1, 4, seed=1)
    da = spmd.copy_to_mesh(a, Layout([("c", "a"), U], MESH3))
    db = spmd.copy_to_mesh(b, Layout([U, ("b", "a")], MESH3))
    out, kinds = _kinds(lambda: da + db)
    assert spmd.fetch_layout(out) == Layout(["c", "b"], MESH3)
    assert sorted(kinds) == [("all_gather", ("a",)), ("all_gather", ("a",))]
    check_replicas(out)
    torch.testing.assert_close(spmd.to_global(out), a + b)


@pytest.mark.parametrize("mesh, target, other, shape, kinds", [
    (MESH, [U, U, "x+y"], ["x+y"], (4,), []),  # a lower-rank operand, broadcast from the target's blocks
    (MESH, [U, "x+y"], [U, "y+x"], (4, 4), [("permute", ("x", "y"))]),
    (MESH, [U, "x+y"], ["x", U], (4, 4), [("all_to_all", ("x",))]),  # (then a local slice for y)
    (MESH3, ["c+b", "a", U], ["b+a"], (4,), [("all_gather", ("a",)), ("all_gather", ("b",))]),
])
def test_in_place_ops_keep_a_multi_axis_targets_layout(mesh, target, other, shape, kinds):
    """An in-place elementwise op writes into its multi-axis target as it is: the other operand is relayouted to
    the target's blocks (its rule used to see the outer dim only, and the op was refused)."""
    y, w = rand(4, 2, 4) if len(target) == 3 else rand(4, 4), rand(*shape, seed=1)
    dy = spmd.copy_to_mesh(y, Layout(target, mesh))
    dw = spmd.copy_to_mesh(w, Layout(other, mesh))
    for op, want in ((lambda a, b: a.mul_(b), y * w), (lambda a, b: a.copy_(b.expand(a.shape)), w.expand(y.shape))):
        out, got = _kinds(lambda: op(dy.clone(), dw))
        assert spmd.fetch_layout(out) == Layout(target, mesh)
        check_replicas(out)
        torch.testing.assert_close(spmd.to_global(out), want)
    assert _kinds(lambda: dy.clone().mul_(dw))[1] == kinds


def test_a_blockwise_op_keeps_outer_dims_where_the_finer_blocks_do_not_divide():
    """`a @ w` with `a`'s columns over ("y", "x") (4 blocks) and `w`'s 2 columns over `y`: renamed back to the
    tuple, `w`'s 2 columns would be split 4 ways (a shape error); the outer dims' decision stands instead."""
    a, w = rand(8, 4), rand(4, 2, seed=1)
    da = spmd.copy_to_mesh(a, Layout([U, "y+x"], MESH))
    dw = spmd.copy_to_mesh(w, Layout([U, "y"], MESH))
    out, kinds = _kinds(lambda: da @ dw)
    assert spmd.fetch_layout(out) == Layout([U, "y"], MESH)
    assert kinds == [("all_gather", ("x",)), ("all_gather", ("y",))]
    torch.testing.assert_close(spmd.to_global(out), a @ w)


def test_linear_forward_backward_and_adamw_step():
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 8, dtype=torch.float64)
    model = torch.nn.Linear(4, 8, dtype=torch.float64)
    model.load_state_dict(plain.state_dict())
    spmd.distribute_module(model, MESH, spmd.LayoutMap({"weight": [("x", "y"), U], "bias": ["y+x"]}))
    assert spmd.fetch_layout(model.weight) == XY and spmd.fetch_layout(model.bias).sharding_specs == ["y+x"]
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, plain))
    x = rand(8, 4)
    dx = spmd.copy_to_mesh(x, Layout([("y", "x"), U], MESH)).requires_grad_()
    for _ in range(2):
        for o in (opt, ref_opt):
            o.zero_grad()
        (model(dx) ** 2).sum().backward()
        (plain(x) ** 2).sum().backward()
        assert spmd.fetch_layout(model.weight.grad) == XY
        torch.testing.assert_close(spmd.to_global(model.weight.grad), plain.weight.grad)
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(spmd.to_global(model.weight), plain.weight)
    torch.testing.assert_close(spmd.to_global(model.bias), plain.bias)
    assert spmd.fetch_layout(dx.grad) == Layout(["y+x", U], MESH)
    check_replicas(model.weight)


# -- rules that keep a multi-axis batch: norms, attention, embeddings, losses, linear layers ---------------------------
def _labels(n, classes, seed=0):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


_BATCH_OPS = [  # (name, fn, inputs, the layouts of the inputs on MESH3: the batch over ("a", "b"))
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), [rand(8, 2, 4), rand(4), rand(4, seed=1)],
     [["a+b", U, U], [U], [U]]),
    ("linear", F.linear, [rand(8, 4), rand(6, 4, seed=1), rand(6, seed=2)], [["a+b", U], [U, U], [U]]),
    ("linear_column_parallel", F.linear, [rand(8, 4), rand(6, 4, seed=1), rand(6, seed=2)],
     [["a+b", U], ["c", U], ["c"]]),
    ("log_softmax", lambda x: F.log_softmax(x, -1), [rand(8, 6)], [["b+a", U]]),
    ("embedding", lambda t, ids: F.embedding(ids, t), [rand(6, 4), _labels(8, 6).view(4, 2)],
     [[U, U], ["a+b", U]]),
    ("embedding_vocab_parallel", lambda t, ids: F.embedding(ids, t), [rand(6, 4), _labels(8, 6).view(4, 2)],
     [["c", U], ["a+b", U]]),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), [rand(8, 6), _labels(8, 6)], [["a+b", U], ["a+b"]]),
    ("cross_entropy_sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"), [rand(8, 6), _labels(8, 6)],
     [["b+a", U], ["b+a"]]),
    ("cross_entropy_vocab_parallel", lambda x, t: F.cross_entropy(x, t), [rand(8, 6), _labels(8, 6)],
     [["a+b", "c"], ["a+b"]]),
    ("attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [rand(4, 2, 3, 4), rand(4, 2, 3, 4, seed=1), rand(4, 2, 3, 4, seed=2)], [["a+b", "c", U, U]] * 3),
]


def _batch_op_case(inputs, specs):
    tensors = [spmd.copy_to_mesh(t, Layout(s, MESH3)) for t, s in zip(inputs, specs)]
    for t in tensors:
        if t.is_floating_point():
            t.requires_grad_()
    return tensors


@pytest.mark.parametrize("name, fn, inputs, specs", _BATCH_OPS, ids=[c[0] for c in _BATCH_OPS])
def test_a_multi_axis_batch_passes_through(name, fn, inputs, specs):
    """These rules decide on a batch axis as if it were sharded over its outer mesh dim alone, and their decisions
    hold on the finer blocks (they read no coordinate of it): the batch keeps its ("a", "b") sharding, with no
    collective in the forward op, and the parameters' gradients are sums pending over both mesh dims (these ops
    used to gather `b` first)."""
    with spmd.implicit_replication():
        assert check_op(fn, inputs, mesh=MESH3, layouts=[[Layout(s, MESH3)] for s in specs]) == 1
    args = _batch_op_case(inputs, specs)
    out, kinds = _kinds(lambda: fn(*args))
    batch_dims = ("a", "b") if "a+b" in specs[0] or "a+b" in specs[-1] else ("b", "a")
    assert all(dims != ("b",) and kind != "all_gather" for kind, dims in kinds), kinds
    if out.dim():
        assert spmd.fetch_layout(out).axes[0] == batch_dims
    loss, kinds = _kinds(lambda: fn(*args).sum())  # a sum over the batch: over both mesh dims at once
    assert any(set(batch_dims) <= set(dims) for kind, dims in kinds if kind == "all_reduce") or \
        set(batch_dims) <= set(loss._pending), (kinds, loss._pending)
    loss.backward()
    for t, s in zip(args, specs):
        if t.grad is not None and U in s[:1]:  # a parameter: its gradient was summed over the whole batch
            assert spmd.fetch_layout(t.grad) == spmd.fetch_layout(t)


def test_a_kernel_built_for_an_outer_dims_blocks_is_not_renamed():
    """A decision naming a mesh dim `fixed` (a vocabulary shard's first row; a bias viewed by its local shape) holds
    for that dim's own blocks only: the finer ones are gathered first, and the values stay right."""
    table, ids = rand(8, 4), _labels(6, 8).view(3, 2)
    with spmd.implicit_replication():
        assert check_op(lambda t, i: F.embedding(i, t), [table, ids],
                        layouts=[[Layout(["x+y", U], MESH)], [Layout([U, U], MESH)]]) == 1
    dt = spmd.copy_to_mesh(table, Layout(["x+y", U], MESH))
    out, kinds = _kinds(lambda: F.embedding(spmd.copy_to_mesh(ids, Layout([U, U], MESH)), dt))
    assert kinds[0] == ("all_gather", ("y",)) and out._pending == ("x",)
    torch.testing.assert_close(spmd.to_global(out), F.embedding(ids, table))
    x, w, b = rand(4, 4), rand(8, 4, seed=1), rand(8, seed=2)
    assert check_op(F.linear, [x, w, b], layouts=[[Layout([U, U], MESH)], [Layout(["x+y", U], MESH)],
                                                  [Layout(["x+y"], MESH)]]) == 1


def test_gpt_training_with_the_batch_over_two_mesh_dims():
    """The demo GPT trained with its batch sharded over ("x", "y"): losses and parameters equal plain torch's, and
    the only collectives are the all-reduces of the gradients and the loss over both mesh dims."""
    from spmd.demo.model import GPT, GPTConfig
    cfg = GPTConfig(n_layer=1, d_model=16, block_size=4, n_head=2)
    torch.manual_seed(0)
    plain = GPT(cfg).double()
    model = GPT(cfg).double()
    model.load_state_dict(plain.state_dict())
    spmd.distribute_module(model, MESH, spmd.LayoutMap({}))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (plain, model)]
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=g) for _ in range(2))
    positions = torch.arange(cfg.block_size)
    batch = Layout(["x+y", U], MESH)
    args = [spmd.copy_to_mesh(t, batch) for t in (ids, targets)]
    dpos = spmd.copy_to_mesh(positions, Layout([U], MESH))
    for _ in range(2):
        want = plain(ids, positions, targets)
        want.backward()

        def step():
            loss = model(args[0], dpos, args[1])
            loss.backward()
            return loss
        loss, kinds = _kinds(step)
        assert set(kinds) == {("all_reduce", ("x", "y"))}, kinds
        torch.testing.assert_close(spmd.to_global(loss), want)
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(spmd.to_global(q), p, msg=name)
        check_replicas(q)


# -- modules that read layouts -----------------------------------------------------------------------------------------
def test_checkpoint_between_multi_axis_and_other_layouts(tmp_path):
    x = rand(8, 8)
    spmd.checkpoint.save({"w": spmd.copy_to_mesh(x, Layout([("y", "x"), U], MESH))}, tmp_path / "a")
    for layout in (XY, Layout(["x", "y"], MESH), Layout([U, ("c", "a")], MESH3)):
        target = {"w": spmd.copy_to_mesh(torch.zeros(8, 8, dtype=torch.float64), layout)}
        spmd.checkpoint.load(target, tmp_path / "a")
        check_components(target["w"], x)
    spmd.checkpoint.save({"w": spmd.copy_to_mesh(x, Layout(["y", "x"], MESH))}, tmp_path / "b")
    target = {"w": spmd.copy_to_mesh(torch.zeros(8, 8, dtype=torch.float64), Layout([("c", "b", "a"), U], MESH3))}
    spmd.checkpoint.load(target, tmp_path / "b")
    check_components(target["w"], x)


def test_random_values_do_not_depend_on_the_layout():
    layouts = [Layout.replicated(MESH3, 2), Layout([("a", "b"), "c"], MESH3), Layout(["c", ("b", "a")], MESH3),
               Layout([("c", "b", "a"), U], MESH3)]
    values = [spmd.to_global(stateless_uniform((8, 8), seed=(1, 2), layout=l)) for l in layouts]
    for v in values[1:]:
        assert torch.equal(v, values[0])
    torch.manual_seed(3)
    a = spmd.to_global(torch.nn.init.normal_(spmd.copy_to_mesh(torch.zeros(8, 8), layouts[1])))
    torch.manual_seed(3)
    b = spmd.to_global(torch.nn.init.normal_(spmd.copy_to_mesh(torch.zeros(8, 8), layouts[3])))
    assert torch.equal(a, b)


def test_shards_variable_and_visualize():
    layout = Layout([("c", "a"), U], MESH3)
    blocks = spmd.shards.local_blocks(layout, (8, 2))
    assert [(b.offsets, b.positions) for b in blocks][:2] == [((0, 0), (0, 2)), ((4, 0), (1, 3))]
    v = spmd.DVariable(spmd.copy_to_mesh(rand(8, 2), layout))
    v.assign(v * 2)
    assert spmd.fetch_layout(v) == layout
    table = sharding_table(spmd.copy_to_mesh(rand(8, 2), layout))
    assert table.row_count == 4 and len(table.columns) == 1  # 4 blocks along axis 0, one along axis 1
