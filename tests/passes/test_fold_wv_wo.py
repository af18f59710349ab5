"""fold_wv_wo: E.T. eq. 4-5, W_V·W_O precomputed per head, with the cost model deciding under "auto"."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from attncomp import ops
from attncomp.passes import costmodel
from attncomp.passes.base import CompileContext
from attncomp.passes.fold_wv_wo import fold_wv_wo
from attncomp.policy import DFSS, ET
from attncomp.spec import AttentionSpec
from tests.utils import rel_err


class Before(nn.Module):
    """Multi-head attention with an attncomp site; the ``variant`` switches one structural detail."""

    def __init__(self, d=24, h=3, d_out=20, variant="plain", mask=None, dropout_p=0.0, bias=True):
        super().__init__()
        self.h, self.dh, self.variant, self.dropout_p = h, d // h, variant, dropout_p
        self.q, self.k, self.v = (nn.Linear(d, d, bias=bias) for _ in range(3))
        self.o = nn.Linear(d, d_out, bias=bias)
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, N, d = x.shape
        q = self.q(x).view(B, N, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(B, N, self.h, self.dh).transpose(1, 2)
        if self.variant == "permute":
            v = self.v(x).reshape(B, N, self.h, self.dh).permute(0, 2, 1, 3).contiguous()
        elif self.variant == "dv_major":        # splits features as (dv, H): not the head layout
            v = self.v(x).view(B, N, self.dh, self.h).transpose(2, 3).transpose(1, 2)
        elif self.variant == "gqa":
            v = self.v(x)[..., : d // self.h].view(B, N, 1, self.dh).transpose(1, 2)
            k = k[:, :1]
        else:
            v = self.v(x).view(B, N, self.h, self.dh).transpose(1, 2)
        spec = AttentionSpec(mask_kind="none" if self.mask is None else "bool", dropout_p=self.dropout_p,
                             gqa_groups=self.h if self.variant == "gqa" else 1)
        o = ops.attention(q, k, v, self.mask, spec=spec, dropout_p=self.dropout_p, seed=7)
        y = o.transpose(1, 2).contiguous().reshape(B, N, d)
        if self.variant == "gelu":
            y = F.gelu(y)
        out = self.o(y)
        if self.variant == "v_reused":
            out = out + v.sum()
        return out


class TiedV(Before):
    """The value projection is applied twice (tied weights)."""

    def forward(self, x):
        return super().forward(x) + self.v(x)[..., :1]


def traced(model, x):
    gm = fx.symbolic_trace(model)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ShapeProp(gm).propagate(x)
    return gm


def run(model, x, ctx):
    """Return (unrewritten, rewritten) graph modules sharing ``model``'s parameters."""
    before = traced(model, x)
    gm = traced(model, x)
    res = fold_wv_wo(gm, ctx)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return before, gm, res


def site(gm):
    (n,) = [n for n in gm.graph.nodes if ops.is_attention_node(n)]
    return n


def frozen(m):
    return m.double().eval().requires_grad_(False)


def called_modules(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_module"}


@pytest.mark.parametrize("variant", ["plain", "permute"])
def test_forced_fold_float64(variant):
    model = frozen(Before(variant=variant))
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=True)
    before, gm, res = run(model, x, ctx)
    assert res.modified
    # the value and output projections are gone; the op's v is X·Wf split into H heads of d_out
    assert called_modules(gm) == {"q", "k"}
    v = site(gm).args[2]
    assert v.target is torch.transpose
    lin = v.args[0].args[0]
    assert lin.target is F.linear and lin.args[0].op == "placeholder"
    wf = getattr(gm, lin.args[1].target)
    assert wf.shape == (3 * 20, 24) and lin.args[2] is None          # paper form: b_V folded into b'
    Wv, Wo = model.v.weight.view(3, 8, 24), model.o.weight.view(20, 3, 8)
    torch.testing.assert_close(wf.view(3, 20, 24)[1], Wo[:, 1] @ Wv[1], rtol=1e-12, atol=1e-14)
    b_attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr" and "bias" in n.target]
    b_prime = model.o.bias + model.o.weight @ model.v.bias
    torch.testing.assert_close(getattr(gm, b_attrs[0]), b_prime, rtol=1e-12, atol=1e-14)
    assert not list(gm.parameters()) or all(not p.requires_grad for p in gm.parameters())
    assert lin.args[1].target in dict(gm.named_buffers())

    assert rel_err(gm(x), before(x)) < 1e-10
    rep = ctx.sites[0]
    assert "fold_wv_wo" in rep.rewrites and rep.details["fold_wv_wo"].startswith("applied: forced")
    flops = rep.details["fold_wv_wo_flops"]
    assert flops["folded"] > flops["original"]
    assert len(ctx.notes) == 1 and ctx.notes[0].startswith("fold_wv_wo") and "FLOP" in ctx.notes[0]


