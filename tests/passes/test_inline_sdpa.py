"""SDPA sites traced into the graph Inductor compiles (``attncomp/passes/inline_sdpa.py``): what the
compiled model computes, that the op is not called at run time where SDPA's kernel is the choice,
that the kept graphs and the report still show the op, and the sites that keep it say why."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import attncomp
from attncomp import ops
from attncomp.codegen import get_backend
from attncomp.codegen.reference import attention as reference_attention
from attncomp.runtime import autotune, dispatch
from attncomp.spec import AttentionSpec, Predicates
from tests.utils import fresh_seed, rel_err

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import ZOO, text  # noqa: E402
from tests.runtime.test_dispatch import KINDS, _inputs, _pred_kw, fake_gpu  # noqa: E402,F401 (fake_gpu: fixture)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _outputs(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


# Llama's RMSNorm computes in float32 whatever the model's dtype: fused differently by Inductor
@pytest.mark.sample(2)
@pytest.mark.parametrize("name,side,tol", [("gpt2", "right", 1e-10), ("llama", "left", 1e-6), ("bert", "right", 1e-10)])
def test_cpu_dense_sites_run_as_traced_sdpa_and_match_float64_eager(name, side, tol, op_calls):
    fam = ZOO[name]
    torch.manual_seed(0)
    model = fam.build().double()
    fast = attncomp.compile(model, inductor=True)
    for _ in range(2):  # fresh inputs each call, the second one through the compiled code as it stands
        x = text(3, 11, side=side)
        with torch.no_grad():
            want = _outputs(model(**x))
            got = _outputs(fast(**x))
        valid = x["attention_mask"].bool()
        # padded query rows: the model's own output there is arbitrary (attncomp gives zero attention)
        assert rel_err(got[valid], want[valid]) < tol, name
    assert op_calls == [], "an SDPA site called the op at run time"
    rep = attncomp.report(fast)
    assert rep.rewritten == fam.sites
    for s in rep.sites:
        assert s.details["inline_sdpa"].startswith("traced into the Inductor graph: SDPA's CPU kernel"), str(rep)
        # weights not frozen here: the scale stays in the site (no runtime multiply of q), SDPA applies it
        assert s.details["scale_reorder"].startswith("not applied: the weights are not frozen"), str(rep)
        assert "stays in the op" in s.details["scale_reorder"], str(rep)
    assert rep.counters["inline_sdpa"]["inlined"] == fam.sites
    assert rep.counters["inline_sdpa"]["mask plans"] == 1      # the layers share one mask, as in the model
    # the graphs kept for the report and for export still hold the op
    assert sum(ops.is_attention_node(n) for g in fast.graphs for n in g.graph.nodes) == fam.sites
    assert not [n for n in rep.notes if "graph break" in n], str(rep)


def test_training_step_through_traced_sdpa_matches_float64_eager(op_calls):
    fam = ZOO["llama"]
    torch.manual_seed(1)
    model = fam.build().double().train()
    fast = attncomp.compile(model, inductor=True)
    x = text(2, 9, side="right")
    w = torch.randn(2, 9, model.config.vocab_size, dtype=torch.float64)
    valid = x["attention_mask"].bool()
    grads = []
    for run in (model, fast):
        model.zero_grad(set_to_none=True)
        (run(**x).logits[valid] * w[valid]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    scale = max(float(g.norm()) for g in grads[0].values())
    for n in grads[0]:  # (Llama's RMSNorm runs in float32, see above)
        assert float((grads[1][n] - grads[0][n]).norm()) / scale < 1e-6, n
    assert op_calls == []
    assert attncomp.report(fast).counters["inline_sdpa"]["inlined"] == fam.sites


def test_switched_off_the_op_runs(monkeypatch, op_calls):
    monkeypatch.setenv("ATTNCOMP_INLINE_SDPA", "0")
    fam = ZOO["gpt2"]
    torch.manual_seed(0)
    model = fam.build()
    fast = attncomp.compile(model, inductor=True)
    x = text(2, 8)
    with torch.no_grad():
        fast(**x)
        op_calls.clear()  # (counted from the second call: the first one compiles)
        fast(**x)
    assert len(op_calls) == fam.sites
    assert "inline_sdpa" not in attncomp.report(fast).sites[0].details


class BiasAttn(nn.Module):
    """Attention with an additive bias that may be a trained parameter."""

    def __init__(self, n=6, d=8, trained=False):
        super().__init__()
        bias = torch.randn(n, n, dtype=torch.float64)
        self.bias = nn.Parameter(bias) if trained else nn.Parameter(bias, requires_grad=False)

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


def test_sites_that_keep_the_op_say_why(op_calls):
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    # a trained bias: SDPA's kernels give it no gradient, the op does
    model = BiasAttn(trained=True)
    fast = attncomp.compile(model, inductor=True)
    out = fast(q, k, v)
    want = model(q, k, v)
    assert rel_err(out, want) < 1e-10
    g = torch.randn_like(out)
    got_grad = torch.autograd.grad(out, model.bias, g)[0]
    want_grad = torch.autograd.grad(want, model.bias, g)[0]
    assert rel_err(got_grad, want_grad) < 1e-10
    op_calls.clear()
    fast(q, k, v)
    assert len(op_calls) == 1
    detail = attncomp.report(fast).sites[0].details["inline_sdpa"]
    assert detail.startswith("op kept: the float mask requires grad"), detail
    # a policy that drops entries runs on the reference on a CPU: the op stays
    torch._dynamo.reset()
    fast = attncomp.compile(BiasAttn(), policy="dfss", inductor=True)
    with torch.no_grad():
        fast(q, k, v)
        op_calls.clear()
        fast(q, k, v)
    assert len(op_calls) == 1
    detail = attncomp.report(fast).sites[0].details["inline_sdpa"]
    assert detail == "op kept: policy 'dfss' does not keep every allowed entry", detail


def test_no_cache_takes_a_tensor_made_in_a_cuda_graph_pool(monkeypatch):
    """CUDA graph trees warm up on a stream of their own, with memory from the graph's private pool:
    a tensor cached then is one the graph does not track. ``cacheable`` says no on a side stream and
    during a capture, and the caches of constants and positions then build afresh (a CPU tensor stands
    in for the device's here: the cache key is the device the caller names)."""
    from attncomp.codegen import reference as ref
    from attncomp.codegen import sdpa as sdm

    main, side = 7, 9  # raw stream handles
    state = {"stream": main, "capturing": False}
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: state["capturing"])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: state["stream"], raising=False)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: type("S", (), {"cuda_stream": main})())
    monkeypatch.setattr(ref, "_DEFAULT_STREAMS", {})
    assert ref.cacheable("cuda:0") and ref.cacheable("cpu")
    for st, cap in ((side, False), (main, True)):
        state.update(stream=st, capturing=cap)
        assert not ref.cacheable("cuda:0") and ref.cacheable("cpu")
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, v, dtype=None, device=None: full(size, v, dtype=dtype))
    monkeypatch.setattr(sdm, "_CONSTS", {})
    state.update(stream=side, capturing=False)
    a, b = sdm._const(1.5, torch.float32, "cuda:0"), sdm._const(1.5, torch.float32, "cuda:0")
    assert a is not b and not sdm._CONSTS
    state.update(stream=main)
    a, b = sdm._const(1.5, torch.float32, "cuda:0"), sdm._const(1.5, torch.float32, "cuda:0")
    assert a is b and len(sdm._CONSTS) == 1


