"""Convolutions, pooling and resampling on DTensors: every layout gives plain torch's values and gradients, and
the batch and channel axes stay sharded (no gather)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, issued, check_op, rand, reduce_gradients

CONVS = {
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), (4, 4, 6, 6), (4, 4, 3, 3)),
    "conv2d_stride_dilation": (lambda x, w, b: F.conv2d(x, w, b, stride=2, dilation=2), (2, 4, 8, 8), (4, 4, 3, 3)),
    "conv2d_groups": (lambda x, w, b: F.conv2d(x, w, b, groups=2), (2, 4, 5, 5), (4, 2, 3, 3)),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=2), (4, 2, 7), (4, 2, 3)),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b), (2, 2, 4, 4, 4), (2, 2, 2, 2, 2)),
    "conv2d_unbatched": (lambda x, w, b: F.conv2d(x, w, b), (4, 5, 5), (2, 4, 3, 3)),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), (2, 4, 3, 3), (4, 2, 3, 3)),
    "conv_transpose2d_groups": (lambda x, w, b: F.conv_transpose2d(x, w, b, groups=2, output_padding=1, stride=2),
                                (2, 4, 3, 3), (4, 2, 2, 2)),
    "conv2d_4_groups": (lambda x, w, b: F.conv2d(x, w, b, groups=4, padding=1), (2, 8, 4, 4), (8, 2, 3, 3)),
    "conv1d_depthwise_groups": (lambda x, w, b: F.conv1d(x, w, b, groups=4, padding=1), (2, 4, 6), (8, 1, 3)),
}
GROUPS = {"conv2d_groups": 2, "conv_transpose2d_groups": 2, "conv2d_4_groups": 4, "conv1d_depthwise_groups": 4}


@pytest.mark.parametrize("name", list(CONVS))
def test_convolution_matches_torch_for_every_layout(name):
    fn, x_shape, w_shape = CONVS[name]
    transposed = "transpose" in name
    groups = GROUPS.get(name, 1)
    out_channels = w_shape[1] * groups if transposed else w_shape[0]
    inputs = [rand(*x_shape), rand(*w_shape, seed=1), rand(out_channels, seed=2)]
    assert check_op(fn, inputs, sample=16) >= 12


def _layout(*specs):
    return Layout(list(specs), MESH)


def test_batch_and_output_channels_stay_sharded():
    x = spmd.copy_to_mesh(rand(4, 4, 6, 6), _layout("x", U, U, U))
    w = spmd.copy_to_mesh(rand(4, 4, 3, 3, seed=1), _layout("y", U, U, U))
    b = spmd.copy_to_mesh(rand(4, seed=2), _layout("y"))
    out, collectives = issued(lambda: F.conv2d(x, w, b, padding=1))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == ["x", "y", U, U]
    torch.testing.assert_close(spmd.to_global(out), F.conv2d(rand(4, 4, 6, 6), rand(4, 4, 3, 3, seed=1),
                                                             rand(4, seed=2), padding=1))


def test_input_channels_sharded_leave_one_pending_sum_and_the_bias_is_added_once():
    x = spmd.copy_to_mesh(rand(4, 4, 6, 6), _layout("x", "y", U, U))
    w = spmd.copy_to_mesh(rand(4, 4, 3, 3, seed=1), _layout(U, "y", U, U))
    b = spmd.copy_to_mesh(rand(4, seed=2), _layout(U))
    out, collectives = issued(lambda: F.conv2d(x, w, b))
    assert collectives == [("all_reduce", ("y",))]  # the bias epilogue resolves the sum at once
    torch.testing.assert_close(spmd.to_global(out), F.conv2d(rand(4, 4, 6, 6), rand(4, 4, 3, 3, seed=1),
                                                             rand(4, seed=2)))


@pytest.mark.parametrize("groups, w_shape", [(4, (8, 2, 3)), (8, (16, 1, 3))], ids=["4 groups", "depthwise"])
def test_grouped_convolutions_keep_channels_sharded_at_group_boundaries(groups, w_shape):
    """Each device convolves its own groups: no collective forward; backward, only the weight's and bias's sums
    over the batch (the input's gradient is complete on each device)."""
    x_value, w_value, b_value = rand(4, 8, 6), rand(*w_shape, seed=1), rand(w_shape[0], seed=2)
    x = spmd.copy_to_mesh(x_value, _layout("x", "y", U)).requires_grad_()
    w = spmd.copy_to_mesh(w_value, _layout("y", U, U)).requires_grad_()
    b = spmd.copy_to_mesh(b_value, _layout("y")).requires_grad_()
    out, forward = issued(lambda: F.conv1d(x, w, b, padding=1, groups=groups))
    assert forward == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y", U]

    def backward():
        out.backward(torch.ones_like(out))
        return w.grad._local, b.grad._local  # (their pending sums resolved)
    _, backward = issued(backward)
    assert sorted(backward) == [("all_reduce", ("x",))] * 2
    assert not x.grad._pending and spmd.fetch_layout(x.grad) == spmd.fetch_layout(x)
    leaves = [t.clone().requires_grad_() for t in (x_value, w_value, b_value)]
    want = F.conv1d(*leaves, padding=1, groups=groups)
    want.sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want)
    for got, leaf in zip((x, w, b), leaves):
        torch.testing.assert_close(spmd.to_global(got.grad), leaf.grad)


