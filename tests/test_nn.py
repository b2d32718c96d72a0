"""spmd.nn: LayoutMap, distribute_module (real and meta models), torch.optim on the result, Strategy, docs/models.md."""

import copy
import doctest
import pathlib
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED, Layout, LayoutMap
from spmd import random as srandom
from spmd.engine import planner
from sweep import issued

U = UNSHARDED
MODELS_DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "models.md"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sharding rule.*")  # one-time fallback notices
        yield


def mesh22():
    return spmd.create_mesh([("batch", 2), ("model", 2)])


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


MLP_MAP = {r"fc1\.weight": ["model", U], r"fc1\.bias": ["model"], r"fc2\.weight": [U, "model"]}


class Net(nn.Module):
    """Linear layers, a tied embedding/head, BatchNorm and LayerNorm, and a causal mask recomputed on reset."""

    def __init__(self, vocab=16, d=8, seq=4):
        super().__init__()
        self.seq = seq
        self.emb = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d, bias=False)
        self.bn, self.ln = nn.BatchNorm1d(2 * d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # weight tying
        self.register_buffer("causal", torch.empty(seq, seq))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.causal.copy_(torch.tril(torch.ones_like(self.causal)))

    def forward(self, idx):
        x = self.emb(idx)  # (B, d)
        x = self.ln(x + self.fc2(F.relu(self.bn(self.fc1(x)))))
        return self.head(x)


NET_MAP = {r"fc1\.weight": ["model", U], r"fc1\.bias": ["model"], r"fc2\.weight": [U, "model"],
           r"^emb\.weight": [U, "model"], r"bn\.running_(mean|var)": ["model"], r"bn\.(weight|bias)": ["model"]}


def specs(t):
    return spmd.fetch_layout(t).sharding_specs


def global_value(t):
    return spmd.to_global(t.detach()) if spmd.is_dtensor(t) else t


# -- LayoutMap ----------------------------------------------------------------------------------------------------
def test_layout_map_lookup_order_and_search():
    mesh = mesh22()
    lm = LayoutMap()
    lm[r"dense.*kernel"] = Layout([U, "model"], mesh)
    lm[r"kernel"] = ["model", U]
    lm["exact.kernel"] = [U, U]
    assert list(lm) == [r"dense.*kernel", "kernel", "exact.kernel"] and len(lm) == 3
    assert lm["block.dense_1.kernel"] == Layout([U, "model"], mesh)  # first match in insertion order
    assert lm["conv.kernel"] == ["model", U]  # re.search: matches anywhere in the name
    assert lm["exact.kernel"] == [U, U]  # an exact key wins over earlier regexes
    assert lm["bias"] is None and lm.get("bias", "d") == "d"
    assert "kernel" in lm and "conv.kernel" not in lm  # `in` asks about keys
    del lm["kernel"]
    assert lm["conv.kernel"] is None
    assert lm.layout_for("conv.bias", (4,), mesh) is None


def test_layout_map_resolves_spec_lists_and_checks():
    mesh = mesh22()
    lm = LayoutMap({"w": ["model", U]})
    assert lm.layout_for("w", (4, 2), mesh) == Layout(["model", U], mesh)
    with pytest.raises(ValueError, match="give a mesh"):
        lm.layout_for("w", (4, 2))
    assert LayoutMap({"w": ["model", U]}, mesh=mesh)["w"] == Layout(["model", U], mesh)
    with pytest.raises(ValueError, match=r"'w'.*shape \[4\].*rank 1"):
        lm.layout_for("w", (4,), mesh)
    with pytest.raises(ValueError, match="regular expression"):
        LayoutMap({"(": [U]})
    with pytest.raises(TypeError, match="Layout or a list"):
        LayoutMap({"w": 3})
    with pytest.raises(TypeError):
        LayoutMap({3: [U]})
    with pytest.raises(ValueError, match="valid mesh dimension"):
        LayoutMap({"w": ["nope"]}, mesh=mesh)
    assert "LayoutMap({'w': ['model', 'unsharded']})" == repr(lm)
    keras_style = LayoutMap(mesh)  # Keras' LayoutMap(mesh): the mesh positionally
    keras_style["w"] = ["model", U]
    assert keras_style.mesh is mesh and keras_style["w"] == Layout(["model", U], mesh)
    with pytest.raises(TypeError, match=r"mapping of regular expressions to layouts, got a list"):
        LayoutMap([("w", ["model", U])])


def test_distribute_module_warns_of_a_layout_map_key_that_matches_nothing():
    mesh = mesh22()
    model = nn.Sequential(nn.Linear(4, 4))  # names "0.weight", "0.bias"
    layout_map = {r"0\.weight$": ["model", U], r"^fc\.weight$": ["model", U], "0.bias": ["model"]}
    with pytest.warns(UserWarning) as caught:
        spmd.distribute_module(model, mesh, layout_map)
    messages = [str(w.message) for w in caught]
    assert messages == ["LayoutMap key '^fc\\.weight$' matches no parameter or buffer name of Sequential (keys "
                        "are regexes searched in names such as '0.bias'), so its layout is not used"]
    assert caught[0].filename == __file__  # the warning points at the call
    assert spmd.fetch_layout(model[0].weight).sharding_specs == ["model", U]


# -- distribute_module on a materialised model -------------------------------------------------------------------
def test_distribute_module_copies_values_with_mapped_layouts():
    mesh = mesh22()
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    model.fc2.weight.requires_grad_(False)
    out = spmd.distribute_module(model, mesh, LayoutMap(NET_MAP))
    assert out is model
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert isinstance(p, spmd.DVariable) and isinstance(p, nn.Parameter) and p.is_leaf, name
        torch.testing.assert_close(global_value(p), ref.get_parameter(name).detach(), rtol=0, atol=0)
    assert specs(model.fc1.weight) == ["model", U] and specs(model.fc1.bias) == ["model"]
    assert specs(model.fc2.weight) == [U, "model"] and specs(model.ln.weight) == [U]  # unmatched: replicated
    assert not model.fc2.weight.requires_grad and model.fc1.weight.requires_grad
    # tied weights stay one DVariable
    assert model.head.weight is model.emb.weight and specs(model.head.weight) == [U, "model"]
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    # buffers: floating ones become DTensors (mapped or replicated); the integer counter stays a plain tensor
    assert specs(model.bn.running_mean) == ["model"] and specs(model.causal) == [U, U]
    assert torch.equal(global_value(model.causal), torch.tril(torch.ones(4, 4)))
    assert not spmd.is_dtensor(model.bn.num_batches_tracked)
    assert set(model.state_dict()) == set(ref.state_dict())


def test_distribute_module_keeps_non_persistent_buffers_and_accepts_dicts():
    mesh = mesh22()
    m = nn.Module()
    m.lin = nn.Linear(4, 4)
    m.register_buffer("scratch", torch.ones(4), persistent=False)
    spmd.distribute_module(m, mesh, {r"lin\.weight": ["model", "batch"]})
    assert specs(m.lin.weight) == ["model", "batch"] and spmd.is_dtensor(m.scratch)
    assert "scratch" not in m.state_dict()


def test_distribute_module_errors_name_the_parameter_and_change_nothing():
    mesh = mesh22()
    model = MLP(d_in=8, hidden=6)  # 6 rows do not split over 4 shards
    mesh3 = spmd.create_mesh([("model", 4)])
    with pytest.raises(spmd.IndivisibleError, match=r"'fc1\.weight' of shape \[6, 8\]"):
        spmd.distribute_module(model, mesh3, MLP_MAP)
    with pytest.raises(ValueError, match=r"'fc1\.bias'.*shape \[6\]"):
        spmd.distribute_module(model, mesh, {r"fc1": ["model", U]})  # rank 2 layout for the rank 1 bias
    assert not any(spmd.is_dtensor(p) for p in model.parameters())  # validated before anything moved
    tied = nn.Module()
    tied.a, tied.b = nn.Linear(4, 4), nn.Linear(4, 4)
    tied.b.weight = tied.a.weight
    with pytest.raises(ValueError, match="two layouts"):
        spmd.distribute_module(tied, mesh, {r"a\.weight": ["model", U], r"b\.weight": [U, "model"]})
    with pytest.raises(TypeError):
        spmd.distribute_module(model, mesh, layout_map=[("fc1", [U])])


def test_redistributing_relayouts_existing_dvariables():
    mesh = mesh22()
    model = spmd.distribute_module(MLP(), mesh)
    before = global_value(model.fc1.weight)
    spmd.distribute_module(model, mesh, MLP_MAP)
    assert specs(model.fc1.weight) == ["model", U]
    assert torch.equal(global_value(model.fc1.weight), before)


def test_moving_or_casting_a_distributed_module_to_what_it_already_is_keeps_its_parameters():
    """`model.to(device)`, `.cpu()`, `.float()`: nn.Module wraps every parameter anew (as `nn.Parameter` of the same
    tensor subclass); each stays the same DVariable, with its layout and its gradient's."""
    mesh = mesh22()
    model = spmd.distribute_module(MLP(), mesh, MLP_MAP)
    weight = model.fc1.weight
    model.to("cpu").cpu().float().to(torch.float32)
    assert model.fc1.weight is weight and isinstance(weight, spmd.DVariable) and specs(weight) == ["model", U]
    model(spmd.copy_to_mesh(torch.randn(4, 8), Layout(["batch", U], mesh))).sum().backward()
    assert specs(weight.grad) == ["model", U]


def test_inference_mode_runs_the_same_sharded_plan_as_no_grad():
    """Under `torch.inference_mode()` torch leaves composite ops (`linear`, `batch_norm`) whole: they run as the ops
    they are made of, not replicated (a Megatron MLP: one all-reduce over `model`)."""
    mesh = mesh22()
    torch.manual_seed(0)
    plain = MLP()
    model = spmd.distribute_module(copy.deepcopy(plain), mesh, MLP_MAP)
    x = torch.randn(4, 8)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    with torch.inference_mode():  # (the result's sum stays pending until it is read)
        out, collectives = issued(lambda: spmd.to_global(model(dx)))
    assert collectives == [("all_reduce", ("model",))]
    torch.testing.assert_close(out, plain(x))


def test_spectral_norm_runs_on_a_distributed_module():
    """torch's power iteration writes through `out=`: the functional op, copied into the DTensor."""
    mesh = mesh22()
    torch.manual_seed(0)
    plain = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 4))
    model = spmd.distribute_module(copy.deepcopy(plain), mesh)
    x = torch.randn(4, 8)
    out = model(spmd.copy_to_mesh(x, Layout(["batch", U], mesh)))
    torch.testing.assert_close(spmd.to_global(out), plain(x))


