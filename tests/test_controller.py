"""Single-controller mode: 2 worker processes x 2 CPU devices, driven from this process, on both engines.

Each engine's controller starts once for the module (a killed-worker test starts its own). Every wait on the
workers is bounded (the collective timeout plus a margin), so a bug fails a test but never hangs the suite.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pickle
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import adam

import spmd
from spmd import UNSHARDED as U, Layout
from spmd.controller import (Controller, ControllerError, RemoteDTensor, WorkerDiedError, WorkerError, protocol,
                             reaper, shadow_cache)
from spmd.engine import fallback

ENGINES = [pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(package) is None,
                                                       reason=f"{package} is not installed"))
           for name, package in (("monarch", "monarch"), ("ray", "ray"))]


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (zombies excluded)."""
    return set(reaper.tree([pid])) - {pid}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, seconds: float = 20) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


@pytest.fixture(scope="module", params=ENGINES)
def ctl(request):
    before = descendants(os.getpid())
    controller = Controller(num_workers=2, devices_per_worker=2, device_type="CPU", engine=request.param,
                            collective_timeout=20)
    started = descendants(os.getpid()) - before
    yield controller
    controller.shutdown()
    assert wait_gone(started | set(controller.worker_pids())) == set(), "processes left after shutdown"


@pytest.fixture(autouse=True)
def check_shadow_cache(monkeypatch):
    """Every op the controller replays from its shadow cache also runs the engine, and the two must agree."""
    monkeypatch.setattr(shadow_cache, "CHECK", True)


@pytest.fixture
def mesh(ctl):
    return ctl.create_mesh([("batch", 2), ("model", 2)])


def test_mesh_names_workers(ctl, mesh):
    assert len(set(ctl.worker_pids())) == 2 and os.getpid() not in ctl.worker_pids()
    assert mesh.local_devices()[2] == "/job:worker/replica:0/task:1/device:CPU:0"
    assert "/job:worker/replica:0/task:1/device:CPU:1" in mesh.to_string()


def test_ops_values_and_gradients_equal_torch(mesh):
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 16), torch.randn(16, 8), torch.randn(8)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    dw = spmd.copy_to_mesh(w, Layout([U, "model"], mesh)).requires_grad_()
    db = spmd.copy_to_mesh(b, Layout(["model"], mesh)).requires_grad_()
    out = (torch.tanh(dx @ dw + db) * 3 - dx[:, :8]).softmax(-1).log().mean()
    assert isinstance(out, RemoteDTensor) and out.device.type == "meta"  # no data on the controller
    w_, b_ = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = (torch.tanh(x @ w_ + b_) * 3 - x[:, :8]).softmax(-1).log().mean()
    torch.testing.assert_close(spmd.to_global(out), ref.detach())
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    out.backward()
    ref.backward()
    torch.testing.assert_close(spmd.to_global(dw.grad), w_.grad)
    torch.testing.assert_close(spmd.to_global(db.grad), b_.grad)
    assert spmd.fetch_layout(dw.grad) == Layout([U, "model"], mesh)


def test_creation_relayout_pack_and_reads(mesh):
    t = spmd.copy_to_mesh(torch.arange(16.).reshape(4, 4), Layout.replicated(mesh, 2))
    s = spmd.relayout(t, Layout(["batch", "model"], mesh))
    assert [c.tolist() for c in spmd.unpack(s)][2] == [[8.0, 9.0], [12.0, 13.0]]  # device 2 is on worker 1
    assert spmd.relayout(s, Layout.replicated(mesh, 2)).numpy().tolist() == torch.arange(16.).reshape(4, 4).tolist()
    z = spmd.zeros(4, 6, layout=Layout(["batch", U], mesh)) + spmd.ones(4, 6, layout=Layout([U, "model"], mesh))
    assert spmd.to_global(z).sum().item() == 24.0
    p = spmd.pack([torch.full((2,), float(i)) for i in range(4)], Layout(["batch"], mesh))
    assert spmd.to_global(p).tolist() == [0.0, 0.0, 2.0, 2.0]
    local = spmd.create_mesh([("x", 2)])  # a mesh of this process: to and from it
    here = spmd.relayout(s, Layout(["x", U], local))
    assert type(here) is not RemoteDTensor and spmd.to_global(here).tolist() == spmd.to_global(s).tolist()
    back = spmd.relayout(here, Layout([U, "model"], mesh))
    assert isinstance(back, RemoteDTensor) and spmd.to_global(back).tolist() == spmd.to_global(s).tolist()
    assert '"task:1/CPU:0": [[ 8.  9.] [12. 13.]]' in repr(s)  # (each worker has a CPU:0: the task names it)


