"""select_backend: the per-call fused/split choice (E.T. §3.2) and the pass's annotation of each site."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from attncomp import ops
from attncomp.passes.base import CompileContext
from attncomp.passes.select_backend import select_backend as select_pass
from attncomp.passes.sparsify import sparsify
from attncomp.policy import DFSS, ET, Dense
from attncomp.runtime import dispatch
from attncomp.spec import AttentionSpec


class Before(nn.Module):
    def __init__(self, backend="auto"):
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v):
        return ops.attention(q, k, v, spec=AttentionSpec(backend=self.backend))


def traced(model, *xs):
    gm = fx.symbolic_trace(model)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ShapeProp(gm).propagate(*xs)
    return gm


def site(gm):
    (n,) = [n for n in gm.graph.nodes if ops.is_attention_node(n)]
    return n


@pytest.fixture
def table(monkeypatch):
    """A fake measurement store: {(policy, head_dim, dtype, arch): value}."""
    store = {}
    calls = []

    def lookup(name, key):
        calls.append((name, key))
        assert name == dispatch.SEQ_RULE
        return store.get((key["policy"], key["head_dim"], key["dtype"], key["arch"]))

    monkeypatch.setattr(dispatch, "_autotune_lookup", lookup)
    dispatch.clear_rule_cache()
    yield store, calls
    dispatch.clear_rule_cache()


class FakeBackend:
    def __init__(self, name, ok=True):
        self.name, self.ok = name, ok

    def supports(self, spec, q):
        return None if self.ok else "not this one"


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend tensors live on an sm_90 GPU with Triton; backends are fakes that say who they are."""
    backends = {"triton": FakeBackend("triton"), "reference": FakeBackend("reference"), "sdpa": FakeBackend("sdpa")}
    monkeypatch.setattr(dispatch, "_gpu_arch", lambda q: "sm_90")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "get_backend", lambda name: backends[name])
    return backends


def qk(n, d=64, dtype=torch.float16):
    return torch.empty(1, 2, n, d, dtype=dtype), torch.empty(1, 2, n, d, dtype=dtype)


def test_threshold_rule_per_call(table, fake_gpu):
    store, calls = table
    # a policy that drops entries: keep-everything sites race SDPA instead (tests/runtime/test_dispatch.py)
    store[("dfss", 64, "float16", "sm_90")] = {"split_above": 224}
    spec = AttentionSpec(policy=DFSS(2, 4))
    for n, want in ((64, "triton"), (224, "triton"), (256, "reference"), (4096, "reference")):
        q, k = qk(n)
        assert dispatch.select_backend(spec, q, k).name == want, n
    # the key length decides (cross-attention: 16 queries over 1024 keys -> split)
    q, _ = qk(16)
    _, k = qk(1024)
    assert dispatch.select_backend(spec, q, k).name == "reference"
    assert len(calls) == 1                              # looked up once, then cached per key
    # another head dim has no measurement: fused for every length
    q, k = qk(4096, d=128)
    assert dispatch.select_backend(spec, q, k).name == "triton"


def test_rule_from_timings_and_named_backends(table, fake_gpu):
    store, _ = table
    store[("dfss", 64, "bfloat16", "sm_90")] = {
        "timings": [{"n": 128, "fused": 1.0, "split": 2.0}, {"n": 256, "fused": 2.0, "split": 2.5},
                    {"n": 512, "fused": 6.0, "split": 5.0}, {"n": 1024, "fused": 20.0, "split": 12.0}],
        "split": "sdpa"}
    rule = dispatch.seq_rule("dfss", 64, torch.bfloat16, "sm_90")
    assert rule == {"split_above": 256, "split": "sdpa"}
    assert dispatch.choose_form(rule, 256) == "fused" and dispatch.choose_form(rule, 300) == "split"
    spec = AttentionSpec(policy=DFSS(2, 4))
    assert dispatch.select_backend(spec, *qk(512, dtype=torch.bfloat16)).name == "sdpa"
    # a split backend that cannot run the spec falls back to the fused kernel (same numerics)
    fake_gpu["sdpa"].ok = False
    dispatch.clear_rule_cache()  # choices are memoised per call signature: a backend's support is fixed
    assert dispatch.select_backend(spec, *qk(512, dtype=torch.bfloat16)).name == "triton"