def test_a_single_device_optimizer_state_loads_laid_out_like_the_parameters():
    """`optimizer.load_state_dict` of a plain model's optimizer: each state tensor takes its parameter's layout, and
    training goes on as the plain model's does."""
    mesh = mesh22()
    torch.manual_seed(0)
    plain = MLP()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    F.mse_loss(plain(x), y).backward()
    plain_opt.step()
    model = spmd.distribute_module(copy.deepcopy(plain), mesh, MLP_MAP)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))  # (torch shares the step counts otherwise)
    assert specs(opt.state[model.fc1.weight]["exp_avg"]) == ["model", U]
    for o, m, inputs in ((plain_opt, plain, (x, y)), (opt, model, [spmd.copy_to_mesh(t, Layout(["batch", U], mesh))
                                                                 for t in (x, y)])):
        o.zero_grad()
        F.mse_loss(m(inputs[0]), inputs[1]).backward()
        o.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(global_value(p), q.detach())


def test_a_parameter_added_after_distribute_module_is_named_at_its_first_use():
    """Its gradient would be a DTensor a plain parameter cannot hold: the op that meets it says so."""
    mesh = mesh22()
    model = spmd.distribute_module(MLP(), mesh, MLP_MAP)
    model.scale = nn.Parameter(torch.ones(4))
    out = model(spmd.copy_to_mesh(torch.randn(4, 8), Layout(["batch", U], mesh)))
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[4\] that requires grad .* after distribute_module"):
        with spmd.implicit_replication():
            out * model.scale