def test_dropped_tensors_are_freed(ctl, mesh):
    spmd.ones(4, layout=Layout(["batch"], mesh)) * 2.0  # (a first call may leave its arguments in the plan cache)
    gc.collect()
    before = ctl.live_handles()
    kept = [spmd.ones(4, layout=Layout(["batch"], mesh)) * float(i) for i in range(10)]
    assert [h - b for h, b in zip(ctl.live_handles(), before)] == [10, 10]  # the products (the ones are gone)
    del kept
    assert ctl.live_handles() == before


def test_a_detach_shares_its_tensors_handle_until_both_are_dropped(ctl, mesh, monkeypatch):
    (spmd.ones(4, layout=Layout(["batch"], mesh)) * 2.0).mul_(3.0)  # (a first call may leave its arguments in
    gc.collect()                                                     # the plan cache)
    before = ctl.live_handles()
    x = spmd.ones(4, layout=Layout(["batch"], mesh)) * 2.0
    ctl.sync()
    sent = _messages(ctl, monkeypatch)
    y = x.detach()
    y.mul_(3.0)  # the same worker-side tensor: x sees it, as eagerly
    assert spmd.to_global(x).tolist() == [6.0] * 4 and sent == [["aten.mul_.Tensor"]]
    del x
    assert spmd.to_global(y).tolist() == [6.0] * 4
    del y
    assert ctl.live_handles() == before


def test_shadow_cache_replays_views_inplace_and_pending_ops(mesh):
    torch.manual_seed(0)  # (float64: the contraction's sums are taken in another order than plain torch's)
    a, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    da = spmd.copy_to_mesh(a, Layout(["batch", "model"], mesh))
    dw = spmd.copy_to_mesh(w, Layout(["model", U], mesh))

    def ops(x, w):
        p = x @ w  # a contraction over the sharded axis: a pending sum, resolved into p by the next op
        q = p[:, 3:].t()  # a view with a storage offset, then a transposed one
        q.mul_(2.0)  # in place through the views
        r = (p + 1.0).contiguous().unsqueeze(0)
        r.squeeze_(0)  # rebinds its target: always run by the engine
        h, g = (q.T @ q).sum(0), x.chunk(2, dim=1)[1]
        return p, r, h, g.sum()

    before = shadow_cache.STATS["checked"]
    first = [spmd.to_global(t) for t in ops(da, dw)]
    again = [spmd.to_global(t) for t in ops(da, dw)]
    assert shadow_cache.STATS["checked"] - before >= 8  # the second pass replayed (and checked) its ops
    expected = ops(a, w)
    for got in (first, again):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


def test_shadow_cache_check_catches_a_wrong_record(mesh):
    x = spmd.ones(4, layout=Layout(["batch"], mesh))
    x * 3.0
    key = shadow_cache.key_of(torch.ops.aten.mul.Tensor, (x, 3.0), {}, [])
    entry = shadow_cache._CACHE[key]
    wrong = entry.outputs[0][:4] + ((7,),) + entry.outputs[0][5:]  # a pending reduction the engine does not make
    shadow_cache._CACHE[key] = shadow_cache.Entry((wrong,), entry.structure, entry.inputs)
    try:
        with pytest.raises(AssertionError, match="shadow cache"):
            x * 3.0
    finally:
        shadow_cache._CACHE[key] = entry


def test_torch_compile_alone_is_refused_by_name(mesh):
    x = spmd.copy_to_mesh(torch.arange(8.), Layout(["batch"], mesh))
    with pytest.raises(Exception, match="use spmd.function"):
        torch.compile(lambda a: (a * a).sum(), backend="eager")(x)
    assert (x * x).sum().item() == 140.0  # the workers are unaffected


