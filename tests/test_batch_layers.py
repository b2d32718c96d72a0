"""torch's layers on a sharded batch: attention (torch's fused inference kernels, and training batch first),
embedding bags, normalisations over a sharded hidden axis and recurrent layers keep the batch where it is, with
plain torch's values and gradients and only the collectives their math needs."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import spmd
from spmd import UNSHARDED as U, Layout, LayoutMap
from spmd.explain import Recorder
from sweep import issued, reduce_gradients


def specs(t):
    return spmd.fetch_layout(t).sharding_specs


@pytest.mark.parametrize("masks", ["none", "key_padding", "attn", "both"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_multihead_attention_fast_path_keeps_the_batch_sharded(masks, need_weights, average):
    """In evaluation under no_grad, batch-first MultiheadAttention takes torch's fused `_native_multi_head_attention`
    (its merged masks: key padding [B, S], or [B, H, L, S]): each device computes its own rows, no collective; the
    second output is None without `need_weights`, as torch's."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    h = torch.randn(4, 6, 16)
    kpm = torch.zeros(4, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    masks = {"key_padding_mask": kpm if masks in ("key_padding", "both") else None,
             "attn_mask": causal if masks in ("attn", "both") else None}
    dmasks = {k: v if v is None else spmd.copy_to_mesh(v, spmd.Layout(["batch" if k[0] == "k" else U, U], mesh))
              for k, v in masks.items()}
    dmha = spmd.distribute_module(copy.deepcopy(mha), mesh)
    dh = spmd.copy_to_mesh(h, spmd.Layout(["batch", U, U], mesh))
    with torch.no_grad(), warnings.catch_warnings(), Recorder() as seen:
        warnings.simplefilter("error")  # no replicated fallback
        out, weights = dmha(dh, dh, dh, need_weights=need_weights, average_attn_weights=average, **dmasks)
        want, want_weights = mha(h, h, h, need_weights=need_weights, average_attn_weights=average, **masks)
    assert "_native_multi_head_attention" in [r.op for r in seen.ops] and seen.collectives == []
    assert specs(out) == ["batch", U, U]
    torch.testing.assert_close(spmd.to_global(out), want)
    if need_weights:
        assert specs(weights) == ["batch"] + [U] * (want_weights.dim() - 1)
        torch.testing.assert_close(spmd.to_global(weights), want_weights)
    else:
        assert weights is None


def test_norms_over_a_sharded_hidden_axis_keep_it_sharded():
    """LayerNorm over hidden units sharded over `model` (weight and bias sharded alike) all-reduces the rows'
    sums (mean, then variance) and, backward, the input gradient's two sums in one; GroupNorm with the channels
    sharded at group boundaries normalises each device's groups, no collective. Neither gathers the input."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    for module, shape in ((nn.LayerNorm(8), (4, 6, 8)), (nn.GroupNorm(4, 8), (4, 8, 3))):
        hidden = 2 if isinstance(module, nn.LayerNorm) else 1
        layout = ["batch"] + [U] * (len(shape) - 1)
        layout[hidden] = "model"
        dmodule = spmd.distribute_module(copy.deepcopy(module), mesh, LayoutMap({".*": Layout(["model"], mesh)}))
        x = torch.randn(shape, requires_grad=True)
        dx = spmd.copy_to_mesh(x.detach(), Layout(layout, mesh)).requires_grad_()
        out, forward = issued(lambda: dmodule(dx))
        want = module(x)
        assert specs(out) == layout
        torch.testing.assert_close(spmd.to_global(out), want)
        grad = torch.randn(shape)
        _, backward = issued(lambda: (out.backward(spmd.copy_to_mesh(grad, Layout(layout, mesh))),
                                      reduce_gradients(dmodule.parameters())))
        want.backward(grad)
        torch.testing.assert_close(spmd.to_global(dx.grad), x.grad)
        for p, plain in zip(dmodule.parameters(), module.parameters()):
            torch.testing.assert_close(spmd.to_global(p.grad), plain.grad)
        if isinstance(module, nn.LayerNorm):
            assert forward == [("all_reduce", ("model",))] * 2
            assert backward == [("all_reduce", ("model",))] + [("all_reduce", ("batch",))] * 2
        else:
            assert forward == [] and backward == [("all_reduce", ("batch",))] * 2


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("masks", ["none", "key_padding", "causal", "both"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kv_dim", [None, 6], ids=["packed", "separate_kv"])
def test_multihead_attention_training_keeps_the_batch_sharded(batch_first, masks, need_weights, kv_dim):
    """torch's training path folds sequence and batch into one axis before the output projection, which has no
    block layout for a sharded batch (it gathered the attention's output): spmd runs it batch first. Values and
    gradients are plain torch's; the forward has no collective, the backward only the parameters' gradient sum."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    kw = {} if kv_dim is None else {"kdim": kv_dim, "vdim": kv_dim}
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw).double()
    dmha = spmd.distribute_module(copy.deepcopy(mha), mesh)
    seq_axes = (lambda b, s, e: (b, s, e)) if batch_first else (lambda b, s, e: (s, b, e))
    x = torch.randn(seq_axes(4, 6, 8), dtype=torch.float64)
    kv = x if kv_dim is None else torch.randn(seq_axes(4, 6, kv_dim), dtype=torch.float64)
    layout = Layout(list(seq_axes("batch", U, U)), mesh)
    kpm = torch.zeros(4, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    masks = {"key_padding_mask": kpm if masks in ("key_padding", "both") else None,
             "attn_mask": causal if masks in ("causal", "both") else None, "is_causal": masks == "causal"}
    dmasks = {k: v if not isinstance(v, torch.Tensor) else
              spmd.copy_to_mesh(v, Layout(["batch" if k[0] == "k" else U, U], mesh)) for k, v in masks.items()}
    q = x.clone().requires_grad_()
    dq = spmd.copy_to_mesh(x, layout).requires_grad_()
    dkv = dq if kv_dim is None else spmd.copy_to_mesh(kv, layout)
    with Recorder() as forward:
        out, weights = dmha(dq, dkv, dkv, need_weights=need_weights, **dmasks)
    want, want_weights = mha(q, q if kv_dim is None else kv, q if kv_dim is None else kv, need_weights=need_weights,
                             **masks)
    assert forward.collectives == [] and specs(out) == list(seq_axes("batch", U, U))
    torch.testing.assert_close(spmd.to_global(out), want)
    if need_weights:
        torch.testing.assert_close(spmd.to_global(weights), want_weights)
    else:
        assert weights is None
    grad = torch.randn_like(want)
    want.backward(grad)
    _, collectives = issued(lambda: (out.backward(spmd.copy_to_mesh(grad, layout)),
                                     reduce_gradients(dmha.parameters())))
    assert set(collectives) == {("all_reduce", ("batch",))}
    torch.testing.assert_close(spmd.to_global(dq.grad), q.grad)
    for (name, p), plain in zip(dmha.named_parameters(), mha.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), plain.grad, msg=name)


@pytest.mark.parametrize("affine,running", [(False, False), (True, False), (True, True)],
                         ids=["plain", "affine", "running_stats"])
@pytest.mark.parametrize("layout", [["batch", "model", U, U], [U, "model", U, U], ["batch", U, U, U]])
def test_instance_norm_keeps_the_batch_and_the_channels_sharded(affine, running, layout):
    """torch folds the batch into the channels to run a batch norm, a fold with no block layout when both are
    sharded (the norm gathered the channels): each sample's channels are normalised on their own device instead,
    with no collective; only the running statistics' update (a value per channel) is all-reduced over the batch,
    and gathered to their replicated buffers from the sharded channels. In eval mode they normalise, as torch's."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    plain = nn.InstanceNorm2d(4, affine=affine, track_running_stats=running).double()
    if affine:
        nn.init.normal_(plain.weight), nn.init.normal_(plain.bias)
    norm = spmd.distribute_module(copy.deepcopy(plain), mesh)
    for training in (True, False):
        plain.train(training), norm.train(training)
        x = torch.randn(4, 4, 3, 5, dtype=torch.float64, requires_grad=True)
        dx = spmd.copy_to_mesh(x.detach(), Layout(layout, mesh)).requires_grad_()
        out, forward = issued(lambda: norm(dx))
        want = plain(x)
        assert specs(out) == layout
        torch.testing.assert_close(spmd.to_global(out), want)
        updates = [("all_reduce", ("batch",))] * (layout[0] == "batch") + [("all_gather", ("model",))] * (
            layout[1] == "model")  # per statistic: the batch's mean, gathered from the sharded channels
        assert forward == (updates * 2 if running and training else [])
        want.backward(want.detach().cos())
        out.backward(spmd.copy_to_mesh(want.detach().cos(), Layout(layout, mesh)))
        torch.testing.assert_close(spmd.to_global(dx.grad), x.grad)
        for p, q in zip(norm.parameters(), plain.parameters()):
            torch.testing.assert_close(spmd.to_global(p.grad), q.grad)
        for b, c in zip(norm.buffers(), plain.buffers()):
            torch.testing.assert_close(spmd.to_global(b) if spmd.is_dtensor(b) else b, c)


@pytest.mark.parametrize("mode,padding_idx,weighted", [("sum", None, False), ("sum", 2, True), ("mean", None, False),
                                                       ("mean", 2, False), ("max", None, False), ("max", 2, False)])
def test_embedding_bags_of_a_sharded_batch_stay_sharded(mode, padding_idx, weighted):
    """torch flattens 2-D bags and makes their offsets itself, which no rule can split by device (the lookup ran
    replicated): the bags are lookups reduced over their rows instead. No collective forward; the table's gradient
    is one all-reduce over the batch."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    plain = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=padding_idx).double()
    bags = spmd.distribute_module(copy.deepcopy(plain), mesh)
    ids = torch.tensor([[1, 2, 3], [2, 2, 2], [4, 2, 9], [0, 0, 1]])  # (a bag of padding only: zeros)
    weights = torch.rand(4, 3, dtype=torch.float64) if weighted else None
    rows = Layout(["batch", U], mesh)
    dweights = None if weights is None else spmd.copy_to_mesh(weights, rows)
    out, forward = issued(lambda: bags(spmd.copy_to_mesh(ids, rows), per_sample_weights=dweights))
    want = plain(ids, per_sample_weights=weights)
    assert forward == [] and specs(out) == ["batch", U]
    torch.testing.assert_close(spmd.to_global(out), want)
    grad = torch.randn_like(want)
    want.backward(grad)
    _, backward = issued(lambda: (out.backward(spmd.copy_to_mesh(grad, rows)), spmd.to_global(bags.weight.grad)))
    assert backward == [("all_reduce", ("batch",))]
    torch.testing.assert_close(spmd.to_global(bags.weight.grad), plain.weight.grad)


def test_transformer_encoder_layer_training_and_its_compiled_step_keep_the_batch_sharded():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    dlayer = spmd.distribute_module(copy.deepcopy(layer), mesh)
    x = torch.randn(4, 6, 8)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U, U], mesh))
    out, collectives = issued(lambda: dlayer(dx))
    assert collectives == [] and specs(out) == ["batch", U, U]
    torch.testing.assert_close(spmd.to_global(out), layer(x))
    compiled = spmd.function(lambda t: dlayer(t).square().mean(), fullgraph=True, backend="aot_eager")
    assert [c.kind for c in compiled.explain(dx).collectives] == ["all_reduce"]  # the mean's sum over the batch
    torch.testing.assert_close(compiled(dx).item(), layer(x).square().mean().item())


