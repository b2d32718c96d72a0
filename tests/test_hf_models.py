"""HuggingFace GPT-2 and Llama, unchanged, trained on a batch x model mesh with Megatron layouts: their forwards
make plain tensors (position ids, causal masks, an empty KV cache) that are taken as replicated."""

import copy

import pytest
import torch

import spmd
from spmd import UNSHARDED as U, Layout, LayoutMap
from spmd.explain import Recorder
from tests.sweep import reduce_gradients

transformers = pytest.importorskip("transformers")

# GPT-2's Conv1D weights are [in, out]: column-parallel shards axis 1, row-parallel axis 0 (Linear's transposed)
GPT2_LAYOUTS = {r"attn\.c_attn\.weight": [U, "model"], r"attn\.c_attn\.bias": ["model"],
                r"mlp\.c_fc\.weight": [U, "model"], r"mlp\.c_fc\.bias": ["model"],
                r"c_proj\.weight": ["model", U], r"wte\.weight": ["model", U]}  # lm_head is tied to wte
LLAMA_LAYOUTS = {r"(q|k|v|gate|up)_proj\.weight": ["model", U], r"(o|down)_proj\.weight": [U, "model"],
                 r"embed_tokens\.weight": ["model", U], r"lm_head\.weight": ["model", U]}


def _gpt2(attn):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config), GPT2_LAYOUTS


def _llama(attn):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config), LLAMA_LAYOUTS


@pytest.fixture(scope="module")
def mesh():
    return spmd.create_mesh([("batch", 2), ("model", 2)])


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # GPT-2's default eos id lies outside the tiny vocabulary
    yield
    transformers.logging.set_verbosity(verbosity)


def _close(got, want, what):
    """Relative 1e-5 of the tensor's largest magnitude (float32 sums in another order differ in the last bits)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=what)


@pytest.mark.parametrize("attn, shard_parameters", [("eager", None), ("sdpa", None), ("sdpa", "batch")])
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_trains_unchanged_like_plain_torch(mesh, build, attn, shard_parameters):
    """`model(input_ids=, labels=)` with the model's own position ids, masks and cache (`use_cache` as the config
    has it): the losses of AdamW training equal plain torch's, and at every step the gradients equal those plain
    torch computes from the same parameters (independent runs drift apart through AdamW's rounding noise, as
    two plain runs summing in different orders do). Also with every parameter sharded over "batch" too (FSDP x
    tensor parallel)."""
    torch.manual_seed(0)
    ref, layouts = build(attn)
    assert ref.config.use_cache and ref.training
    layout_map = LayoutMap(layouts)
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, layout_map, shard_parameters=shard_parameters)
    same_params = copy.deepcopy(ref)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (3, 4, 8), generator=torch.Generator().manual_seed(1))
    for ids in data:
        with torch.no_grad():
            for p, q in zip(model.parameters(), same_params.parameters()):
                q.copy_(spmd.to_global(p))
        dist_ids = spmd.copy_to_mesh(ids, Layout(["batch", U], mesh))
        loss = model(input_ids=dist_ids, labels=dist_ids).loss
        loss.backward()
        same_params(input_ids=ids, labels=ids).loss.backward()
        for (name, p), q in zip(model.named_parameters(), same_params.parameters()):
            _close(spmd.to_global(p.grad), q.grad, name)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=0)
        opt.step()
        ref_opt.step()
        for m in (model, ref, same_params):
            m.zero_grad()
    for name, p in model.named_parameters():
        assert isinstance(p, spmd.DVariable), name
        mapped = Layout(layout_map[name] or [U] * p.dim(), mesh)
        if shard_parameters:
            mapped = spmd.fsdp.sharded_layout(mapped, tuple(p.shape), shard_parameters)
        assert spmd.fetch_layout(p) == mapped, name


@pytest.mark.parametrize("reentrant, shard_parameters", [(False, None), (True, None), (False, "batch")])
def test_activation_checkpointing_recomputes_each_layer_with_the_same_dropout(mesh, reentrant, shard_parameters):
    """`gradient_checkpointing_enable()` (torch.utils.checkpoint): each layer's forward runs again in backward —
    dropout drawing the same values, sharded parameters gathered again — so the loss and gradients equal those of
    the same model without checkpointing."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32, attn_implementation="eager", attention_dropout=0.3)
    model = spmd.distribute_module(transformers.LlamaForCausalLM(config), mesh, LayoutMap(LLAMA_LAYOUTS),
                                   shard_parameters=shard_parameters)
    stored = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = spmd.copy_to_mesh(torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)),
                            Layout(["batch", U], mesh))
    losses = []
    for m in (model, stored):
        torch.manual_seed(5)
        losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    assert len(calls) == 2  # the forward, and its recomputation in backward
    assert losses[0].item() == losses[1].item()
    for (name, p), q in zip(model.named_parameters(), stored.parameters()):
        _close(spmd.to_global(p.grad), spmd.to_global(q.grad), name)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_context_parallel_llama_keeps_the_sequence_sharded(attn, rows):
    """Llama with the sequence sharded too (context parallelism; one or two rows of the batch per device): the
    linear layers' batch × sequence rows stay sharded over both, so forward gathers only each layer's keys and
    values (their cache's concatenation) and the shifted labels, and backward sums only their gradients (with two
    rows per device, the logits that the loss merges into rows are exchanged first: see below); loss and gradients
    are plain torch's."""
    mesh = spmd.create_mesh([("batch", 2), ("seq", 2)])
    torch.manual_seed(0)
    ref, _ = _llama(attn)
    model = spmd.distribute_module(copy.deepcopy(ref), mesh)
    ids = torch.randint(0, 64, (2 * rows, 16), generator=torch.Generator().manual_seed(1))
    dist_ids = spmd.copy_to_mesh(ids, Layout(["batch", "seq"], mesh))
    with Recorder() as r:
        out = model(input_ids=dist_ids, labels=dist_ids)
        out.loss.backward()
    expected = ref(input_ids=ids, labels=ids)
    expected.loss.backward()
    assert spmd.fetch_layout(out.logits) == Layout(["batch", "seq", U], mesh)
    forward = [(c.kind, c.mesh_dims) for c in r.collectives if not c.backward]
    # the logits' rows, merged for the loss, stay sharded over both dims; with two rows per device the batch takes the
    # sequence's mesh dim first (one all-to-all), so that each device's rows are one block of the merge
    moved = [("all_to_all", ("seq",))] * (rows - 1)
    assert sorted(forward) == sorted([("all_gather", ("seq",))] * 5 + moved + [("all_reduce", ("batch", "seq"))])
    # backward: each layer's key and value gradients summed over the seq devices' query rows, after the sum over
    # the query heads that share them (grouped-query attention: 2 of 4 heads' size)
    kv = rows * 2 * 16 * 8 * 4  # a device's batch rows, 2 key-value heads, 16 positions, head size 8, float32
    logits = rows * 8 * 64 * 4  # a device's rows of logits: 8 positions, 64 classes (back to the model's layout)
    assert [(c.kind, c.mesh_dims, c.bytes) for c in r.collectives if c.backward] == \
        [("all_to_all", ("seq",), logits)] * (rows - 1) + [("all_reduce", ("seq",), kv)] * 4
    torch.testing.assert_close(out.loss.item(), expected.loss.item(), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(spmd.to_global(p.grad), q.grad, name)


def _bert(attn):
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, attn_implementation=attn)
    return transformers.BertForMaskedLM(config), {}


