"""``backend="auto"``: keep-everything sites run SDPA's kernels (CPU: its flash kernel; CUDA: the
measured faster of SDPA and Triton), every other site the reference (or Triton on CUDA). Numerics of
the SDPA route against the reference for every predicate kind, forward and backward; the CUDA choice
tested on the CPU with injected timings."""

from __future__ import annotations

import pytest
import torch

from attncomp.codegen import get_backend
from attncomp.codegen import reference as R
from attncomp.functional import attention
from attncomp.policy import DFSS, ET, Dense, Drop, Hash
from attncomp.runtime import autotune, dispatch
from attncomp.spec import AttentionSpec, Predicates
from tests.utils import assert_close, fresh_seed

F64 = torch.float64



def _inputs(seed, B=2, Hq=4, Hk=2, Nq=13, Nk=21, D=16, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype).requires_grad_(True)  # noqa: E731
    return g, mk(B, Hq, Nq, D), mk(B, Hk, Nk, D), mk(B, Hk, Nk, D)


def _pred_kw(kind, g, B, Nq, Nk, dtype):
    """Keyword arguments of ``functional.attention`` for one predicate kind (empty rows planted)."""
    if kind == "none":
        return {}
    if kind == "causal":
        return dict(is_causal=True)
    if kind == "causal_bottom_right":
        return dict(is_causal=True, causal_align="bottom_right")
    if kind == "window":
        return dict(window=(3, 2))
    if kind == "sliding_causal":
        return dict(is_causal=True, window=(4, None), causal_align="bottom_right")
    if kind == "positions":
        return dict(is_causal=True, q_pos=torch.randint(0, Nk, (B, Nq), generator=g), k_pos=torch.arange(Nk)[None])
    if kind == "segments":
        qs = torch.sort(torch.randint(0, 3, (B, Nq), generator=g)).values
        qs[0, 0] = 7                                              # a query with no key in its segment
        return dict(q_seg=qs, k_seg=torch.sort(torch.randint(0, 3, (B, Nk), generator=g)).values)
    if kind == "padding":
        kv = torch.rand(B, Nk, generator=g) < 0.7
        kv[1] = False                                             # batch 1: no valid key
        return dict(k_valid=kv, q_valid=torch.rand(B, Nq, generator=g) < 0.8)
    if kind == "causal_bool_mask":
        m = torch.rand(Nq, Nk, generator=g) < 0.6
        m[0, 0] = False                                           # query 0's only causal key masked
        return dict(is_causal=True, attn_mask=m)
    if kind == "float_mask_padding":
        m = torch.randn(B, 1, Nq, Nk, generator=g, dtype=F64).to(dtype)
        m[0, 0, 2] = float("-inf")
        return dict(attn_mask=m.requires_grad_(True), k_valid=torch.rand(1, Nk, generator=g) < 0.8)
    raise AssertionError(kind)


KINDS = ("none", "causal", "causal_bottom_right", "window", "sliding_causal", "positions", "segments", "padding",
         "causal_bool_mask", "float_mask_padding")


@pytest.mark.parametrize("dtype", (F64, torch.float32), ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ("dense", "et"))
def test_auto_on_cpu_runs_sdpa_and_equals_reference(policy, kind, dtype):
    seed = fresh_seed()
    g, q, k, v = _inputs(seed, dtype=dtype)
    kw = _pred_kw(kind, g, 2, 13, 21, dtype)
    msg = f"{policy} {kind} {dtype} seed={seed}"
    preds = Predicates(*(kw.get(n) for n in Predicates._fields))
    spec = AttentionSpec(causal=kw.get("is_causal", False), policy=ET() if policy == "et" else Dense())
    assert dispatch.select_backend(spec, q, k, v, preds=preds, dropout_p=0.0).name == "sdpa", msg
    out = attention(q, k, v, policy=policy, enable_gqa=True, **kw)
    ref = attention(q, k, v, policy=policy, enable_gqa=True, backend="reference", **kw)
    assert_close(out, ref, dtype, msg=msg)
    go = torch.randn(out.shape, generator=g, dtype=F64).to(dtype)
    leaves = [t for t in (q, k, v, kw.get("attn_mask")) if t is not None and t.requires_grad]
    got = torch.autograd.grad(out, leaves, go)
    want = torch.autograd.grad(ref, leaves, go)
    for nm, a, b in zip(("dq", "dk", "dv", "dmask"), got, want):
        assert_close(a, b, dtype, msg=f"{nm} {msg}")


