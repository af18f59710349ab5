"""decompose_mha: ``nn.MultiheadAttention`` calls become projections around one attention op.

Every capture spells the call differently (dynamo: one ``F.multi_head_attention_forward`` call; fx: a
``call_module`` leaf; a graph may call the fast path's ``torch._native_multi_head_attention``; export:
aten ops). Each form is found and rewritten to ``attncomp::attention``, outputs equal eager's (training:
gradients too; eval under ``torch.no_grad()``, where eager runs PyTorch's fused fast path). A call whose
attention weights are used is left alone, and the report says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attncomp
from attncomp import ops
from tests.utils import rel_err

TOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class SelfAttn(nn.Module):
    """Self-attention through nn.MultiheadAttention with a key padding mask and a causal attn_mask."""

    def __init__(self, batch_first=True, need_weights=None, causal=False, heads=4):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, heads, batch_first=batch_first)
        self.need_weights, self.causal = need_weights, causal
        self.register_buffer("future", torch.ones(64, 64, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x, kpm):
        n = x.shape[1] if self.mha.batch_first else x.shape[0]
        am = self.future[:n, :n] if self.causal else None  # True: may not attend
        kw = {} if self.need_weights is None else dict(need_weights=self.need_weights)
        out = self.mha(x, x, x, key_padding_mask=kpm, attn_mask=am, **kw)
        return out[0]


class CrossAttn(nn.Module):
    """Cross-attention from 32-wide queries to a 24-wide memory (kdim = vdim = 24: separate weights)."""

    def __init__(self, batch_first=True, float_mask=False):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=24, vdim=24)
        self.float_mask = float_mask

    def forward(self, x, mem, kpm):
        if self.float_mask:
            kpm = torch.zeros(kpm.shape, dtype=x.dtype).masked_fill(kpm, float("-inf"))
        return self.mha(x, mem, mem, key_padding_mask=kpm, need_weights=False)[0]


class PerHeadMask(nn.Module):
    """F.multi_head_attention_forward called directly, L-first, with a (B*H, L, S) float attn_mask."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4)

    def forward(self, x, bias):
        m = self.mha
        return torch.nn.functional.multi_head_attention_forward(
            x, x, x, 32, 4, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0, m.out_proj.weight,
            m.out_proj.bias, training=self.training, attn_mask=bias, need_weights=False)[0]


class ReturnsWeights(SelfAttn):
    def forward(self, x, kpm):
        return self.mha(x, x, x, key_padding_mask=kpm)