def test_auto_skips_a_backend_that_cannot_take_the_value_head_dim(table, fake_gpu, monkeypatch):
    """A W_V·W_O-folded site has v of head dim d_model: auto must not pick a kernel limited to 256."""
    monkeypatch.setattr(fake_gpu["triton"], "supports", lambda spec, t: None if t.shape[-1] <= 256 else "head dim")
    q, k = qk(128)
    v = torch.empty(1, 2, 128, 768, dtype=torch.float16)
    assert dispatch.select_backend(AttentionSpec(policy=DFSS(2, 4)), q, k, v).name == "reference"
    assert dispatch.select_backend(AttentionSpec(policy=DFSS(2, 4)), q, k, k).name == "triton"


def test_no_measurement_means_fused_and_cpu_means_reference(table, monkeypatch):
    assert dispatch.choose_form(None, 10 ** 6) == "fused"
    store, _ = table
    store[("dfss", 64, "float32", "cpu")] = {"split_above": 1}
    be = dispatch.select_backend(AttentionSpec(policy=DFSS(1, 2)), *qk(128, dtype=torch.float32))
    assert be.name == "reference"                       # CPU tensors: the exact reference backend


def test_named_backend_is_used_as_asked(fake_gpu, table):
    store, _ = table
    store[("dense", 64, "float16", "sm_90")] = {"split_above": 8}
    assert dispatch.select_backend(AttentionSpec(backend="triton"), *qk(512)).name == "triton"
    fake_gpu["triton"].ok = False
    with pytest.raises(RuntimeError, match="cannot run this site"):
        dispatch.select_backend(AttentionSpec(backend="triton"), *qk(512))


def test_autotune_store_round_trip():
    autotune = pytest.importorskip("attncomp.runtime.autotune")
    dispatch.clear_rule_cache()
    assert dispatch.seq_rule("et", 64, torch.float16, "sm_90") is None
    dispatch.record_seq_rule("et", 64, torch.float16, "sm_90", {"split_above": 192})
    assert dispatch.seq_rule("et", 64, torch.float16, "sm_90") == {"split_above": 192}
    assert autotune.lookup(dispatch.SEQ_RULE, dispatch.seq_rule_key("et", 64, "float16", "sm_90")) == {"split_above": 192}
    with pytest.raises(ValueError):
        dispatch.record_seq_rule("et", 64, torch.float16, "sm_90", {"threshold": 3})
    dispatch.clear_rule_cache()


# -- the pass --------------------------------------------------------------------------------------

def test_pass_annotates_auto_rule_on_cpu():
    xs = [torch.randn(1, 2, 8, 16) for _ in range(3)]
    gm = traced(Before(), *xs)
    ctx = CompileContext(policy=ET())
    res = select_pass(gm, ctx)
    assert not res.modified
    text = ctx.sites[0].details["select_backend"]
    # et keeps every allowed entry: SDPA's CPU kernel, on a GPU the faster of SDPA and Triton
    assert text.startswith("auto, per call: on CPU: sdpa"), text
    assert "on CUDA: the faster of SDPA" in text, text
    assert AttentionSpec.from_json(site(gm).args[ops.ARG_INDEX["spec"]]).backend == "auto"
    assert ctx.counters["select_backend"]["auto"] == 1


def test_pass_annotates_sparse_auto_rule_on_cpu():
    xs = [torch.randn(1, 2, 8, 16) for _ in range(3)]
    gm = traced(Before(), *xs)
    ctx = CompileContext(policy=DFSS(1, 2))
    sparsify(gm, ctx)
    select_pass(gm, ctx)
    text = ctx.sites[0].details["select_backend"]
    assert text.startswith("auto, per call: on CPU: tvm where apache-tvm is installed"), text
    assert "on CUDA: triton" in text and "split form" in text, text


def test_pass_writes_named_backend():
    xs = [torch.randn(1, 2, 8, 16) for _ in range(3)]
    gm = traced(Before(), *xs)
    ctx = CompileContext(policy=Dense(), backend="reference")
    res = select_pass(gm, ctx)
    gm.recompile()
    assert res.modified and AttentionSpec.from_json(site(gm).args[ops.ARG_INDEX["spec"]]).backend == "reference"
    assert ctx.sites[0].details["select_backend"].startswith("reference (as asked)")
    torch.testing.assert_close(gm(*xs), Before()(*xs))
