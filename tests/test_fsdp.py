"""Sharded parameters (`distribute_module(..., shard_parameters=...)`, `spmd.fsdp`): training equals plain torch,
parameters, gradients and optimizer state stay sharded, each step issues FSDP's collectives and no others, and
gathered copies do not outlive their module's forward."""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
from torch import nn

import spmd
from spmd import UNSHARDED as U, Layout
from spmd import fsdp
from spmd.errors import LayoutError, UnsupportedOpError
from spmd.explain import Recorder
from tests.test_multiclient import _worker_function, launch


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()


def _train(model, x, y, steps=3, step_fn=None):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        loss = step_fn(x, y) if step_fn else ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def _data(mesh):
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    data = Layout(["batch", U], mesh)
    return (x, y), (spmd.copy_to_mesh(x, data), spmd.copy_to_mesh(y, data))


@pytest.mark.parametrize("sharding, expected", [
    ((U, U), ["batch", U]),  # the first free axis
    ((U, "model"), ["batch", "model"]),
    (("model", U), ["model", "batch"]),
    ((U,), ["batch"]),
])
def test_sharded_layout_adds_the_batch_dim_on_the_first_free_axis(sharding, expected):
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    layout = fsdp.sharded_layout(Layout(list(sharding), mesh), (8,) * len(sharding), "batch")
    assert layout.sharding_specs == expected


def test_sharded_layout_falls_back_to_a_minor_mesh_dim_or_keeps_the_layout():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    # no free axis: the batch dim goes under the model dim of the first axis that still divides
    assert fsdp.sharded_layout(Layout(["model"], mesh), (8,), "batch").axes == (("model", "batch"),)
    assert fsdp.sharded_layout(Layout([U, U], mesh), (3, 5), "batch") == Layout([U, U], mesh)  # indivisible
    assert fsdp.sharded_layout(Layout(["model"], mesh), (2,), "batch") == Layout(["model"], mesh)
    assert fsdp.sharded_layout(Layout([], mesh), (), "batch") == Layout([], mesh)  # a 0-d parameter
    already = Layout(["batch", U], mesh)
    assert fsdp.sharded_layout(already, (8, 8), "batch") is already
    one = spmd.create_mesh([("batch", 1), ("model", 4)], devices=[f"CPU:{i}" for i in range(4)])
    assert fsdp.sharded_layout(Layout([U], one), (8,), "batch") == Layout([U], one)  # nothing to shard over


def test_unknown_mesh_dim_and_a_strategy_without_batch_dim_are_errors():
    mesh = spmd.create_mesh([("batch", 2)])
    with pytest.raises(LayoutError, match=r"shard_parameters='data' is not a dimension of the mesh.*batch"):
        spmd.distribute_module(_mlp(), mesh, shard_parameters="data")
    with pytest.raises(LayoutError, match="give batch_dim"):
        spmd.Strategy(mesh, shard_parameters=True)


@pytest.mark.parametrize("dims, layout_map", [
    ((4, 1), None),
    ((2, 2), {r"0\.weight": ["model", U], r"0\.bias": ["model"], r"2\.weight": [U, "model"]}),  # FSDP x TP
])
def test_training_equals_plain_torch_with_everything_sharded(dims, layout_map):
    mesh = spmd.create_mesh([("batch", dims[0]), ("model", dims[1])])
    reference = _mlp()
    model = spmd.distribute_module(copy.deepcopy(reference), mesh, layout_map, shard_parameters="batch")
    (x, y), (dx, dy) = _data(mesh)
    losses, opt = _train(model, dx, dy)
    expected, _ = _train(reference, x, y)
    assert losses == pytest.approx(expected, rel=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert "batch" in str(p._layout.sharding_specs)
        torch.testing.assert_close(spmd.to_global(p.detach()), q.detach())
        for state in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][state]._layout == p._layout
    loss = ((model(dx) - dy) ** 2).mean()
    loss.backward()
    assert all(p.grad._layout == p._layout and not p.grad._pending for p in model.parameters())