class NativeCall(nn.Module):
    """A graph that calls the fast path's fused op itself."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x, kpm):
        m = self.mha
        return torch._native_multi_head_attention(x, x, x, 32, 4, m.in_proj_weight, m.in_proj_bias,
                                                  m.out_proj.weight, m.out_proj.bias, kpm, False, True, 1)[0]


def inputs(batch_first=True, b=2, n=7, s=None):
    torch.manual_seed(3)
    x = torch.randn(b, n, 32) if batch_first else torch.randn(n, b, 32)
    kpm = torch.zeros(b, n if s is None else s, dtype=torch.bool)
    kpm[1, -2:] = True  # row 1: its last two keys are padding (no row is fully masked)
    return x, kpm


def mha_sites(fast):
    rep = attncomp.report(fast)
    return rep.sites, rep


def attention_ops(fast):
    return sum(ops.is_attention_node(n) for g in fast.graphs for n in g.graph.nodes)


def check_eval(model, args, capture="dynamo"):
    model.eval()
    torch.manual_seed(0)
    fast = attncomp.compile(model, capture=capture)
    with torch.no_grad():
        got, want = fast(*args), model(*args)
    sites, rep = mha_sites(fast)
    assert len(sites) == 1 and sites[0].rewritten, str(rep)
    assert attention_ops(fast) == 1
    assert rel_err(got, want) < TOL, (rel_err(got, want), str(rep))
    return fast, rep


def check_training(model, args, capture="dynamo"):
    model.train()
    fast = attncomp.compile(model, capture=capture)
    params = list(model.parameters())
    w = torch.linspace(-1, 1, 32)
    want = (model(*args) * w).square().sum()
    g_want = torch.autograd.grad(want, params)
    got = (fast(*args) * w).square().sum()
    g_got = torch.autograd.grad(got, params)
    sites, rep = mha_sites(fast)
    assert len(sites) == 1 and sites[0].rewritten, str(rep)
    assert rel_err(got, want) < TOL
    for p, a, b in zip(params, g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.sample(2)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [False, None, True])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_eval(batch_first, need_weights, causal):
    # need_weights None: the default (True) with the weights dropped by the caller
    check_eval(SelfAttn(batch_first, need_weights, causal), inputs(batch_first))


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_training_gradients(batch_first):
    check_training(SelfAttn(batch_first, causal=True), inputs(batch_first))


def test_eval_fast_path_equals_eager():
    """Eval, batch first, self-attention, no grad: eager runs torch._native_multi_head_attention."""
    model = SelfAttn(True, None).eval()
    x, kpm = inputs()
    assert not torch.backends.mha.get_fastpath_enabled() or model.mha.training is False
    with torch.no_grad(), torch.autograd.profiler.profile() as prof:
        model(x, kpm)
    assert any("_native_multi_head_attention" in e.name for e in prof.function_events), "no fast path in eager"
    check_eval(model, (x, kpm))


def test_native_op_in_the_graph():
    """dynamo keeps a call of the fused op as one node: it is opened up like the others."""
    model = NativeCall()
    x, kpm = inputs()
    fast, rep = check_eval(model, (x, kpm))
    assert "nn.MultiheadAttention" not in [s.pattern for s in rep.sites]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("float_mask", [False, True])
def test_cross_attention_kdim_vdim(batch_first, float_mask):
    x, _ = inputs(batch_first)
    torch.manual_seed(4)
    mem = torch.randn(2, 9, 24) if batch_first else torch.randn(9, 2, 24)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[0, -3:] = True
    model = CrossAttn(batch_first, float_mask)
    check_eval(model, (x, mem, kpm))
    check_training(model, (x, mem, kpm))


def test_functional_call_with_a_per_head_mask():
    x, _ = inputs(False)
    bias = torch.randn(2 * 4, 7, 7)
    bias[5, :, 3] = float("-inf")  # batch 1, head 1: key 3 masked (heads are batch-major in B*H)
    check_eval(PerHeadMask(), (x, bias))
    check_training(PerHeadMask(), (x, bias))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_other_captures(capture):
    fast, rep = check_eval(SelfAttn(True, False, causal=True), inputs(), capture=capture)
    if capture == "fx":
        assert "symbolic_trace" in rep.capture, rep.capture  # the call_module form
    check_training(SelfAttn(False, None), inputs(False), capture=capture)


@pytest.mark.parametrize("capture", ["dynamo", "fx"])
def test_weights_used_left_alone_with_reason(capture):
    model = ReturnsWeights().eval()
    x, kpm = inputs()
    fast = attncomp.compile(model, capture=capture)
    with torch.no_grad():
        (o, w), (o_ref, w_ref) = fast(x, kpm), model(x, kpm)
    assert rel_err(o, o_ref) < TOL and rel_err(w, w_ref) < TOL
    sites, rep = mha_sites(fast)
    assert len(sites) == 1 and not sites[0].rewritten, str(rep)
    assert "weights" in sites[0].reason and sites[0].pattern == "nn.MultiheadAttention", sites[0].reason
    assert "weights it returns are used" in str(rep)


def encoder(norm_first, activation, batch_first=True):
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation=activation, batch_first=batch_first,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_fused_layer(norm_first, activation, causal):
    """Eval, batch first, no grad: the layer's fast path is one op, torch._transformer_encoder_layer_fwd,
    which dynamo captures as it is; its attention is opened up like the others."""
    model = encoder(norm_first, activation).eval()
    x, kpm = inputs()
    # a bool mask, as the key padding mask (mixing a float one with it makes the layer warn: a graph break),
    # and is_causal said (else the encoder tests the mask's values: a graph break)
    kw = dict(mask=torch.ones(7, 7, dtype=torch.bool).triu(1), is_causal=True) if causal else {}
    fast = attncomp.compile(model)
    with torch.no_grad():
        got, want = fast(x, src_key_padding_mask=kpm, **kw), model(x, src_key_padding_mask=kpm, **kw)
    rep = attncomp.report(fast)
    assert [s.name for s in rep.sites] == ["layers.0.self_attn", "layers.1.self_attn"] and rep.rewritten == 2, str(rep)
    assert rep.counters["decompose_mha"]["form:fused_layer"] == 2, rep.counters
    assert rel_err(got, want) < TOL


def test_transformer_encoder_training():
    model = encoder(False, "relu", batch_first=False)
    x, kpm = inputs(False)
    kw = dict(mask=torch.ones(7, 7, dtype=torch.bool).triu(1), src_key_padding_mask=kpm, is_causal=True)
    model.train()
    fast = attncomp.compile(model)
    params = list(model.parameters())
    want = model(x, **kw).square().sum()
    got = fast(x, **kw).square().sum()
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rep = attncomp.report(fast)
    assert rep.rewritten == 2 and rep.counters["decompose_mha"]["form:functional"] == 2, str(rep)


class Unbatched(nn.Module):
    """(L, E) inputs, self-attention with a (S,) key padding mask and cross-attention with (H, L, S) masks."""

    def __init__(self, batch_first):
        super().__init__()
        self.sa = nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.ca = nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=24, vdim=24)

    def forward(self, x, mem, kpm, am):
        y = self.sa(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
        return self.ca(y, mem, mem, attn_mask=am)[0]


@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_inputs(batch_first):
    torch.manual_seed(6)
    x, mem = torch.randn(7, 32), torch.randn(5, 24)
    kpm = torch.zeros(7, dtype=torch.bool)
    kpm[-2:] = True
    am = torch.zeros(4, 7, 5, dtype=torch.bool)
    am[1, :, 0] = True
    model = Unbatched(batch_first).eval()
    fast = attncomp.compile(model)
    with torch.no_grad():
        got, want = fast(x, mem, kpm, am), model(x, mem, kpm, am)
    rep = attncomp.report(fast)
    assert [s.name for s in rep.sites] == ["sa", "ca"] and rep.rewritten == 2, str(rep)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("option, needle", [(dict(add_bias_kv=True), "bias_k"),
                                            (dict(add_zero_attn=True), "add_zero_attn")])
def test_unsupported_options_left_alone_with_reason(option, needle):
    model = SelfAttn()
    model.mha = nn.MultiheadAttention(32, 4, batch_first=True, **option)
    model.eval()
    x, kpm = inputs()
    fast = attncomp.compile(model)
    with torch.no_grad():
        assert rel_err(fast(x, kpm), model(x, kpm)) < TOL
    rep = attncomp.report(fast)
    assert len(rep.sites) == 1 and not rep.sites[0].rewritten and needle in rep.sites[0].reason, str(rep)


def test_siglip_attention_pooling_head():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=16, patch_size=4)
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(cfg).eval()
    mha = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert mha and mha[0].endswith("head.attention"), mha
    px = torch.randn(2, 3, 16, 16)
    fast = attncomp.compile(model)
    with torch.no_grad():
        got, want = fast(pixel_values=px), model(pixel_values=px)
    rep = attncomp.report(fast)
    names = [s.name for s in rep.sites]
    assert mha[0] in names and all(n in dict(model.named_modules()) for n in names), names
    assert rep.rewritten == len(rep.sites) == 3, str(rep)
    assert rel_err(got.pooler_output, want.pooler_output) < 1e-4
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < 1e-4
