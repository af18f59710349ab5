"""The kernel template on a CUDA GPU (compiled kernels): the policy x predicate matrix of the interpreter
tests at realistic sizes in bf16/fp16/fp32, and the FlashAttention-style odd-shape matrix.

Run in a process of its own (``pytest -m gpu tests/codegen/test_template_gpu.py``): a module that
sets ``TRITON_INTERPRET=1`` makes every Triton kernel of its process interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

from attncomp.codegen import reference as R
from attncomp.spec import AttentionSpec, dtype_name
from tests.codegen.template_cases import CASES, close, given_buckets_case, make_mask, make_policy, make_preds, make_qkv
from tests.utils import fresh_seed, poisoned_empty

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels", allow_module_level=True)

# per dtype (atol, rtol) against a float64 reference, gradients scaled by their largest magnitude
_TOL = {torch.float32: (5e-3, 5e-3), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    pytest.importorskip("triton")
    from attncomp.codegen.triton import backend as TB

    monkeypatch.setenv("ATTNCOMP_TRITON_TUNE", "0")
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    return TB


def _close(name, a, b, dtype, grad=False):
    close(name, a, b, _TOL[dtype], grad)


def _inputs(policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(policy, g, B, Hq, Hk, Nq, Nk, D, torch.float32)
    fields, preds = make_preds(kinds, g, B, Nq, Nk)
    mask = make_mask(mask_kind, g, B, Hq, Nq, Nk)
    pol, qa, ka, bp = make_policy(policy, g, B, Hq, Hk, Nq, Nk)
    dev = "cuda"
    q, k, v = (x.to(dev, dtype) for x in (q, k, v))
    to = (lambda t: None if t is None else t.to(dev))
    mask, qa, ka, bp = to(mask), to(qa), to(ka), to(bp)
    preds = preds._replace(**{f: to(getattr(preds, f)) for f in preds._fields})
    spec = AttentionSpec(mask_kind=mask_kind, dtype=dtype_name(dtype), policy=pol, **fields)
    go = torch.randn(B, Hq, Nq, D, generator=g).to(dev, dtype)
    return spec, q, k, v, mask, qa, ka, bp, preds, go


def _run(TB, policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, dtype, dropout_p=0.0, seed=0):
    spec, q, k, v, mask, qa, ka, bp, preds, go = _inputs(policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, dtype, seed)
    be = TB.TritonBackend()
    out, lse = be.forward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, preds=preds)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    args = dict(spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, dropout_p=dropout_p, seed=seed, preds=preds)
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, **args)
    _close("out", out, ro, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    dq, dk, dv, _ = be.backward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, out, lse, go, preds=preds)
    rq, rk, rv, _ = R.attention_backward(q.double(), k.double(), v.double(), m64, go.double(), **args)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _close(name, a, b, dtype, grad=True)


def _scaled(case, dtype):
    """The interpreter case at GPU size: lengths x 9 (still odd), the given dtype."""
    policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, _ = case
    return policy, kinds, mask_kind, B, Hq, Hk, Nq * 9, Nk * 9, D, dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join([c[0], "+".join(c[1]) or "nopred", c[2], f"D{c[8]}"]))
def test_policy_x_predicates_on_gpu(_setup, case, dtype):
    _run(_setup, *_scaled(case, dtype))


# FlashAttention's odd-shape matrix (seqlen pairs x head dims), causal and not, bf16
_FA_SHAPES = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
              (1024, 1023), (2048, 2048)]
_FA_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_dim", [(s, _FA_DIMS[i % len(_FA_DIMS)]) for i, s in enumerate(_FA_SHAPES)],
                         ids=lambda p: f"{p[0][0]}x{p[0][1]}-D{p[1]}")
def test_flash_attention_odd_shapes(_setup, shape_dim, causal):
    (nq, nk), d = shape_dim
    kinds = ("bottom_right",) if causal else ()
    _run(_setup, "dense", kinds, "none", 2, 4, 2, nq, nk, d, torch.bfloat16)


# every Hopper candidate (TMA descriptors) of the tuning store, forced
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kinds", [(), ("causal",), ("window", "k_valid")], ids=["full", "causal", "window"])
def test_hopper_candidates(_setup, monkeypatch, D, kinds):
    from attncomp.codegen.triton import configs

    TB = _setup
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need a Hopper GPU")
    cands = [c for c in configs.fwd_candidates(D, D, torch.bfloat16, 1) if c.get("TMA")]
    bwd = [c for c in configs.bwd_candidates(D, D, torch.bfloat16, 1) if c.get("TMA")]
    assert cands and bwd
    for i, fwd_cfg in enumerate(cands):
        real_fwd = TB.attention_forward
        monkeypatch.setattr(TB, "attention_forward",
                            lambda *a, _f=real_fwd, _c=fwd_cfg, **kw: _f(*a, **{**kw, "config": _c}))
        real_bwd = TB.attention_backward
        monkeypatch.setattr(TB, "attention_backward",
                            lambda *a, _f=real_bwd, _c=bwd[min(i, len(bwd) - 1)], **kw: _f(*a, **{**kw, "config": _c}))
        try:
            _run(TB, "dense", kinds, "none", 2, 4, 2, 1000, 1000, D, torch.bfloat16, seed=D)
        finally:
            monkeypatch.setattr(TB, "attention_forward", real_fwd)
            monkeypatch.setattr(TB, "attention_backward", real_bwd)


# every one-launch backward candidate (dQ by float32 atomics or TMA bulk reductions in the dK/dV pass) of
# the tuning store, forced; ``hash`` (a sorted layout) declines the TMA form for the element atomics
# (D=64 only for DFSS and for the TMA form: at D=128 neither is a candidate, see configs)
@pytest.mark.parametrize("policy,kinds,D", [
    ("dense", (), 64), ("dense", ("causal",), 64), ("dense", ("window", "k_valid"), 64), ("hash", ("causal",), 64),
    ("dfss", ("causal",), 64), ("dfss", ("window", "k_valid"), 64),
    ("dense", (), 128), ("dense", ("causal",), 128), ("dense", ("window", "k_valid"), 128), ("hash", ("causal",), 128),
], ids=lambda x: ("+".join(x) or "full") if isinstance(x, tuple) else str(x))
def test_atomic_dq_candidates(_setup, monkeypatch, D, policy, kinds):
    from attncomp.codegen.triton import configs

    TB = _setup
    nm = 4 if policy == "dfss" else 1
    bwd = [c for c in configs.bwd_candidates(D, D, torch.bfloat16, nm) if c.get("DQ_ATOMIC")]
    assert bwd and (D != 64 or any(c["DQ_ATOMIC"] == 2 for c in bwd))
    for cfg in bwd:
        real_bwd = TB.attention_backward
        monkeypatch.setattr(TB, "attention_backward",
                            lambda *a, _f=real_bwd, _c=cfg, **kw: _f(*a, **{**kw, "config": _c}))
        try:
            _run(TB, policy, kinds, "none", 2, 4, 2, 1000, 1000, D, torch.bfloat16, seed=D)
        finally:
            monkeypatch.setattr(TB, "attention_backward", real_bwd)


# the short launch path (launch.FastLaunch) against Triton's own JITFunction.run: the same kernels, so
# bit-identical results, for every policy; calls after the first of an argument class take it
@pytest.mark.parametrize("policy,kinds,mask_kind", [
    ("dense", ("causal",), "none"), ("dense", ("window", "k_valid"), "bool"), ("dense", ("k_valid",), "float"),
    ("dfss", ("causal",), "none"),
    ("hash", ("causal",), "none"), ("drop", ("segments",), "none"), ("spion", ("causal",), "float")],
    ids=lambda p: p if isinstance(p, str) else "+".join(p))
def test_short_launches_equal_jit_launches(_setup, policy, kinds, mask_kind):
    from attncomp.codegen.triton import launch

    TB = _setup
    be = TB.TritonBackend()
    for seed in (1, 2):
        spec, q, k, v, mask, qa, ka, bp, preds, go = _inputs(policy, kinds, mask_kind, 2, 4, 2, 300, 300, 64,
                                                             torch.bfloat16, seed)
        res = []
        # Triton's run; the first call of the class; a repeat (which builds a dense/DFSS forward's plan);
        # for dense/DFSS a plan launch (null pointers for what the forward does not read, addresses)
        for short in (False, True, True, True):
            launch.enabled(short)
            try:
                hits = TB._attention_kernel.hits
                out, lse = be.forward(spec, q, k, v, mask, qa, ka, bp, 0.1, seed, preds=preds)
                grads = be.backward(spec, q, k, v, mask, qa, ka, bp, 0.1, seed, out, lse, go, preds=preds)[:3]
                res.append((out, lse) + tuple(grads))
            finally:
                launch.enabled(True)
        assert TB._attention_kernel.hits > hits, "a repeated call did not take the short path"
        if policy in ("dense", "dfss") and preds.q_pos is None and preds.k_pos is None:  # positions: no plan
            assert any(p.spec is spec for p in TB._PLANS.values()), "no launch plan was built"
        for r in res[1:]:
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res[0], r):
                assert torch.equal(a, b), f"{name} differs between the short and the JIT launch path"


# score modifiers (DESIGN §4.2) in the template, forward and backward, at GPU sizes: (policy, predicates,
# residual mask, modifiers); the gradients of the slopes, table and sinks too
_MOD_CASES = [
    ("dense", ("causal",), "none", ("alibi",)),
    ("dense", ("bottom_right", "k_valid"), "float", ("rel", "softcap")),
    ("dense", ("window", "segments"), "none", ("alibi", "rel", "softcap", "sinks")),
    ("dfss", ("causal",), "none", ("softcap", "sinks")),
    ("hash", ("causal", "k_valid"), "none", ("alibi", "rel")),
    ("drop", ("bottom_right",), "none", ("rel", "sinks")),
    ("spion", ("window", "k_valid"), "bool", ("alibi", "softcap")),
]


def _mods(names, g, Hq, dev):
    """``(spec fields, Modifiers)`` with random slopes, table (8 buckets, a max distance below the lengths),
    cap and sinks (as the interpreter tests' ``make_mods``)."""
    from attncomp.spec import Modifiers

    fields, slopes, table, sinks = {}, None, None, None
    if "alibi" in names:
        fields["alibi"] = True
        slopes = (torch.rand(Hq, generator=g) * 0.1).to(dev)
    if "rel" in names:
        fields.update(rel_buckets=8, rel_max_distance=64)
        table = torch.randn(8, Hq, generator=g).to(dev)
    if "softcap" in names:
        fields["softcap"] = 6.0
    if "sinks" in names:
        fields["sinks"] = True
        sinks = torch.randn(Hq, generator=g).to(dev)
    return fields, Modifiers(slopes, table, sinks)


def _run_mods(TB, policy, kinds, mask_kind, names, B, Hq, Hk, Nq, Nk, D, dtype, seed=0, be=None):
    from attncomp.spec import Modifiers

    spec, q, k, v, mask, qa, ka, bp, preds, go = _inputs(policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, dtype, seed)
    fields, mods = _mods(names, torch.Generator().manual_seed(seed + 1), Hq, q.device)
    spec = spec.replace(**fields)
    be = be or TB.TritonBackend()
    out, lse = be.forward(spec, q, k, v, mask, qa, ka, bp, 0.0, seed, preds=preds, mods=mods)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    m64s = Modifiers(*(None if t is None else t.double() for t in mods))
    args = dict(spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, preds=preds, mods=m64s)
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, **args)
    _close("out", out, ro, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    _close("lse", lse[fin], rl[fin], torch.float32)
    got = be.backward(spec, q, k, v, mask, qa, ka, bp, 0.0, seed, out, lse, go, preds=preds, mods=mods)
    ref = R.attention_backward_mods(q.double(), k.double(), v.double(), m64, go.double(), **args)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        _close(name, a, b, dtype, grad=True)
    for name, a, b, t in zip(("dslopes", "dtable", "dsinks"), got[4], ref[4], mods):
        assert (a is None) == (t is None), name
        if t is not None:
            _close(name, a, b, dtype, grad=True)
    return spec, out, lse, got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("case", _MOD_CASES, ids=lambda c: "-".join([c[0], "+".join(c[1]), c[2], "+".join(c[3])]))
def test_modifiers_on_gpu(_setup, case, dtype):
    _run_mods(_setup, *case, 2, 4, 2, 333, 405, 64, dtype)


# decoding steps (the split-KV decode kernels, then the template's backward): policy, predicates, mask, modifiers,
# B, Hq, Hk, Nq, Nk, D
_DECODE_CASES = [
    ("dense", ("bottom_right",), "none", (), 4, 32, 8, 1, 4099, 128),
    ("dense", ("bottom_right", "k_valid"), "bool", ("alibi", "softcap", "sinks"), 2, 8, 2, 3, 3001, 64),
    ("dense", ("segments", "q_valid"), "none", (), 1, 16, 1, 2, 777, 256),
    ("dfss", ("bottom_right",), "none", (), 2, 8, 2, 1, 2050, 128),
    ("hash", ("bottom_right", "k_valid"), "none", ("rel",), 2, 8, 2, 1, 1999, 64),
    ("drop", ("bottom_right",), "none", ("sinks",), 2, 8, 1, 4, 2500, 128),
    ("spion", ("window",), "float", (), 1, 4, 2, 5, 1500, 64),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("case", _DECODE_CASES,
                         ids=lambda c: "-".join([c[0], "+".join(c[1]), c[2], "+".join(c[3]) or "nomod", f"Nq{c[7]}"]))
def test_decode_on_gpu(_setup, monkeypatch, case, dtype):
    """A decoding step runs the decode kernels (workspaces poisoned; ``hash`` with its buckets given, as a KV cache
    keeps them) and equals the reference, its backward too."""
    from attncomp.codegen.triton import decode as DEC

    monkeypatch.setattr(DEC, "_empty", poisoned_empty)
    calls = []
    real = DEC.decode_forward
    monkeypatch.setattr(DEC, "decode_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    policy, kinds, mask_kind, names, *sizes = case
    if names:
        _run_mods(_setup, *case, dtype)
    else:
        _run(_setup, policy, kinds, mask_kind, *sizes, dtype)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("B,Hq,Hk,Nq,Nk,D,preds", [(4, 32, 8, 1, 8193, 128, ("bottom_right",)),
                                                   (2, 8, 2, 3, 3001, 64, ("bottom_right", "k_valid"))],
                         ids=["llama-like", "k_valid"])
def test_decode_given_buckets_on_gpu(_setup, monkeypatch, B, Hq, Hk, Nq, Nk, D, preds, dtype):
    """``hash`` with the buckets a KV cache keeps: the route takes the decode kernels, which equal the reference and
    read only the keys in their group's buckets (the others' K and V rows are NaN), 16 buckets."""
    from attncomp.codegen.triton import decode as DEC

    monkeypatch.setattr(DEC, "_empty", poisoned_empty)
    calls = []
    real = DEC.decode_forward
    monkeypatch.setattr(DEC, "decode_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(fresh_seed())
    spec, q, k, v, pr, qa, ka, ro, rl = given_buckets_case(g, B, Hq, Hk, Nq, Nk, D, dtype, preds, n_buckets=16,
                                                           device="cuda")
    out, lse = _setup.attention_forward(spec, q, k, v, preds=pr, q_aux=qa, k_aux=ka)
    assert calls == [1]
    _close("out", out, ro, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))


@pytest.mark.parametrize("D", [64, 128])
def test_modifiers_with_atomic_dq_candidates(_setup, monkeypatch, D):
    """Every one-launch backward candidate (dQ added in the dK/dV pass) with all four modifiers, forced."""
    from attncomp.codegen.triton import configs

    TB = _setup
    bwd = [c for c in configs.bwd_candidates(D, D, torch.bfloat16, 1) if c.get("DQ_ATOMIC")]
    for cfg in bwd:
        real_bwd = TB.attention_backward
        monkeypatch.setattr(TB, "attention_backward",
                            lambda *a, _f=real_bwd, _c=cfg, **kw: _f(*a, **{**kw, "config": _c}))
        try:
            _run_mods(TB, "dense", ("causal",), "none", ("alibi", "rel", "softcap", "sinks"), 2, 4, 2, 700, 700, D,
                      torch.bfloat16, seed=D)
        finally:
            monkeypatch.setattr(TB, "attention_backward", real_bwd)


def test_modifiers_decline_gluon_and_repeat_with_new_values(_setup):
    """A dense causal site with modifiers runs the template (on sm_90 the Gluon kernel declines it, saying
    why); repeated calls (the short launch path) read each call's modifier tensors: new table and sink
    values give the new reference."""
    TB = _setup
    be = TB.TritonBackend()
    for seed in (1, 2, 3):
        _run_mods(TB, "dense", ("causal",), "none", ("rel", "sinks"), 2, 8, 8, 1024, 1024, 128, torch.bfloat16,
                  seed=seed, be=be)
        if torch.cuda.get_device_capability()[0] == 9:
            assert "score modifiers" in (TB.gluon_skipped.get("fwd") or ""), TB.gluon_skipped
            assert "score modifiers" in (TB.gluon_skipped.get("bwd") or ""), TB.gluon_skipped
