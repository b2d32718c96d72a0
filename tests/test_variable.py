"""DVariable with nn.Module and torch.optim, and the gradient layouts of DTensor leaves (reference §1.8)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.utils.prune

import spmd
from spmd import (
    UNSHARDED,
    DTensor,
    DVariable,
    Layout,
    copy_to_mesh,
    create_mesh,
    fetch_layout,
    is_dtensor,
    relayout,
)
from tests.sweep import gather  # noqa: E402

U = UNSHARDED


# -- DVariable ---------------------------------------------------------------------------------------------------
@pytest.fixture
def xy(mesh22):
    return Layout(["x", "y"], mesh22)


def test_dvariable_from_a_dtensor(xy):
    d = copy_to_mesh(torch.arange(16.0).reshape(4, 4), xy)
    v = DVariable(d)
    assert fetch_layout(v) == xy and torch.equal(gather(v), gather(d))
    assert is_dtensor(v) and isinstance(v, DTensor)
    assert isinstance(v, torch.nn.Parameter)
    assert v.requires_grad and v.is_leaf
    assert DVariable(d, layout=xy).shape == (4, 4)  # an equal layout is fine
    assert not DVariable(d, requires_grad=False).requires_grad


def test_dvariable_from_a_plain_value_with_layout(xy):
    for value in (torch.ones(4, 4), np.ones((4, 4), dtype=np.float32), lambda: torch.ones(4, 4)):
        v = DVariable(value, layout=xy)
        assert fetch_layout(v) == xy and torch.equal(gather(v), torch.ones(4, 4))
    assert DVariable(torch.ones(4, 4), layout=xy, dtype=torch.float64).dtype == torch.float64


def test_dvariable_errors(xy, mesh22):
    d = copy_to_mesh(torch.ones(4, 4), xy)
    with pytest.raises(ValueError, match="Conflicting layout"):
        DVariable(d, layout=Layout.replicated(mesh22, 2))
    with pytest.raises(ValueError, match="Neither layout nor DTensor initial value are provided"):
        DVariable(torch.ones(4, 4))


def test_dvariable_assign(xy, mesh22):
    v = DVariable(torch.zeros(4, 4), layout=xy)
    local = v._local
    assert v.assign(spmd.ones((4, 4), layout=xy)) is v
    assert torch.equal(gather(v), torch.ones(4, 4))
    v.assign_add(spmd.fill((4, 4), 2.0, layout=xy))
    assert torch.equal(gather(v), torch.full((4, 4), 3.0))
    v.assign_sub(spmd.ones((4, 4), layout=xy))
    assert torch.equal(gather(v), torch.full((4, 4), 2.0))
    v.assign(5.0)  # a Python scalar is broadcast
    assert torch.equal(gather(v), torch.full((4, 4), 5.0))
    v.assign_add(torch.tensor(1.0))  # so is a 0-d tensor
    assert torch.equal(gather(v), torch.full((4, 4), 6.0))
    assert fetch_layout(v) == xy and v._local is local  # in place, same layout
    r = v.read_value()
    assert not isinstance(r, DVariable) and fetch_layout(r) == xy and torch.equal(gather(r), gather(v))
    v.assign(0.0)
    assert torch.equal(gather(r), torch.full((4, 4), 6.0))  # read_value is a copy


def test_dvariable_assign_errors(xy, mesh22):
    v = DVariable(torch.zeros(4, 4), layout=xy)
    with pytest.raises(ValueError, match=r"layout \['unsharded', 'unsharded'\]"):
        v.assign(copy_to_mesh(torch.ones(4, 4), Layout.replicated(mesh22, 2)))
    other_mesh = create_mesh([("x", 2), ("y", 2)], mesh_name="other")
    with pytest.raises(ValueError, match="mesh"):
        v.assign(copy_to_mesh(torch.ones(4, 4), Layout(["x", "y"], other_mesh)))
    with pytest.raises(ValueError, match="mesh"):
        v.assign_add(copy_to_mesh(torch.ones(4, 4), Layout(["x", "y"], other_mesh)))
    with pytest.raises(ValueError, match=r"shape \[4, 8\]"):
        v.assign(copy_to_mesh(torch.ones(4, 8), xy))
    for plain in (torch.ones(4, 4), np.ones((4, 4)), [[1.0] * 4] * 4):
        with pytest.raises(TypeError, match="copy_to_mesh"):
            v.assign(plain)
    with pytest.raises(TypeError):
        v.assign_sub(torch.ones(4, 4))
    assert torch.equal(gather(v), torch.zeros(4, 4)) and fetch_layout(v) == xy


def test_dvariable_in_nn_module(xy):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = DVariable(torch.ones(4, 4), layout=xy)

    model = Model()
    params = dict(model.named_parameters())
    assert list(params) == ["w"] and params["w"] is model.w
    assert isinstance(model.w, DVariable)
    assert "w" in model.state_dict()
    clone = copy.deepcopy(model)
    assert isinstance(clone.w, DVariable) and fetch_layout(clone.w) == xy and clone.w is not model.w
    assert torch.equal(gather(clone.w), gather(model.w))


@pytest.mark.parametrize("convert", ["double", "half", "to_bfloat16"])
def test_a_modules_dvariables_stay_dvariables_when_it_changes_dtype(xy, mesh22, convert):
    """`module.double()` and `.to(dtype)` swap new tensors into a module's parameters (torch's swap for tensor
    subclasses): each stays the same object, a DVariable of its layout, that an optimizer made before still steps."""
    model = spmd.distribute_module(torch.nn.Linear(4, 4), mesh22, spmd.LayoutMap({"weight": xy}))
    before = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtype = {"double": torch.float64, "half": torch.float16, "to_bfloat16": torch.bfloat16}[convert]
    model.to(dtype) if convert.startswith("to_") else getattr(model, convert)()
    after = list(model.parameters())
    assert [type(p) for p in after] == [DVariable, DVariable] and all(a is b for a, b in zip(after, before))
    assert [p.dtype for p in after] == [dtype, dtype] and fetch_layout(model.weight) == xy
    value = gather(model.weight).clone()
    x = copy_to_mesh(torch.ones(2, 4, dtype=dtype), Layout([U, U], mesh22))
    model(x).sum().backward()
    assert fetch_layout(model.weight.grad) == xy
    opt.step()
    torch.testing.assert_close(gather(model.weight), value - 0.1 * gather(model.weight.grad))
    model.weight.assign_add(torch.ones(()))  # still a variable's methods


def test_a_parameter_of_a_dtensor_is_a_dvariable(xy):
    """`nn.Parameter(dtensor)` is spmd's parameter, a DVariable of the DTensor's layout."""
    p = torch.nn.Parameter(copy_to_mesh(torch.ones(4, 4), xy))
    assert type(p) is DVariable and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert fetch_layout(p) == xy and p.variable_name is None


def test_dvariable_gradient_has_its_layout(xy, mesh22):
    w = DVariable(torch.ones(4, 4), layout=xy)
    x = copy_to_mesh(torch.arange(16.0).reshape(4, 4), Layout(["x", U], mesh22))
    (x @ w).sum().backward()
    assert fetch_layout(w.grad) == xy
    expected = torch.arange(16.0).reshape(4, 4).T @ torch.ones(4, 4)
    assert torch.allclose(gather(w.grad), expected)


OPTIMIZERS = [
    ("SGD", lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=fe)),
    ("Adam", lambda p, fe: torch.optim.Adam(p, lr=0.05, foreach=fe)),
    ("AdamW", lambda p, fe: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=fe)),
]


@pytest.mark.parametrize("foreach", [False, None], ids=["foreach=False", "default"])
@pytest.mark.parametrize("name, make", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_optimizers_match_plain_torch(mesh22, name, make, foreach):
    gen = torch.Generator().manual_seed(0)
    W0, B0 = torch.randn(4, 4, generator=gen), torch.randn(4, generator=gen)
    X, Y = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    w_layout, b_layout = Layout([U, "y"], mesh22), Layout(["y"], mesh22)
    w, b = DVariable(W0.clone(), layout=w_layout), DVariable(B0.clone(), layout=b_layout)
    pw, pb = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(B0.clone())
    opt, popt = make([w, b], foreach), make([pw, pb], foreach)
    x, y = copy_to_mesh(X, Layout(["x", U], mesh22)), copy_to_mesh(Y, Layout(["x", U], mesh22))
    storage = (w._local, b._local)
    for _ in range(4):
        opt.zero_grad()
        loss = ((x @ w + b - y) ** 2).mean()
        loss.backward()
        opt.step()
        popt.zero_grad()
        ploss = ((X @ pw + pb - Y) ** 2).mean()
        ploss.backward()
        popt.step()
        assert torch.allclose(gather(loss), ploss.detach(), atol=1e-5)
    assert isinstance(w, DVariable) and fetch_layout(w) == w_layout and fetch_layout(b) == b_layout
    assert w._local is storage[0] and b._local is storage[1]  # updated in place
    assert torch.allclose(gather(w), pw.detach(), atol=1e-5)
    assert torch.allclose(gather(b), pb.detach(), atol=1e-5)
    for state in opt.state.values():  # optimizer state is distributed like the parameter
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert is_dtensor(value)


# -- gradients of DTensor leaves ---------------------------------------------------------------------------------
LEAF_LOSSES = [  # (name, loss of a DTensor on mesh m, the same loss in plain torch)
    ("square", lambda t, m: (t * t).sum(), lambda t: (t * t).sum()),
    ("relayout", lambda t, m: relayout(t, Layout.replicated(m, 2)).sum(), lambda t: t.sum()),
    ("matmul", lambda t, m: (t @ copy_to_mesh(torch.ones(4, 4), Layout(["x", U], m))).sum(),
     lambda t: (t @ torch.ones(4, 4)).sum()),
    ("reduce", lambda t, m: (t.sum(0) ** 2).sum(), lambda t: (t.sum(0) ** 2).sum()),
    ("relayout-mean", lambda t, m: (relayout(t, Layout(["y", "x"], m)) * 2).mean(), lambda t: (t * 2).mean()),
]


@pytest.mark.parametrize("specs", [["x", "y"], ["y", "x"], ["x", U], [U, U]])
@pytest.mark.parametrize("name, loss, plain_loss", LEAF_LOSSES, ids=[n for n, _, _ in LEAF_LOSSES])
def test_leaf_gradient_has_the_leaf_layout(mesh22, specs, name, loss, plain_loss):
    layout = Layout(specs, mesh22)
    value = torch.arange(16.0).reshape(4, 4)
    leaf = copy_to_mesh(value, layout).requires_grad_()
    assert leaf.is_leaf and leaf.requires_grad
    loss(leaf, mesh22).backward()
    assert is_dtensor(leaf.grad) and fetch_layout(leaf.grad) == layout
    reference = value.clone().requires_grad_()
    plain_loss(reference).backward()
    assert torch.allclose(gather(leaf.grad), reference.grad)


def test_assigning_data_rebinds_the_components():
    """`p.data = value`, as torch's utilities rebind parameters: a DVariable takes the value in its own layout, a
    DTensor the value's layout and shape; a plain tensor is refused."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    dlin = spmd.distribute_module(copy.deepcopy(lin), mesh, {"weight": ["model", spmd.UNSHARDED]})
    dlin.weight.data = spmd.copy_to_mesh(torch.ones(2, 4), spmd.Layout([spmd.UNSHARDED, "batch"], mesh))
    assert isinstance(dlin.weight, spmd.DVariable) and dlin.weight.requires_grad
    assert spmd.fetch_layout(dlin.weight).sharding_specs == ["model", spmd.UNSHARDED]
    assert torch.equal(spmd.to_global(dlin.weight.detach()), torch.ones(2, 4))
    vector = torch.nn.utils.parameters_to_vector(dlin.parameters())
    torch.nn.utils.vector_to_parameters(vector * 3, dlin.parameters())
    assert torch.equal(spmd.to_global(dlin.weight.detach()), torch.full((2, 4), 3.0))
    torch.nn.utils.prune.l1_unstructured(lin, "weight", amount=0.5)
    torch.nn.utils.prune.l1_unstructured(dlin, "weight", amount=0.5)
    torch.nn.utils.prune.remove(dlin, "weight")  # rebinds the weight's .data to the pruned value
    assert int((spmd.to_global(dlin.weight.detach()) == 0).sum()) == 4
    t = spmd.copy_to_mesh(torch.zeros(4, 4), spmd.Layout(["batch", spmd.UNSHARDED], mesh))
    t.data = spmd.copy_to_mesh(torch.ones(2, 4), spmd.Layout([spmd.UNSHARDED, "model"], mesh))
    assert t.shape == (2, 4) and spmd.fetch_layout(t).sharding_specs == [spmd.UNSHARDED, "model"]
    assert torch.equal(spmd.to_global(t), torch.ones(2, 4))
    with pytest.raises(spmd.MixedTensorError, match="copy_to_mesh"):
        t.data = torch.ones(2, 4)