def test_eager_calls_after_tracing_get_real_tensors():
    """Tracing the SDPA forward makes constants and positions under fake tensors: none may enter the
    caches that eager calls read (and eager calls' cached ones may not enter a trace)."""
    spec = AttentionSpec(causal=True)

    def eager_check(n):
        q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for _ in range(3))
        kv = torch.rand(2, n) > 0.3
        kv[:, 0] = True
        got = ops.attention(q, k, v, spec=spec, k_valid=kv)
        want = reference_attention(q, k, v, spec=spec, preds=Predicates(k_valid=kv))[0]
        assert rel_err(got, want) < 1e-12

    eager_check(7)                                    # fills the caches with real tensors
    fam = ZOO["gpt2"]
    torch.manual_seed(0)
    model = fam.build().double()
    fast = attncomp.compile(model, inductor=True)
    x = text(2, 7)
    with torch.no_grad():
        assert rel_err(_outputs(fast(**x)), _outputs(model(**x))) < 1e-10
    eager_check(7)
    eager_check(5)


# -- the choice (a fake GPU, no timing) -----------------------------------------------------------

@pytest.fixture
def inline_gpu(fake_gpu):
    """A fake GPU (``tests/runtime/test_dispatch.py``) whose SDPA backend can be traced."""
    backends, _, calls = fake_gpu
    sd = get_backend("sdpa")
    backends["sdpa"].inline_plan, backends["sdpa"].inline_forward = sd.inline_plan, sd.inline_forward
    yield backends
    assert calls == [], "the inline choice timed kernels through the dense kernel choice"
    autotune.clear_memo()


