"""Layout sweeps of the regression losses (values and gradients against plain torch)."""

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U, Layout
from tests.sweep import Const, check_op, issued


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(4, 6), (4, 2, 2)])
def test_mse_loss(reduction, shape):
    torch.manual_seed(0)
    x, target = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    assert check_op(lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, target]) > 0


def _ctc_inputs():
    torch.manual_seed(0)
    log_probs = torch.randn(6, 4, 5, dtype=torch.float64).log_softmax(2)  # [T, N, C]
    targets = torch.tensor([[1, 2, 2], [3, 1, 0], [4, 0, 0], [2, 0, 0]])  # padded: the last half's are shorter
    return log_probs, targets, torch.tensor([6, 5, 6, 4]), torch.tensor([3, 2, 1, 1])


def _concatenated(targets, target_lengths):
    """The targets one sample's after the other's (1-D), as HuggingFace's CTC heads pass them."""
    return torch.cat([t[:n] for t, n in zip(targets, target_lengths)])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lengths", ["tensors", "lists"])
@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
def test_ctc_loss_for_every_layout(reduction, lengths, concatenated):
    """Each device aligns its own samples: values and log-probabilities' gradients as torch's, for every layout of
    log-probabilities, targets (padded or concatenated) and lengths (a sharded time or class axis is gathered)."""
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs()
    if concatenated:
        targets = _concatenated(targets, target_lengths)
    if lengths == "tensors":
        fn = lambda lp, t, il, tl: F.ctc_loss(lp, t, il, tl, reduction=reduction)  # noqa: E731
        inputs = [log_probs, Const(targets), Const(input_lengths), Const(target_lengths)]
    else:
        fn = lambda lp, t: F.ctc_loss(lp, t, input_lengths.tolist(), target_lengths.tolist(),  # noqa: E731
                                      reduction=reduction)
        inputs = [log_probs, Const(targets)]
    assert check_op(fn, inputs, sample=24) >= 7  # (7 concatenated targets: only unsharded)


@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
def test_ctc_loss_over_a_sharded_batch_issues_no_collective(concatenated):
    """Log-probabilities sharded over the batch, padded targets with them, the lengths whole (the widest target sets
    `log_alpha`'s width); concatenated (1-D) targets whole, each device taking its own samples' run of them by the
    target lengths: each device's samples, forward and backward, with no collective."""
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs()
    if concatenated:
        targets = _concatenated(targets, target_lengths)
    mesh = spmd.create_mesh([("batch", 2)])
    rows = lambda t, rank: spmd.copy_to_mesh(t, Layout(["batch"] + [U] * (rank - 1), mesh))  # noqa: E731
    lp = spmd.copy_to_mesh(log_probs, Layout([U, "batch", U], mesh)).requires_grad_()
    dist_targets = spmd.copy_to_mesh(targets, Layout([U], mesh)) if concatenated else rows(targets, 2)
    whole = [spmd.copy_to_mesh(t, Layout([U], mesh)) for t in (input_lengths, target_lengths)]
    loss, forward = issued(lambda: F.ctc_loss(lp, dist_targets, *whole, reduction="none"))
    _, backward = issued(lambda: loss.backward(rows(torch.ones(4, dtype=torch.float64), 1)))
    assert forward == [] and backward == []
    assert spmd.fetch_layout(loss).sharding_specs == ["batch"]
    assert spmd.fetch_layout(lp.grad).sharding_specs == [U, "batch", U]
    plain = log_probs.clone().requires_grad_()
    want = F.ctc_loss(plain, targets, input_lengths, target_lengths, reduction="none")
    want.sum().backward()
    torch.testing.assert_close(spmd.to_global(loss), want)
    torch.testing.assert_close(spmd.to_global(lp.grad), plain.grad)


_CHUNKED_LOSS_COLLECTIVES = {  # on the classifier replicated and the rows sharded over "batch"
    "mean": [("all_reduce", ("batch",))] * 3,  # the rows' total weight; the weight's and bias's gradients (torch
    "sum": [("all_reduce", ("batch",))] * 2,  # stashes them, computed with the loss), each device's partial sums
    "none": [],
}


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="F.linear_cross_entropy is new in torch 2.13")
@pytest.mark.parametrize("classifier", [[U, U], ["model", U]], ids=["replicated", "vocab-sharded"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_linear_cross_entropy_matches_torch(reduction, classifier):
    """torch's chunked linear + cross-entropy (the logits never whole): each device runs it on its rows, with the
    classifier whole (gathered where it is sharded) — the loss a pending sum over the rows' mesh dim, a mean's
    total weight one all-reduce of a scalar; at 'none' its backward too (torch's Python loop over scratch buffers,
    per device). Values and gradients as torch's, an ignored target among them."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
    torch.manual_seed(0)
    x, w, b, target = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32), torch.randint(0, 32, (8,))
    target[3] = -100
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh)).requires_grad_()
    dw = spmd.copy_to_mesh(w, Layout(classifier, mesh)).requires_grad_()
    db = spmd.copy_to_mesh(b, Layout([U], mesh)).requires_grad_()
    dt = spmd.copy_to_mesh(target, Layout(["batch"], mesh))
    options = LinearCrossEntropyOptions()
    got, collectives = issued(lambda: F.linear_cross_entropy(dx, dw, dt, linear_bias=db, reduction=reduction,
                                                             options=options))
    gathered = [("all_gather", ("model",))] if classifier[0] == "model" else []
    assert collectives == gathered + _CHUNKED_LOSS_COLLECTIVES[reduction]
    assert spmd.fetch_layout(got).sharding_specs == (["batch"] if reduction == "none" else [])
    if reduction != "none":
        assert got._pending == ("batch",)
    _, collectives = issued(lambda: got.sum().backward())
    # nothing reads the loss (its sum over "batch" stays pending through `.sum()`); the classifier's gradient stays
    # a sum pending over "batch" (reduced when read), also through its relayout back to the shards over "model"
    assert collectives == []
    px, pw, pb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    want = F.linear_cross_entropy(px, pw, target, linear_bias=pb, reduction=reduction, options=options)
    want.sum().backward()
    torch.testing.assert_close(spmd.to_global(got), want.detach())
    for d, p in ((dx, px), (dw, pw), (db, pb)):
        torch.testing.assert_close(spmd.to_global(d.grad), p.grad)