def test_fully_masked_row_keeps_value_bias_per_head():
    """A query row with no allowed key outputs 0 in the op: folding b_V into b' would be wrong there."""
    N = 6
    mask = torch.ones(1, 1, N, N, dtype=torch.bool)
    mask[..., 2, :] = False
    model = frozen(Before(mask=mask))
    x = torch.randn(2, N, 24, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=True)
    before, gm, _ = run(model, x, ctx)
    lin = site(gm).args[2].args[0].args[0]
    assert lin.args[2] is not None                                   # c_h = W_O,h b_V,h stays in V'
    ref = before(x)
    torch.testing.assert_close(ref[:, 2], model.o.bias.expand(2, 20))  # the masked row is b_O alone
    assert rel_err(gm(x), ref) < 1e-10
    assert "kept per head" in ctx.sites[0].details["fold_wv_wo"]


def test_dropout_training_is_exact_and_trains():
    model = Before(dropout_p=0.3).double().train()
    x = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=False)
    before, gm, _ = run(model, x, ctx)
    params = dict(gm.named_parameters())
    folded = {k: p for k, p in params.items() if k.startswith("_attncomp_wvwo")}
    assert len(folded) == 3 and all(p.requires_grad for p in folded.values())   # Wf, c (per head), b'

    ref, out = before(x), gm(x)
    assert rel_err(out, ref) < 1e-10                               # same dropout draw, exact
    gx_ref, = torch.autograd.grad(ref.square().sum(), [x])
    loss = out.square().sum()
    gx, *gp = torch.autograd.grad(loss, [x, *folded.values()])
    assert rel_err(gx, gx_ref) < 1e-10
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in gp)

    opt = torch.optim.SGD(folded.values(), lr=1e-3)
    for p, g in zip(folded.values(), gp):
        p.grad = g
    opt.step()
    assert gm(x).square().sum() < loss


def test_auto_declines_multi_head_and_reports_flops():
    model = frozen(Before(h=3))
    x = torch.randn(1, 8, 24, dtype=torch.float64)
    ctx = CompileContext(policy=ET(), inference=True)
    _, gm, res = run(model, x, ctx)
    assert not res.modified and "o" in called_modules(gm)
    rep = ctx.sites[0]
    assert rep.details["fold_wv_wo"].startswith("not applied: the cost model predicts the folded form costs more")
    assert rep.details["fold_wv_wo_flops"]["folded"] > rep.details["fold_wv_wo_flops"]["original"]
    assert len(ctx.notes) == 1 and "not folded" in ctx.notes[0]


def test_auto_folds_single_head():
    model = frozen(Before(d=16, h=1, d_out=16))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    ctx = CompileContext(policy=ET(), inference=True)
    before, gm, res = run(model, x, ctx)
    assert res.modified and "fewer FLOPs" in ctx.sites[0].details["fold_wv_wo"]
    assert rel_err(gm(x), before(x)) < 1e-10


def test_forbidden_by_policy_still_reports_cost():
    model = frozen(Before(d=16, h=1, d_out=16))
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=False), inference=True)
    _, gm, res = run(model, x, ctx)
    assert not res.modified
    assert "forbidden" in ctx.sites[0].details["fold_wv_wo"] and "fold_wv_wo_flops" in ctx.sites[0].details


