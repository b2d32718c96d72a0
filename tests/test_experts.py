"""`spmd.expert_parallel`: a HuggingFace experts module's experts spread over a mesh dim, the tokens sent to them by
all-to-all — values, gradients and collectives against the module run by plain torch; token dropping; errors."""

import copy

import pytest
import torch

import spmd
from spmd import UNSHARDED as U, Layout
from spmd.explain import Recorder

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

EXPERTS, HIDDEN, TOKENS = 4, 8, 8
SCALE = torch.arange(1.0, HIDDEN + 1)  # the loss's weights: every output column's gradient differs


def _experts(implementation="grouped_mm"):
    torch.manual_seed(0)
    layer = MixtralExperts(transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=16,
                                                      num_local_experts=EXPERTS,
                                                      experts_implementation=implementation))
    torch.nn.init.normal_(layer.gate_up_proj, std=0.3)
    torch.nn.init.normal_(layer.down_proj, std=0.3)
    return layer


def _routing():
    """Top-2 routing, skewed: expert 0 takes most tokens."""
    first = torch.tensor([0, 0, 0, 1, 0, 2, 0, 3])
    top_k = torch.stack([first, (first + 1 + torch.arange(TOKENS) % 3) % EXPERTS], 1)
    return torch.randn(TOKENS, HIDDEN), top_k, torch.rand(TOKENS, 2)


def _run(layer, mesh, hidden, top_k, weights, **options):
    """The expert-parallel layer's output, its gradients (hidden, weights) and the collectives, forward + backward."""
    ep = spmd.expert_parallel(spmd.distribute_module(copy.deepcopy(layer), mesh, {".": ["batch", U, U]}), "batch",
                              **options)
    rows = Layout(["batch", U], mesh)
    h, w = (spmd.copy_to_mesh(t, rows).requires_grad_() for t in (hidden, weights))
    with Recorder() as recorded:
        out = ep(h, spmd.copy_to_mesh(top_k, rows), w)
        (out * spmd.copy_to_mesh(SCALE, Layout([U], mesh))).sum().backward()
    return ep, out, h.grad, w.grad, [(c.kind, c.mesh_dims) for c in recorded.collectives]


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("shape", [[("batch", 2)], [("batch", 4)], [("batch", 2), ("model", 2)]],
                         ids=["2", "4", "2x2"])
def test_equals_the_module_on_one_device(implementation, shape):
    """Outputs, gradients and every device's component as plain torch's module; the collectives: the capacity's
    all-reduce, an all-to-all there and back, and their reverses in backward — all over "batch" only."""
    layer, mesh = _experts(implementation), spmd.create_mesh(shape)
    hidden, top_k, weights = _routing()
    hidden.requires_grad_(), weights.requires_grad_()
    want = layer(hidden, top_k, weights)
    (want * SCALE).sum().backward()
    ep, out, h_grad, w_grad, collectives = _run(layer, mesh, hidden.detach(), top_k, weights.detach())
    for got, expected in [(out, want), (h_grad, hidden.grad), (w_grad, weights.grad),
                          (ep.gate_up_proj.grad, layer.gate_up_proj.grad), (ep.down_proj.grad, layer.down_proj.grad)]:
        torch.testing.assert_close(spmd.to_global(got), expected, rtol=1e-5, atol=1e-5)
        assert not got._pending
        for device, component in enumerate(spmd.unpack(got)):  # each device holds its shard of the value
            start = spmd.fetch_layout(got).mesh.device_location(device)[0] * component.shape[0]
            torch.testing.assert_close(component, expected[start:start + component.shape[0]], rtol=1e-5, atol=1e-5)
    assert collectives == [("all_reduce", ("batch",))] + [("all_to_all", ("batch",))] * 4


def _dropped_reference(layer, hidden, top_k, weights, devices: int, capacity: int):
    """The layer's output where each device's (token, choice) pairs beyond an expert's first `capacity` are
    dropped, in token order then choice order."""
    per_choice = [layer(hidden, top_k[:, j:j + 1], weights[:, j:j + 1]) for j in range(top_k.shape[1])]
    out = torch.zeros_like(hidden)
    rows = TOKENS // devices
    for d in range(devices):
        taken = [0] * EXPERTS
        for t in range(d * rows, (d + 1) * rows):
            for j in range(top_k.shape[1]):
                e = int(top_k[t, j])
                if taken[e] < capacity:
                    out[t] += per_choice[j][t]
                taken[e] += 1
    return out


@pytest.mark.parametrize("capacity_factor, capacity", [(0.5, 1), (1.0, 2), (100.0, 200)])
def test_capacity_factor_drops_the_tokens_beyond_an_experts_slots(capacity_factor, capacity):
    """With capacity_factor f each expert takes ceil(f * k * tokens / experts) tokens from a device, the first in
    token order; the dropped choices add nothing. No all-reduce: the capacity is known without looking."""
    layer, mesh = _experts(), spmd.create_mesh([("batch", 2)])
    hidden, top_k, weights = _routing()
    _, out, _, _, collectives = _run(layer, mesh, hidden, top_k, weights, capacity_factor=capacity_factor)
    with torch.no_grad():
        want = _dropped_reference(layer, hidden, top_k, weights, 2, capacity)
    torch.testing.assert_close(spmd.to_global(out), want, rtol=1e-5, atol=1e-5)
    assert collectives == [("all_to_all", ("batch",))] * 4


