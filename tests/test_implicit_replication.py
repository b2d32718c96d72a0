"""Plain tensors that torch makes inside an op: derivative formulas and the composite ops that make them
(`F.one_hot`, the math attention kernel, `quantile`) take them as replicated by themselves; elsewhere
`spmd.implicit_replication()` does; a user's plain tensor still raises MixedTensorError."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import spmd
from spmd import UNSHARDED, Layout
from spmd.engine import plain_operands
from sweep import Const, check_op, components, rand
from test_engine import issued

U = UNSHARDED


@pytest.mark.parametrize("fn", [lambda x: x.prod(1), lambda x: x.prod(), lambda x: torch.copysign(x, x.flip(0)),
                                lambda x: x.cumprod(1), lambda x: torch.linalg.vander(x[0], N=3),
                                lambda x: x.unbind(1)[2], lambda x: x.split(3, dim=0)[1]],
                         ids=["prod_dim", "prod", "copysign", "cumprod", "vander", "unbind", "split"])
def test_derivative_formulas_that_make_plain_tensors(fn):
    """prod's backward makes a plain ones/zeros, cumprod's scatters into one, unbind's stacks zeros for the unused
    outputs: values, gradients and every component equal plain torch's for every layout."""
    assert check_op(fn, [rand(4, 6)]) > 1


def test_one_hot_needs_no_scope_and_issues_no_collective(mesh22):
    labels = spmd.copy_to_mesh(torch.tensor([0, 3, 1, 2]), Layout(["x"], mesh22))
    out, collectives = issued(F.one_hot, labels, 5)
    assert collectives == []
    assert spmd.fetch_layout(out) == Layout(["x", U], mesh22)
    torch.testing.assert_close(spmd.to_global(out), F.one_hot(torch.tensor([0, 3, 1, 2]), 5))
    assert components(out) == [[[1, 0, 0, 0, 0], [0, 0, 0, 1, 0]]] * 2 + \
        [[[0, 1, 0, 0, 0], [0, 0, 1, 0, 0]]] * 2
    for bad, num_classes, message in ((labels - 1, 5, "non-negative"), (labels, 3, "smaller than num_classes")):
        with pytest.raises(RuntimeError, match=message):  # torch's checks of the values, on every device
            F.one_hot(bad, num_classes)
    assert not spmd.scope.replicates_plain()  # the op's scope ended with it


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_hot_in_a_traced_function(mesh22, backend):
    """Traced, torch checks one_hot's labels with an `_assert_async` on a DTensor (a rule of its own)."""
    labels = spmd.copy_to_mesh(torch.tensor([0, 3, 1, 2]), Layout(["x"], mesh22))
    counts = spmd.function(lambda y: F.one_hot(y, 5).sum(0), backend=backend)(labels)
    assert spmd.to_global(counts).tolist() == [1, 1, 1, 1, 0]


def _causal_math_attention(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_math_attention_with_its_causal_mask():
    """The math kernel builds its causal mask as a plain [T, T] tensor."""
    assert check_op(_causal_math_attention, [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2)],
                    sample=12) > 1


def test_quantile_makes_its_own_plain_tensors():
    assert check_op(lambda x: torch.quantile(x, 0.25, dim=1), [rand(4, 6)]) > 1
    quantiles = Const(torch.tensor([0.2, 0.9], dtype=rand(1).dtype))
    assert check_op(lambda x, q: torch.quantile(x, q, dim=0), [rand(4, 6), quantiles]) > 1


def test_a_plain_tensor_passed_to_such_an_op_still_raises(mesh22):
    """Only what torch makes inside is taken as replicated: a mask (or quantiles) from the caller is the caller's
    to lay out."""
    q = spmd.copy_to_mesh(rand(2, 2, 4, 2), Layout(["x", "y", U, U], mesh22))
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4, 4\]"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[2\]"):
        torch.quantile(q, torch.tensor([0.2, 0.9]))
    assert not spmd.scope.replicates_plain()
    mask = spmd.copy_to_mesh(torch.ones(4, 4, dtype=torch.bool), Layout([U, U], mesh22))
    torch.testing.assert_close(spmd.to_global(F.scaled_dot_product_attention(q, q, q, attn_mask=mask)),
                               F.scaled_dot_product_attention(*[spmd.to_global(q)] * 3))