def test_transformer_encoder_inference_with_a_padding_mask_takes_torchs_regular_path():
    """TransformerEncoder asks whether a padded batch can become a nested tensor (its fused inference path); a
    DTensor cannot, so the answer is no: the positions that are not padding equal plain torch's."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    denc = spmd.distribute_module(copy.deepcopy(enc), mesh, {})
    x, pad = torch.randn(4, 6, 8), torch.zeros(4, 6, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad(), warnings.catch_warnings(), Recorder() as seen:
        warnings.simplefilter("ignore")  # (torch's nested tensors' prototype warning)
        warnings.filterwarnings("error", "spmd")  # the layers' fused kernel has a rule: no replicated fallback
        want = enc(x, src_key_padding_mask=pad)
        out = denc(spmd.copy_to_mesh(x, spmd.Layout(["batch", spmd.UNSHARDED, spmd.UNSHARDED], mesh)),
                   src_key_padding_mask=spmd.copy_to_mesh(pad, spmd.Layout(["batch", spmd.UNSHARDED], mesh)))
    assert [r.op for r in seen.ops].count("_transformer_encoder_layer_fwd") == 2 and seen.collectives == []
    assert specs(out) == ["batch", U, U]
    torch.testing.assert_close(spmd.to_global(out)[~pad], want[~pad])


# -- recurrent modules ------------------------------------------------------------------------------------------
RECURRENT = {
    "LSTM": lambda: nn.LSTM(6, 8),
    "LSTM batch_first, 2 layers, bidirectional": lambda: nn.LSTM(6, 8, 2, batch_first=True, bidirectional=True),
    "LSTM with projections": lambda: nn.LSTM(6, 8, batch_first=True, proj_size=4),
    "GRU": lambda: nn.GRU(6, 8, batch_first=True),
    "RNN relu, 2 layers": lambda: nn.RNN(6, 8, 2, nonlinearity="relu"),
    "LSTMCell": lambda: nn.LSTMCell(6, 8),
    "GRUCell": lambda: nn.GRUCell(6, 8),
}


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_modules_keep_the_batch_sharded(name):
    """A batch-sharded input through a recurrent module (its initial state made by torch, or given): no collective
    in the forward, and in the backward only the weight gradients' sums over the batch; values and gradients as
    torch's."""
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    rnn = RECURRENT[name]()
    cell = isinstance(rnn, nn.RNNCellBase)
    batch_axis = 0 if cell or rnn.batch_first else 1
    x = torch.randn(4, 6) if cell else torch.randn(4, 5, 6) if batch_axis == 0 else torch.randn(5, 4, 6)
    drnn = spmd.distribute_module(copy.deepcopy(rnn), mesh)
    specs_of_x = [U] * x.dim()
    specs_of_x[batch_axis] = "batch"
    dx = spmd.copy_to_mesh(x, Layout(specs_of_x, mesh)).requires_grad_()
    with warnings.catch_warnings(), Recorder() as seen:
        warnings.filterwarnings("error", "spmd")
        out = drnn(dx)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        reduce_gradients(drnn.parameters())
    forward = [c for c in seen.collectives if not c.backward]
    assert forward == [] and {(c.kind, c.mesh_dims) for c in seen.collectives} == {("all_reduce", ("batch",))}
    assert len(seen.collectives) == len(list(rnn.parameters()))
    assert specs(out)[batch_axis] == "batch"
    xp = x.clone().requires_grad_()
    want = rnn(xp)
    want = want[0] if isinstance(want, tuple) else want
    want.sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want)
    torch.testing.assert_close(spmd.to_global(dx.grad), xp.grad)
    for (n, p), q in zip(drnn.named_parameters(), rnn.parameters()):
        torch.testing.assert_close(spmd.to_global(p.grad), q.grad, msg=n)