def test_weight_gradient_of_a_batch_sharded_convolution_is_one_all_reduce():
    x = spmd.copy_to_mesh(rand(4, 4, 6, 6), _layout("x", U, U, U))
    w = spmd.copy_to_mesh(rand(4, 4, 3, 3, seed=1), _layout(U, U, U, U)).requires_grad_()
    out, forward = issued(lambda: F.conv2d(x, w))
    _, backward = issued(lambda: (out.sum().backward(), reduce_gradients([w])))
    assert forward == [] and backward == [("all_reduce", ("x",))]
    ref = rand(4, 4, 3, 3, seed=1).requires_grad_()
    F.conv2d(rand(4, 4, 6, 6), ref).sum().backward()
    torch.testing.assert_close(spmd.to_global(w.grad), ref.grad)


SPATIAL = {
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), (4, 4, 6, 6)),
    "max_pool2d_indices": (lambda x: F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True), (2, 4, 6, 6)),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), (2, 2, 4, 4, 4)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 2), (4, 4, 6)),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), (4, 4, 6, 6)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), (4, 2, 6)),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2), (2, 2, 4, 4, 4)),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (4, 4, 6, 6)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 3), (4, 2, 6, 6)),
    "unbatched_max_pool2d": (lambda x: F.max_pool2d(x, 2), (4, 6, 6)),
    "nearest2d": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (4, 2, 3, 3)),
    "nearest_exact1d": (lambda x: F.interpolate(x, size=7, mode="nearest-exact"), (4, 2, 4)),
    "linear1d": (lambda x: F.interpolate(x, size=7, mode="linear", align_corners=True), (4, 2, 4)),
    "bilinear2d": (lambda x: F.interpolate(x, size=(5, 7), mode="bilinear"), (4, 2, 3, 3)),
    "bicubic2d": (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), (2, 4, 3, 3)),
    "bilinear2d_aa": (lambda x: F.interpolate(x, size=(2, 2), mode="bilinear", antialias=True), (2, 4, 5, 5)),
    "trilinear3d": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), (2, 2, 2, 2, 2)),
    "reflection_pad2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), (4, 2, 4, 4)),
    "replication_pad1d": (lambda x: F.pad(x, (2, 1), mode="replicate"), (4, 2, 4)),
    "reflection_pad3d": (lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"), (2, 2, 3, 3, 3)),
}


@pytest.mark.parametrize("name", list(SPATIAL))
def test_pooling_and_resampling_match_torch_for_every_layout(name):
    fn, shape = SPATIAL[name]
    assert check_op(fn, [rand(*shape)], sample=10) >= 5