@pytest.mark.parametrize("table", [[U, U], ["model", U]], ids=["replicated", "vocabulary-sharded"])
@pytest.mark.parametrize("ids_layout", [[U, U], ["batch", U]], ids=["ids-replicated", "ids-sharded"])
def test_an_embedding_with_max_norm_renormalises_the_rows_it_looks_up(table, ids_layout):
    mesh = mesh22()
    torch.manual_seed(0)
    plain = nn.Embedding(16, 8, max_norm=1.0)
    with torch.no_grad():
        plain.weight.mul_(3)
    model = spmd.distribute_module(copy.deepcopy(plain), mesh, {"weight": table})
    ids = torch.randint(0, 16, (4, 5))
    out = model(spmd.copy_to_mesh(ids, Layout(ids_layout, mesh)))
    want = plain(ids)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want)
    torch.testing.assert_close(global_value(model.weight), plain.weight.detach())
    torch.testing.assert_close(spmd.to_global(model.weight.grad), plain.weight.grad)


# -- meta models ---------------------------------------------------------------------------------------------------
def _meta_net_values(mesh_dims, seed=0, **kwargs):
    mesh = spmd.create_mesh(mesh_dims)
    with torch.device("meta"):
        model = Net()
    torch.manual_seed(seed)
    spmd.distribute_module(model, mesh, NET_MAP, **kwargs)
    return model, {k: global_value(v) for k, v in model.state_dict().items()}


