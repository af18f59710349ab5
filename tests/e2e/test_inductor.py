"""Inductor around the op: ``attncomp.compile`` hands every rewritten graph to Inductor (the default
outside this test suite), so everything around ``attncomp::attention`` is compiled as ``torch.compile``
would compile it, with no graph break caused by attncomp.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import attncomp
from tests.utils import fresh_seed, rel_err

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import ZOO, text  # noqa: E402
from tests.e2e.test_hf_families import assert_outputs_match  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Attn(nn.Module):
    def __init__(self, d=32, h=4, p=0.0):
        super().__init__()
        self.h, self.dh, self.p = h, d // h, p
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)
        p = torch.nn.functional.dropout(s.softmax(-1), self.p, self.training)
        return self.o((p @ v).transpose(1, 2).reshape(B, N, C)).relu()


def test_llama_inference_and_generate_with_inductor():
    fam = ZOO["llama"]
    torch.manual_seed(0)
    model = fam.build()
    fast = attncomp.compile(model, inductor=True)
    x = fam.inputs(2, 12)
    with torch.no_grad():
        assert_outputs_match(fast(**x), model(**x), "llama/inductor")
        g = text(2, 7, side="left")
        assert torch.equal(fast.generate(**g, max_new_tokens=4, do_sample=False),
                           model.generate(**g, max_new_tokens=4, do_sample=False))
    rep = attncomp.report(fast)
    assert "Inductor around the op" in rep.capture, rep.capture
    assert rep.rewritten == 2 and not [n for n in rep.notes if "graph break" in n], str(rep)


def test_training_step_with_inductor_matches_eager():
    fam = ZOO["bert"]
    torch.manual_seed(1)
    model = fam.build()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "dropout_prob", None), float):
            m.dropout_prob = 0.0
    model.train()
    fast = attncomp.compile(model, inductor=True)
    x = fam.inputs(2, 10)
    w = torch.randn(2, 10, 64)
    grads = []
    for run in (model, fast):
        model.zero_grad(set_to_none=True)
        (run(**x).last_hidden_state * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # relative to the largest gradient: a key bias's gradient is zero up to rounding (softmax ignores it)
    scale = max(g.norm() for g in grads[0].values())
    for n in grads[0]:
        err = float((grads[1][n] - grads[0][n]).norm() / scale)
        assert err < 1e-4, f"{n}: {err:.3g}"
    assert attncomp.report(fast).rewritten == 2


def test_dropout_draws_fresh_per_call_under_inductor():
    """Per-call seeds are graph inputs, not constants baked by Inductor's tracing."""
    torch.manual_seed(2)
    model = Attn(p=0.5).train()
    fast = attncomp.compile(model, inductor=True)
    x = torch.randn(2, 9, 32)
    a, b = fast(x), fast(x)
    assert not torch.equal(a, b), "training-mode dropout repeated the same draw"
    model.eval()
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 1e-5
    rep = attncomp.report(fast)
    assert rep.rewritten == 1 and "dropout" in rep.sites[0].pattern, str(rep)


@pytest.mark.parametrize("policy", ["hash", "drop", "dfss"])
def test_sparse_policies_under_inductor_match_the_uncompiled_graph(policy):
    torch.manual_seed(3)
    model = Attn().eval()
    x = torch.randn(2, 16, 32)
    plain = attncomp.compile(model, policy=policy, inductor=False)
    fast = attncomp.compile(model, policy=policy, inductor=True)
    with torch.no_grad():
        assert rel_err(fast(x), plain(x)) < 1e-5
    assert attncomp.report(fast).rewritten == 1


def test_no_graph_break_from_attncomp_fullgraph():
    """``torch.compile(fullgraph=True)`` with the attncomp backend: the op never breaks the graph."""
    model = Attn().eval()
    be = attncomp.backend(policy="hash", inductor=True)
    compiled = torch.compile(model, backend=be, fullgraph=True)
    x = torch.randn(2, 11, 32)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with torch.no_grad():
        compiled(x)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert attncomp.report(be).rewritten == 1