def test_named_triton_backend_with_wide_fold_declines():
    model = frozen(Before(d=16, h=1, d_out=300))
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), backend="triton", inference=True)
    _, gm, res = run(model, x, ctx)
    assert not res.modified and "exceeds what the triton backend runs" in ctx.sites[0].details["fold_wv_wo"]


def test_other_policies_never_fold():
    model = frozen(Before(d=16, h=1, d_out=16))
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    ctx = CompileContext(policy=DFSS(), inference=True)
    _, gm, res = run(model, x, ctx)
    assert not res.modified and "only the 'et' policy" in ctx.sites[0].details["fold_wv_wo"]


# -- negative twins: structure differs -> left alone, reason recorded ---------------------------------

@pytest.mark.parametrize("variant, why", [
    ("gelu", "before any output projection"),
    ("dv_major", "head split"),
    ("v_reused", "used elsewhere"),
    ("gqa", "grouped-query"),
])
def test_structure_differs(variant, why):
    model = frozen(Before(variant=variant))
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=True)
    before, gm, res = run(model, x, ctx)
    assert not res.modified
    assert why in ctx.sites[0].details["fold_wv_wo"], ctx.sites[0].details["fold_wv_wo"]
    assert "fold_wv_wo" not in ctx.sites[0].rewrites
    assert rel_err(gm(x), before(x)) < 1e-12


def test_tied_value_weights_not_untied_in_training():
    model = TiedV().double().train()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=False)
    _, _, res = run(model, x, ctx)
    assert not res.modified and "untie" in ctx.sites[0].details["fold_wv_wo"]
    # frozen weights may be folded even when shared: the other use keeps the original W_V
    model = frozen(TiedV())
    ctx = CompileContext(policy=ET(fold_wv_wo=True), inference=True)
    before, gm, res = run(model, x, ctx)
    assert res.modified and rel_err(gm(x), before(x)) < 1e-10


# -- cost model ---------------------------------------------------------------------------------------

def test_cost_model_bert_base():
    for N in (128, 512):
        c = costmodel.fold_cost(1, N, N, 12, 768, 64, 768)
        orig = 2 * N * 768 * 768 * 2 + 2 * 12 * N * N * 64 + N * 768 + N * 768
        assert c.flops_original == orig
        assert c.flops_folded == 2 * N * 768 * 12 * 768 + 2 * 12 * N * N * 768 + N * 11 * 768 + N * 768
        assert not c.cheaper_folded and c.flops_folded > 5 * c.flops_original
    one = costmodel.fold_cost(1, 128, 128, 1, 64, 64, 64)
    assert one.cheaper_folded


# -- end to end through attncomp.compile on Hugging Face BERT ---------------------------------------

def bert(**kw):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  attn_implementation="eager", **kw)
    torch.manual_seed(0)
    return transformers.BertModel(cfg), torch.randint(0, cfg.vocab_size, (2, 11))


def value_output_weights_read(gm):
    return [n.target for n in gm.graph.nodes if n.op == "get_attr"
            and (".attention.self.value." in n.target or ".attention.output.dense." in n.target)]


def test_compile_bert_forced_fold_float64():
    import attncomp

    model, ids = bert()
    model = frozen(model)
    c = attncomp.compile(model, policy=ET(fold_wv_wo=True), example_inputs=(ids,))
    rep = attncomp.report(c)
    assert [("fold_wv_wo" in s.rewrites) for s in rep.sites] == [True, True]
    assert not value_output_weights_read(c.graph_module)
    assert sum("fold_wv_wo" in n for n in rep.notes) == 2
    assert rel_err(c(ids).last_hidden_state, model(ids).last_hidden_state) < 1e-10