def test_errors_say_how_to_distribute_the_experts():
    mesh = spmd.create_mesh([("batch", 2)])
    with pytest.raises(TypeError, match="distribute the model first"):
        spmd.expert_parallel(_experts(), "batch")
    replicated = spmd.distribute_module(_experts(), mesh)
    with pytest.raises(spmd.LayoutError, match=r"'gate_up_proj'.*sharded there over 'batch'.*\['batch', UNSHARDED"):
        spmd.expert_parallel(replicated, "batch")
    with pytest.raises(spmd.LayoutError, match="no dimension 'experts'"):
        spmd.expert_parallel(replicated, "experts")
    sharded = spmd.distribute_module(_experts(), mesh, {".": ["batch", U, U]})
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        spmd.expert_parallel(sharded, "batch", capacity_factor=0)
    spmd.expert_parallel(sharded, "batch")
    with pytest.raises(ValueError, match="already expert parallel"):
        spmd.expert_parallel(sharded, "batch")


def test_traced_by_function_mode_as_its_steps():
    """Under spmd.function each step is one row of `explain`: the routing, the all-to-all there, the experts, the
    all-to-all back, the combine; the capacity is static (a device's every token), so no all-reduce."""
    layer, mesh = _experts(), spmd.create_mesh([("batch", 2)])
    ep = spmd.expert_parallel(spmd.distribute_module(layer, mesh, {".": ["batch", U, U]}), "batch")
    rows = Layout(["batch", U], mesh)
    hidden, top_k, weights = (spmd.copy_to_mesh(t, rows) for t in _routing())
    step = spmd.function(lambda h, i, w: ep(h, i, w), backend="aot_eager")
    explained = step.explain(hidden, top_k, weights)
    assert [row.op for row in explained.ops if not row.backward] == [
        "local_map(_to_slots)", "spmd.relayout", "local_map(_LocalExperts)", "spmd.relayout", "local_map(_from_slots)"]
    assert [(c.kind, c.mesh_dims) for c in explained.collectives] == [("all_to_all", ("batch",))] * 2
    torch.testing.assert_close(spmd.to_global(step(hidden, top_k, weights)),
                               spmd.to_global(ep(hidden, top_k, weights)), rtol=1e-5, atol=1e-5)


def test_expert_parallel_within_data_parallel():
    """token_dims=("data", "expert"): the tokens sharded over both, the experts over "expert" and copied over
    "data". Each "expert" group exchanges its own tokens (all-to-alls over "expert" only); the experts' gradients
    are the sum of the "data" groups' contributions, pending over "data" until read."""
    layer, mesh = _experts(), spmd.create_mesh([("data", 2), ("expert", 2)])
    hidden, top_k, weights = _routing()
    hidden.requires_grad_(), weights.requires_grad_()
    want = layer(hidden, top_k, weights)
    (want * SCALE).sum().backward()
    ep = spmd.expert_parallel(spmd.distribute_module(copy.deepcopy(layer), mesh, {".": ["expert", U, U]}), "expert",
                              token_dims=("data", "expert"))
    rows = Layout([("data", "expert"), U], mesh)
    h, w = (spmd.copy_to_mesh(t.detach(), rows).requires_grad_() for t in (hidden, weights))
    with Recorder() as recorded:
        out = ep(h, spmd.copy_to_mesh(top_k, rows), w)
        (out * spmd.copy_to_mesh(SCALE, Layout([U], mesh))).sum().backward()
    assert [(c.kind, c.mesh_dims) for c in recorded.collectives] == \
        [("all_reduce", ("data", "expert"))] + [("all_to_all", ("expert",))] * 4
    assert ep.gate_up_proj.grad._pending == ("data",)
    torch.testing.assert_close(spmd.to_global(out), want, rtol=1e-5, atol=1e-5)
    for got, expected in [(h.grad, hidden.grad), (w.grad, weights.grad),
                          (ep.gate_up_proj.grad, layer.gate_up_proj.grad), (ep.down_proj.grad, layer.down_proj.grad)]:
        torch.testing.assert_close(spmd.to_global(got), expected, rtol=1e-5, atol=1e-5)


def test_token_dims_must_include_the_experts_dim():
    mesh = spmd.create_mesh([("data", 2), ("expert", 2)])
    sharded = spmd.distribute_module(_experts(), mesh, {".": ["expert", U, U]})
    with pytest.raises(spmd.LayoutError, match="'expert' among them"):
        spmd.expert_parallel(sharded, "expert", token_dims=("data",))