def test_recurrent_module_with_a_given_state_and_unbatched_input():
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8, batch_first=True)
    dlstm = spmd.distribute_module(copy.deepcopy(lstm), mesh)
    x, h, c = torch.randn(4, 5, 6), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    out, (hy, cy) = dlstm(spmd.copy_to_mesh(x, Layout(["batch", U, U], mesh)),
                          tuple(spmd.copy_to_mesh(t, Layout([U, "batch", U], mesh)) for t in (h, c)))
    want, (want_h, want_c) = lstm(x, (h, c))
    for got, expected in ((out, want), (hy, want_h), (cy, want_c)):
        torch.testing.assert_close(spmd.to_global(got), expected)
    assert specs(hy) == [U, "batch", U]
    single = spmd.copy_to_mesh(x[0], Layout([U, U], mesh))  # unbatched: torch makes its own state
    torch.testing.assert_close(spmd.to_global(dlstm(single)[0]), lstm(x[0])[0])


def test_recurrent_module_under_spmd_function_names_the_limit():
    """Dynamo does not trace recurrent modules: a clear TraceError, and with fullgraph=False the module runs
    eagerly between graphs."""
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    gru = nn.GRU(6, 8, batch_first=True)
    dgru = spmd.distribute_module(copy.deepcopy(gru), mesh)
    x = torch.randn(4, 5, 6)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U, U], mesh))

    def total(x):
        return dgru(x)[0].sum()
    with pytest.raises(spmd.TraceError, match="does not trace recurrent modules.*fullgraph=False"):
        spmd.function(total)(dx)
    torch.testing.assert_close(spmd.to_global(spmd.function(total, fullgraph=False)(dx)), gru(x)[0].sum())