def test_meta_init_is_layout_invariant_across_meshes():
    _, one = _meta_net_values([("batch", 1), ("model", 1)])
    _, four = _meta_net_values([("batch", 2), ("model", 2)])
    model, eight = _meta_net_values([("batch", 2), ("model", 4)])
    assert set(one) == set(four) == set(eight)
    for name in one:
        assert torch.equal(one[name], four[name]) and torch.equal(one[name], eight[name]), name
    assert specs(model.fc1.weight) == ["model", U] and specs(model.emb.weight) == [U, "model"]
    assert model.head.weight is model.emb.weight
    # a different seed gives different values; the init follows nn.init's distributions
    _, other = _meta_net_values([("batch", 2), ("model", 2)], seed=1)
    assert not torch.equal(other["fc1.weight"], four["fc1.weight"])
    bound = 1 / 8 ** 0.5  # Linear's kaiming_uniform(a=sqrt(5)) bound for fan_in 8
    assert four["fc1.weight"].abs().max() <= bound and four["fc1.weight"].std() > bound / 3
    # the tied head keeps the embedding's normal init (as plain torch's construction-then-tying does)
    assert abs(float(four["emb.weight"].mean())) < 0.5 and 0.6 < float(four["emb.weight"].std()) < 1.4


def test_meta_buffers_materialise_through_reset_methods():
    model, values = _meta_net_values([("batch", 2), ("model", 2)])
    assert torch.equal(values["bn.running_mean"], torch.zeros(16))
    assert torch.equal(values["bn.running_var"], torch.ones(16))
    assert values["bn.num_batches_tracked"].item() == 0 and not values["bn.num_batches_tracked"].is_meta
    assert torch.equal(values["bn.weight"], torch.ones(16)) and torch.equal(values["ln.bias"], torch.zeros(8))
    assert torch.equal(values["causal"], torch.tril(torch.ones(4, 4)))
    assert not any(t.is_meta for t in model.state_dict().values())


def test_meta_model_never_materialises_a_full_sharded_parameter(monkeypatch):
    mesh = spmd.create_mesh([("batch", 2), ("model", 4)])
    big = 64 * 32
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64))
    seen = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                seen.append((getattr(fn, "__name__", "?"), out.numel() // max(1, out.shape[0]) if
                             out.dim() else 1, out.numel()))
            return out
        return wrapped

    monkeypatch.setattr(planner, "run", spy(planner.run))  # any relayout: (L, *component)
    for name in ("empty", "zeros", "ones", "full", "rand", "randn", "empty_like", "zeros_like", "tensor"):
        monkeypatch.setattr(torch, name, spy(getattr(torch, name)))  # anything nn.py or nn.init would allocate
    monkeypatch.setattr(spmd.api._CopyToMesh, "apply", lambda *a: pytest.fail("a meta model was copied"))
    torch.manual_seed(0)
    spmd.distribute_module(model, mesh, {r"0\.weight": ["model", "batch"], r"0\.bias": ["model"]})
    assert seen and all(component < big for _, component, _ in seen), seen
    assert all(total < big for name, _, total in seen if name != "run"), seen
    w = model[0].weight
    assert tuple(w._local.shape) == (8, 16, 16)  # each device holds one (64/4, 32/2) shard
    assert tuple(model[0].bias._local.shape) == (8, 16)