def test_composite_ops_that_make_plain_tensors_are_refused_by_name(mesh):
    """F.one_hot makes its arange on the input's device, 'meta' on the controller: a clear error, not a meta tensor
    sent to the workers."""
    labels = spmd.copy_to_mesh(torch.tensor([0, 2, 1, 3]), Layout(["batch"], mesh))
    with pytest.raises(spmd.UnsupportedOpError, match="controller mesh"):
        torch.nn.functional.one_hot(labels, 4)
    assert (labels * 2).sum().item() == 12  # the workers are unaffected


@pytest.mark.parametrize("index", [[0, 2], [True, False, True, False], ([0, 3], slice(1, 3)), (slice(None), [1, 3]),
                                   1, (1, 2), (slice(None), 2)])
def test_indexing_reads_and_writes_as_in_torch(mesh, index):
    """A list index (torch makes it a tensor on the indexed tensor's device, 'meta' on the controller) and a number
    written through an index (made a tensor alike) reach the workers with their values; a write into a row of a
    sharded axis (a view copied in another layout) goes back into the tensor it was taken from."""
    value = torch.arange(32.).reshape(4, 8)
    for _ in range(2):  # (the second time from the shadow cache)
        a = spmd.copy_to_mesh(value, Layout(["batch", U], mesh))
        assert torch.equal(spmd.to_global(a[index]), value[index])
        a[index] = -1.0
        expected = value.clone()
        expected[index] = -1.0
        assert torch.equal(spmd.to_global(a), expected)


def test_ops_whose_shape_depends_on_the_values_run_on_the_workers(mesh, monkeypatch):
    """`x[mask]`, `nonzero`, `unique`: the controller holds no values, so the workers run the op and tell it the
    results' shapes; gradients flow back through them."""
    x = spmd.copy_to_mesh(torch.arange(8.) - 3, Layout(["batch"], mesh)).requires_grad_()
    monkeypatch.setattr(fallback, "_GATHERED", set())
    with pytest.warns(UserWarning, match="gathered on every device"):  # on the controller, as in local mode
        positive = x[x > 0]
    assert positive.shape == (4,) and spmd.fetch_layout(positive).sharding_specs == [U]
    assert spmd.to_global(positive).tolist() == [1., 2., 3., 4.]
    (positive * positive).sum().backward()
    assert spmd.to_global(x.grad).tolist() == [0., 0., 0., 0., 2., 4., 6., 8.]
    values, counts = torch.unique(spmd.copy_to_mesh(torch.tensor([1, 3, 1, 2]), Layout(["batch"], mesh)),
                                  return_counts=True)
    assert spmd.to_global(values).tolist() == [1, 2, 3] and spmd.to_global(counts).tolist() == [2, 1, 1]
    where = torch.nonzero(x.detach() < 0)
    assert where.shape == (3, 1) and (where * 2).sum().item() == 6  # the results are usable, on the workers


def test_function_mode_needs_a_backend_the_workers_can_name(mesh):
    x = spmd.copy_to_mesh(torch.arange(8.), Layout(["batch"], mesh))
    with pytest.raises(Exception, match="name its backend"):
        spmd.function(lambda a: (a * a).sum(), backend=lambda gm, inputs: gm)(x)


def _messages(ctl, monkeypatch) -> list[list]:
    """The messages the controller sends to all workers from now on: each the kinds of its instructions (an op's
    name for an op)."""
    sent, engine = [], ctl._session.engine
    send_all = engine.send_all
    monkeypatch.setattr(engine, "send_all", lambda payload: (
        sent.append([i[1] if i[0] == protocol.OP else i[0] for i in pickle.loads(payload)[1]]), send_all(payload)))
    return sent


