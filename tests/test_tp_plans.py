"""`spmd.layout_map_from_tp_plan`: HuggingFace's `model.tp_plan` and torch's `parallelize_module` plans as layouts —
the layouts they give, training unchanged (losses and gradients of plain torch), the collectives, and the errors."""

import copy

import pytest
import torch
from torch import nn

import spmd
from spmd import UNSHARDED as U, Layout, LayoutMap
from spmd.explain import Recorder

MESH = spmd.create_mesh([("batch", 2), ("model", 2)])


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, ids):
        h = self.embed(ids)
        return h + self.down(torch.relu(self.up(h)))


def _specs(layout_map, model):
    return {name: layout_map[name] for name, _ in model.named_parameters() if layout_map[name] is not None}


def test_torch_styles_shard_linear_and_embedding_weights_as_parallelize_module_does():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    net = _Net()
    plan = {"embed": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(), "": PrepareModuleInput()}
    assert _specs(spmd.layout_map_from_tp_plan(net, plan), net) == {
        "embed.weight": ["model", U],  # an embedding's rows: its vocabulary
        "up.weight": ["model", U], "up.bias": ["model"], "down.weight": [U, "model"]}
    assert _specs(spmd.layout_map_from_tp_plan(net, {"embed": ColwiseParallel()}, mesh_dim="batch"), net) == {
        "embed.weight": [U, "batch"]}


def test_a_megatron_plan_trains_like_plain_torch_with_one_all_reduce_per_pair():
    torch.manual_seed(0)
    ref = _Net()
    model = spmd.distribute_module(copy.deepcopy(ref), MESH,
                                   spmd.layout_map_from_tp_plan(ref, {"up": "colwise", "down": "rowwise"}))
    ids = torch.randint(0, 16, (4, 6))
    with Recorder() as r:
        out = model(spmd.copy_to_mesh(ids, Layout(["batch", U], MESH)))
        out.pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    torch.testing.assert_close(spmd.to_global(out), ref(ids))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad, msg=name)
    # the row-parallel layer's sum in forward, the column-parallel layer's input gradient in backward
    model_dim = [(c.kind, c.mesh_dims) for c in r.collectives if c.mesh_dims == ("model",)]
    assert model_dim == [("all_reduce", ("model",))] * 2


def test_wildcards_and_a_parameter_entry_over_its_modules():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 8))
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.experts = Experts()

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    plan = {"layers.*.proj": "colwise", "layers.*.experts.gate_up_proj": "packed_colwise",
            "layers.*.experts.down_proj": "rowwise", "layers.*.experts": "moe_tp_experts"}
    specs = _specs(spmd.layout_map_from_tp_plan(model, plan), model)
    assert specs == {f"layers.{i}.{name}": spec for i in range(2) for name, spec in [
        ("proj.weight", ["model", U]), ("proj.bias", ["model"]), ("experts.gate_up_proj", [U, "model", U]),
        ("experts.down_proj", [U, U, "model"])]}
    ep = spmd.layout_map_from_tp_plan(model, {"layers.*.experts.*": "grouped_gemm"}, mesh_dim="batch")
    assert _specs(ep, model) == {f"layers.{i}.experts.{n}": ["batch", U, U] for i in range(2)
                                 for n in ("gate_up_proj", "down_proj")}


def test_a_plan_entry_applies_to_its_modules_own_parameters_only():
    net = _Net()
    assert _specs(spmd.layout_map_from_tp_plan(net, {"": "colwise"}), net) == {}


@pytest.mark.parametrize("plan, error, message", [
    ({"up": "diagonal"}, ValueError, "'diagonal' is not a tensor-parallel style spmd knows"),
    ({"up": nn.Linear(2, 2)}, TypeError, "a style is a HuggingFace style name"),
    ({3: "colwise"}, TypeError, "plan keys are module names"),
    ([("up", "colwise")], TypeError, "plan must be a dict"),
])
def test_bad_plans_are_refused(plan, error, message):
    with pytest.raises(error, match=message):
        spmd.layout_map_from_tp_plan(_Net(), plan)


def test_a_model_without_a_plan_asks_for_one():
    with pytest.raises(ValueError, match="_Net has no tensor-parallel plan"):
        spmd.layout_map_from_tp_plan(_Net())


# -- HuggingFace's plans -----------------------------------------------------------------------------------------------
def _hf(name, **extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config")(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                    **extra)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(transformers, name + "ForCausalLM")(config)


def test_llamas_own_plan_is_the_megatron_layout_map():
    from tests.test_hf_models import LLAMA_LAYOUTS
    model = _hf("Llama")
    derived, hand = spmd.layout_map_from_tp_plan(model), LayoutMap(LLAMA_LAYOUTS)
    for name, p in model.named_parameters():
        assert (derived[name] or [U] * p.dim()) == (hand[name] or [U] * p.dim()), name


@pytest.mark.parametrize("name, extra, gathers", [  # (the forward's all-gathers over "model")
    ("Qwen3", {"head_dim": 8}, 0),  # column/row pairs only: the sums of Megatron's layers and nothing else
    ("Phi3", {"pad_token_id": 0}, 8),  # packed q|k|v and gate|up projections: their outputs are split, gathered
    ("Mixtral", {"num_local_experts": 4}, 2),  # the experts' packed gate|up
])
def test_hf_models_train_unchanged_under_their_own_plans(name, extra, gathers):
    from tests.test_hf_models import _step_like_torch
    ref = _hf(name, **extra)
    model = spmd.distribute_module(copy.deepcopy(ref), MESH, spmd.layout_map_from_tp_plan(ref))
    forward = _step_like_torch(model, ref, MESH)
    assert sum(c.kind == "all_gather" and c.mesh_dims == ("model",) for c in forward.collectives) == gathers