def test_a_step_issues_the_gathers_and_reduce_scatters_of_fsdp_and_nothing_else():
    mesh = spmd.create_mesh([("batch", 4)])
    model = spmd.distribute_module(_mlp(), mesh, shard_parameters="batch")
    _, (dx, dy) = _data(mesh)
    with Recorder() as e:
        loss = ((model(dx) - dy) ** 2).sum()
        loss.backward()
    forward = [(c.kind, c.mesh_dims, c.bytes) for c in e.collectives if not c.backward]
    backward = [(c.kind, c.mesh_dims, c.bytes) for c in e.collectives if c.backward]
    gather = "all_gather", ("batch",)
    # each parameter's shard (a quarter of it, float64) gathered before its layer runs; the loss stays pending
    assert forward == [(*gather, 16 * 8 * 2), (*gather, 4 * 8), (*gather, 8 * 16 * 2), (*gather, 2 * 8)]
    # the second layer's weight gathered again for its input's gradient (the first layer's input needs none),
    # then each gradient, a sum over the batch, reduce-scattered onto its shard
    scatter = "reduce_scatter", ("batch",)
    assert backward[0] == (*gather, 8 * 16 * 2)
    assert sorted(backward[1:]) == sorted([(*scatter, 16 * 8 * 8), (*scatter, 16 * 8), (*scatter, 8 * 16 * 8),
                                           (*scatter, 8 * 8)])


def test_without_resharding_after_forward_backward_gathers_nothing_again():
    mesh = spmd.create_mesh([("batch", 4)])
    reference = _mlp()
    model = spmd.distribute_module(copy.deepcopy(reference), mesh, shard_parameters="batch",
                                   reshard_after_forward=False)
    (x, y), (dx, dy) = _data(mesh)
    with Recorder() as e:
        ((model(dx) - dy) ** 2).sum().backward()
    assert [c.kind for c in e.collectives if not c.backward] == ["all_gather"] * 4
    assert [c.kind for c in e.collectives if c.backward] == ["reduce_scatter"] * 4  # no gather again
    assert not fsdp._LIVE and model[2].weight._layout.sharding_specs[0] == "batch"
    ((reference(x) - y) ** 2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad)


@pytest.mark.parametrize("reshard, mixed", [(True, False), (False, False), (True, True)])
def test_no_sync_keeps_gradients_then_reduce_scatters_each_once(reshard, mixed):
    """Gradient accumulation over 3 micro-batches, the first two inside spmd.no_sync: their backwards reduce nothing
    (only the saved weight is gathered again), the third reduce-scatters each gradient once; the gradients equal
    plain torch's accumulated ones and those of a run reduce-scattering every micro-batch (also under a mixed
    precision policy: computed in float32, the partial sums kept and reduced in float64)."""
    mesh = spmd.create_mesh([("batch", 4)])
    reference = _mlp()
    policy = _mixed(param_dtype=torch.float32, reduce_dtype=torch.float64) if mixed else None
    model, every = (spmd.distribute_module(copy.deepcopy(reference), mesh, shard_parameters="batch",
                                           reshard_after_forward=reshard, mp_policy=policy) for _ in range(2))
    torch.manual_seed(1)
    backward = []
    for i, ((x, y), (dx, dy)) in enumerate(_data(mesh) for _ in range(3)):
        with spmd.no_sync(model) if i < 2 else contextlib.nullcontext(), Recorder() as e:
            ((model(dx) - dy) ** 2).sum().backward()
        backward.append([c.kind for c in e.collectives if c.backward])
        ((every(dx) - dy) ** 2).sum().backward()
        ((reference(x) - y) ** 2).sum().backward()
        if i < 2:
            assert all(p.grad is None for p in model.parameters())
    again = ["all_gather"] if reshard else []  # (the second layer's weight, for its input's gradient)
    assert backward == [again, again, again + ["reduce_scatter"] * 4]
    for p, q, r in zip(model.parameters(), every.parameters(), reference.parameters()):
        assert p.grad._layout == p._layout and not p.grad._pending
        torch.testing.assert_close(spmd.to_global(p.grad), r.grad, **({"rtol": 1e-5, "atol": 1e-5} if mixed else {}))
        torch.testing.assert_close(spmd.to_global(p.grad), spmd.to_global(q.grad))
    assert not any(fsdp._UNITS[m].kept for m in model.modules() if m in fsdp._UNITS)


def test_no_sync_with_sharded_parameters_is_refused_under_function_mode():
    mesh = spmd.create_mesh([("batch", 4)])
    model = spmd.distribute_module(_mlp(), mesh, shard_parameters="batch")
    _, (dx, dy) = _data(mesh)
    step = spmd.function(lambda x, y: ((model(x) - y) ** 2).sum())
    with spmd.no_sync(model), pytest.raises(UnsupportedOpError, match="no_sync on a module with sharded"):
        step(dx, dy)


