"""The SDPA backend (SDPA's CPU kernel with attncomp's contract) against the reference: every position
predicate, alignment, key/query padding with rows left without any allowed key, residual masks, GQA,
Nq != Nk; outputs and the log-sum-exp (``-inf`` exactly on the empty rows), float64."""

from __future__ import annotations

import itertools

import pytest
import torch

from attncomp.codegen import get_backend
from attncomp.policy import Dense
from attncomp.spec import AttentionSpec, Predicates
from tests.utils import assert_close

CASES = list(itertools.product([False, True], ["top_left", "bottom_right"], [None, 3], [False, True], [False, True],
                               [False, True], ["none", "bool", "float"]))


@pytest.mark.parametrize("causal,align,left,kvalid,qvalid,qpos,mask", CASES)
def test_sdpa_backend_equals_reference(causal, align, left, kvalid, qvalid, qpos, mask):
    ref, sd = get_backend("reference"), get_backend("sdpa")
    for nq, nk in ((7, 7), (3, 9), (1, 6)):
        B = 2
        q = torch.randn(B, 4, nq, 8, dtype=torch.float64)
        k, v = torch.randn(B, 2, nk, 8, dtype=torch.float64), torch.randn(B, 2, nk, 8, dtype=torch.float64)
        kv = (torch.rand(B, nk) > 0.4) if kvalid else None
        if kvalid:
            kv[0, :nk // 2] = False  # left padding: early rows of a causal site have no allowed key
        qv = (torch.rand(B, nq) > 0.3) if qvalid else None
        qp = torch.randint(0, nk, (B, nq)) if qpos else None
        am = None
        if mask == "bool":
            am = torch.rand(B, 1, nq, nk) > 0.3
            am[1, :, 0] = False
        elif mask == "float":
            am = torch.randn(B, 1, nq, nk, dtype=torch.float64)
            am[1, :, 0] = float("-inf")
        spec = AttentionSpec(causal=causal, causal_align=align, window_left=left, policy=Dense(), gqa_groups=2,
                             dtype="float64", head_dim=8, mask_kind=mask)
        preds = Predicates(qp, None, None, None, qv, kv)
        o1, l1 = ref.forward(spec, q, k, v, am, None, None, None, 0.0, 0, preds=preds)
        o2, l2 = sd.forward(spec, q, k, v, am, None, None, None, 0.0, 0, preds=preds)
        torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-10)
        assert torch.equal(torch.isneginf(l2), torch.isneginf(l1)), "rows without an allowed key differ"
        fin = ~torch.isneginf(l1)
        torch.testing.assert_close(l2[fin].double(), l1[fin].double(), rtol=1e-5, atol=1e-5)


def test_transposed_key_view():
    """A k given as a transposed view (head dim strided) is read as the tensor it is."""
    sd, ref = get_backend("sdpa"), get_backend("reference")
    q, v = (torch.randn(2, 3, 11, 16, dtype=torch.float64) for _ in range(2))
    k = torch.randn(2, 3, 16, 11, dtype=torch.float64).transpose(-1, -2)
    assert k.stride(-1) != 1
    spec = AttentionSpec(policy=Dense(), dtype="float64", head_dim=16)
    torch.testing.assert_close(sd.forward(spec, q, k, v, None, None, None, None, 0.0, 0)[0],
                               ref.forward(spec, q, k, v, None, None, None, None, 0.0, 0)[0])