def test_function_draws_random_numbers_on_the_workers_and_refuses_factories_with_layout(ctl, mesh):
    x = torch.randn(8, 4)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    dropout = spmd.function(lambda a: F.dropout(a, 0.5), backend="aot_eager")
    first, second = spmd.to_global(dropout(dx)), spmd.to_global(dropout(dx))  # the seed drawn by each call
    kept = first != 0
    torch.testing.assert_close(first[kept], 2 * x[kept])
    assert 0 < kept.float().mean() < 1 and not torch.equal(first, second)
    with pytest.raises(spmd.UnsupportedOpError, match="single-controller mesh"):
        spmd.function(lambda a: a + spmd.ones(8, 4, layout=Layout([U, "model"], mesh)), backend="aot_eager")(dx)


def test_function_runs_each_graph_on_the_workers_with_one_instruction(ctl, mesh, monkeypatch):
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    dw = spmd.copy_to_mesh(w, Layout([U, "model"], mesh)).requires_grad_()

    @spmd.function(backend="aot_eager")
    def f(a):  # the relayout names the controller's mesh: the workers' graph names theirs
        return spmd.relayout((a @ dw).relu(), Layout(["batch", U], mesh)).sum()

    f(dx).backward()  # traced here, compiled by the workers, metadata of its results read once
    dw.grad = None
    ctl.sync()
    sent = _messages(ctl, monkeypatch)
    out = f(dx)
    out.backward()
    ctl.sync()
    # one message: the graph and its backward, one instruction each, and autograd's seed gradient (its detach of
    # the gradient, into `.grad`, is a second controller object of the same handle: nothing sent)
    assert sent == [[protocol.RUN_GRAPH, "aten.ones_like.default", protocol.GRAPH_BACKWARD]]
    wr = w.clone().requires_grad_()
    expected = (x @ wr).relu().sum()
    expected.backward()
    torch.testing.assert_close(out.item(), expected.item())
    torch.testing.assert_close(spmd.to_global(dw.grad), wr.grad)
    assert spmd.fetch_layout(dw.grad) == spmd.fetch_layout(dw) and f.experimental_get_tracing_count() == 1
    assert [(c.kind, c.mesh_dims) for c in f.explain(dx).collectives] == [("all_gather", ("model",)),
                                                                        ("all_reduce", ("batch",))]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam_after_an_eager_step"])
def test_function_training_step_matches_one_process(ctl, mesh, optimizer, monkeypatch):
    """The forward, the backward and the optimizer's step are graphs the workers compile (Adam's step counts,
    tensors of the controller, are counted here and sent with each call, also when an eager step made them)."""
    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-2)

    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]
    ref_opt = make(reference.parameters())
    expected = [_step(reference, ref_opt, batch, lambda t: t) for batch in batches]
    spmd.distribute_module(model, mesh, _mlp_layouts(mesh))
    opt = make(model.parameters())

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = spmd.function(step, backend="aot_eager", fullgraph=False)
    to_input = lambda t: spmd.copy_to_mesh(t, Layout(["batch", U], mesh))  # noqa: E731
    first = step if optimizer == "adam_after_an_eager_step" else compiled
    losses = [first(to_input(batches[0][0]), to_input(batches[0][1])).item()]
    losses += [compiled(to_input(x), to_input(y)).item() for x, y in batches[1:-1]]
    x, y = to_input(batches[-1][0]), to_input(batches[-1][1])
    ctl.sync()
    messages = _messages(ctl, monkeypatch)
    losses.append(compiled(x, y).item())
    assert len(messages) == 1  # the step, sent as the loss is read
    sent = messages[0]
    assert sent.count(protocol.RUN_GRAPH) == 2 and sent.count(protocol.GRAPH_BACKWARD) == 1
    assert set(sent) - {protocol.RUN_GRAPH, protocol.GRAPH_BACKWARD} == {"aten.ones_like.default"}
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert compiled.experimental_get_tracing_count() == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(spmd.to_global(p), q.detach(), msg=name)
        for key, value in ref_opt.state[q].items():  # the optimizer's state, on the controller as eagerly
            torch.testing.assert_close(_global(opt.state[p][key]), value, msg=f"{name} {key}")


