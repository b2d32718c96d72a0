"""Elementwise ops outside torch's pointwise tag, and elementwise losses: every layout gives plain torch's values,
gradients and components, the sharded axes stay sharded, and the collectives are exactly the ones the math
needs (an elementwise op none; a mean loss one all-reduce over the mesh dims sharding its inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, issued, Const, all_layouts, check_op, rand


def _layout(*specs):
    return Layout(list(specs), MESH)


def _fallbacks_after(fn) -> list:
    before = set(spmd.cache_stats()["fallbacks"])
    fn()
    return sorted(set(spmd.cache_stats()["fallbacks"]) - before)


def _sorted_rows(*shape, seed=0):
    return rand(*shape, seed=seed).sort(-1).values


def _int(*shape, high=4, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# -- elementwise ops --------------------------------------------------------------------------------------------------
ELEMENTWISE = {
    "rsub": (lambda a, b: torch.rsub(a, b, alpha=2), [rand(4, 6), rand(4, 6, seed=1)]),
    "rsub_broadcast": (lambda a, b: torch.rsub(a, b), [rand(4, 6), rand(6, seed=1)]),
    "floor_divide": (torch.floor_divide, [rand(4, 6), rand(4, 6, seed=1).abs() + 0.5]),
    "fill": (lambda a: torch.ops.aten.fill.Scalar(a, 3.0), [rand(4, 6)]),
    "hardswish": (lambda a: F.hardswish(a * 4), [rand(4, 6)]),
    "logsigmoid": (F.logsigmoid, [rand(4, 6)]),
    "prelu": (F.prelu, [rand(4, 6, 2), rand(6, seed=1)]),
    "prelu_one_weight": (F.prelu, [rand(4, 6), rand(1, seed=1)]),
    "glu_last": (F.glu, [rand(4, 4, 2)]),
    "glu_first": (lambda a: F.glu(a, 0), [rand(4, 6)]),
    "masked_fill_0d": (lambda a, m, v: a.masked_fill(m > 0, v), [rand(4, 6), Const(rand(4, 6, seed=2)), rand()]),
    "masked_fill_broadcast": (lambda a, m: a.masked_fill(m > 0, -1.0), [rand(6), Const(rand(4, 6, seed=2))]),
    "renorm_dim0": (lambda a: torch.renorm(a, 2, 0, 1.0), [rand(4, 6, 2)]),
    "renorm_dim1": (lambda a: torch.renorm(a, 1, 1, 2.0), [rand(4, 6, 2)]),
    "isin": (lambda e, t: torch.isin(e, t), [_int(4, 6, high=8), _int(4, seed=1, high=8)]),
    "isin_invert": (lambda e, t: torch.isin(e, t, invert=True), [_int(4, 6, high=8), _int(2, 2, seed=1, high=8)]),
    "bucketize": (lambda x, b: torch.bucketize(x, b, right=True), [rand(4, 6), Const(_sorted_rows(4))]),
    "searchsorted": (lambda s, x: torch.searchsorted(s, x), [Const(_sorted_rows(6)), rand(4, 2)]),
    "searchsorted_batched": (lambda s, x: torch.searchsorted(s, x, side="right"),
                             [Const(_sorted_rows(4, 6)), rand(4, 2, seed=1)]),
    "searchsorted_sorter": (lambda s, x: torch.searchsorted(s, x, sorter=s.argsort(-1)),
                            [Const(rand(2, 6)), rand(2, 4, seed=1)]),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_op_matches_torch_for_every_layout(name):
    fn, inputs = ELEMENTWISE[name]
    inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    assert check_op(fn, inputs, sample=24, grad=name != "floor_divide") >= 3  # torch has no floor_divide gradient


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_op_runs_no_replicated_fallback(name):
    fn, inputs = ELEMENTWISE[name]
    args = [spmd.copy_to_mesh(x.value if isinstance(x, Const) else x,
                              Layout.replicated(MESH, (x.value if isinstance(x, Const) else x).dim()))
            for x in inputs]
    assert _fallbacks_after(lambda: fn(*args)) == []


def _sharded(t, *specs):
    return spmd.copy_to_mesh(t, _layout(*specs)).requires_grad_(t.is_floating_point())


@pytest.mark.parametrize("fn", [lambda a: torch.rsub(a, a * 2), lambda a: torch.floor_divide(a, 0.7), F.hardswish,
                                F.logsigmoid, lambda a: F.glu(a, 0), lambda a: torch.renorm(a, 2, 1, 1.0),
                                lambda a: a.masked_fill(a > 0, torch.tensor(2.0)),
                                lambda a: F.prelu(a, torch.full((6,), 0.25, dtype=a.dtype))],
                         ids=["rsub", "floor_divide", "hardswish", "logsigmoid", "glu", "renorm", "masked_fill",
                              "prelu"])
def test_elementwise_ops_keep_their_sharded_axes_and_issue_no_collective(fn):
    x = rand(4, 6)
    dx = spmd.copy_to_mesh(x, _layout(U, "y"))
    with spmd.implicit_replication():
        out, collectives = issued(lambda: fn(dx))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == [U, "y"]
    torch.testing.assert_close(spmd.to_global(out), fn(x))


def test_lookups_keep_the_values_sharded_and_replicate_the_table():
    x = _sharded(rand(4, 6), "x", "y")
    boundaries = spmd.copy_to_mesh(_sorted_rows(5), _layout(U))
    out, collectives = issued(lambda: torch.bucketize(x, boundaries))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    torch.testing.assert_close(spmd.to_global(out), torch.bucketize(rand(4, 6), _sorted_rows(5)))
    sequence = spmd.copy_to_mesh(_sorted_rows(4, 6), _layout("x", U))
    values = spmd.copy_to_mesh(rand(4, 2), _layout("x", "y"))
    out, collectives = issued(lambda: torch.searchsorted(sequence, values))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y"]


def test_glu_gathers_only_its_split_axis():
    x = _sharded(rand(4, 8), "x", "y")
    out, collectives = issued(lambda: F.glu(x, -1))
    assert collectives == [("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == ["x", U]


# -- elementwise losses -----------------------------------------------------------------------------------------------
LOSSES = {
    "mse_loss": lambda x, t, **kw: F.mse_loss(x, t, **kw),
    "huber_loss": lambda x, t, **kw: F.huber_loss(x, t, delta=0.5, **kw),
    "smooth_l1_loss": lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.7, **kw),
    "soft_margin_loss": lambda x, t, **kw: F.soft_margin_loss(x, t.sign(), **kw),
    "binary_cross_entropy": lambda x, t, **kw: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), **kw),
    "bce_weighted": lambda x, t, **kw: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), weight=rand(6, seed=5).abs(),
                                                              **kw),
    "bce_with_logits": lambda x, t, **kw: F.binary_cross_entropy_with_logits(x, t.sigmoid(), **kw),
    "bce_with_logits_pos_weight": lambda x, t, **kw: F.binary_cross_entropy_with_logits(
        x, t.sigmoid(), pos_weight=rand(6, seed=5).abs(), **kw),
}


def _plain_weights(fn):
    """The loss with its constant weight tensors replicated (made under implicit replication)."""
    def run(x, t, **kw):
        with spmd.implicit_replication():
            return fn(x, t, **kw)
    return run


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_matches_torch_for_every_layout(name, reduction):
    fn = _plain_weights(LOSSES[name])
    target = rand(4, 6, seed=1) if name in ("mse_loss", "huber_loss") else Const(rand(4, 6, seed=1))
    assert check_op(lambda x, t: fn(x, t, reduction=reduction), [rand(4, 6), target], sample=20) >= 10


def test_broadcast_target_loss_matches_torch():
    with pytest.warns(UserWarning):
        F.mse_loss(rand(4, 1), rand(4, 6))  # torch warns about the broadcast; spmd follows torch
    for reduction in ("mean", "none"):
        check_op(lambda x, t: F.huber_loss(x, t, reduction=reduction), [rand(4, 1), rand(4, 6, seed=1)], sample=12)


@pytest.mark.parametrize("name", list(LOSSES))
def test_mean_loss_is_one_all_reduce_when_read_and_its_gradient_none(name):
    """A mean loss is left pending (a step that never reads it never reduces it): one all-reduce when read."""
    fn = _plain_weights(LOSSES[name])
    x, t = _sharded(rand(4, 6), "x", "y"), spmd.copy_to_mesh(rand(4, 6, seed=1), _layout("x", "y"))
    assert _fallbacks_after(lambda: fn(x, t)) == []
    loss, forward = issued(lambda: fn(x, t))
    assert forward == []
    _, backward = issued(lambda: loss.backward())
    assert backward == []
    ref = rand(4, 6).requires_grad_()
    fn(ref, rand(4, 6, seed=1)).backward()
    value, read = issued(lambda: spmd.to_global(loss))
    assert read == [("all_reduce", ("x", "y"))]
    torch.testing.assert_close(value, fn(rand(4, 6), rand(4, 6, seed=1)))
    torch.testing.assert_close(spmd.to_global(x.grad), ref.grad)


def test_sum_loss_stays_pending_and_none_loss_keeps_the_layout():
    x, t = _sharded(rand(4, 6), "x", U), spmd.copy_to_mesh(rand(4, 6, seed=1), _layout("x", U))
    loss, collectives = issued(lambda: F.huber_loss(x, t, reduction="sum"))
    assert collectives == []  # the partial sums wait for their reader
    resolved, collectives = issued(lambda: spmd.to_global(loss))
    assert ("all_reduce", ("x",)) in collectives
    torch.testing.assert_close(resolved, F.huber_loss(rand(4, 6), rand(4, 6, seed=1), reduction="sum"))
    per, collectives = issued(lambda: F.soft_margin_loss(x, t.sign(), reduction="none"))
    assert collectives == [] and spmd.fetch_layout(per).sharding_specs == ["x", U]


# -- negative log-likelihood over spatial axes ------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_spatial_nll_matches_torch_for_every_layout(reduction, weighted):
    weight = rand(3, seed=4).abs() if weighted else None
    target = _int(2, 4, 2, high=3, seed=1)
    target[0, 0, 0] = -100  # an ignored position

    def fn(x, t):
        with spmd.implicit_replication():
            return F.cross_entropy(x, t, weight=weight, reduction=reduction)
    layouts = [all_layouts(MESH, (2, 3, 4, 2)), all_layouts(MESH, (2, 4, 2))]
    assert check_op(fn, [rand(2, 3, 4, 2), Const(target)], layouts=layouts, sample=30) >= 20


def test_spatial_nll_keeps_batch_and_spatial_axes_sharded():
    x = _sharded(rand(2, 3, 4, 2), "x", U, "y", U)
    target = spmd.copy_to_mesh(_int(2, 4, 2, high=3, seed=1), _layout("x", "y", U))
    weight = spmd.copy_to_mesh(rand(3, seed=4).abs(), _layout(U))
    assert _fallbacks_after(lambda: F.nll_loss(x, target, weight=weight)) == []
    loss, forward = issued(lambda: F.nll_loss(x, target, weight=weight))
    # the weighted sum of the picked entries and the sum of their weights, stacked: one all-reduce
    assert forward == [("all_reduce", ("x", "y"))]
    _, backward = issued(lambda: loss.backward())
    assert backward == []
    assert spmd.fetch_layout(x.grad).sharding_specs == ["x", U, "y", U]
    ref = rand(2, 3, 4, 2).requires_grad_()
    want = F.nll_loss(ref, _int(2, 4, 2, high=3, seed=1), weight=rand(3, seed=4).abs())
    want.backward()
    torch.testing.assert_close(spmd.to_global(loss), want)
    torch.testing.assert_close(spmd.to_global(x.grad), ref.grad)


def test_spatial_nll_with_the_class_axis_sharded_gathers_only_the_classes():
    x = spmd.copy_to_mesh(rand(2, 4, 4, 2), _layout("x", "y", U, U))
    target = spmd.copy_to_mesh(_int(2, 4, 2, high=4, seed=1), _layout("x", U, U))
    out, collectives = issued(lambda: F.nll_loss(x, target, reduction="none"))
    assert collectives == [("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == ["x", U, U]



def test_broadcast_tensors_matches_torch_for_every_layout():
    # torch decomposes it into one expand per operand before a DTensor sees it, except under the Python dispatcher
    # that torch.compile traces with: there its own rule runs
    with enable_python_dispatcher():
        check_op(lambda a, b: torch.broadcast_tensors(a, b), [rand(4, 1, 6), rand(4, 6, seed=1)])


def test_broadcast_tensors_expands_each_operand_in_its_own_layout():
    a = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
    b = spmd.copy_to_mesh(rand(6, seed=1), Layout(["y"], MESH))
    with enable_python_dispatcher():
        (out_a, out_b), collectives = issued(lambda: torch.broadcast_tensors(a, b))
    assert collectives == []
    assert spmd.fetch_layout(out_a).sharding_specs == ["x", "y"] and spmd.fetch_layout(out_b).sharding_specs == [U, "y"]
    torch.testing.assert_close(spmd.to_global(out_b), rand(6, seed=1).expand(4, 6))


# -- losses read from whole rows: multi_margin_loss, multilabel_margin_loss -------------------------------------------
def _multilabel_targets(n, c, seed=0):
    """Each row's target classes, then -1 (torch reads a row's targets up to its first -1)."""
    t = torch.full((n, c), -1)
    for i, k in enumerate(torch.randint(1, c, (n,), generator=torch.Generator().manual_seed(seed))):
        t[i, :k] = torch.randperm(c, generator=torch.Generator().manual_seed(seed + i))[:k]
    return t


ROW_LOSSES = {
    "multi_margin": (lambda x, t, **kw: F.multi_margin_loss(x, t, **kw), _int(4, high=6, seed=1)),
    "multi_margin_p2_weighted": (lambda x, t, w, **kw: F.multi_margin_loss(x, t, p=2, margin=0.7, weight=w, **kw),
                                 _int(4, high=6, seed=1)),
    "multilabel_margin": (lambda x, t, **kw: F.multilabel_margin_loss(x, t, **kw), _multilabel_targets(4, 6)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(ROW_LOSSES))
def test_row_loss_matches_torch_for_every_layout(name, reduction):
    fn, target = ROW_LOSSES[name]
    inputs = [rand(4, 6), Const(target)] + ([Const(rand(6, seed=3).abs())] if "weighted" in name else [])
    assert check_op(lambda *a: fn(*a, reduction=reduction), inputs, sample=20) >= 10
    check_op(lambda *a: fn(*a, reduction=reduction), [rand(6), Const(target[0])] + inputs[2:])  # one row


@pytest.mark.parametrize("name", list(ROW_LOSSES)[::2])
def test_row_loss_keeps_rows_sharded_and_gathers_only_the_classes(name):
    fn, target = ROW_LOSSES[name]
    x = _sharded(rand(4, 6), "x", U)
    t = spmd.copy_to_mesh(target, _layout(*("x", U)[:target.dim()]))
    assert _fallbacks_after(lambda: fn(x, t)) == []
    loss, forward = issued(lambda: fn(x, t))
    assert forward == []  # the mean waits, a pending sum over the rows' mesh dim, for its reader
    _, backward = issued(lambda: loss.backward())
    assert backward == [] and spmd.fetch_layout(x.grad).sharding_specs == ["x", U]
    ref = rand(4, 6).requires_grad_()
    fn(ref, target).backward()
    torch.testing.assert_close(spmd.to_global(loss), fn(rand(4, 6), target))
    torch.testing.assert_close(spmd.to_global(x.grad), ref.grad)
    per_row, collectives = issued(lambda: fn(spmd.copy_to_mesh(rand(4, 6), _layout("x", "y")), t, reduction="none"))
    assert collectives == [("all_gather", ("y",))] and spmd.fetch_layout(per_row).sharding_specs == ["x"]