def test_compile_bert_training_fold_trains():
    import attncomp

    model, ids = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = model.double().train()
    c = attncomp.compile(model, policy=ET(fold_wv_wo=True), example_inputs=(ids,), capture="fx")
    gm = c.graph_module
    folded = {k: p for k, p in gm.named_parameters() if k.startswith("_attncomp_wvwo")}
    # the all-ones attention mask is proven to allow every entry (analyze_mask), so rows of S sum to 1
    # and each layer's value bias folds into b': one folded weight and one bias per layer
    assert len(folded) == 4 and all(p.requires_grad for p in folded.values()), sorted(folded)

    w = torch.linspace(-1, 1, 64, dtype=torch.float64)
    ref = (model(ids).last_hidden_state * w).square().sum()
    out = (c(ids).last_hidden_state * w).square().sum()
    assert rel_err(out, ref) < 1e-10
    emb = model.embeddings.word_embeddings.weight
    g_ref, = torch.autograd.grad(ref, [emb])
    g_out, *g_fold = torch.autograd.grad(out, [emb, *folded.values()])
    assert rel_err(g_out, g_ref) < 1e-10
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in g_fold)


# -- end to end through attncomp.compile's default capture (dynamo), weights not frozen -------------
# dynamo lifts parameters that require grad to graph inputs: the fold reads them at run time


class ToyMHA(nn.Module):
    """Multi-head self-attention as users write it (SDPA between Linear projections)."""

    def __init__(self, d=32, h=4, d_out=24):
        super().__init__()
        self.h = h
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.o = nn.Linear(d, d_out)

    def forward(self, x):
        B, N, d = x.shape
        q, k, v = (p(x).view(B, N, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, N, d))


def folded_sites(fast):
    rep = attncomp_report(fast)
    return [("fold_wv_wo" in s.rewrites) and str(s.details.get("fold_wv_wo", "")).startswith("applied: forced")
            for s in rep.sites], rep


def attncomp_report(fast):
    import attncomp

    return attncomp.report(fast)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_dynamo_forced_fold_eval_live_weights():
    import attncomp

    torch.manual_seed(0)
    model = ToyMHA().double().eval()          # parameters require grad, as after loading a model
    fast = attncomp.compile(model, policy=attncomp.ET(fold_wv_wo=True))
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        y = fast(x)
        assert rel_err(y, model(x)) < 1e-10
    folded, rep = folded_sites(fast)
    assert folded == [True], str(rep)
    assert "dynamo" in rep.capture and "fold_wv_wo_flops" in rep.sites[0].details
    assert any(n.startswith("fold_wv_wo") and "FLOP" in n for n in rep.notes), rep.notes
    # the fold reads the weights at run time: a change to them is seen without recompiling
    with torch.no_grad():
        model.v.weight.mul_(-0.5)
        model.o.bias.add_(1.0)
        assert rel_err(fast(x), model(x)) < 1e-10
    assert attncomp_report(fast).graphs == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_dynamo_forced_fold_training_gradients_reach_wv_wo():
    import attncomp

    torch.manual_seed(1)
    model = ToyMHA().double().train()
    fast = attncomp.compile(model, policy=attncomp.ET(fold_wv_wo=True))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    w = torch.linspace(-1, 1, 24, dtype=torch.float64)
    params = list(model.parameters())
    ref = (model(x) * w).square().sum()
    g_ref = torch.autograd.grad(ref, params)
    out = (fast(x) * w).square().sum()
    g_out = torch.autograd.grad(out, params)
    assert folded_sites(fast)[0] == [True]
    assert rel_err(out, ref) < 1e-10
    for a, b in zip(g_out, g_ref):  # (the key bias's gradient is zero up to rounding: atol)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_dynamo_forced_fold_bert_fp32():
    import attncomp

    model, ids = bert()
    model.eval()                              # float32, parameters require grad
    fast = attncomp.compile(model, policy=attncomp.ET(fold_wv_wo=True))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0                           # a padded row: the value bias stays per head
    with torch.no_grad():
        got = fast(ids, attention_mask=mask).last_hidden_state
        want = model(ids, attention_mask=mask).last_hidden_state
    folded, rep = folded_sites(fast)
    assert folded == [True, True], str(rep)
    assert rel_err(got, want) < 1e-4