def test_a_second_controller_gets_its_own_layouts(ctl, mesh):
    x = spmd.ones(4, layout=Layout(["batch"], mesh))
    x + 1.0  # the engine's plan and the shadow cache now hold this controller's layouts
    with Controller(num_workers=2, devices_per_worker=2, engine=ctl.engine_name, collective_timeout=20) as other:
        pids = set(other.worker_pids())
        mesh2 = other.create_mesh([("batch", 2), ("model", 2)])  # named like `mesh`
        y = spmd.ones(4, layout=Layout(["batch"], mesh2)) + 1.0
        assert spmd.fetch_layout(y).mesh is mesh2
        z = spmd.copy_to_mesh(torch.ones(4), spmd.fetch_layout(y))  # reaches `other`'s workers, not `ctl`'s
        assert spmd.to_global(z + y).tolist() == [3.0] * 4
    assert wait_gone(pids) == set()
    assert spmd.to_global(x + 1.0).tolist() == [2.0] * 4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _train(model, batches, to_input, foreach=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=foreach)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(to_input(x)), to_input(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_mlp_trains_like_one_process(mesh, foreach):
    """Also with the foreach update, whose ops on gradients still pending run position by position: on shadows
    only, the workers run the foreach op they are sent (once)."""
    torch.manual_seed(0)
    model = MLP()
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    expected = _train(reference, batches, lambda t: t)
    layouts = spmd.LayoutMap({"fc1.weight": Layout(["model", U], mesh), "fc1.bias": Layout(["model"], mesh),
                              "fc2.weight": Layout([U, "model"], mesh)})
    spmd.distribute_module(model, mesh, layouts)
    assert isinstance(model.fc1.weight, RemoteDTensor)
    replayed = shadow_cache.STATS["checked"]
    losses = _train(model, batches, lambda t: spmd.copy_to_mesh(t, Layout(["batch", U], mesh)), foreach)
    assert shadow_cache.STATS["checked"] - replayed > 4 * 20  # steps 2-5 replayed their ops, checked
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_optimizers_take_their_foreach_update_by_default_for_a_controller_meshs_parameters(mesh):
    """A for-loop could not run on stacks that live on the workers: it would send one op per parameter and element
    op, where the foreach update sends one per op."""
    model = spmd.distribute_module(MLP(), mesh)
    params = list(model.parameters())
    assert adam._default_to_fused_or_foreach(params, False) == (False, True)
    assert adam._default_to_fused_or_foreach([p.detach().clone() for p in MLP().parameters()], False) == (False, False)


def _mlp_layouts(mesh, names=("batch", "model")):
    return spmd.LayoutMap({"fc1.weight": Layout([names[1], U], mesh), "fc1.bias": Layout([names[1]], mesh),
                           "fc2.weight": Layout([U, names[1]], mesh)})


def _step(model, opt, batch, to_input) -> float:
    x, y = batch
    loss = F.mse_loss(model(to_input(x)), to_input(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _global(t):
    return spmd.to_global(t) if isinstance(t, spmd.DTensor) else t


def _assert_same_training_state(model, opt, other, other_opt):
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(_global(p), _global(q), msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(_global(opt.state[p][key]), _global(other_opt.state[q][key]))


def test_checkpoint_saved_by_the_workers_loads_in_local_mode(ctl, mesh, tmp_path):
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(2)]
    model = MLP()
    spmd.distribute_module(model, mesh, _mlp_layouts(mesh))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    to_input = lambda t: spmd.copy_to_mesh(t, Layout(["batch", U], mesh))  # noqa: E731
    _step(model, opt, batches[0], to_input)
    before = ctl.traffic()
    spmd.checkpoint.save({"model": model, "optim": opt, "epoch": 1}, tmp_path / "ckpt")
    assert ctl.traffic() == before  # each worker wrote its own shards: no component came to the controller
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    local_mesh = spmd.create_mesh([("x", 2), ("y", 2)])  # local mode, other layouts: resharded on load
    local = MLP()
    spmd.distribute_module(local, local_mesh, _mlp_layouts(local_mesh, ("y", "x")))
    local_opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    state = {"model": local, "optim": local_opt, "epoch": 0}
    spmd.checkpoint.load(state, tmp_path / "ckpt")
    assert state["epoch"] == 1
    _assert_same_training_state(model, opt, local, local_opt)
    assert _step(local, local_opt, batches[1], lambda t: spmd.copy_to_mesh(t, Layout(["x", U], local_mesh))) == \
        pytest.approx(_step(model, opt, batches[1], to_input), rel=1e-6)


def test_local_checkpoint_loads_on_the_workers(ctl, mesh, tmp_path):
    torch.manual_seed(1)
    local = MLP()
    local_opt = torch.optim.Adam(local.parameters(), lr=1e-2)  # plain torch: local mode
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    _step(local, local_opt, batch, lambda t: t)
    spmd.checkpoint.save({"model": local, "optim": local_opt, "epoch": 7}, tmp_path / "ckpt")
    model = MLP()
    spmd.distribute_module(model, mesh, _mlp_layouts(mesh))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # fresh: its state comes from the checkpoint
    state = {"model": model, "optim": opt, "epoch": 0}
    before = ctl.traffic()
    spmd.checkpoint.load(state, tmp_path / "ckpt")
    assert ctl.traffic() == before  # each worker read its own shards
    assert state["epoch"] == 7 and isinstance(opt.state[model.fc1.weight]["exp_avg"], RemoteDTensor)
    _assert_same_training_state(local, local_opt, model, opt)
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    assert _step(model, opt, batch, lambda t: spmd.copy_to_mesh(t, Layout(["batch", U], mesh))) == \
        pytest.approx(_step(local, local_opt, batch, lambda t: t), rel=1e-6)
    with pytest.raises(KeyError, match="bias"):  # errors are raised on the controller, naming the entry
        spmd.checkpoint.load({"bias": spmd.zeros(4, layout=Layout(["batch"], mesh))}, tmp_path / "ckpt")


def test_dataset_batches_are_made_on_the_workers(ctl, mesh):
    torch.manual_seed(2)
    xs, ys = torch.randn(40, 16), torch.randn(40, 4)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    expected = _train(reference, [(xs[i:i + 8], ys[i:i + 8]) for i in range(0, 40, 8)], lambda t: t)
    spmd.distribute_module(model, mesh, _mlp_layouts(mesh))
    ds = spmd.DTensorDataset(torch.utils.data.TensorDataset(xs, ys), mesh=mesh, global_batch_size=8,
                             layouts=(Layout(["batch", U], mesh), Layout(["batch", U], mesh)), batch_dim="batch")
    before = ctl.traffic()
    losses = _train(model, ds, lambda t: t)
    assert ctl.traffic() == before  # the workers read the rows: none went through the controller
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    x, y = next(iter(ds))
    assert isinstance(x, RemoteDTensor) and spmd.to_global(y).tolist() == ys[:8].tolist()


def test_dataset_without_a_length_and_one_that_cannot_be_sent(mesh):
    import functools
    import operator
    from torch.utils.data.datapipes.iter import IterableWrapper
    rows = IterableWrapper(range(10)).filter(functools.partial(operator.le, 0))  # picklable, no len()
    ds = spmd.DTensorDataset(rows, mesh=mesh, layouts=Layout(["batch"], mesh), global_batch_size=4,
                             batch_dim="batch")
    assert [spmd.to_global(b).tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the remainder is dropped
    with pytest.raises(ControllerError, match="cannot be pickled.*sent to every worker"):
        spmd.DTensorDataset((i for i in range(8)), mesh=mesh, layouts=Layout(["batch"], mesh), global_batch_size=4,
                            batch_dim="batch")


def test_worker_error_surfaces_naming_the_op(ctl, mesh):
    table = spmd.copy_to_mesh(torch.randn(10, 4), Layout.replicated(mesh, 2))
    bad = spmd.copy_to_mesh(torch.tensor([1, 99]), Layout.replicated(mesh, 1))  # 99: out of range, data only
    out = F.embedding(bad, table)  # decided on the controller's metadata: no error yet
    with pytest.raises(WorkerError, match="embedding"):
        out.sum().item()
    ok = spmd.ones(2, layout=Layout.replicated(mesh, 1))  # the workers go on after the report
    assert spmd.to_global(ok * 2).tolist() == [2.0, 2.0]


def test_a_custom_op_the_workers_did_not_import_is_named(ctl, mesh):
    from tests import custom_op_module
    x = spmd.copy_to_mesh(torch.randn(8, 4), Layout(["batch", U], mesh))
    with pytest.raises(WorkerError, match=r"no op spmd_test_controller::scaled_square.default on this worker.*"
                                          r"imports=\[that module\]"):
        custom_op_module.scaled_square(x, 3.0).sum().item()
    with pytest.raises(TypeError, match="imports takes a list of module names"):
        Controller(imports="tests.custom_op_module")


@pytest.mark.parametrize("engine", ENGINES)
def test_workers_import_the_modules_of_custom_ops_and_their_rules(engine):
    """`Controller(imports=[...])`: each worker imports the module that defines a custom op and its sharding rule,
    so the op runs on the workers where the data is (a `...` rule: sharded as its input, no collective)."""
    from tests import custom_op_module
    x = torch.randn(8, 4)
    with Controller(num_workers=2, devices_per_worker=2, engine=engine, collective_timeout=20,
                    imports=["tests.custom_op_module"]) as controller:
        mesh = controller.create_mesh([("x", 4)])
        y = custom_op_module.scaled_square(spmd.copy_to_mesh(x, Layout(["x", U], mesh)), 3.0)
        assert spmd.fetch_layout(y).sharding_specs == ["x", U]
        torch.testing.assert_close(spmd.to_global(y), x * x * 3)
        # an op writing its argument: each worker writes its devices' components where they are
        assert custom_op_module.add_scaled_(y, spmd.copy_to_mesh(x, Layout([U, U], mesh)), 2.0) is None
        assert spmd.fetch_layout(y).sharding_specs == ["x", U]
        torch.testing.assert_close(spmd.to_global(y), x * x * 3 + 2 * x)


@pytest.mark.parametrize("engine", ENGINES)
def test_killed_worker_is_an_error_not_a_hang(engine):
    before = descendants(os.getpid())
    ctl = Controller(num_workers=2, devices_per_worker=2, engine=engine, collective_timeout=10)
    started = descendants(os.getpid()) - before
    mesh = ctl.create_mesh([("x", 4)])
    t = spmd.ones(8, layout=Layout(["x"], mesh))
    assert t.sum().item() == 8.0
    os.kill(ctl.worker_pids()[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError):
        (t * 2).sum().item()  # a collective with a dead peer
    assert time.monotonic() - start < 30
    with pytest.raises(ControllerError, match="shut down"):
        t + 1
    assert wait_gone(started | set(ctl.worker_pids())) == set(), "processes left after a worker died"


_KILLED_CONTROLLER = """
import os, sys, time
import spmd
ctl = spmd.Controller(num_workers=2, devices_per_worker=1, engine=sys.argv[1], collective_timeout=20)
mesh = ctl.create_mesh([("x", 2)])
print("ready", flush=True)
time.sleep(300)
"""


def _started_controller(engine: str, tmp_path, attempts: int = 2):
    """A controller process that printed "ready". An engine that failed to start (Ray's daemons, once, on a loaded
    machine) is started again, after what it left is killed: what the test checks comes after the start."""
    import subprocess
    import sys
    for attempt in range(attempts):
        log = tmp_path / f"controller-{attempt}.err"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", _KILLED_CONTROLLER, engine], stdout=subprocess.PIPE,
                                    stderr=err, text=True)
        if proc.stdout.readline().strip() == "ready":
            return proc
        for pid in descendants(proc.pid) | {proc.pid}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
    raise AssertionError(f"the controller did not start {attempts} times; its last stderr:\n"
                         + log.read_text()[-3000:])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_controller_leaves_no_process(engine, tmp_path):
    """SIGKILL of the controller process: its workers, and the engine's own daemons (Ray's), end with it."""
    proc = _started_controller(engine, tmp_path)
    started: set[int] = set()
    try:
        started = descendants(proc.pid)
        assert started, "the controller started no process"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone(started, seconds=30)
        assert left == set(), f"processes left after the controller was killed: {sorted(left)}"
    finally:  # whatever failed, this test leaves nothing behind
        if proc.poll() is None:
            proc.kill()
        for pid in started | descendants(proc.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
