"""The boundary of a distributed module: plain tensors its forward makes are taken as replicated, a plain tensor
argument of the outermost call and user code outside any distributed forward raise MixedTensorError."""

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd import UNSHARDED as U, Layout
from spmd.engine import dispatch
from sweep import Plain, check_op, rand


class Causal(nn.Module):
    """Causal attention-like mixing with its mask made in the forward (as HF models do)."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
        scores = (self.proj(x) @ x.transpose(1, 2)).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ x


class Shifted(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.out = nn.Linear(d, 4)

    def forward(self, h, shift):
        return self.out(h) + shift.unsqueeze(-1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Causal(), Causal()])
        self.head = Shifted()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x, torch.linspace(0, 1, x.shape[1]))  # a plain tensor passed to a submodule


@pytest.fixture(scope="module")
def mesh():
    return spmd.create_mesh([("batch", 2), ("model", 2)])


def _models(mesh):
    torch.manual_seed(0)
    ref = Model()
    layouts = {r"proj\.weight": ["model", U], r"proj\.bias": ["model"], r"out\.weight": [U, "model"]}
    return ref, spmd.distribute_module(copy.deepcopy(ref), mesh, layouts)


def _batch(mesh, x):
    return spmd.copy_to_mesh(x, Layout(["batch", U, U], mesh))


def test_plain_tensors_made_inside_are_replicated(mesh):
    ref, model = _models(mesh)
    x = torch.randn(4, 6, 8)
    out = model(_batch(mesh, x))
    assert spmd.fetch_layout(out).sharding_specs == ["batch", U, U]
    torch.testing.assert_close(spmd.to_global(out), ref(x))
    out.square().mean().backward()
    ref(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad, msg=name)
    assert dispatch.IMPLICIT_REPLICATION == [0]


def test_user_code_outside_still_raises(mesh):
    _, model = _models(mesh)
    out = model(_batch(mesh, torch.randn(4, 6, 8)))
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4\]"):
        out + torch.arange(4.0)
    with spmd.implicit_replication():  # the user's explicit choice still works
        out + torch.arange(4.0)


def test_a_plain_argument_of_the_outermost_call_raises(mesh):
    _, model = _models(mesh)
    with pytest.raises(spmd.MixedTensorError, match=r"Model\.forward got a plain torch\.Tensor of shape "
                                                    r"\[4, 6, 8\] as `x`.*copy_to_mesh"):
        model(torch.randn(4, 6, 8))
    h = _batch(mesh, torch.randn(4, 6, 8))
    with pytest.raises(spmd.MixedTensorError, match=r"Shifted\.forward .* shape \[6\] as `shift`"):
        model.head(h, torch.ones(6))  # a submodule called from outside: its call is the outermost
    with pytest.raises(spmd.MixedTensorError, match=r"as `shift\[1\]`"):
        model.head(h, (1.0, torch.ones(6)))  # named inside a structure too
    assert spmd.fetch_layout(model.head(h, torch.tensor(1.0))).sharding_specs == ["batch", U, U]  # 0-d is a scalar
    assert dispatch.IMPLICIT_REPLICATION == [0]


def test_nested_modules_each_have_the_scope(mesh):
    ref, model = _models(mesh)
    x = torch.randn(4, 6, 8)
    torch.testing.assert_close(spmd.to_global(model.layers[1](_batch(mesh, x))), ref.layers[1](x))

    class Outside(nn.Module):  # an undistributed wrapper: its own plain tensors are the user's
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) + torch.ones(4)

    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4\]"):
        Outside(model)(_batch(mesh, x))


def test_an_exception_inside_forward_ends_the_scope(mesh):
    class Failing(Causal):
        def forward(self, x):
            super().forward(x)
            raise ValueError("boom")

    model = spmd.distribute_module(Failing(), mesh)
    x = _batch(mesh, torch.randn(4, 6, 8))
    with pytest.raises(ValueError, match="boom"):
        model(x)
    assert dispatch.IMPLICIT_REPLICATION == [0]
    with pytest.raises(spmd.MixedTensorError):
        x + torch.ones(8)


def test_reentrant_forward(mesh):
    """A module calling itself (and a submodule called twice) keeps the scope until the outermost call returns."""

    class Recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, depth=2):
            x = self.lin(x) + torch.ones(8)
            return x if depth == 0 else self(x, depth - 1) - torch.ones(8)

    torch.manual_seed(0)
    ref = Recursive()
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, {r"lin\.weight": ["model", U]})
    x = torch.randn(4, 8)
    torch.testing.assert_close(spmd.to_global(model(spmd.copy_to_mesh(x, Layout(["batch", U], mesh)))), ref(x))
    assert dispatch.IMPLICIT_REPLICATION == [0]


def test_the_forward_stays_the_modules(mesh):
    """The signature is the module's (HF reads it), a deep copy runs its own parameters, a second distribution
    does not wrap twice, and a forward set on the instance before is kept."""
    ref, model = _models(mesh)
    assert str(inspect.signature(model.head.forward)) == "(h, shift)"
    twin = copy.deepcopy(model)
    assert twin.forward.module is twin and twin.head.forward.module is twin.head
    x = torch.randn(4, 6, 8)
    with torch.no_grad():
        twin.head.out.bias.add_(1.0)
    torch.testing.assert_close(spmd.to_global(twin(_batch(mesh, x))), ref(x) + 1.0)
    spmd.distribute_module(model, mesh)
    assert model.forward.inner is None

    plain = nn.Linear(8, 8)
    plain.forward = lambda x: F.linear(x, plain.weight) + torch.ones(8)  # (as hooks of other libraries do)
    spmd.distribute_module(plain, mesh)
    assert spmd.to_global(plain(spmd.copy_to_mesh(torch.zeros(4, 8), Layout(["batch", U], mesh)))).sum() == 32


def test_function_traces_a_distributed_module_in_one_graph(mesh):
    """Dynamo defers the scope's counter past the ops it traces: a traced forward's plain tensors are replicated
    all the same, with no graph break, and the traced training step equals the eager one."""
    ref, model = _models(mesh)
    x = torch.randn(4, 6, 8)

    def loss(x):
        return model(x).square().mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = spmd.function(loss, backend="aot_eager", fullgraph=True)(_batch(mesh, x))
    assert not [w for w in caught if "graph breaks" in str(w.message)]
    torch.testing.assert_close(traced.item(), ref(x).square().mean().item(), rtol=1e-5, atol=0)
    assert dispatch.IMPLICIT_REPLICATION == [0]


def test_implicit_replication_inside_a_traced_function(mesh):
    x = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["batch", U], mesh))

    def shifted(x):
        with spmd.implicit_replication():
            return x + torch.arange(4.0)

    out = spmd.function(shifted, backend="aot_eager")(x)
    assert spmd.fetch_layout(out).sharding_specs == ["batch", U]
    torch.testing.assert_close(spmd.to_global(out), torch.ones(4, 4) + torch.arange(4.0))


@pytest.mark.parametrize("first", [True, False], ids=["cache_first", "cache_last"])
def test_cat_skips_a_legacy_empty_tensor(first):
    """HF's empty KV cache is `torch.tensor([])`, concatenated with 4-D keys: torch skips such an operand."""
    def fn(keys, plain_empty):
        with spmd.implicit_replication():
            return torch.cat([plain_empty, keys] if first else [keys, plain_empty], dim=-2)

    assert check_op(fn, [rand(2, 2, 4, 2), Plain(torch.tensor([]))], sample=24) > 1
