"""`spmd.local_map`: a plain-tensor function run on each device's components — values, gradients (a replicated
argument's gradient summed over exactly the mesh dims where the copies' contributions differ), the collectives,
modules, and the errors."""

import copy

import pytest
import torch
from torch import nn

import spmd
from spmd import UNSHARDED as U, Layout, axis_index, local_map
from tests.sweep import issued

MESH = spmd.create_mesh([("batch", 2), ("model", 2)])
ROWS = Layout(["batch", U], MESH)


def _leaf(t, layout):
    return spmd.copy_to_mesh(t, layout).requires_grad_()


def test_each_device_runs_on_its_rows_and_a_replicated_weight_sums_its_gradient_over_batch_only():
    torch.manual_seed(0)
    x, w = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    dx, dw = _leaf(x, ROWS), _leaf(w, Layout([U, U], MESH))
    seen = []

    def layer(a, b):
        seen.append(tuple(a.shape))
        return torch.tanh(a @ b)
    out, collectives = issued(lambda: local_map(layer, out_layouts=ROWS)(dx, dw))
    assert collectives == [] and seen == [(4, 4)] * 4
    (out ** 2).sum().backward()
    px, pw = x.clone().requires_grad_(), w.clone().requires_grad_()
    (torch.tanh(px @ pw) ** 2).sum().backward()
    torch.testing.assert_close(spmd.to_global(out), torch.tanh(x @ w))
    torch.testing.assert_close(spmd.to_global(dx.grad), px.grad)
    assert dw.grad._pending == ("batch",)  # "model" replicates every argument and result: nothing to sum there
    grad, collectives = issued(lambda: spmd.to_global(dw.grad))
    assert collectives == [("all_reduce", ("batch",))]
    torch.testing.assert_close(grad, pw.grad)


def test_a_replicated_result_counts_its_gradient_once():
    w = torch.randn(4, 3, dtype=torch.float64)
    dw = _leaf(w, Layout([U, U], MESH))
    dx = _leaf(torch.randn(8, 4, dtype=torch.float64), ROWS)
    rows, total = local_map(lambda a, b: (a @ b, (2 * b).sum()), out_layouts=(ROWS, Layout([], MESH)))(dx, dw)
    (rows.sum() + 3 * total).backward()
    pw = w.clone().requires_grad_()
    x = spmd.to_global(dx).detach()
    ((x @ pw).sum() + 3 * (2 * pw).sum()).backward()
    torch.testing.assert_close(spmd.to_global(dw.grad), pw.grad)


def test_axis_index_says_where_the_function_runs():
    zeros = spmd.copy_to_mesh(torch.zeros(2, 2), Layout(["batch", "model"], MESH))
    where = local_map(lambda t: t + 10 * axis_index("batch") + axis_index("model"),
                      out_layouts=Layout(["batch", "model"], MESH))
    assert spmd.to_global(where(zeros)).tolist() == [[0, 1], [10, 11]]
    with pytest.raises(RuntimeError, match="only inside a function that spmd.local_map runs"):
        axis_index("batch")
    with pytest.raises(spmd.LayoutError, match="no dimension 'x'"):
        local_map(lambda t: t + axis_index("x"), out_layouts=ROWS)(spmd.copy_to_mesh(torch.zeros(4, 2), ROWS))


def test_in_layouts_relayout_the_arguments_first():
    x = torch.randn(4, 4)
    columns = spmd.copy_to_mesh(x, Layout([U, "model"], MESH))
    out, collectives = issued(lambda: local_map(lambda a: a * 2, out_layouts=ROWS, in_layouts=(ROWS,))(columns))
    assert collectives == [("all_gather", ("model",))]
    torch.testing.assert_close(spmd.to_global(out), x * 2)


def test_a_module_maps_its_parameters_in_place_of_a_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    model = spmd.distribute_module(net, MESH)
    model[0].forward = local_map(model[0], out_layouts=ROWS)
    x = torch.randn(8, 4, dtype=torch.float64)
    out, collectives = issued(lambda: model(spmd.copy_to_mesh(x, ROWS)))
    assert collectives == []
    out.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(spmd.to_global(out), ref(x))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad, msg=name)
        assert spmd.fetch_layout(p.grad) == spmd.fetch_layout(p)
    assert isinstance(model[0].weight, spmd.DTensor)  # (swapped back after each device's call)