def test_recompile_storm_is_reported():
    class Modal(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x, tag: str):
            return self.attn(x) * len(tag)

    fast = attncomp.compile(Modal().eval(), inductor=False)
    with torch.no_grad():
        for i in range(12):
            fast(torch.randn(2, 5, 32), "t" * (i + 1) + str(i))
    rep = attncomp.report(fast)
    storm = [n for n in rep.notes if "recompile storm" in n]
    assert storm and "tag" in storm[0], str(rep)   # names the guard that failed
    assert len(rep.sites) == 1


class GQAAttn(nn.Module):
    """Grouped-query attention of x over ``[mem, x]`` (more keys than queries when mem is given)."""

    def __init__(self, d=32, hq=4, hk=2):
        super().__init__()
        self.hq, self.hk, self.dh = hq, hk, d // hq
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * hk * self.dh)

    def qkv(self, x, mem):
        B, N, _ = x.shape
        src = torch.cat([mem, x], 1)
        q = self.q(x).view(B, N, self.hq, self.dh).transpose(1, 2)
        k, v = self.kv(src).view(B, src.shape[1], 2, self.hk, self.dh).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x, mem):
        q, k, v = self.qkv(x, mem)
        # unit scale: the op gets q as computed here (no scale moved onto q by the compiler)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=1.0)


def _same_as_functional(out, gx, want, x, inductor: bool) -> None:
    """The compiled site's output and input gradient (of ``(out * out).sum()``) against the functional
    API's ``want``: bit for bit without Inductor; with it, Inductor compiles the projections around the
    op and rounding may differ."""
    wx, = torch.autograd.grad((want * want).sum(), x)
    if inductor:
        assert rel_err(out, want) < 1e-5 and rel_err(gx, wx) < 1e-4
    else:
        assert torch.equal(out, want) and torch.equal(gx, wx)


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_hash_buckets_derived_inside_the_op(inductor):
    """Compiled hash sites hand the op no buckets: the graph holds no bucket derivation, the report
    says where they come from, and forward and backward equal the functional API given the
    buckets of ``attncomp.policy.lsh_buckets`` (GQA, more keys than queries)."""
    from attncomp.functional import attention
    from attncomp.policy import Hash, lsh_buckets

    seed = fresh_seed()
    torch.manual_seed(seed)
    model = GQAAttn()
    pol = Hash(n_buckets=4, seed=seed % 997)
    x, mem = torch.randn(2, 6, 32, requires_grad=True), torch.randn(2, 5, 32)
    fast = attncomp.compile(model, policy=pol, inductor=inductor, example_inputs=(x, mem))
    out = fast(x, mem)
    gx, = torch.autograd.grad((out * out).sum(), x)

    q, k, v = model.qkv(x, mem)
    qb, kb = lsh_buckets(q.detach(), k.detach(), pol.n_buckets, pol.seed)
    want = attention(q, k, v, policy=pol, q_buckets=qb, k_buckets=kb, enable_gqa=True, scale=1.0)
    _same_as_functional(out, gx, want, x, inductor)
    assert not torch.allclose(want, model(x, mem))  # the buckets matter
    rep = attncomp.report(fast)
    assert rep.rewritten == 1 and rep.sites[0].policy == "hash", str(rep)
    assert "derived inside the op" in rep.sites[0].details.get("buckets", ""), str(rep)
    targets = {str(n.target) for gm in fast.graphs for n in gm.graph.nodes}
    assert "attncomp.attention.default" in targets and not [t for t in targets if "policy_aux" in t], targets


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_drop_masks_drawn_inside_the_op_from_its_seed(inductor, monkeypatch):
    """Compiled drop sites hand the op no keep masks, only a seed: fresh per training call (forward
    and backward of one call draw from the same one), the policy's in eval mode. Forward and backward
    equal the functional API given the masks of that seed (GQA, more keys than queries)."""
    from attncomp import ops
    from attncomp.functional import attention
    from attncomp.policy import Drop

    seed = fresh_seed()
    torch.manual_seed(seed)
    model = GQAAttn().train()
    pol = Drop(q_rate=0.3, k_rate=0.4, seed=seed % 997)
    x, mem = torch.randn(2, 6, 32, requires_grad=True), torch.randn(2, 5, 32)
    fast = attncomp.compile(model, policy=pol, inductor=inductor, example_inputs=(x, mem))
    drawn = []
    real = ops.materialize_aux
    monkeypatch.setattr(ops, "materialize_aux", lambda *a, **kw: drawn.append(kw.get("seed")) or real(*a, **kw))

    def step():
        drawn.clear()
        out = fast(x, mem)
        gx, = torch.autograd.grad((out * out).sum(), x)
        return out, gx, list(drawn)

    out, gx, seeds = step()
    assert len(seeds) == 2 and seeds[0] == seeds[1], seeds  # forward and backward: one draw
    q, k, v = model.qkv(x, mem)
    qk, kk = real(attncomp.AttentionSpec(policy=pol), q.detach(), k.detach(), seed=seeds[0])
    want = attention(q, k, v, policy=pol, q_keep=qk, k_keep=kk, enable_gqa=True, scale=1.0)
    _same_as_functional(out, gx, want, x, inductor)
    assert step()[2][0] != seeds[0]  # the next training call draws afresh
    fast.eval()
    with torch.no_grad():
        drawn.clear()
        fast(x, mem)
        assert drawn == [pol.seed]
    rep = attncomp.report(fast)
    assert rep.rewritten == 1 and rep.sites[0].policy == "drop", str(rep)
    assert "drawn inside the op" in rep.sites[0].details.get("keep masks", ""), str(rep)
    targets = {str(n.target) for gm in fast.graphs for n in gm.graph.nodes}
    assert "attncomp.attention.default" in targets and not [t for t in targets if "policy_aux" in t], targets