def test_a_cnn_trains_without_gathering_its_activations():
    """Conv, pooling and resampling keep the batch sharded: the forward runs no collective, the backward only
    the weight gradients' all-reduces over the batch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(8, 4, 3), torch.nn.Upsample(scale_factor=2, mode="bilinear"),
                              torch.nn.AdaptiveAvgPool2d((2, 2)), torch.nn.Flatten(), torch.nn.Linear(16, 2)).double()
    reference = copy.deepcopy(net)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    spmd.distribute_module(net, MESH, spmd.LayoutMap({}))
    out, forward = issued(lambda: net(spmd.copy_to_mesh(x, _layout("x", U, U, U))))
    assert forward == []
    _, backward = issued(lambda: (spmd.to_global(out).square().sum().backward(), reduce_gradients(net.parameters())))
    assert set(backward) == {("all_reduce", ("x",))}
    reference(x).square().sum().backward()
    for p, ref in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), ref.grad)
    assert not any(op in f for f in spmd.cache_stats()["fallbacks"] for op in ("conv", "pool", "upsample"))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 4, 3, 2), (4, 2)])
def test_batch_norm_matches_torch_for_every_layout(training, shape):
    """Training uses the global batch's statistics (as SyncBatchNorm); the running statistics are updated in
    place to torch's values whatever their layout."""
    c = shape[1]
    mean, var = rand(c, seed=3), rand(c, seed=4).abs() + 0.5

    def fn(x, w, b):
        rm, rv = mean.clone(), var.clone()
        if spmd.is_dtensor(x):
            rm, rv = (spmd.copy_to_mesh(t, Layout(spmd.fetch_layout(w).sharding_specs, MESH)) for t in (rm, rv))
        out = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.3)
        global_rm = spmd.to_global(rm) if spmd.is_dtensor(rm) else rm
        ref_rm, ref_rv = mean.clone(), var.clone()
        F.batch_norm(spmd.to_global(x).detach() if spmd.is_dtensor(x) else x.detach(), ref_rm, ref_rv,
                     training=training, momentum=0.3)
        torch.testing.assert_close(global_rm, ref_rm)
        return out

    assert check_op(fn, [rand(*shape), rand(c, seed=1), rand(c, seed=2)], sample=16) >= 8


def test_batch_norm_statistics_are_two_all_reduces_over_the_batch():
    x = spmd.copy_to_mesh(rand(4, 4, 3, 2), _layout("x", "y", U, U))
    w, b = (spmd.copy_to_mesh(rand(4, seed=s), _layout("y")) for s in (1, 2))
    rm, rv = (spmd.copy_to_mesh(torch.zeros(4, dtype=torch.float64), _layout("y")) for _ in range(2))
    out, collectives = issued(lambda: F.batch_norm(x, rm, rv, w, b, training=True))
    assert collectives == [("all_reduce", ("x",)), ("all_reduce", ("x",))]
    assert spmd.fetch_layout(out).sharding_specs == ["x", "y", U, U]


def test_a_cnn_training_step_compiles_and_matches_torch():
    """Conv, batch norm (running statistics updated in place inside the graph), pooling and an optimizer step
    under spmd.function, with channel-sharded first layers on a batch x model mesh."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4))
    reference = copy.deepcopy(net)
    spmd.distribute_module(net, mesh, spmd.LayoutMap({r"0\.weight": ["model", U, U, U], r"0\.bias": ["model"],
                                                      r"1\.": ["model"]}))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, reference))

    @spmd.function(backend="aot_eager", fullgraph=False)
    def step(x, y):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
        loss = step(spmd.copy_to_mesh(x, Layout(["batch", U, U, U], mesh)), spmd.copy_to_mesh(y, Layout(["batch"], mesh)))
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(spmd.to_global(loss), ref_loss.detach())
    torch.testing.assert_close(spmd.to_global(net[1].running_var), reference[1].running_var)
    torch.testing.assert_close(spmd.to_global(net[4].weight), reference[4].weight.detach())
    assert step.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("pad", [(1, 1), (2, 0, 1, 3), (-1, 2, 1, 0)])
def test_circular_padding_keeps_the_batch_sharded(pad):
    """F.pad(mode="circular") (and a convolution's padding_mode="circular"): torch writes into a fresh tensor of
    its own, which would be replicated; spmd pads by concatenating wrapped-around slices — every layout's values as
    torch's, and a batch-sharded input stays sharded with no collective."""
    shape = (4, 2, 4, 4)[: 2 + len(pad) // 2]
    assert check_op(lambda x: F.pad(x, pad, mode="circular"), [rand(*shape)], sample=20) > 1
    x = spmd.copy_to_mesh(rand(*shape), Layout(["x"] + [U] * (len(shape) - 1), MESH))
    out, collectives = issued(lambda: F.pad(x, pad, mode="circular"))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs[0] == "x"