@pytest.mark.parametrize("kind", ("segments", "padding", "float_mask_padding", "causal_bool_mask"))
def test_sdpa_empty_rows_zero_and_lse_minus_inf(kind):
    seed = fresh_seed()
    g, q, k, v = _inputs(seed)
    kw = _pred_kw(kind, g, 2, 13, 21, F64)
    spec = AttentionSpec(causal=kw.pop("is_causal", False))
    mask = kw.pop("attn_mask", None)
    preds = Predicates(*(kw.get(n) for n in Predicates._fields))
    sd, ref = get_backend("sdpa"), get_backend("reference")
    args = (spec, q.detach(), k.detach(), v.detach(), None if mask is None else mask.detach(), None, None, None, 0.0, 0)
    out, lse = sd.forward(*args, preds=preds)
    rout, rlse = ref.forward(*args, preds=preds)
    empty = torch.isneginf(rlse)
    assert empty.any(), f"the case must plant empty rows (seed={seed})"
    assert torch.equal(torch.isneginf(lse), empty), f"seed={seed}"
    assert torch.all(out[empty] == 0) and not out.isnan().any()
    assert_close(out, rout, F64, msg=f"seed={seed}")
    assert_close(lse[~empty], rlse[~empty], F64, msg=f"seed={seed}")
    assert lse.dtype == F64 and out.is_contiguous()  # float64 inputs: a float64 lse, as the reference's


@pytest.mark.parametrize("spec", [AttentionSpec(policy=DFSS(1, 2)), AttentionSpec(policy=Hash()),
                                  AttentionSpec(policy=Drop(q_rate=0.0, k_rate=0.0)), AttentionSpec(dropout_p=0.1)],
                         ids=("dfss", "hash", "drop", "dense_dropout"))
def test_auto_on_cpu_keeps_reference_where_sdpa_differs(spec):
    """Policies that drop entries, and dropout (SDPA draws differently), stay on the reference."""
    q = torch.randn(1, 2, 8, 16)
    assert dispatch.select_backend(spec, q, q, q).name == "reference"
    if spec.dropout_p:
        assert dispatch.select_backend(spec, q, q, q, dropout_p=0.0).name == "sdpa"   # eval mode
    with pytest.raises(RuntimeError, match="cannot run this site"):
        dispatch.select_backend(spec.replace(backend="sdpa"), q, q, q)


def test_sdpa_refuses_value_head_dim_other_than_q():
    q = torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 40)
    assert dispatch.select_backend(AttentionSpec(), q, q, v).name == "reference"


def test_describe_choice():
    assert dispatch.describe_choice(AttentionSpec(), "cpu").startswith("sdpa")
    assert "reference" in dispatch.describe_choice(AttentionSpec(policy=DFSS()), "cpu")
    assert "dropout" in dispatch.describe_choice(AttentionSpec(dropout_p=0.1), "cpu")
    assert dispatch.describe_choice(AttentionSpec(backend="reference"), "cpu") == "reference (as asked)"


# -- CUDA: SDPA against Triton, measured once per shape bucket (fake GPU, injected timings) -----

class FakeBackend:
    def __init__(self, name, ok=True):
        self.name, self.ok = name, ok

    def supports(self, spec, q, preds=None):
        return None if self.ok else "not this one"


@pytest.fixture
def fake_gpu(monkeypatch):
    backends = {n: FakeBackend(n) for n in ("triton", "reference", "sdpa")}
    monkeypatch.setattr(dispatch, "_gpu_arch", lambda q: "sm_90")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "get_backend", lambda name: backends[name])
    timings = {"sdpa": 1.0, "triton": 2.0}
    calls = []

    def time_candidates(names, spec, q, k, v, attn_mask, preds):
        calls.append((tuple(names), q.shape[-2], k.shape[-2]))
        return {n: timings[n] for n in names}

    monkeypatch.setattr(dispatch, "_time_candidates", time_candidates)
    monkeypatch.setenv("ATTNCOMP_AUTOTUNE", "1")  # these tests measure; the default is tested below
    dispatch.clear_rule_cache()
    autotune.clear_memo()
    yield backends, timings, calls
    dispatch.clear_rule_cache()


def _qk(n, d=64, dtype=torch.float16, nk=None):
    return torch.empty(1, 4, n, d, dtype=dtype), torch.empty(1, 4, nk or n, d, dtype=dtype)


def test_cuda_measures_once_per_bucket_and_remembers(fake_gpu):
    backends, timings, calls = fake_gpu
    spec = AttentionSpec()
    q, k = _qk(1000)
    assert dispatch.select_backend(spec, q, k, k).name == "sdpa"
    assert len(calls) == 1
    q, k = _qk(1024)                                         # same pow2 bucket: no new measurement
    assert dispatch.select_backend(spec, q, k, k).name == "sdpa"
    assert len(calls) == 1
    timings.update(sdpa=5.0)
    q, k = _qk(3000)                                         # a new bucket measures again
    assert dispatch.select_backend(spec, q, k, k).name == "triton"
    assert len(calls) == 2
    # a new process (memo cleared) reads the stored winner from the autotune store
    dispatch.clear_rule_cache()
    autotune.clear_memo()
    assert dispatch.select_backend(spec, *_qk(900)[:1], _qk(900)[1]).name == "sdpa"
    assert len(calls) == 2


