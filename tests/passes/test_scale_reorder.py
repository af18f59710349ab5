"""scale_reorder: the softmax scale moves onto q, folded into the q projection when weights are frozen."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from attncomp import ops
from attncomp.passes.node_info import view_kind
from attncomp.passes.base import CompileContext, counters
from attncomp.passes.scale_reorder import scale_reorder
from attncomp.policy import ET, Dense
from attncomp.spec import AttentionSpec
from tests.utils import rel_err


class Before(nn.Module):
    """Multi-head attention: Linear + view + transpose for q/k/v, one attncomp site, output Linear.

    ``eager=True`` computes the same attention in plain PyTorch (the model a user would write).
    ``qk_quarter=True`` scales q and k by ``d**-0.25`` in eager mode (what the matcher folds into
    ``scale = 1/sqrt(d)``).
    """

    def __init__(self, d=32, h=4, scale=0.3, q_from=None, eager=False, qk_quarter=False):
        super().__init__()
        self.h, self.dh, self.scale, self.q_from, self.eager, self.qk_quarter = h, d // h, scale, q_from, eager, qk_quarter
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def heads(self, t, B, N):
        return t.view(B, N, self.h, self.dh).transpose(1, 2)

    def forward(self, x):
        B, N, d = x.shape
        if self.q_from == "shared":      # q and k read one projection
            qk = self.q(x)
            q, k = self.heads(qk, B, N), self.heads(qk, B, N)
        elif self.q_from == "tanh":      # q is not a Linear followed by views
            q, k = self.heads(torch.tanh(self.q(x)), B, N), self.heads(self.k(x), B, N)
        else:
            q, k = self.heads(self.q(x), B, N), self.heads(self.k(x), B, N)
        v = self.heads(self.v(x), B, N)
        if self.eager:
            if self.qk_quarter:
                q, k = q * self.dh ** -0.25, k * self.dh ** -0.25
                s = q @ k.transpose(-1, -2)
            else:
                s = (q @ k.transpose(-1, -2)) * (self.scale if self.scale is not None else self.dh ** -0.5)
            o = torch.softmax(s, dim=-1) @ v
        else:
            o = ops.attention(q, k, v, spec=AttentionSpec(scale=self.scale))
        return self.o(o.transpose(1, 2).reshape(B, N, d))


class FunctionalQ(nn.Module):
    """q projected with ``F.linear`` on raw parameters: traces to get_attr + call_function."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.dh = h, d // h
        self.wq = nn.Parameter(torch.randn(d, d) / 4)
        self.bq = nn.Parameter(torch.randn(d) / 4)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        B, N, d = x.shape
        q = F.linear(x, self.wq, self.bq).reshape(B, N, self.h, self.dh).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, self.h, self.dh).permute(0, 2, 1, 3)
        return ops.attention(q, k, k, spec=AttentionSpec(scale=0.5)).sum()


def traced(model, *example, meta=True):
    gm = fx.symbolic_trace(model)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    if meta:
        ShapeProp(gm).propagate(*example)
    return gm


def site(gm):
    (n,) = [n for n in gm.graph.nodes if ops.is_attention_node(n)]
    return n


def run(before, ctx):
    """Run the pass on a fresh trace of ``before``'s root (sharing the model's parameters)."""
    gm = fx.GraphModule(before, copy.deepcopy(before.graph))
    for a, b in zip(before.graph.nodes, gm.graph.nodes):
        b.meta = dict(a.meta)
    res = scale_reorder(gm, ctx)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm, res


def q_producer(gm):
    """Walk back from the op's q through data movement; return (nodes walked, producer)."""
    cur, walked = site(gm).args[0], []
    while view_kind(cur) is not None:
        walked.append(cur)
        cur = cur.args[0]
    return walked, cur


def frozen(m):
    return m.double().eval().requires_grad_(False)