def test_gathered_parameters_do_not_outlive_the_forward():
    mesh = spmd.create_mesh([("batch", 4)])
    model = spmd.distribute_module(_mlp(), mesh, shard_parameters="batch")
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(m.weight)))
    _, (dx, dy) = _data(mesh)
    loss = ((model(dx) - dy) ** 2).mean()
    assert seen[0]() is None  # autograd keeps a note to gather it again, not the gathered copy
    assert model[2].weight is model[2]._parameters["weight"] and model[2].weight._layout.sharding_specs[0] == "batch"
    assert not fsdp._LIVE
    loss.backward()
    assert model[2].weight.grad is not None


def test_nested_modules_and_tied_weights():
    """A module owning a parameter around a child owning others, and a weight tied between two modules."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.inner = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.inner(self.embed(ids)) * self.scale)

    torch.manual_seed(0)
    reference = Tied().double()
    mesh = spmd.create_mesh([("batch", 4)])
    model = spmd.distribute_module(copy.deepcopy(reference), mesh, shard_parameters="batch")
    assert model.head.weight is model.embed.weight
    ids = torch.randint(0, 16, (8, 5))
    dids = spmd.copy_to_mesh(ids, Layout(["batch", U], mesh))
    losses, _ = _train(model, dids, None, step_fn=lambda x, _: model(x).logsumexp(-1).mean())
    expected, _ = _train(reference, ids, None, step_fn=lambda x, _: reference(x).logsumexp(-1).mean())
    assert losses == pytest.approx(expected, rel=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(spmd.to_global(p.detach()), q.detach())


def test_a_meta_model_is_materialised_as_shards():
    mesh = spmd.create_mesh([("batch", 4)])
    with torch.device("meta"):
        model = nn.Linear(64, 32)
    spmd.distribute_module(model, mesh, shard_parameters="batch")
    assert [tuple(c.shape) for c in spmd.unpack(model.weight.detach())] == [(8, 64)] * 4
    assert model(spmd.copy_to_mesh(torch.ones(4, 64), Layout(["batch", U], mesh))).shape == (4, 32)


def test_strategy_shards_parameters_over_its_batch_dim():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    strategy = spmd.Strategy(mesh, "batch", shard_parameters=True)
    model = strategy.distribute_model(_mlp())
    assert [p._layout.sharding_specs for p in model.parameters()] == [["batch", U], ["batch"]] * 2
    strategy = spmd.Strategy(mesh, "batch", shard_parameters=True, reshard_after_forward=False,
                             mp_policy=_mixed(reduce_dtype=torch.float32))
    model = strategy.distribute_model(_mlp().float())
    with Recorder() as e:
        out = model(strategy.distribute_batch(torch.randn(4, 8)))
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and not [c for c in e.collectives if c.backward and c.kind == "all_gather"]


def test_checkpoint_of_a_sharded_run_loads_into_replicated_parameters(tmp_path):
    mesh = spmd.create_mesh([("batch", 4)])
    model = spmd.distribute_module(_mlp(), mesh, shard_parameters="batch")
    _, (dx, dy) = _data(mesh)
    _train(model, dx, dy, steps=1)
    spmd.checkpoint.save({"model": model.state_dict()}, tmp_path / "ckpt")
    other = spmd.distribute_module(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double(),
                                   spmd.create_mesh([("batch", 2), ("model", 2)]))
    state = {"model": other.state_dict()}
    spmd.checkpoint.load(state, tmp_path / "ckpt")
    for p, q in zip(other.parameters(), model.parameters()):
        assert p._layout.is_fully_replicated()
        torch.testing.assert_close(spmd.to_global(p.detach()), spmd.to_global(q.detach()))


def test_function_mode_compiles_a_sharded_step():
    """Traced by spmd.function the gathers are relayouts of the graph; the compiled graph keeps what backward
    needs (no gather again) and reduce-scatters the gradients."""
    mesh = spmd.create_mesh([("batch", 4)])
    reference = _mlp()
    model = spmd.distribute_module(copy.deepcopy(reference), mesh, shard_parameters="batch")
    (x, y), (dx, dy) = _data(mesh)
    step = spmd.function(lambda a, b: ((model(a) - b) ** 2).mean(), backend="aot_eager")
    losses, _ = _train(model, dx, dy, step_fn=step)
    expected, _ = _train(reference, x, y)
    assert losses == pytest.approx(expected, rel=1e-12)
    e = step.explain(dx, dy, backward=True)
    assert [c.kind for c in e.collectives if c.backward] == ["reduce_scatter"] * 4
    assert [c.kind for c in e.collectives if not c.backward] == ["all_gather"] * 4 + ["all_reduce"]


@pytest.mark.parametrize("clients, per_client, dims", [(2, 1, (2, 1)), (2, 2, (2, 2)), (4, 1, (2, 2))])
def test_clients_train_as_one_process(clients, per_client, dims):
    """2 or 4 gloo clients, parameters sharded over the batch dim between them (and over "model" too in 2-D, also
    between clients with 4 of them): losses, parameters and layouts of the one-process run on a mesh of the same
    shape, also where each step accumulates two micro-batches under spmd.no_sync."""
    fsdp_training = _worker_function("_fsdp_training")
    mesh = spmd.create_mesh([("batch", dims[0]), ("model", dims[1])])
    single = {"dp": fsdp_training(mesh), "2d": fsdp_training(mesh, tensor_parallel=True)}
    results = launch("fsdp_training", argv_extra=[per_client, f"{dims[0]},{dims[1]}"], n=clients, timeout_s=90)
    assert len(results) == clients
    for r in results:
        if per_client == 1 and dims[1] == 1:  # mixed precision: torch FSDP2's losses, and one process's
            # (bfloat16 compute: the clients' products fold fewer devices than one process's, roundings differ)
            assert r["mixed"] == pytest.approx(r["fsdp2_mixed"], rel=1e-3)
            assert r["mixed"] == pytest.approx(fsdp_training(mesh, mixed_precision=True)[0], rel=1e-3)
        # two micro-batches of half the loss each, the first under spmd.no_sync: the data-parallel run's values
        for kind, (losses, params, layouts, *_) in [*single.items(), ("accumulated", single["dp"])]:
            assert r[kind][0] == pytest.approx(losses, rel=1e-9), kind
            assert r[kind][2] == layouts
            for p, q in zip(r[kind][1], params):
                assert torch.allclose(torch.tensor(p), torch.tensor(q), rtol=1e-9, atol=1e-12), kind
        assert single["dp"][3:5] == (0, 0)  # one process: nothing to prefetch
        # backward gathers again the weights autograd saved: the 2nd and 3rd layers' (the 1st layer's input needs
        # no gradient), the 2nd's prefetched during the 3rd's backward and taken (no third gather)
        assert single["dp"][5] == r["dp"][5] == 2
        if per_client == 1 and dims[1] == 1:  # one member per client: from the 2nd step (the 1st learns the order)
            assert r["dp"][3] == 4 * 2, r["dp"][3]  # forward: the 2nd and 3rd layers' 2 parameters each
            assert r["dp"][4] == 3, r["dp"][4]  # backward: the 2nd layer's weight, in each of the 3 steps


def test_an_optimizer_state_loaded_from_a_replicated_run_is_sharded_like_the_parameters():
    """Resuming a sharded-parameter run from a replicated run's optimizer state: each state tensor takes its
    parameter's layout (its memory sharded too), and training goes on as the replicated run does."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    x = spmd.copy_to_mesh(torch.randn(8, 8), Layout(["batch", U], mesh))

    def build(**kwargs):
        torch.manual_seed(0)
        model = spmd.distribute_module(nn.Linear(8, 4), mesh, **kwargs)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    def step(model, opt):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    replicated, replicated_opt = build()
    step(replicated, replicated_opt)
    sharded, sharded_opt = build(shard_parameters="batch")
    sharded.load_state_dict(replicated.state_dict())
    sharded_opt.load_state_dict(copy.deepcopy(replicated_opt.state_dict()))  # (torch shares the tensors)
    for p in sharded.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert spmd.fetch_layout(sharded_opt.state[p][name]) == spmd.fetch_layout(p)
    step(replicated, replicated_opt)
    step(sharded, sharded_opt)
    for got, want in zip(sharded.parameters(), replicated.parameters()):
        torch.testing.assert_close(spmd.to_global(got.detach()), spmd.to_global(want.detach()))