def test_inductor_failure_falls_back_to_the_rewritten_graph(monkeypatch):
    """A graph Inductor cannot compile (torch 2.11's CPU C++ codegen fails on some index checks) runs
    as attncomp rewrote it, with the failure in the report, instead of failing the user's model."""
    import torch._inductor.compile_fx as cfx

    def broken(*a, **k):
        raise RuntimeError("C++ compile error\nmore lines")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    fam = ZOO["llama"]
    torch.manual_seed(fresh_seed())
    model = fam.build()
    fast = attncomp.compile(model, inductor=True)
    x = fam.inputs(2, 12)
    with torch.no_grad():
        assert_outputs_match(fast(**x), model(**x), "llama/inductor-fallback")
    rep = attncomp.report(fast)
    assert rep.rewritten == 2, str(rep)
    assert any("Inductor failed (RuntimeError: C++ compile error)" in n for n in rep.notes), rep.notes


def test_inductor_cache_key_holds_the_op_fakes_and_a_configured_post_grad_pass_still_runs(monkeypatch):
    """attncomp's Inductor compiles carry a post-grad pass whose uuid is the source hash of
    ``attncomp/ops.py`` (the fakes whose strides compiled code asserts) and of the code traced SDPA
    sites run, so an Inductor cache filled by another version is not reused; a post-grad pass the user configured still runs, and its uuid is
    part of the key (None, not cacheable, stays None)."""
    import uuid

    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from attncomp import api, ops

    runs = []
    theirs = f"theirs-{uuid.uuid4().hex}"  # a key no cache holds yet: Inductor compiles, so the pass runs

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            runs.append(len(graph.nodes))

        def uuid(self):
            return theirs

    files = api.revision_files()
    assert ops.__file__ in files and any(f.endswith("sdpa.py") for f in files), files
    assert any(f.endswith("opspec.py") for f in files), files  # the fakes' strides are computed there
    assert api._op_revision_pass().uuid() == get_hash_for_files(files)
    monkeypatch.setattr(torch._inductor.config, "post_grad_custom_post_pass", Theirs())
    p = api._op_revision_pass()
    assert p.uuid() == (get_hash_for_files(files), theirs)

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    torch._dynamo.reset()
    fast = attncomp.compile(Block(), policy="dense", inductor=True)
    torch.testing.assert_close(fast(q, k, v), Block()(q, k, v), atol=1e-5, rtol=1e-5)
    assert runs, "the configured post-grad pass did not run"

    class Uncacheable(Theirs):
        def uuid(self):
            return None

    monkeypatch.setattr(torch._inductor.config, "post_grad_custom_post_pass", Uncacheable())
    assert api._op_revision_pass().uuid() is None