def test_inference_folds_scale_into_q_weights_float64():
    model = frozen(Before(scale=0.3))
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    before = traced(model, x)
    w0, b0 = model.q.weight.clone(), model.q.bias.clone()
    counters.clear()
    ctx = CompileContext(policy=ET(), inference=True)
    gm, res = run(before, ctx)

    assert res.modified
    s = site(gm)
    assert AttentionSpec.from_json(s.args[ops.ARG_INDEX["spec"]]).scale == 1.0
    walked, prod = q_producer(gm)
    # no multiply between the Linear and the op: only view + transpose, then the new linear
    assert [view_kind(n) for n in walked] == ["transpose", "reshape"]
    assert prod.op == "call_function" and prod.target is F.linear
    w_attr, b_attr = prod.args[1], prod.args[2]
    assert w_attr.op == b_attr.op == "get_attr"
    assert not any(n.target in (torch.mul, torch.ops.aten.mul.Tensor) for n in gm.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(getattr(gm, w_attr.target), 0.3 * w0, rtol=1e-15, atol=0)
    torch.testing.assert_close(getattr(gm, b_attr.target), 0.3 * b0, rtol=1e-15, atol=0)
    # the user's module is untouched, and the folded tensors are buffers, not parameters
    assert torch.equal(model.q.weight, w0) and torch.equal(model.q.bias, b0)
    assert w_attr.target in dict(gm.named_buffers()) and w_attr.target not in dict(gm.named_parameters())

    assert rel_err(gm(x), before(x)) < 1e-10
    assert rel_err(gm(x), frozen_eager(model)(x)) < 1e-10
    assert ctx.counters["scale_reorder"]["folded"] == 1 and counters["scale_reorder"]["applied"] == 1
    rep = ctx.sites[0]
    assert "scale_reorder" in rep.rewrites and rep.details["scale_reorder"].startswith("applied")


def frozen_eager(model):
    e = copy.deepcopy(model)
    e.eager = True
    return e


def test_default_scale_comes_from_head_dim():
    model = frozen(Before(scale=None))
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    before = traced(model, x)
    gm, _ = run(before, CompileContext(policy=Dense(), inference=True))
    _, prod = q_producer(gm)
    torch.testing.assert_close(getattr(gm, prod.args[1].target), model.q.weight / math.sqrt(8), rtol=1e-15, atol=0)
    assert rel_err(gm(x), before(x)) < 1e-10


def test_qk_quarter_power_scaling_matches_eager():
    """A model scaling q and k by d**-0.25 each: after matching, spec.scale = 1/sqrt(d); the rewrite keeps it exact."""
    model = frozen(Before(scale=1 / math.sqrt(8)))
    eager = frozen_eager(model)
    eager.qk_quarter = True
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    gm, _ = run(traced(model, x), CompileContext(policy=ET(), inference=True))
    assert rel_err(gm(x), eager(x)) < 1e-10


def test_training_inserts_runtime_mul_and_grads_reach_user_params():
    model = Before(scale=0.3).double().train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    before = traced(model, x)
    gm, _ = run(before, CompileContext(policy=ET(), inference=False))
    q = site(gm).args[0]
    assert q.op == "call_function" and q.target is torch.mul and q.args[1] == pytest.approx(0.3)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert "runtime multiply" in site(gm).meta["attncomp_site"].details["scale_reorder"]

    g_ref = torch.autograd.grad(before(x).square().sum(), [model.q.weight, model.k.weight])
    g_new = torch.autograd.grad(gm(x).square().sum(), [model.q.weight, model.k.weight])
    for a, b in zip(g_new, g_ref):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("policy", ["dense", "dfss", "hash"])
@pytest.mark.parametrize("case", ["training", "unfoldable"])
def test_other_policies_keep_an_unfoldable_scale_in_the_op(policy, case):
    """Outside ``et``, a scale that cannot be folded into the q projection stays in the op (its kernels apply
    it to float32 scores): no runtime multiply, the spec keeps the scale, the report says why, and the
    compiled graph equals the unrewritten one in float64, gradients to the user's parameters included."""
    from attncomp.policy import get_policy

    pol = get_policy(policy)
    model = Before(scale=0.3, q_from="tanh" if case == "unfoldable" else None).double()
    if case == "unfoldable":
        model = frozen(model)
    else:
        model.train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    before = traced(model, x)
    ctx = CompileContext(policy=pol, inference=case == "unfoldable")
    gm, res = run(before, ctx)
    assert not [n for n in gm.graph.nodes if n.target is torch.mul]
    assert AttentionSpec.from_json(site(gm).args[ops.ARG_INDEX["spec"]]).scale == pytest.approx(0.3)
    rep = ctx.sites[0].details["scale_reorder"]
    assert rep.startswith("not applied") and "stays in the op" in rep, rep
    assert ctx.counters["scale_reorder"]["kept_in_op"] == 1 and "scale_reorder" not in ctx.sites[0].rewrites
    assert rel_err(gm(x), before(x)) < 1e-10  # (sparsify has not run: the site is still the model's own)
    if case == "training":
        g_ref = torch.autograd.grad(before(x).square().sum(), [model.q.weight, model.k.weight])
        g_new = torch.autograd.grad(gm(x).square().sum(), [model.q.weight, model.k.weight])
        for a, b in zip(g_new, g_ref):
            assert rel_err(a, b) < 1e-10


def test_aten_style_linear_with_get_attr_weights():
    model = FunctionalQ().double().eval().requires_grad_(False)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    before = traced(model, x)
    wq = model.wq.clone()
    gm, _ = run(before, CompileContext(policy=ET(), inference=True))
    walked, prod = q_producer(gm)
    assert [view_kind(n) for n in walked] == ["permute", "reshape"]
    assert prod.target is F.linear and prod.args[1].target != "wq"
    assert torch.equal(model.wq, wq)
    assert rel_err(gm(x), before(x)) < 1e-10


# -- negative twins: the scale still moves (runtime multiply) or stays, and the report says why ------

@pytest.mark.parametrize("q_from, why", [("shared", "shared"), ("tanh", "not a Linear")])
def test_unfoldable_q_gets_runtime_mul(q_from, why):
    model = frozen(Before(scale=0.3, q_from=q_from))
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    before = traced(model, x)
    ctx = CompileContext(policy=ET(), inference=True)
    gm, _ = run(before, ctx)
    assert site(gm).args[0].target is torch.mul
    assert why in ctx.sites[0].details["scale_reorder"]
    assert ctx.counters["scale_reorder"]["runtime_mul"] == 1
    assert rel_err(gm(x), before(x)) < 1e-10


def test_unscaled_model_is_left_alone():
    model = frozen(Before(scale=1.0))
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    before = traced(model, x)
    ctx = CompileContext(policy=ET(), inference=True)
    gm, res = run(before, ctx)
    assert not res.modified
    assert ctx.sites[0].details["scale_reorder"].startswith("not needed")
    assert "scale_reorder" not in ctx.sites[0].rewrites


def test_disabled_by_policy():
    model = frozen(Before(scale=0.3))
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    ctx = CompileContext(policy=ET(reorder_scale=False), inference=True)
    gm, res = run(traced(model, x), ctx)
    assert not res.modified and AttentionSpec.from_json(site(gm).args[ops.ARG_INDEX["spec"]]).scale == 0.3
    assert "disabled" in ctx.sites[0].details["scale_reorder"]


def test_unknown_head_dim_keeps_scale_in_op():
    model = frozen(Before(scale=None))
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    ctx = CompileContext(policy=ET(), inference=True)
    gm, res = run(traced(model, x, meta=False), ctx)
    assert not res.modified and AttentionSpec.from_json(site(gm).args[ops.ARG_INDEX["spec"]]).scale is None
    assert "head dim unknown" in ctx.sites[0].details["scale_reorder"]


# -- fp16: scores that overflow in the original order stay finite ----------------------------------

def overflow_model(d=128, h=2, n=16):
    """q == k per token with |q|^2 ~ 64 * 40^2 ~ 1e5 > 65504: q·k overflows fp16, q·k/8 does not."""
    torch.manual_seed(0)
    m = Before(d=d, h=h, scale=None)
    with torch.no_grad():
        w = torch.randn(d, d) * (40 / math.sqrt(d))
        m.q.weight.copy_(w)
        m.k.weight.copy_(w)
        m.q.bias.zero_()
        m.k.bias.zero_()
    return m.eval().requires_grad_(False), torch.randn(1, n, d)


def op_inputs(gm, x):
    """The (q, k) tensors the attention op receives on input ``x``."""
    seen = {}

    class Grab(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if ops.is_attention_node(n):
                seen["q"], seen["k"] = self.env[n.args[0]], self.env[n.args[1]]
            return out

    Grab(gm).run(x)
    return seen["q"], seen["k"]


def test_fp16_overflow_stays_finite():
    model, x = overflow_model()
    eager16 = frozen_eager(model).half()
    ref = frozen_eager(model).double()(x.double())
    x16 = x.half()

    out_eager = eager16(x16)
    assert not torch.isfinite(out_eager).all()          # inf scores -> NaN after softmax

    before = traced(model.half(), x16)
    gm, _ = run(before, CompileContext(policy=ET(), inference=True))
    out = gm(x16)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2

    # the op's own q·k in pure fp16 (what an fp16 kernel computes first) overflows before, not after
    q0, k0 = op_inputs(before, x16)
    q1, k1 = op_inputs(gm, x16)
    assert torch.isinf(q0 @ k0.transpose(-1, -2)).any()
    assert torch.isfinite(q1 @ k1.transpose(-1, -2)).all()


# -- end to end through attncomp.compile ----------------------------------------------------------

def test_compile_fp16_overflow_model():
    import attncomp

    model, x = overflow_model()
    eager16 = frozen_eager(model).half()
    x16 = x.half()
    assert not torch.isfinite(eager16(x16)).all()
    c = attncomp.compile(eager16, policy="dense", example_inputs=(x16,))
    out = c(x16)
    assert torch.isfinite(out).all()
    assert rel_err(out, frozen_eager(model).double()(x.double())) < 2e-2
    (rep,) = attncomp.report(c).sites
    assert rep.details["scale_reorder"].startswith("applied: scale 0.125 folded")


def bert(**kw):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  attn_implementation="eager", **kw)
    torch.manual_seed(0)
    return transformers.BertModel(cfg), torch.randint(0, cfg.vocab_size, (2, 11))


def test_compile_bert_folds_scale_float64():
    import attncomp

    model, ids = bert()
    model = frozen(model)
    c = attncomp.compile(model, policy="et", example_inputs=(ids,))
    rep = attncomp.report(c)
    assert len(rep.sites) == 2
    for s in rep.sites:
        assert s.details["scale_reorder"].startswith("applied: scale 0.25 folded")
        assert s.details["fold_wv_wo"].startswith("not applied: the cost model")
    muls = [n for n in c.graph_module.graph.nodes if n.op == "call_function" and n.target is torch.mul]
    assert not muls
    assert rel_err(c(ids).last_hidden_state, model(ids).last_hidden_state) < 1e-10