def test_bad_calls_name_what_is_wrong():
    dx = spmd.copy_to_mesh(torch.randn(8, 4), ROWS)
    with pytest.raises(spmd.LayoutError, match="returned .* but out_layouts is shaped"):
        local_map(lambda a: (a, a), out_layouts=ROWS)(dx)
    with pytest.raises(spmd.LayoutError, match="different shapes on the devices"):
        local_map(lambda a: a[: 1 + axis_index("batch")], out_layouts=ROWS)(dx)
    with pytest.raises(spmd.LayoutError, match="has rank 1"):
        local_map(lambda a: a.sum(1), out_layouts=ROWS)(dx)
    with pytest.raises(spmd.MixedTensorError, match="plain tensor of shape \\[4\\] that requires grad"):
        local_map(lambda a, b: a * b, out_layouts=ROWS)(dx, torch.ones(4, requires_grad=True))
    other = spmd.create_mesh([("batch", 4)])
    with pytest.raises(spmd.MeshMismatchError, match="different meshes"):
        local_map(lambda a: a, out_layouts=Layout(["batch", U], other))(dx)
    with pytest.raises(TypeError, match="needs out_layouts"):
        local_map(lambda a: a)


def test_spmd_function_traces_it_into_its_graph():
    """One trace; the mapped layer's plain ops are in the graph; losses and gradients as eager. A call with other
    arguments than tensors runs between the graphs."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    dx, dw = spmd.copy_to_mesh(x, ROWS), _leaf(w, Layout([U, U], MESH))
    layer = local_map(lambda a, b: torch.tanh(a @ b), out_layouts=ROWS)
    step = spmd.function(lambda a, b: layer(a, b).pow(2).sum(), backend="aot_eager")
    for _ in range(2):
        dw.grad = None
        loss = step(dx, dw)
        loss.backward()
    pw = w.clone().requires_grad_()
    want = torch.tanh(x @ pw).pow(2).sum()
    want.backward()
    assert step.experimental_get_tracing_count() == 1
    assert str(step.explain(dx, dw)).splitlines()[2] == "local_map(<lambda>) | [batch,-] [-,-] | [batch,-] | "
    torch.testing.assert_close(loss.item(), want.item())
    torch.testing.assert_close(spmd.to_global(dw.grad), pw.grad)
    scaled = local_map(lambda a, k: a * k, out_layouts=ROWS)
    with pytest.raises(spmd.TraceError, match="fullgraph=False"):
        spmd.function(lambda a: scaled(a, 2).sum(), backend="eager")(dx)
    with pytest.warns(UserWarning, match="graph breaks"):
        total = spmd.function(lambda a: scaled(a, 2).sum(), backend="eager", fullgraph=False)(dx)
    torch.testing.assert_close(total.item(), 2 * x.sum().item())


def test_a_result_that_is_not_a_tensor_takes_none_and_is_the_first_devices():
    dx = spmd.copy_to_mesh(torch.randn(8, 4), ROWS)
    out, count = local_map(lambda a: (a * 2, a.shape[0]), out_layouts=(ROWS, None))(dx)
    assert count == 4 and spmd.fetch_layout(out) == ROWS  # (each device: 4 of the 8 rows)


def test_a_whole_step_traces_it_into_its_graph():
    """`spmd.function(whole_step=True)` traces on the components (make_fx): the mapped layer's plain ops are in
    its graph, and the steps' losses are eager spmd's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = spmd.copy_to_mesh(torch.randn(8, 4, dtype=torch.float64), ROWS)
    losses = []
    for whole_step in (False, True):
        model = spmd.distribute_module(copy.deepcopy(net), MESH)
        model[0].forward = local_map(model[0], out_layouts=ROWS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss
        run = spmd.function(step, whole_step=True, backend="eager") if whole_step else step
        losses.append([run(x).item() for _ in range(3)])
    torch.testing.assert_close(losses[1], losses[0])