def test_no_first_call_measures_outside_max_autotune(fake_gpu, monkeypatch):
    """DESIGN §6: a process that compiled nothing with mode="max-autotune" (ATTNCOMP_AUTOTUNE unset) never
    times kernels: a bucket nothing measured takes SDPA; after a max-autotune compile it is measured."""
    from attncomp.runtime import env

    backends, timings, calls = fake_gpu
    monkeypatch.delenv("ATTNCOMP_AUTOTUNE")
    monkeypatch.setattr(env, "_MEASURING", [False])
    timings.update(sdpa=5.0, triton=1.0)                      # a measurement would pick triton
    q, k = _qk(700)
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "sdpa"
    assert calls == []
    monkeypatch.setenv("ATTNCOMP_AUTOTUNE", "0")
    env.allow_measuring()                                     # ATTNCOMP_AUTOTUNE=0 wins over the mode
    assert not env.measuring_allowed()
    monkeypatch.delenv("ATTNCOMP_AUTOTUNE")
    import attncomp

    attncomp.compile(torch.nn.Linear(2, 2), mode="max-autotune")  # what sets it in a real process
    assert env.measuring_allowed()
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"
    assert len(calls) == 1


def test_triton_configs_are_not_timed_outside_max_autotune(monkeypatch, tmp_path):
    """The Triton kernels' tile configuration: the default (first candidate) or a stored choice, never a
    timing, unless measuring is allowed."""
    from attncomp.codegen.triton import configs
    from attncomp.runtime import env

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("ATTNCOMP_AUTOTUNE", raising=False)
    monkeypatch.setattr(env, "_MEASURING", [False])
    autotune.clear_memo()
    cands = [{"BLOCK_M": 64}, {"BLOCK_M": 128}]
    timed = []

    def bench(cfg):
        timed.append(cfg)
        return 1.0 if cfg["BLOCK_M"] == 128 else 2.0

    assert configs.choose("t.fwd", {"k": 1}, cands, bench) == cands[0] and timed == []
    monkeypatch.setenv("ATTNCOMP_AUTOTUNE", "1")
    assert configs.choose("t.fwd", {"k": 1}, cands, bench) == cands[1] and len(timed) == 2
    monkeypatch.delenv("ATTNCOMP_AUTOTUNE")                   # not measuring: the stored choice stands
    configs._chosen.clear()
    autotune.clear_memo()
    assert configs.choose("t.fwd", {"k": 1}, cands, bench) == cands[1] and len(timed) == 2


def test_cuda_choice_keyed_by_predicate_kind_dtype_and_head_dim(fake_gpu):
    backends, timings, calls = fake_gpu
    q, k = _qk(512)
    dispatch.select_backend(AttentionSpec(), q, k, k)
    dispatch.select_backend(AttentionSpec(causal=True), q, k, k)
    dispatch.select_backend(AttentionSpec(causal=True), q, k, k, preds=Predicates(k_valid=torch.ones(1, 512).bool()))
    dispatch.select_backend(AttentionSpec(window_left=64), q, k, k)
    dispatch.select_backend(AttentionSpec(), *_qk(512, dtype=torch.bfloat16), k.bfloat16())
    dispatch.select_backend(AttentionSpec(), *_qk(512, d=128), _qk(512, d=128)[1])
    assert len(calls) == 6                                   # none, causal, causal+mask, mask, bf16, D=128
    dispatch.select_backend(AttentionSpec(window_left=8), q, k, k, preds=Predicates(k_valid=torch.ones(1, 512).bool()))
    assert len(calls) == 6                                   # window + padding: the "mask" bucket again
    kinds = {dispatch.predicate_kind(AttentionSpec(causal=True), None, 4, 4),
             dispatch.predicate_kind(AttentionSpec(causal=True, causal_align="bottom_right"), None, 4, 8),
             dispatch.predicate_kind(AttentionSpec(), None, 4, 4)}
    assert kinds == {"causal", "mask", "none"}


def test_cuda_only_runnable_candidates_compete(fake_gpu):
    backends, timings, calls = fake_gpu
    backends["triton"].ok = False                            # e.g. predicates not supported yet
    q, k = _qk(256)
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "sdpa"
    assert calls == []                                       # nothing to measure
    backends["triton"].ok, backends["sdpa"].ok = True, False
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"
    # dropout, or a policy that drops entries: the Triton / sequence-length rule, never SDPA
    backends["sdpa"].ok = True
    assert dispatch.select_backend(AttentionSpec(), q, k, k, dropout_p=0.1).name == "triton"
    assert dispatch.select_backend(AttentionSpec(policy=DFSS(2, 4)), q, k, k).name == "triton"
    assert calls == []