@pytest.mark.parametrize("case", ["causal", "bottom_right", "bool mask", "float mask", "padding", "gqa", "transposed k"])
def test_the_op_keeps_the_sdpa_plan_its_calls_take(monkeypatch, case):
    """A repeated dense call that SDPA serves goes from the op to the kept plan (no backend selection),
    with fresh inputs each call that match the float64 reference: mask and predicate tensors are read
    per call, SDPA's flags kept only where the call brings neither."""
    from attncomp import ops
    from attncomp.codegen import reference as R

    monkeypatch.setattr(ops, "_CALLS", {})
    n = []
    real = ops._backend_for
    monkeypatch.setattr(ops, "_backend_for", lambda *a, **kw: n.append(1) or real(*a, **kw))
    nq, nk = (5, 9) if case == "bottom_right" else (9, 9)
    hk = 1 if case == "gqa" else 3
    mask_kind = {"bool mask": "bool", "float mask": "float"}.get(case, "none")
    spec = AttentionSpec(causal=case != "bool mask", causal_align="bottom_right" if case == "bottom_right" else "top_left",
                         mask_kind=mask_kind, gqa_groups=3 // hk, head_dim=16)
    sj = spec.to_json()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, (1,))))
    for call in range(4):
        # q, k, v as a model's projections give them: (B, N, H, D) viewed as (B, H, N, D)
        q = torch.randn(2, nq, 3, 16, generator=g).transpose(1, 2)
        k = torch.randn(2, nk, hk, 16, generator=g).transpose(1, 2)
        v = torch.randn(2, nk, hk, 16, generator=g).transpose(1, 2)
        if case == "transposed k":
            k = torch.randn(2, hk, 16, nk, generator=g).transpose(-1, -2)
        am = kv = None
        if mask_kind == "bool":
            am = torch.rand(2, 1, nq, nk, generator=g) > 0.3
        elif mask_kind == "float":
            am = torch.randn(2, 1, nq, nk, generator=g)
        if case == "padding":
            kv = torch.ones(2, nk, dtype=torch.bool)
            kv[call % 2, nk - 1 - call:] = False
        out, lse = torch.ops.attncomp.attention(q, k, v, am, None, None, None, None, None, None, None, None, kv,
                                                sj, 0.0, 0)
        d = torch.float64
        want, want_lse = R.attention(q.to(d), k.to(d), v.to(d), None if am is None else am.to(d) if am.is_floating_point()
                                     else am, spec=spec, preds=Predicates(k_valid=kv) if kv is not None else None)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5, msg=f"call {call}")
        torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-4, atol=1e-5)
        assert out.stride() == ops.output_strides(*out.shape)
    # call 1 selects and keeps the plan; calls 2-4 go through it
    assert len(n) == 1 and len(ops._CALLS) == 1
    assert type(next(iter(ops._CALLS.values()))).__name__ == "_Plan"


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [1, 2, 4])
def test_grouped_kv_heads_go_to_the_cpu_kernel_as_they_are(monkeypatch, causal, hk, mask):
    """On a CPU, k/v with fewer heads than q go to SDPA's CPU kernel without being repeated, forward
    and backward (dk/dv come with k's heads); first call and kept plan alike, fresh inputs each call,
    against the float64 reference with the heads repeated, a residual mask of each kind."""
    from attncomp import ops
    from attncomp.codegen import reference as R
    from attncomp.codegen import sdpa
    from tests.utils import fresh_generator

    monkeypatch.setattr(ops, "_CALLS", {})
    repeats = []
    monkeypatch.setattr(sdpa, "_expand", lambda x, h, _f=sdpa._expand: repeats.append(x.shape[1] != h) or _f(x, h))
    hq, nq, nk, d = 4, 13, 21, 32
    g = fresh_generator()
    spec = AttentionSpec(causal=causal, causal_align="bottom_right", gqa_groups=hq // hk, head_dim=d,
                         mask_kind=mask or "none", backend="sdpa")
    sj = spec.to_json()
    for call in range(3):
        q = torch.randn(2, nq, hq, d, generator=g).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(2, nk, hk, d, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
        m = None
        if mask == "bool":
            m = torch.rand(2, 1, nq, nk, generator=g) > 0.3
        elif mask == "float":
            m = torch.randn(1, hq, nq, nk, generator=g)
        out, lse = torch.ops.attncomp.attention(q, k, v, m, None, None, None, None, None, None, None, None, None,
                                                sj, 0.0, 0)
        go = torch.randn(out.shape, generator=g)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
        f = torch.float64
        qd, kd, vd = (t.detach().to(f) for t in (q, k, v))
        md = m.to(f) if mask == "float" else m
        want, want_lse = R.attention(qd, kd, vd, md, spec=spec)
        wq, wk, wv = R.attention_backward(qd, kd, vd, md, go.to(f), spec=spec)[:3]
        assert_close(out, want, torch.float32, f"call {call}")
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        torch.testing.assert_close(lse[fin].double(), want_lse[fin].double(), rtol=1e-4, atol=1e-4)
        for a, b in ((dq, wq), (dk, wk), (dv, wv)):
            assert a.shape == b.shape
            assert_close(a, b, torch.float32, f"call {call}")
    assert not any(repeats)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [1, 2, 8])
def test_grouped_kv_heads_run_flash_as_they_are_on_cuda(monkeypatch, causal, hk):
    """On CUDA, k/v with fewer heads than q go to FlashAttention without being repeated (no copy of k
    and v per call), first call and kept plan alike; outputs and lse match the float32 reference with
    the heads repeated, fresh inputs each call, N not a multiple of the kernel's block."""
    from attncomp import ops
    from attncomp.codegen import reference as R
    from attncomp.codegen import sdpa

    monkeypatch.setattr(ops, "_CALLS", {})
    repeats = []
    monkeypatch.setattr(sdpa, "_expand", lambda x, h, _f=sdpa._expand: repeats.append(x.shape[1] != h) or _f(x, h))
    hq, n, d = 8, 203, 64
    spec = AttentionSpec(causal=causal, gqa_groups=hq // hk, head_dim=d, dtype="bfloat16", backend="sdpa")
    sj = spec.to_json()
    for call in range(3):
        q = torch.randn(2, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(2, n, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        out, lse = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                                sj, 0.0, 0)
        want, want_lse = R.attention(q.float(), k.float(), v.float(), spec=spec.replace(dtype="float32"))
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2, msg=f"call {call}")
        torch.testing.assert_close(lse.float(), want_lse.float(), rtol=1e-3, atol=1e-3)
    assert sdpa._GROUPED[0] in (None, True) and (hk == hq or sdpa._GROUPED[0])
    assert not any(repeats)