def test_a_plain_mask_passed_to_attention_is_replicated_where_plain_tensors_are(mesh22):
    """Under implicit_replication() (and in spmd.function, whose tensors made without a layout are replicated) the
    caller's plain mask is taken as replicated, as it is by every other op there."""
    q = spmd.copy_to_mesh(rand(2, 2, 4, 2), Layout(["x", "y", U, U], mesh22))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    want = F.scaled_dot_product_attention(*[spmd.to_global(q)] * 3, attn_mask=mask)
    with spmd.implicit_replication():
        torch.testing.assert_close(spmd.to_global(F.scaled_dot_product_attention(q, q, q, attn_mask=mask)), want)
    attend = spmd.function(lambda q: F.scaled_dot_product_attention(
        q, q, q, attn_mask=torch.tril(torch.ones(4, 4, dtype=torch.bool))), backend="eager")
    torch.testing.assert_close(spmd.to_global(attend(q)), want)


def test_a_users_plain_tensor_still_raises_and_the_scope_ends(mesh22):
    x = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", U], mesh22))
    with pytest.raises(RuntimeError, match="boom"), spmd.implicit_replication():
        torch.testing.assert_close(spmd.to_global(x + torch.arange(4.0)), torch.ones(4, 4) + torch.arange(4.0))
        raise RuntimeError("boom")
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4\]"):
        x + torch.arange(4.0)


def test_an_op_writing_dtensors_into_a_plain_tensor_writes_their_global_values(mesh22, monkeypatch):
    """A plain tensor holds a global value in the scope (a cache a model allocated for itself): a write of DTensors
    into it writes their global values, gathered and warned about once. Outside the scope it is refused and nothing
    is written. Written with DTensors that require grad, the plain tensor requires grad too: where it meets
    DTensors again it is refused (its gradient could not reach them)."""
    monkeypatch.setattr(plain_operands, "_WARNED", set())  # (each op warns once per process)
    x = spmd.copy_to_mesh(torch.arange(4.0), Layout(["x"], mesh22))
    plain = torch.zeros(4)
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4\]"):
        plain.add_(x)
    with spmd.implicit_replication(), pytest.warns(UserWarning, match=r"writes DTensors into a plain tensor"):
        _, collectives = issued(plain.add_, x)
    assert plain.tolist() == [0, 1, 2, 3]
    assert collectives == [("all_gather", ("x",), False)]
    with spmd.implicit_replication():
        plain[1:3].copy_(x[:2])
    assert plain.tolist() == [0, 0, 1, 3]
    with spmd.implicit_replication():
        plain.mul_(x.detach().requires_grad_())
        assert plain.requires_grad and plain.tolist() == [0, 0, 2, 9]
        with pytest.raises(spmd.MixedTensorError, match=r"buffer written with DTensors that require grad"):
            plain * x


def test_a_plain_scalar_written_with_a_dtensor_takes_its_value(mesh22):
    """A plain 0-d tensor is a scalar operand elsewhere; as the target of an in-place op (a chunked loss's running
    total in its backward) it takes the DTensor's value where plain tensors hold global values."""
    total, x = torch.zeros(()), spmd.copy_to_mesh(torch.arange(4.0), Layout(["x"], mesh22))
    with pytest.raises(spmd.MixedTensorError, match=r"plain 0-d tensor"):
        total.add_(x.sum())
    with spmd.implicit_replication():
        total.add_(x.sum())
        total.add_(x.sum())
    assert total.item() == 12.0 and type(total) is torch.Tensor


def test_scatter_in_place_keeps_the_targets_layout(mesh22):
    """scatter_ (what cumprod's backward runs) writes into a target sharded on another axis than `dim`, and into
    one sharded along `dim` (each device writes the indices in its block), without a collective."""
    index, src = torch.tensor([[0], [3], [1], [2]]), rand(4, 1, seed=1)
    want = rand(4, 4).scatter_(1, index, src)
    dist_index, dist_src = (spmd.copy_to_mesh(t, Layout.replicated(mesh22, 2)) for t in (index, src))
    for layout in (Layout(["x", U], mesh22), Layout([U, "y"], mesh22), Layout(["x", "y"], mesh22)):
        target = spmd.copy_to_mesh(rand(4, 4), layout)
        _, collectives = issued(target.scatter_, 1, dist_index, dist_src)
        assert collectives == [] and spmd.fetch_layout(target) == layout
        torch.testing.assert_close(spmd.to_global(target), want)
        for got, expected in zip(spmd.unpack(target), spmd.unpack(spmd.copy_to_mesh(want, layout))):
            torch.testing.assert_close(got, expected)
    added = spmd.copy_to_mesh(rand(4, 4), Layout([U, "y"], mesh22))
    added.scatter_add_(1, dist_index, dist_src)
    torch.testing.assert_close(spmd.to_global(added), rand(4, 4).scatter_add_(1, index, src))
    filled = spmd.copy_to_mesh(rand(4, 4), Layout([U, "y"], mesh22))
    filled.scatter_(1, dist_index, 1.0)
    torch.testing.assert_close(spmd.to_global(filled), rand(4, 4).scatter_(1, index, 1.0))
