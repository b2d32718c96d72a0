"""spmd.xla: PyTorch/XLA's SPMD API (seed 001) — Mesh, mark_sharding, XLAShardedTensor, shard_module."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import spmd
import spmd.xla as xs
from spmd.xla import xla_model
from spmd import UNSHARDED, Layout, LayoutError, MixedTensorError
from spmd.demo.model import GPT, GPTConfig, megatron_layouts

# seed 001's usage example, verbatim but for its imports (and the seed's `assertisinstance` typo)
SEED_EXAMPLE = """
import numpy as np
import torch
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_sharding as xs
from torch_xla.distributed.xla_sharding import Mesh
from torch_xla.distributed.xla_sharded_tensor import XLAShardedTensor

mesh_shape = (2, 4)  # device mesh
num_devices = len(xm.get_xla_supported_devices())
device_ids = np.array(range(num_devices))
mesh = Mesh(device_ids, mesh_shape, ('x', 'y'))
t = torch.randn(8, 4).to(xm.xla_device())
# Mesh partitioning, each device holds 1/8-th of the input
partition_spec = (0, 1)
m1_sharded = xs.mark_sharding(t, mesh, partition_spec)
assert isinstance(m1_sharded, XLAShardedTensor) == True
"""

PORTED_IMPORTS = {"torch_xla.core.xla_model": "spmd.xla.xla_model",
                  "torch_xla.distributed.xla_sharding": "spmd.xla",
                  "torch_xla.distributed.xla_sharded_tensor": "spmd.xla"}


@pytest.fixture
def eight_devices(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "8")  # PyTorch/XLA's way to ask for 8 CPU devices


@pytest.fixture
def mesh():
    return xs.Mesh(np.arange(8), (2, 4), ("x", "y"))


def test_seed_001_usage_example_runs_with_only_the_imports_changed(eight_devices):
    source = SEED_EXAMPLE
    for xla, ours in PORTED_IMPORTS.items():
        source = source.replace(xla, ours)
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(source, "seed_001_example", "exec"), namespace)
    torch.manual_seed(0)
    expected = torch.randn(8, 4)
    sharded = namespace["m1_sharded"]
    assert sharded is namespace["t"]  # annotated in place
    assert torch.equal(sharded.global_tensor, expected)
    # each device holds 1/8-th: a (4, 1) block, device (i, j) at rows 4i.., column j
    for k, shard in enumerate(sharded.local_shards):
        i, j = divmod(k, 4)
        assert shard.indices == (slice(4 * i, 4 * i + 4, 1), slice(j, j + 1, 1))
        assert torch.equal(shard.data, expected[4 * i:4 * i + 4, j:j + 1])
        assert shard.replica_id == 0 and shard.shard_device == f"CPU:{k}"
    assert sharded.sharding_type == xs.ShardingType.TILED
    assert sharded.sharding_spec == "{devices=[2,4]<=[8]}"


def test_mesh_keeps_the_users_device_order():
    ids = np.array([3, 1, 0, 2, 7, 5, 4, 6])
    mesh = xs.Mesh(ids, (4, 2), ("a", "b"))
    assert mesh.get_logical_mesh().tolist() == [[3, 1], [0, 2], [7, 5], [4, 6]]
    assert list(mesh.shape().items()) == [("a", 4), ("b", 2)] and mesh.size() == 8
    assert mesh.get_axis_name_idx("b") == 1 and mesh.get_axis_name_idx("c") is None
    inner = mesh.to_spmd()
    assert inner.dim_names == ["a", "b"] and inner.shape() == [4, 2]
    assert [d.rsplit(":", 1)[1] for d in inner.local_devices()] == [str(i) for i in ids]
    back = xs.Mesh.from_spmd(inner)
    assert back == mesh and back.get_logical_mesh().tolist() == mesh.get_logical_mesh().tolist()
    unnamed = xs.Mesh(range(4), (2, 2))
    assert unnamed.axis_names is None and list(unnamed.shape().items()) == [(0, 2), (1, 2)]


def test_get_1d_mesh_spans_the_runtimes_devices(eight_devices):
    mesh = xs.get_1d_mesh("data")
    assert mesh.mesh_shape == (8,) and mesh.axis_names == ("data",)
    assert xs.runtime.global_runtime_device_count() == 8
    assert len(xs.xla_model.get_xla_supported_devices()) == 8


@pytest.mark.parametrize("ids, shape, names, words", [
    ([0, 1, 1, 2], (2, 2), None, "unique"),
    ([0, 1, 2], (2, 2), None, "do not fill"),
    ([0, 1, 2, 3], (2, 2), ("x",), "axis names"),
    ([-1, 0, 1, 2], (2, 2), None, "non-negative"),
])
def test_mesh_errors(ids, shape, names, words):
    with pytest.raises(LayoutError, match=words):
        xs.Mesh(ids, shape, names)


@pytest.mark.parametrize("spec, specs", [
    ((0, 1), ["x", "y"]), (("y", None), ["y", UNSHARDED]), ((None, ("x",)), [UNSHARDED, "x"]),
    ((None, None), [UNSHARDED, UNSHARDED]), ((1, 0), ["y", "x"]),
    ((("x", "y"), None), ["x+y", UNSHARDED]), ((None, (1, 0)), [UNSHARDED, "y+x"]),
])
def test_partition_spec_forms(mesh, spec, specs):
    assert xs.layout_of_partition_spec(mesh, spec, 2).sharding_specs == specs


@pytest.mark.parametrize("spec, words", [
    ((0,), "1 entries for a tensor of rank 2"),
    ((0, 0), "uses a mesh axis twice"),
    ((("x", None), None), "mixes None with mesh axes"),
    ((("x", "x"), None), "uses a mesh axis twice"),
    ((2, None), "not a mesh axis"),
    (("z", None), "names axis 'z'"),
    ((True, None), "not a mesh axis"),
])
def test_partition_spec_errors(mesh, spec, words):
    with pytest.raises(LayoutError, match=words):
        xs.mark_sharding(torch.zeros(8, 4), mesh, spec)


@pytest.mark.parametrize("spec, kind, text", [
    ((None, None), xs.ShardingType.REPLICATED, "{replicated}"),
    ((0, None), xs.ShardingType.PARTIAL, "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"),
    ((1, None), xs.ShardingType.PARTIAL, "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}"),
    ((1, 0), xs.ShardingType.TILED, "{devices=[4,2]<=[2,4]T(1,0)}"),
    (((1, 0), None), xs.ShardingType.TILED, "{devices=[8,1]<=[2,4]T(1,0)}"),
    (((0, 1), None), xs.ShardingType.TILED, "{devices=[8,1]<=[8]}"),
])
def test_local_shards_and_sharding_spec(mesh, spec, kind, text):
    value = torch.arange(32.).reshape(8, 4)
    t = xs.mark_sharding(value.clone(), mesh, spec)
    assert t.sharding_type == kind and t.sharding_spec == text
    layout = xs.layout_of_partition_spec(mesh, spec, 2)
    replicas: dict = {}
    for k, shard in enumerate(t.local_shards):
        x, y = divmod(k, 4)
        expected = value if shard.indices is Ellipsis else value[shard.indices]
        assert torch.equal(shard.data, expected) and torch.equal(shard.unpadded_data, shard.data)
        assert shard.shard_device == f"CPU:{k}"
        blocks = layout.shard_index((x, y))
        replicas.setdefault(blocks, []).append(shard.replica_id)
    for ids in replicas.values():  # each copy of a block has its own replica id, 0 first
        assert ids == list(range(len(ids)))


def test_sharding_spec_with_a_custom_device_order():
    mesh = xs.Mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 4), ("x", "y"))
    t = xs.mark_sharding(torch.zeros(8, 4), mesh, (0, 1))
    assert t.sharding_spec == "{devices=[2,4]7,6,5,4,3,2,1,0}"
    assert [s.shard_device for s in t.local_shards] == [f"CPU:{i}" for i in (7, 6, 5, 4, 3, 2, 1, 0)]


def test_plain_tensors_meeting_a_sharded_tensor_are_replicated(mesh):
    a = torch.randn(8, 4)
    b = torch.randn(8, 4)
    sharded = xs.mark_sharding(a.clone(), mesh, (0, 1))
    out = sharded * b + b.sum()
    assert isinstance(out, xs.XLAShardedTensor)
    torch.testing.assert_close(out.global_tensor, a * b + b.sum())
    assert spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    # spmd's own DTensors keep MixedTensorError
    plain_dtensor = spmd.copy_to_mesh(a, Layout(["x", "y"], mesh.to_spmd()))
    with pytest.raises(MixedTensorError):
        plain_dtensor * b


def test_in_place_annotation_of_a_parameter_keeps_the_module_and_optimizer_objects(mesh):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 8)
    reference = copy.deepcopy(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    weight = layer.weight
    assert xs.mark_sharding(layer.weight, mesh, ("y", None)) is weight
    xs.mark_sharding(layer.bias, mesh, ("y",))
    assert layer.weight is weight and opt.param_groups[0]["params"][0] is weight
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight, xs.XLAShardedTensor)
    x = torch.randn(8, 4)
    for _ in range(2):
        layer(xs.mark_sharding(x.clone(), mesh, (0, None))).square().sum().backward()
        reference(x).square().sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    torch.testing.assert_close(weight.global_tensor, reference.weight.detach())
    torch.testing.assert_close(layer.bias.global_tensor, reference.bias.detach())
    assert spmd.fetch_layout(weight).sharding_specs == ["y", UNSHARDED]


def test_annotating_an_intermediate_keeps_its_gradient_path(mesh):
    a = torch.randn(8, 4, requires_grad=True)
    sharded_a = xs.mark_sharding(a.detach().clone().requires_grad_(), mesh, (0, 1))
    h = sharded_a * 3
    assert xs.mark_sharding(h, mesh, (None, 1)) is h
    assert spmd.fetch_layout(h).sharding_specs == [UNSHARDED, "y"]
    (h.sin().sum()).backward()
    (a * 3).sin().sum().backward()
    torch.testing.assert_close(sharded_a.grad.global_tensor, a.grad)


def test_clear_sharding_replicates(mesh):
    t = xs.mark_sharding(torch.arange(32.).reshape(8, 4), mesh, (0, 1))
    assert xs.clear_sharding(t) is t and t.sharding_type == xs.ShardingType.REPLICATED
    assert torch.equal(t.global_tensor, torch.arange(32.).reshape(8, 4))
    plain = torch.ones(2)
    assert xs.clear_sharding(plain) is plain


def test_a_single_device_gpt_trains_sharded_by_mark_sharding_alone():
    """The demo GPT, written for one device, sharded with nothing but annotations on its parameters and inputs:
    the same losses as plain torch."""
    cfg = GPTConfig(n_layer=1, d_model=32, block_size=8, vocab_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))
    rules = {pattern: tuple(None if s == UNSHARDED else s for s in specs)
             for pattern, specs in megatron_layouts("model").items()}

    def spec_of(name, tensor):
        import re
        return next((spec for pattern, spec in rules.items() if re.search(pattern, name)), None)

    xs.shard_module(model, mesh, spec_of)
    assert spmd.fetch_layout(model.blocks[0].attn.q.weight).sharding_specs == ["model", UNSHARDED]
    assert spmd.fetch_layout(model.ln_f.weight).sharding_specs == [UNSHARDED]
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(cfg.block_size)  # plain: replicated where it meets the sharded model
    for _ in range(3):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
        ref_loss = reference(idx, positions, targets)
        loss = model(xs.mark_sharding(idx.clone(), mesh, ("data", None)), positions,
                     xs.mark_sharding(targets.clone(), mesh, ("data", None)))
        assert isinstance(loss, xs.XLAShardedTensor)
        torch.testing.assert_close(loss.global_tensor, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for m, o, l in ((model, opt, loss), (reference, ref_opt, ref_loss)):
            l.backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model.head.weight.global_tensor, reference.head.weight.detach(), rtol=1e-4,
                               atol=1e-5)


def test_a_trace_takes_the_annotation_as_a_constraint(mesh):
    a = xs.mark_sharding(torch.randn(8, 4), mesh, (0, 1))

    @spmd.function(backend="eager")
    def f(t):
        h = xs.mark_sharding(t * 2, mesh, (None, None))  # inside a trace: use the returned tensor
        return h + 1

    out = f(a)
    assert spmd.fetch_layout(out).sharding_specs == [UNSHARDED, UNSHARDED]
    torch.testing.assert_close(spmd.to_global(out), a.global_tensor * 2 + 1)
    kinds = [c.kind for c in f.explain(a).collectives]
    assert kinds == ["all_gather", "all_gather"]


@pytest.mark.parametrize("spec", [("data", None), (None, "model"), ("data", "model"), (("data", "model"), None)],
                         ids=str)
def test_writes_through_views_of_an_annotated_tensor_reach_it(spec):
    """A view across shards holds a copy; a write into it goes back into the annotated tensor, as for any DTensor
    (the sharded tensor's own wrapper keeps what that needs)."""
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    t, want = torch.zeros(4, 4), torch.zeros(4, 4)
    xs.mark_sharding(t, mesh, spec)
    for x in (t, want):
        x[0] = 1.0
        x[1:3].add_(2.0)
        x[:, 3] = 7.0
        x.view(16)[5] = -3.0
    assert torch.equal(t.global_tensor, want)


def test_mark_step_is_there_for_training_loops():
    assert xla_model.mark_step() is None