def _no_timing(*a, **kw):
    raise AssertionError("the choice timed kernels")


def test_gpu_choice_reads_the_store_and_measures_nothing(inline_gpu, monkeypatch):
    monkeypatch.setattr(dispatch, "_inline_times", _no_timing)
    spec = AttentionSpec(causal=True)
    q = torch.empty(2, 8, 512, 64, dtype=torch.float16)
    k = torch.empty(2, 2, 512, 64, dtype=torch.float16)
    kv = torch.ones(2, 512, dtype=torch.bool)
    preds = Predicates(k_valid=kv)
    ok, why = dispatch.inline_choice(spec, q, k, k, preds)
    assert ok and why.startswith("the default rule") and "not 'max-autotune'" in why, why
    key = dispatch.dense_choice_key(512, 512, 64, q.dtype, "causal+mask", "sm_90", 4)
    dispatch.record_dense_choice(key, {"sdpa": 2.0, "triton": 1.0})
    ok, why = dispatch.inline_choice(spec, q, k, k, preds)
    assert not ok and "Triton's kernel measured faster" in why, why
    dispatch.record_dense_choice(key, {"sdpa": 1.0, "triton": 2.0})
    ok, why = dispatch.inline_choice(spec, q, k, k, preds)
    assert ok and "measured faster" in why, why
    # another bucket (no padding: the causal kind) is not covered by that measurement: the default rule
    ok, why = dispatch.inline_choice(spec, q, k, k, None)
    assert ok and why.startswith("the default rule"), why
    # Triton cannot run it: SDPA whatever was measured
    inline_gpu["triton"].ok = False
    ok, why = dispatch.inline_choice(spec, q, k, k, None)
    assert ok and "Triton does not run" in why, why