def _mixed(**kwargs):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(**{"param_dtype": torch.bfloat16, **kwargs})


@pytest.mark.parametrize("reduce_dtype, reduced_bytes", [(torch.float32, 4), (None, 2)])
def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype(reduce_dtype, reduced_bytes):
    """FSDP2's MixedPrecisionPolicy: each shard cast to bfloat16 before its gather (half the bytes), the module
    computing in it, each device's partial gradient cast to `reduce_dtype` (default: bfloat16) before the
    reduce-scatter; parameters, gradients and optimizer state stay float32."""
    mesh = spmd.create_mesh([("batch", 4)])
    reference = _mlp().float()
    model = spmd.distribute_module(copy.deepcopy(reference), mesh, shard_parameters="batch",
                                   mp_policy=_mixed(reduce_dtype=reduce_dtype))
    (x, y), (dx, dy) = _data(mesh)
    dx, dy = dx.float(), dy.float()
    with Recorder() as e:
        out = model(dx)
        loss = ((out.float() - dy) ** 2).sum()
        loss.backward()
    assert out.dtype == torch.bfloat16
    gathers = [(c.kind, c.bytes) for c in e.collectives if c.kind == "all_gather"]
    assert gathers == [("all_gather", n * 2) for n in (16 * 8 // 4, 16 // 4, 8 * 16 // 4, 8 // 4, 8 * 16 // 4)]
    scatters = sorted(c.bytes for c in e.collectives if c.kind == "reduce_scatter")
    assert scatters == sorted(n * reduced_bytes for n in (16 * 8, 16, 8 * 16, 8))
    ((reference(x.float()) - y.float()) ** 2).sum().backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == p.grad.dtype == opt.state[p]["exp_avg"].dtype == torch.float32
        assert spmd.fetch_layout(p.grad) == spmd.fetch_layout(p)
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad, rtol=0.03, atol=0.03 * float(q.grad.abs().max()))


def test_mixed_precision_output_dtype_and_inputs_left_as_given():
    mesh = spmd.create_mesh([("batch", 2)])
    _, (dx, _) = _data(mesh)
    model = spmd.distribute_module(_mlp().float(), mesh, shard_parameters="batch",
                                   mp_policy=_mixed(output_dtype=torch.float32))
    assert model(dx.float()).dtype == torch.float32
    uncast = spmd.distribute_module(_mlp().float(), mesh, shard_parameters="batch",
                                    mp_policy=_mixed(cast_forward_inputs=False))
    with pytest.raises(RuntimeError, match="dtype"):  # torch's own error: a float32 input, bfloat16 weights
        uncast(dx.float())
    assert uncast(dx.to(torch.bfloat16)).dtype == torch.bfloat16


def test_mixed_precision_under_function_mode_equals_eager():
    mesh = spmd.create_mesh([("batch", 4)])
    models = [spmd.distribute_module(_mlp().float(), mesh, shard_parameters="batch",
                                     mp_policy=_mixed(reduce_dtype=torch.float32)) for _ in range(2)]
    _, (dx, dy) = _data(mesh)
    dx, dy = dx.float(), dy.float()
    def loss(model):
        return lambda a, b: ((model(a).float() - b) ** 2).mean()
    step = spmd.function(loss(models[0]), backend="aot_eager")
    assert _train(models[0], dx, dy, step_fn=step)[0] == _train(models[1], dx, dy, step_fn=loss(models[1]))[0]
    e = step.explain(dx, dy, backward=True)
    assert [c.bytes for c in e.collectives if c.kind == "all_gather"] == [64, 8, 64, 4]  # bfloat16 shards
    assert sorted(c.bytes for c in e.collectives if c.kind == "reduce_scatter") == [32, 64, 512, 512]  # float32


def test_a_mixed_precision_policy_needs_sharded_parameters_and_floating_dtypes():
    mesh = spmd.create_mesh([("batch", 2)])
    for kwargs in ({"mp_policy": _mixed()}, {"reshard_after_forward": False}):
        with pytest.raises(ValueError, match="give shard_parameters"):
            spmd.distribute_module(_mlp(), mesh, **kwargs)
    with pytest.raises(TypeError, match="mp_policy takes torch.distributed.fsdp.MixedPrecisionPolicy"):
        spmd.distribute_module(_mlp(), mesh, shard_parameters="batch", mp_policy=torch.bfloat16)
    with pytest.raises(TypeError, match="param_dtype must be a floating dtype"):
        spmd.distribute_module(_mlp(), mesh, shard_parameters="batch", mp_policy=_mixed(param_dtype=torch.int8))