@pytest.mark.parametrize("build", [_bert, _llama], ids=["bert", "llama"])
def test_a_padded_batch_trains_data_parallel_with_only_the_gradients_sums(build):
    """A padding mask is built as `mask[batch_idx, kv_idx]` (the batch index an arange): that index keeps the
    batch sharded rather than gathering the mask; BERT's token type ids, a buffer expanded over the batch, take
    the batch's sharding in the embedding's backward. Forward: only the loss's sums; backward: only all-reduces."""
    mesh = spmd.create_mesh([("batch", 4)])
    torch.manual_seed(0)
    ref, _ = build("sdpa")
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, LayoutMap({}))
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, -2:] = 0
    rows = Layout(["batch", U], mesh)
    with Recorder() as forward:
        loss = model(input_ids=spmd.copy_to_mesh(ids, rows), attention_mask=spmd.copy_to_mesh(mask, rows),
                     labels=spmd.copy_to_mesh(ids, rows)).loss
    with Recorder() as backward:
        loss.backward()
        reduce_gradients(model.parameters())
    want = ref(input_ids=ids, attention_mask=mask, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.item(), want.item(), rtol=1e-5, atol=0)
    assert {c.kind for c in forward.collectives} == {"all_reduce"}
    assert {c.kind for c in backward.collectives} == {"all_reduce"}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None and q.grad.abs().max() > 1e-6:  # (a key's bias: zero, but for rounding)
            _close(spmd.to_global(p.grad), q.grad, name)


def test_a_plain_batch_names_the_argument(mesh):
    model = spmd.distribute_module(_llama("sdpa")[0], mesh, LayoutMap(LLAMA_LAYOUTS))
    with pytest.raises(spmd.MixedTensorError, match=r"LlamaForCausalLM\.forward .* shape \[4, 8\] as `labels`"):
        model(input_ids=spmd.copy_to_mesh(torch.zeros(4, 8, dtype=torch.long), Layout(["batch", U], mesh)),
              labels=torch.zeros(4, 8, dtype=torch.long))