def test_meta_init_fn_replaces_reset_parameters():
    calls = []

    def init_fn(name, tensor):
        calls.append(name)
        if name == "causal":
            return torch.tril(torch.ones(4, 4))  # a plain value is copied onto the tensor's layout
        if name == "bn.num_batches_tracked":
            return None
        if name.endswith("bias") or "running_mean" in name:
            tensor.zero_()
            return None
        if "running_var" in name:
            return torch.ones_like(tensor)  # a DTensor of the same layout (not `tensor * 0`: `empty` may hold NaN)
        return srandom.stateless_normal(tensor.shape, seed=(len(name), 7), stddev=0.02, dtype=tensor.dtype,
                                        layout=spmd.fetch_layout(tensor))

    models = [_meta_net_values(dims, init_fn=init_fn) for dims in ([("batch", 1), ("model", 1)],
                                                                     [("batch", 2), ("model", 4)])]
    (model, a), (_, b) = models
    assert "head.weight" not in calls[:len(calls) // 2]  # tied: initialised once, under its first name
    assert len(calls) == 2 * len(model.state_dict()) - 2
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(a["causal"], torch.tril(torch.ones(4, 4)))
    assert torch.equal(a["bn.running_var"], torch.ones(16))
    assert a["fc1.weight"].std() < 0.05
    assert torch.equal(a["fc1.weight"], srandom.stateless_normal((16, 8), seed=(10, 7), stddev=0.02))


def test_meta_buffer_without_reset_is_zeroed_with_a_warning_and_parameter_raises():
    mesh = mesh22()
    with torch.device("meta"):
        m = nn.Module()
        m.lin = nn.Linear(4, 4)
        m.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    with pytest.warns(UserWarning, match=r"\['mask'\].*zeros"):
        spmd.distribute_module(m, mesh)
    assert torch.equal(global_value(m.mask), torch.zeros(4, 4))
    with torch.device("meta"):
        bare = nn.Module()
        bare.scale = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"\['scale'\].*init_fn"):
        spmd.distribute_module(bare, mesh)
    assert bare.scale.is_meta
    spmd.distribute_module(bare, mesh, init_fn=lambda name, t: torch.ones(4))
    assert torch.equal(global_value(bare.scale), torch.ones(4))


def test_meta_model_trains():
    mesh = mesh22()
    with torch.device("meta"):
        model = Net().double()
    torch.manual_seed(0)
    strategy = spmd.Strategy(mesh, batch_dim="batch", layout_map=NET_MAP)
    strategy.distribute_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, target = strategy.distribute_batch((torch.randint(0, 16, (8,)), torch.randint(0, 16, (8,))))
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(idx), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.head.weight is model.emb.weight and specs(model.emb.weight) == [U, "model"]
    assert model.bn.num_batches_tracked.item() == 3 and specs(model.bn.running_mean) == ["model"]


# -- torch.optim ---------------------------------------------------------------------------------------------------
OPTIMIZERS = [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 1e-2}),
              (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})]