def test_gpu_measures_sdpa_traced_against_the_op_once_per_bucket(inline_gpu, monkeypatch):
    timings = {"sdpa": 0.04, "triton": 0.09}   # a small call: the op's host time dominates
    calls = []

    def inline_times(spec, q, k, v, preds, attn_mask, sizes, device_only=False):
        calls.append(sizes)
        return dict(timings)

    monkeypatch.setattr(dispatch, "_inline_times", inline_times)
    spec = AttentionSpec()
    q = torch.empty(8, 16, 512, 64, dtype=torch.bfloat16)
    kv = Predicates(k_valid=torch.ones(8, 512, dtype=torch.bool))
    ok, why = dispatch.inline_choice(spec, q, q, q, kv, mode="max-autotune")
    assert ok and "sdpa 0.04 ms, triton 0.09 ms" in why, why
    assert calls == [(8, 16, 512, 64, 16, 512, 64)]
    ok, _ = dispatch.inline_choice(spec, torch.empty(8, 16, 300, 64, dtype=torch.bfloat16),
                                   torch.empty(8, 16, 300, 64, dtype=torch.bfloat16),
                                   torch.empty(8, 16, 300, 64, dtype=torch.bfloat16), kv, mode="max-autotune")
    assert ok and len(calls) == 1                # the same pow2 bucket: stored, not measured again
    # a larger call: the kernel decides
    timings.update(sdpa=9.0, triton=6.0)
    big = torch.empty(1, 32, 16384, 64, dtype=torch.bfloat16)
    ok, why = dispatch.inline_choice(AttentionSpec(causal=True), big, big[:, :8], big[:, :8], mode="max-autotune")
    assert not ok and "the op on Triton measured faster" in why and len(calls) == 2, why
    # a new process reads both from the store
    dispatch.clear_rule_cache()
    autotune.clear_memo()
    assert dispatch.inline_choice(spec, q, q, q, kv)[0]
    assert not dispatch.inline_choice(AttentionSpec(causal=True), big, big[:, :8], big[:, :8])[0]
    assert len(calls) == 2
    # no timing while a sync debug mode or a CUDA graph capture forbids it
    monkeypatch.setattr(dispatch, "_no_measuring", lambda: "during CUDA graph capture")
    ok, why = dispatch.inline_choice(spec, q[:, :, :64], q[:, :, :64], q[:, :, :64], mode="max-autotune")
    assert not ok and why.endswith("not measured during CUDA graph capture") and len(calls) == 2, why


@pytest.mark.parametrize("case,expect", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(spec=AttentionSpec(policy=attncomp.get_policy("hash"))), "does not keep every allowed entry"),
    (dict(spec=AttentionSpec(backend="triton")), "backend 'triton' asked"),
])
def test_inline_choice_refusals(case, expect):
    q = torch.randn(1, 2, 8, 16)
    spec = case.get("spec", AttentionSpec())
    ok, why = dispatch.inline_choice(spec, q, q, q, None, case.get("dropout_p", 0.0))
    assert not ok and expect in why, why


def test_inline_choice_on_cpu_and_as_asked():
    q = torch.randn(1, 2, 8, 16)
    assert dispatch.inline_choice(AttentionSpec(), q, q, q)[0]
    assert dispatch.inline_choice(AttentionSpec(backend="sdpa"), q, q, q) == (True, "sdpa (as asked)")
    # a value head dim SDPA cannot take (a folded site)
    assert not dispatch.inline_choice(AttentionSpec(), q, q, torch.randn(1, 2, 8, 32))[0]