def test_function_traces_llama_in_one_graph(mesh):
    """The forwards' scope holds in a trace: the loss of `spmd.function` (fullgraph) equals plain torch's."""
    torch.manual_seed(0)
    ref, layouts = _llama("sdpa")
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, LayoutMap(layouts))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    loss = spmd.function(lambda x: model(input_ids=x, labels=x).loss, backend="aot_eager", fullgraph=True)
    got = loss(spmd.copy_to_mesh(ids, Layout(["batch", U], mesh)))
    torch.testing.assert_close(got.item(), ref(input_ids=ids, labels=ids).loss.item(), rtol=1e-5, atol=0)


def test_function_trains_llama_and_returns_its_output(mesh):
    """A whole step under `spmd.function` returning the model's output: its logits are an output the backward of the
    loss does not reach (they get zero gradients laid out as traced)."""
    torch.manual_seed(0)
    ref, layouts = _llama("sdpa")
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, LayoutMap(layouts))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def step(x):
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out

    compiled = spmd.function(step, backend="aot_eager", fullgraph=False)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    x = spmd.copy_to_mesh(ids, Layout(["batch", U], mesh))
    for _ in range(2):
        out = compiled(x)
        want = ref(input_ids=ids, labels=ids)
        want.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _close(spmd.to_global(out.logits), want.logits.detach(), "logits")
        torch.testing.assert_close(out.loss.item(), want.loss.item(), rtol=1e-5, atol=0)
    assert compiled.experimental_get_tracing_count() == 1


def _mixtral(implementation):
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
                                        experts_implementation=implementation)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.filterwarnings("ignore:spmd. the shape of aten.nonzero")  # (the loop's token lists: gathered, it says)
@pytest.mark.parametrize("implementation, experts", [("grouped_mm", None), ("grouped_mm", "model"), ("eager", None)],
                         ids=["data_parallel", "expert_parallel", "data_parallel_loop"])
def test_mixture_of_experts_trains_unchanged(mesh, implementation, experts):
    """Mixtral's experts run as one grouped product (`torch._grouped_mm`) over the tokens sorted by expert. With the
    experts sharded over "model" each device multiplies only its own experts' tokens: one all-reduce over "model"
    per grouped product completes the layer; data parallel, nothing is reduced over "model". transformers' eager
    loop over the experts adds each one's outputs into the batch-sharded tokens (`index_add_`) where they are."""
    torch.manual_seed(0)
    ref = _mixtral(implementation)
    layouts = {r"experts\.(gate_up_proj|down_proj)$": [experts, U, U]} if experts else {}
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, LayoutMap(layouts))
    forward = _step_like_torch(model, ref, mesh)
    for name, p in model.named_parameters():
        if "experts" in name:
            assert spmd.fetch_layout(p.grad).sharding_specs == [experts or U, U, U], name
    over_model = [c for c in forward.collectives if "model" in c.mesh_dims]
    assert [c.kind for c in over_model] == (["all_reduce"] * 4 if experts else [])  # 2 layers x (up, down)


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_mixture_of_experts_routes_each_devices_tokens_under_local_map(mesh, implementation):
    """transformers routes the whole batch's tokens at once, so spmd gathers them over "batch" in every MoE layer
    (above); with each layer's experts under `spmd.local_map` each device routes its own tokens: the forward's
    only collective is the loss's, and losses and gradients are still plain torch's."""
    torch.manual_seed(0)
    ref = _mixtral(implementation)
    model = spmd.distribute_module(copy.deepcopy(ref), mesh)
    for layer in model.model.layers:
        layer.mlp.experts.forward = spmd.local_map(layer.mlp.experts, out_layouts=Layout(["batch", U], mesh))
    forward = _step_like_torch(model, ref, mesh)
    assert [(c.kind, c.mesh_dims) for c in forward.collectives] == [("all_reduce", ("batch",))]  # the mean's sums


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_mixture_of_experts_expert_parallel(mesh, implementation):
    """`spmd.expert_parallel`: each layer's experts sharded over "batch", each device's tokens sent to their experts'
    devices and back (an all-to-all each way), no token dropped: the losses and gradients of plain torch. The
    forward's collectives: per layer one all-reduce of the routing's counts (the slots' capacity) and two
    all-to-alls, all over "batch"; nothing over "model" (its copies compute the same)."""
    torch.manual_seed(0)
    ref = _mixtral(implementation)
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, {r"experts\.": ["batch", U, U]})
    for layer in model.model.layers:
        spmd.expert_parallel(layer.mlp.experts, "batch")
    forward = _step_like_torch(model, ref, mesh)
    per_layer = [("all_reduce", ("batch",)), ("all_to_all", ("batch",)), ("all_to_all", ("batch",))]
    assert [(c.kind, c.mesh_dims) for c in forward.collectives] == per_layer * 2 + [("all_reduce", ("batch",))]
    for name, p in model.named_parameters():
        if "experts" in name:  # each device's experts' gradients: nothing pending, nothing all-reduced
            assert p.grad._layout.sharding_specs == ["batch", U, U] and not p.grad._pending, name