def _train(model, opt, x, y, steps=3):
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("foreach", [False, None, True], ids=["loop", "default", "foreach"])
@pytest.mark.parametrize("opt_cls,kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_optimizers_match_plain_torch_and_keep_layouts(opt_cls, kwargs, foreach):
    torch.manual_seed(0)
    ref = MLP().double()
    model = spmd.distribute_module(copy.deepcopy(ref), mesh22(), MLP_MAP)
    layouts = {name: spmd.fetch_layout(p) for name, p in model.named_parameters()}
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    strategy = spmd.Strategy(mesh22(), batch_dim="batch")
    opt = opt_cls(model.parameters(), foreach=foreach, **kwargs)
    got = _train(model, opt, *strategy.distribute_batch((x, y)))
    want = _train(ref, opt_cls(ref.parameters(), foreach=foreach, **kwargs), x, y)
    assert got == pytest.approx(want, rel=1e-9)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert spmd.fetch_layout(p) == layouts[name], name  # step() keeps every layout
        assert isinstance(p, spmd.DVariable)
        torch.testing.assert_close(global_value(p), q.detach(), rtol=1e-9, atol=1e-12)
        for key, state in opt.state[p].items():
            if torch.is_tensor(state) and state.dim() > 0:
                assert spmd.fetch_layout(state) == layouts[name], (name, key)


# -- Strategy ------------------------------------------------------------------------------------------------------
def test_strategy_batches_scope_and_run():
    mesh = mesh22()
    strategy = spmd.Strategy(mesh, batch_dim="batch", layout_map=MLP_MAP)
    assert "batch_dim='batch'" in repr(strategy)
    batch = {"x": torch.arange(8.).view(4, 2), "pair": (torch.ones(4), 3), "label": torch.tensor(1)}
    out = strategy.distribute_batch(batch)
    assert specs(out["x"]) == ["batch", U] and specs(out["pair"][0]) == ["batch"] and out["pair"][1] == 3
    assert specs(out["label"]) == [] and torch.equal(global_value(out["x"]), batch["x"])
    assert strategy.distribute_batch(out["x"]) is out["x"]  # DTensors pass through
    assert specs(spmd.Strategy(mesh).distribute_batch(torch.ones(4, 2))) == [U, U]
    with strategy.scope() as m:
        assert m == mesh and spmd.get_default_mesh() == mesh and spmd.is_dtensor(torch.zeros(2))
    assert spmd.get_default_mesh() is None

    model = strategy.distribute_model(MLP())
    assert specs(model.fc1.weight) == ["model", U]

    def step(x, scale=1.0):
        assert spmd.get_default_mesh() == mesh
        return model(x).sum() * scale

    x = torch.randn(4, 8)
    torch.testing.assert_close(strategy.run(step, x, scale=2.0).item(),
                               2 * (F.relu(x @ global_value(model.fc1.weight).T + global_value(model.fc1.bias))
                                    @ global_value(model.fc2.weight).T + global_value(model.fc2.bias)).sum().item())
    with pytest.raises(ValueError, match="batch_dim 'nope'"):
        spmd.Strategy(mesh, batch_dim="nope")
    with pytest.raises(spmd.IndivisibleError):
        strategy.distribute_batch(torch.ones(3, 2))


def test_strategy_distribute_dataset():
    if not hasattr(spmd, "DTensorDataset"):
        pytest.skip("spmd.DTensorDataset is not available")
    mesh = mesh22()
    strategy = spmd.Strategy(mesh, batch_dim="batch")
    data = torch.utils.data.TensorDataset(torch.arange(32.).view(16, 2), torch.arange(16))
    batches = list(strategy.distribute_dataset(data, global_batch_size=8))
    assert len(batches) == 2
    x, y = batches[1]
    assert specs(x) == ["batch", U] and specs(y) == ["batch"]
    assert torch.equal(global_value(x), torch.arange(16., 32.).view(8, 2))
    with pytest.raises(TypeError, match="layouts="):
        strategy.distribute_dataset(iter([torch.ones(2)]), global_batch_size=2)


# -- docs/models.md --------------------------------------------------------------------------------------------
def test_models_doc_examples():
    if not hasattr(spmd, "DTensorDataset"):
        pytest.skip("docs/models.md uses spmd.DTensorDataset (Strategy.distribute_dataset)")
    text = MODELS_DOC.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)
    assert len(blocks) >= 5
    for block in blocks:
        assert block.lstrip().startswith(">>>"), block  # only checked examples
    failed, attempted = doctest.testfile(str(MODELS_DOC), module_relative=False, globs={}, report=True,
                                         optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted >= 30 and failed == 0, f"{failed} of {attempted} examples of {MODELS_DOC.name} failed"


def test_a_distributed_module_swaps_its_parameters_after_a_backward():
    """torch swaps a module's parameters in place (`model.double()`, a parametrization's registration) only if
    nothing else holds them: spmd's gradient hook and its op planning keep no reference to a parameter (a call's
    DTensors were kept alive by a reference cycle until the next collection)."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    lin = nn.Linear(8, 16)
    dlin = spmd.distribute_module(copy.deepcopy(lin), mesh, {"weight": ["model", U]})
    x = torch.randn(8, 8)
    dlin(spmd.copy_to_mesh(x, Layout(["batch", U], mesh))).sum().backward()
    dlin.double()
    assert dlin.weight.dtype == torch.float64 and specs(dlin.weight) == ["model", U]
    torch.testing.assert_close(spmd.to_global(dlin.weight), lin.weight.double())
    torch.nn.utils.parametrizations.spectral_norm(dlin)
    torch.nn.utils.parametrizations.spectral_norm(lin.double())
    lin.eval(), dlin.eval()  # (its power iteration starts from a random vector: spmd's draw is not torch's)
    torch.testing.assert_close(spmd.to_global(dlin.weight), lin.weight, rtol=1e-3, atol=1e-4)