def test_symbolic_sizes_are_chosen_at_their_hints(inline_gpu, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    seen = []
    monkeypatch.setattr(dispatch, "_inline_times", lambda *a: seen.append(a[6]) or {"sdpa": 1.0, "triton": 2.0})
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dyn = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    q = mode.from_tensor(torch.empty(3, 4, 200, 64, dtype=torch.float16), symbolic_context=dyn)
    assert not isinstance(q.shape[2], int)
    ok, why = dispatch.inline_choice(AttentionSpec(), q, q, q, mode="max-autotune")
    assert ok and seen == [(3, 4, 200, 64, 4, 200, 64)], (why, seen)


def test_under_cuda_graphs_the_choice_compares_device_time(inline_gpu, monkeypatch):
    """A graph replayed as a CUDA graph (``mode="reduce-overhead"``) issues no host work between
    kernels: its sites are chosen by device time, measured and stored apart from the per-call
    choice of the same bucket, which stays as it was."""
    calls = []

    def inline_times(spec, q, k, v, preds, attn_mask, sizes, device_only=False):
        calls.append(device_only)
        # the op's host path makes it slower per call; its kernel alone is the faster one
        return {"sdpa": 0.045, "triton": 0.035} if device_only else {"sdpa": 0.05, "triton": 0.1}

    monkeypatch.setattr(dispatch, "_inline_times", inline_times)
    spec = AttentionSpec()
    q = torch.empty(8, 16, 512, 64, dtype=torch.bfloat16)
    ok, why = dispatch.inline_choice(spec, q, q, q, mode="max-autotune")
    assert ok and "measured faster per call than" in why and calls == [False], why
    ok, why = dispatch.inline_choice(spec, q, q, q, mode="max-autotune", device_only=True)
    assert not ok and "per call on the device (CUDA graphs)" in why and calls == [False, True], why
    # both stored: neither is measured again, and each keeps its own answer
    assert dispatch.inline_choice(spec, q, q, q, mode="max-autotune")[0]
    assert not dispatch.inline_choice(spec, q, q, q, mode="max-autotune", device_only=True)[0]
    assert calls == [False, True]


@pytest.mark.sample(2)
@pytest.mark.parametrize("mode,graphs", [(None, False), ("default", False), ("reduce-overhead", True)])
def test_the_compile_mode_reaches_the_choice(mode, graphs, monkeypatch):
    seen = []
    real = dispatch.inline_choice

    def spy(*a, device_only=False, **kw):
        seen.append((device_only, kw.get("mode")))
        return real(*a, device_only=device_only, **kw)

    monkeypatch.setattr(dispatch, "inline_choice", spy)
    torch.manual_seed(0)
    fast = attncomp.compile(ZOO["gpt2"].build().eval(), inductor=True, mode=mode)
    with torch.no_grad():
        fast(**text(1, 8, side="right"))
    assert seen and set(seen) == {(graphs, mode)}


def _site_graph(n: int = 512, d: int = 64, dtype=torch.bfloat16):
    """One ``attncomp::attention`` site on (fake-GPU-shaped) example values, as the pass sees it."""
    import operator

    import torch.fx as fx

    g = fx.Graph()
    args = [None] * (ops.ARG_INDEX["seed"] + 1)
    for name in ("q", "k", "v"):
        node = args[ops.ARG_INDEX[name]] = g.placeholder(name)
        node.meta["val"] = torch.empty(2, 8, n, d, dtype=dtype)
    args[ops.ARG_INDEX["spec"]] = AttentionSpec(causal=True).to_json()
    args[ops.ARG_INDEX["dropout_p"]], args[ops.ARG_INDEX["seed"]] = 0.0, 0
    site = g.call_function(torch.ops.attncomp.attention.default, tuple(args))
    g.output(g.call_function(operator.getitem, (site, 0)))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune"])
def test_the_pass_measures_only_under_max_autotune(inline_gpu, monkeypatch, mode):
    """The pass asks the runtime and times nothing itself; the runtime times SDPA traced against the op
    only for a compile with ``mode="max-autotune"``, once per bucket."""
    from attncomp.passes.base import CompileContext
    from attncomp.passes.inline_sdpa import inline_sdpa

    timed = []

    def inline_times(spec, q, k, v, preds, attn_mask, sizes, device_only=False):
        if mode != "max-autotune":
            raise AssertionError("timed kernels outside max-autotune")
        timed.append(sizes)
        return {"sdpa": 2.0, "triton": 1.0}

    monkeypatch.setattr(dispatch, "_inline_times", inline_times)
    for _ in range(2):
        ctx = CompileContext(mode=mode, cuda_graphs=mode == "reduce-overhead")
        res = inline_sdpa(_site_graph(), ctx)
        detail = ctx.sites[0].details["inline_sdpa"]
        if mode == "max-autotune":
            assert not res.modified and "the op on Triton measured faster per call" in detail, detail
        else:
            assert res.modified and "the default rule" in detail, detail
    assert timed == ([(2, 8, 512, 64, 8, 512, 64)] if mode == "max-autotune" else [])


@pytest.fixture
def synthetic_table(tmp_path, monkeypatch):
    """A synthetic table ``h100.json`` where the shipped tables are looked for, and q's GPU an H100."""
    from attncomp.runtime import choice_tables

    key = dispatch.dense_choice_key(512, 512, 64, torch.bfloat16, "causal", "sm_90")
    table = {"dense_kernel_choice": [
                 {"key": dict(key, nq=1024, nk=1024), "best": "sdpa", "timings": {"sdpa": 1.0, "triton": 2.0},
                  "row": "synthetic 1024"},
                 {"key": dict(key, nq=2048, nk=2048), "best": "triton", "timings": {"sdpa": 2.0, "triton": 1.0},
                  "row": "synthetic 2048"}],
             "dense_inline_choice": [
                 {"key": key, "best": "triton", "timings": {"sdpa": 0.5, "triton": 0.25}, "row": "synthetic 512"},
                 {"key": dict(key, cuda_graphs=True), "best": "sdpa", "timings": {"sdpa": 0.2, "triton": 0.25},
                  "row": "synthetic 512, device time"}]}
    (tmp_path / "h100.json").write_text(json.dumps(table))
    monkeypatch.setattr(choice_tables, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(dispatch, "_gpu_name", lambda q: "NVIDIA H100 80GB HBM3")
    choice_tables.clear()
    yield
    choice_tables.clear()


def test_the_table_shipped_for_the_gpu_decides_what_nothing_measured(inline_gpu, synthetic_table, monkeypatch):
    monkeypatch.setattr(dispatch, "_inline_times", _no_timing)
    spec = AttentionSpec(causal=True)

    def choice(n, **kw):
        q = torch.empty(2, 8, n, 64, dtype=torch.bfloat16)
        return dispatch.inline_choice(spec, q, q, q, **kw)

    ok, why = choice(512)
    assert not ok and "in the table shipped for this GPU (sdpa 0.5 ms, triton 0.25 ms; synthetic 512)" in why, why
    ok, why = choice(512, device_only=True)
    assert ok and "faster per call on the device (CUDA graphs)" in why and "synthetic 512, device time" in why, why
    ok, why = choice(1024)
    assert ok and "SDPA's kernel faster than Triton's" in why and "synthetic 1024" in why, why
    ok, why = choice(2048)
    assert not ok and "Triton's kernel faster than SDPA's" in why, why
    ok, why = choice(4096)                                   # no entry: the default rule
    assert ok and why.startswith("the default rule"), why
    # the store comes first: a measurement of this machine outranks the table
    key = dispatch.dense_choice_key(512, 512, 64, torch.bfloat16, "causal", "sm_90")
    autotune.record(dispatch.INLINE_CHOICE, key, {"best": "sdpa", "timings": {"sdpa": 0.1, "triton": 0.2}})
    ok, why = choice(512)
    assert ok and "measured faster per call" in why and "table" not in why, why
    # a GPU without a table: the default rule
    monkeypatch.setattr(dispatch, "_gpu_name", lambda q: "NVIDIA A100-SXM4-80GB")
    ok, why = choice(1024)
    assert ok and why.startswith("the default rule"), why


def test_shipped_tables_are_the_measured_rows(tmp_path):
    """The tables shipped for H100 and H200 are what :func:`choice_tables.build` makes of the kernel
    benchmark's results, and a real key reads its measured row."""
    from pathlib import Path

    from attncomp.runtime import choice_tables

    assert choice_tables.table_name("NVIDIA H100 80GB HBM3") == "h100"
    assert choice_tables.table_name("NVIDIA H200") == "h200"
    assert choice_tables.table_name("NVIDIA A100-SXM4-80GB") is None
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    gpus = ["h100", "h200"]
    missing = [g for g in gpus if not (results / f"kernels_{g}.json").exists()]
    assert not missing, f"the kernel benchmark's results the shipped tables come from are gone: {missing}"
    choice_tables.build(str(results), str(tmp_path))
    for gpu in gpus:
        built = json.loads((tmp_path / f"{gpu}.json").read_text())
        shipped = json.loads((choice_tables.TABLES_DIR / f"{gpu}.json").read_text())
        assert built == shipped, f"attncomp/runtime/tables/{gpu}.json differs from the results: rebuild it"
        assert built["dense_kernel_choice"] and built["dense_inline_choice"]
    key = dispatch.dense_choice_key(4096, 4096, 64, torch.bfloat16, "causal", "sm_90")
    choice_tables.clear()
    hit = choice_tables.lookup(dispatch.DENSE_CHOICE, key, "NVIDIA H100 80GB HBM3")
    assert hit["timings"] == {"sdpa": 1.2889, "triton": 1.3321} and hit["best"] == "sdpa"
    assert "kernels_h100.json: dense fwd+bwd B=4 H=16 D=64 N=4096 causal=True" in hit["row"]
    assert choice_tables.lookup(dispatch.DENSE_CHOICE, dict(key, dtype="float16"), "NVIDIA H100 80GB HBM3") is None


# -- what a traced CUDA site computes, run on the CPU -----------------------------------------------



@pytest.mark.parametrize("kind", KINDS)
def test_public_sdpa_path_equals_the_reference_forward_and_backward(kind, monkeypatch):
    """A traced CUDA site without ``lse`` runs ``scaled_dot_product_attention`` itself (torch picks the
    kernel, cuDNN's with a mask on Hopper): the causal bound folded into the mask where both are
    present, rows with no allowed key given a finite mask and a zero output. The same code on the
    CPU, float64, against the reference: outputs and gradients, with no NaN from the empty rows."""
    from attncomp.codegen import sdpa

    seed = fresh_seed()
    g, q, k, v = _inputs(seed)
    kw = _pred_kw(kind, g, 2, 13, 21, torch.float64)
    spec = AttentionSpec(causal=kw.pop("is_causal", False), causal_align=kw.pop("causal_align", "top_left"),
                         window_left=kw.get("window", (None, None))[0], window_right=kw.pop("window", (None, None))[1])
    mask = kw.pop("attn_mask", None)
    if mask is not None:
        mask = mask.detach()                     # (a mask that requires grad keeps the op)
    preds = Predicates(*(kw.get(n) for n in Predicates._fields))
    preds = preds if preds.any() else None
    masks = []
    real = torch.nn.functional.scaled_dot_product_attention

    def seen(*a, attn_mask=None, **kw):
        masks.append(attn_mask)
        return real(*a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", seen)
    out = sdpa._public_forward(spec, q, k, v, sdpa._public_plan(spec, q, k, mask, preds))
    # every row of the mask allows something: the CUDA kernels give NaN for a row that allows nothing
    assert masks[0] is None or bool((masks[0] > float("-inf")).any(-1).all())
    want = reference_attention(q, k, v, mask, spec=spec, preds=preds)[0]
    msg = f"{kind} seed={seed}"
    assert rel_err(out, want) < 1e-12, msg
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), go)
    exp = torch.autograd.grad(want, (q, k, v), go)
    for nm, a, b in zip(("dq", "dk", "dv"), got, exp):
        assert torch.isfinite(a).all(), f"{nm} {msg}"
        assert rel_err(a, b) < 1e-10, f"{nm} {msg}"


def test_mask_plans_are_shared_only_between_equal_values():
    """Sites share a mask plan where their masks are computed the same way from the same nodes;
    a random draw or an in-place call never counts as the same value twice."""
    import operator

    import torch.fx as fx

    from attncomp.passes.inline_sdpa import _structure

    g = fx.Graph()
    m = g.placeholder("mask")
    a = g.call_function(operator.getitem, (m, (slice(None), 0, 0, slice(None))))
    b = g.call_function(operator.getitem, (m, (slice(None), 0, 0, slice(None))))
    c = g.call_function(operator.getitem, (m, (slice(None), 0, 1, slice(None))))
    assert _structure(a) == _structure(b) != _structure(c)
    r1, r2 = (g.call_function(torch.rand_like, (m,)) for _ in range(2))
    assert _structure(r1) != _structure(r2)
    i1, i2 = (g.call_method("add_", (m, 1)) for _ in range(2))
    assert _structure(i1) != _structure(i2)
    d1, d2 = (g.call_function(torch.nn.functional.dropout, (m, 0.5)) for _ in range(2))
    assert _structure(d1) != _structure(d2)
    e1, e2 = (g.call_function(torch.gt, (x, 0)) for x in (r1, r1))
    assert _structure(e1) == _structure(e2)          # the same draw, compared twice: equal