_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=32, num_experts_per_tok=2, experts_implementation="grouped_mm")
MOE_MODELS = {  # HuggingFace's experts interface: gated or not, with biases (gpt-oss), shared experts beside them
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_SMALL, num_experts=4, moe_intermediate_size=32, head_dim=8)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_SMALL, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**_SMALL, num_experts=4)),
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **_SMALL, num_local_experts=4, head_dim=8, layer_types=["full_attention"] * 2)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **dict(_SMALL, num_key_value_heads=4), n_routed_experts=4, moe_intermediate_size=32, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8)),
}


@pytest.mark.parametrize("name", MOE_MODELS)
def test_expert_parallel_moe_families(mesh, name):
    """Other mixture-of-experts families of transformers, unchanged, expert parallel over "batch" (their routers,
    shared experts and expert biases as they are): plain torch's losses and gradients; 2 all-to-alls per layer."""
    torch.manual_seed(0)
    ref = MOE_MODELS[name]()
    model = spmd.distribute_module(copy.deepcopy(ref), mesh,
                                   {r"\.experts\.\w*bias$": ["batch", U], r"\.experts\.": ["batch", U, U]})
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            spmd.expert_parallel(module, "batch")
    forward = _step_like_torch(model, ref, mesh)
    assert [c.kind for c in forward.collectives].count("all_to_all") == 4


@pytest.mark.parametrize("per_device", ["local_map", "expert_parallel"])
def test_mixture_of_experts_per_device_traces_as_one_graph(mesh, per_device):
    """Under spmd.function each device's routing and experts (`local_map`), or the expert-parallel layer's steps and
    its all-to-alls, are traced into the step's graph."""
    torch.manual_seed(0)
    ref = _mixtral("grouped_mm")
    expert_parallel = per_device == "expert_parallel"
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, {r"experts\.": ["batch", U, U]} if expert_parallel
                                   else None)
    for layer in model.model.layers:
        if expert_parallel:
            spmd.expert_parallel(layer.mlp.experts, "batch")
        else:
            layer.mlp.experts.forward = spmd.local_map(layer.mlp.experts, out_layouts=Layout(["batch", U], mesh))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    step = spmd.function(lambda x: model(input_ids=x, labels=x).loss, backend="aot_eager")
    explained = step.explain(spmd.copy_to_mesh(ids, Layout(["batch", U], mesh)))
    # expert parallel: 2 layers x (there, back)
    assert [c.kind for c in explained.collectives].count("all_to_all") == (4 if expert_parallel else 0)
    loss = step(spmd.copy_to_mesh(ids, Layout(["batch", U], mesh)))
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert step.experimental_get_tracing_count() == 1
    torch.testing.assert_close(loss.item(), want.item(), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(spmd.to_global(p.grad), q.grad, name)


def _step_like_torch(model, ref, mesh) -> Recorder:
    """A language-model training step of `model` on a batch-sharded batch, its loss and gradients checked against
    plain torch's `ref`; the forward's collectives."""
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    rows = spmd.copy_to_mesh(ids, Layout(["batch", U], mesh))
    with Recorder() as forward:
        loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.item(), want.item(), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(spmd.to_global(p.grad), q.grad, name)
    return forward


def _mamba(attn):  # (a builder's signature: Mamba has no attention)
    config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4, expand=2,
                                      conv_kernel=4, use_mambapy=False)
    return transformers.MambaForCausalLM(config), {}


@pytest.mark.filterwarnings("ignore:spmd. aten")  # (the caches' writes gather, and say so)
@pytest.mark.parametrize("build, cache", [(_llama, "dynamic"), (_llama, "static"), (_mamba, None)],
                         ids=["llama", "llama_static_cache", "mamba"])
def test_generate_matches_plain_torch(mesh, build, cache):
    """`model.generate` under implicit replication, greedy: the tokens plain torch generates. A static KV cache and
    Mamba's convolution and state caches are plain tensors the model allocates and updates in place: the writes
    take the DTensors' global values."""
    torch.manual_seed(0)
    ref, layouts = build("sdpa")
    model = spmd.distribute_module(copy.deepcopy(ref), mesh, LayoutMap(layouts))
    ids = torch.randint(3, 64, (4, 5), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if cache:
        options["cache_implementation"] = cache
    with torch.no_grad():
        want = ref.generate(ids, **options)
        with spmd.implicit_replication():
            got = model.generate(spmd.copy_to_mesh(ids, Layout(["batch", U], mesh)), **options)
    assert torch.equal(spmd.to_global(got) if spmd.is_dtensor(got) else got, want)