def test_record_and_read_dense_choice():
    key = dispatch.dense_choice_key(1000, 1000, 64, torch.float16, "causal", "sm_90")
    assert key["nq"] == 1024 and key["kind"] == "causal"
    assert dispatch.dense_choice(key) is None
    assert dispatch.record_dense_choice(key, {"sdpa": 0.5, "triton": 0.4}) == "triton"
    dispatch.clear_rule_cache()
    autotune.clear_memo()
    assert dispatch.dense_choice(key) == "triton"
    with pytest.raises(ValueError):
        dispatch.record_dense_choice(key, {})


@pytest.mark.parametrize("state", ["capturing", "sync_debug"])
def test_cuda_choice_never_measures_during_capture_or_sync_debug(fake_gpu, monkeypatch, state):
    """Timing synchronises: under CUDA graph capture or a sync debug mode the call takes the stored
    winner, else SDPA (the static default), measures nothing and remembers nothing."""
    backends, timings, calls = fake_gpu
    capturing = {"on": state == "capturing"}
    debug = {"on": state == "sync_debug"}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 2 if debug["on"] else 0)
    timings.update(sdpa=5.0, triton=1.0)                      # triton would win a measurement
    q, k = _qk(700)
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "sdpa"
    assert calls == []
    backends["sdpa"].ok = False                               # SDPA cannot run it: the one that can
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"
    assert calls == []
    backends["sdpa"].ok = True
    capturing["on"] = debug["on"] = False                     # allowed again: measures once, remembers
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"
    assert len(calls) == 1
    capturing["on"], debug["on"] = state == "capturing", state == "sync_debug"
    timings.update(sdpa=0.1)
    assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"  # the stored winner
    assert len(calls) == 1


def test_cuda_choice_is_memoised_per_call_signature(fake_gpu, monkeypatch):
    """The per-call choice is computed once per spec, sizes, head counts, mask and predicates present;
    a provisional choice (timing not allowed now) is not kept."""
    from attncomp.spec import Predicates

    backends, timings, calls = fake_gpu
    seen = []
    real = dispatch._auto_explained
    monkeypatch.setattr(dispatch, "_auto_explained", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    spec = AttentionSpec()
    q, k = _qk(512)
    for _ in range(3):
        assert dispatch.select_backend(spec, q, k, k).name == "sdpa"
    assert len(seen) == 1 and len(calls) == 1
    m = torch.ones(1, 1, 512, 512, dtype=torch.bool)
    dispatch.select_backend(spec, q, k, k, attn_mask=m)
    dispatch.select_backend(spec, q, k, k, attn_mask=m)
    assert len(seen) == 2
    kv = torch.ones(1, 512, dtype=torch.bool)
    dispatch.select_backend(spec, q, k, k, preds=Predicates(k_valid=kv))
    assert len(seen) == 3
    k2 = torch.empty(1, 2, 512, 64, dtype=torch.float16)     # GQA: another head count
    dispatch.select_backend(spec, q, k2, k2)
    assert len(seen) == 4
    measured = len(calls)                                    # (a mask or predicates: other buckets)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    q3, k3 = _qk(5000)                                       # a new bucket while capturing: provisional
    dispatch.select_backend(spec, q3, k3, k3)
    dispatch.select_backend(spec, q3, k3, k3)
    assert len(seen) == 6 and len(calls) == measured


def test_cuda_choice_reads_the_table_shipped_for_the_gpu_before_measuring(fake_gpu, tmp_path, monkeypatch):
    """With nothing in the autotune store, a keep-everything CUDA call takes the winner of the table
    shipped for its GPU model and measures nothing; a bucket the table lacks is measured as before."""
    import json

    from attncomp.runtime import choice_tables

    backends, timings, calls = fake_gpu
    timings.update(sdpa=5.0, triton=1.0)                      # a measurement would pick triton
    key = dispatch.dense_choice_key(1000, 1000, 64, torch.float16, "none", "sm_90")
    (tmp_path / "h100.json").write_text(json.dumps({"dense_kernel_choice": [
        {"key": key, "best": "sdpa", "timings": {"sdpa": 1.0, "triton": 2.0}, "row": "synthetic 1024"}]}))
    monkeypatch.setattr(choice_tables, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(dispatch, "_gpu_name", lambda q: "NVIDIA H100 80GB HBM3")
    choice_tables.clear()
    try:
        q, k = _qk(1000)
        assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "sdpa"
        assert calls == []
        q, k = _qk(3000)                                      # not in the table: measured
        assert dispatch.select_backend(AttentionSpec(), q, k, k).name == "triton"
        assert len(calls) == 1
    finally:
        choice_tables.clear()
