"""``hash``/``drop`` on the kernel template (sorted layouts) against the reference, on CPU through
Triton's interpreter.

Fresh random inputs every test, outputs poisoned with NaN before each call (every element must be
written), forward and gradients compared with ``attncomp/codegen/reference.py`` in float64.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch

pytest.importorskip("numpy")
pytest.importorskip("triton")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import schedule as S  # noqa: E402
from attncomp.policy import Drop, Hash  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402
from tests.utils import TOL, assert_close, poisoned_empty, qkv  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    monkeypatch.setattr(S, "_empty", poisoned_empty)  # tile summaries and lists


def _buckets(g, shape, nb, kind="uniform"):
    if kind == "uniform":
        return torch.randint(0, nb, shape, generator=g, dtype=torch.int32)
    if kind == "skewed":
        return (nb * torch.rand(shape, generator=g) ** 4).floor().to(torch.int32)
    if kind == "single":
        return torch.zeros(shape, dtype=torch.int32)
    if kind == "distinct":
        n = shape[-1]
        return torch.stack([torch.randperm(n, generator=g) for _ in range(shape[0] * shape[1])]).view(shape).int()
    raise AssertionError(kind)


def _check(spec, q, k, v, q_aux, k_aux, *, attn_mask=None, dropout_p=0.0, seed=0, grad=True, preds=None):
    out, lse = TB.TritonBackend().forward(spec, q, k, v, attn_mask, q_aux, k_aux, None, dropout_p, seed, preds=preds)
    d = torch.float64
    ref_out, ref_lse = R.attention(q.to(d), k.to(d), v.to(d), attn_mask, spec=spec, q_aux=q_aux, k_aux=k_aux,
                                   dropout_p=dropout_p, seed=seed, preds=preds)
    assert_close(out, ref_out, q.dtype, "out")
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without kept keys differ"
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin].double(), atol=1e-3, rtol=1e-3)
    if not grad:
        return out, lse
    go = torch.randn(out.shape, dtype=torch.float32).to(q.dtype)
    dq, dk, dv, dm = TB.TritonBackend().backward(spec, q, k, v, attn_mask, q_aux, k_aux, None, dropout_p, seed,
                                                 out, lse, go, preds=preds)
    assert dm is None
    rq, rk, rv, _ = R.attention_backward(q.to(d), k.to(d), v.to(d), attn_mask, go.to(d), spec=spec, q_aux=q_aux,
                                         k_aux=k_aux, dropout_p=dropout_p, seed=seed, preds=preds)
    # gradients sum many rounded products: compare relative to their own scale
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        atol, rtol = TOL[q.dtype]
        scale = max(1.0, b.abs().max().item())
        assert not torch.isnan(a).any(), f"NaN in {name}"
        torch.testing.assert_close(a.double(), b, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}\n{m}")
    return out, lse


# ---------------------------------------------------------------------------------------------
# hash


@pytest.mark.sample(1)
@pytest.mark.parametrize("draw", range(6))
def test_hash_forward_random_buckets(draw):
    """Every collision pattern of a bucket draw is computed exactly: 6 draws over bucket counts 2..64,
    skewed sizes, one bucket, all distinct; causal and not; odd lengths."""
    g = torch.Generator().manual_seed(draw)
    nb = [2, 4, 8, 16, 32, 64][draw % 6]
    kind = ["uniform", "skewed", "uniform", "single", "distinct"][draw % 5]
    N = 37 + 11 * (draw % 4)
    causal = draw % 2 == 0
    q, k, v = qkv(1, 2, N, 32)
    spec = AttentionSpec(causal=causal, policy=Hash(n_buckets=max(2, nb)))
    _check(spec, q, k, v, _buckets(g, (1, 2, N), nb, kind), _buckets(g, (1, 2, N), nb, kind), grad=False)


@pytest.mark.parametrize("causal,kind", [(True, "uniform"), (False, "skewed")])
def test_hash_gradients(causal, kind):
    g = torch.Generator().manual_seed(7)
    q, k, v = qkv(2, 2, 45, 32)
    spec = AttentionSpec(causal=causal, policy=Hash(n_buckets=4))
    _check(spec, q, k, v, _buckets(g, (2, 2, 45), 4, kind), _buckets(g, (2, 2, 45), 4, kind))


@pytest.mark.parametrize("dtype,D", [(torch.float16, 64), (torch.bfloat16, 256), (torch.float32, 80)])
def test_hash_half_precision_head_dims(dtype, D):
    g = torch.Generator().manual_seed(D)
    q, k, v = qkv(1, 2, 40, D, dtype=dtype)
    spec = AttentionSpec(causal=True, policy=Hash(n_buckets=2))
    _check(spec, q, k, v, _buckets(g, (1, 2, 40), 2), _buckets(g, (1, 2, 40), 2))


def test_hash_gqa_cross_attention_exclude_self():
    """Nq != Nk with separate bucket tensors; 4 query heads on 2 KV heads; no query attends to its own position."""
    g = torch.Generator().manual_seed(3)
    q, k, v = qkv(1, 4, 50, 32, Hk=2, Nk=33, Dv=16)
    spec = AttentionSpec(causal=True, policy=Hash(n_buckets=4, exclude_self=True))
    _check(spec, q, k, v, _buckets(g, (1, 4, 50), 3), _buckets(g, (1, 2, 33), 3))


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_hash_attn_mask_broadcast(mask_kind):
    g = torch.Generator().manual_seed(11)
    B, H, N = 2, 2, 40
    q, k, v = qkv(B, H, N, 32)
    if mask_kind == "bool":  # padding mask: (B, 1, 1, Nk)
        lens = torch.tensor([N, 29])
        mask = (torch.arange(N)[None, :] < lens[:, None])[:, None, None, :]
    else:  # additive bias (1, H, N, N) with some -inf
        mask = torch.randn(1, H, N, N, generator=g)
        mask[mask < -1.2] = float("-inf")
    spec = AttentionSpec(causal=False, mask_kind=mask_kind, policy=Hash(n_buckets=4))
    _check(spec, q, k, v, _buckets(g, (B, H, N), 3), _buckets(g, (B, H, N), 3), attn_mask=mask)


def test_hash_dropout_matches_reference_mask():
    g = torch.Generator().manual_seed(5)
    q, k, v = qkv(1, 2, 40, 32, Nk=36)
    spec = AttentionSpec(causal=True, dropout_p=0.3, policy=Hash(n_buckets=2))
    _check(spec, q, k, v, _buckets(g, (1, 2, 40), 2), _buckets(g, (1, 2, 36), 2), dropout_p=0.3, seed=987654321)


def test_hash_rows_without_keys_are_zero():
    """Queries whose bucket holds no key (and, under causality, no earlier key) give 0 and lse=-inf."""
    q, k, v = qkv(1, 1, 33, 32)
    qb = torch.zeros(1, 1, 33, dtype=torch.int32)
    qb[..., ::3] = 5  # bucket 5 has no key
    kb = torch.zeros(1, 1, 33, dtype=torch.int32)
    kb[..., :10] = 1  # bucket 0 starts at key 10: queries 0..9 of bucket 0 are stranded under causality
    spec = AttentionSpec(causal=True, policy=Hash(n_buckets=2))
    out, lse = _check(spec, q, k, v, qb, kb)
    assert (out[0, 0, ::3] == 0).all() and torch.isneginf(lse[0, 0, ::3]).all()
    assert (out[0, 0, 1:10] == 0).all()


# ---------------------------------------------------------------------------------------------
# drop


@pytest.mark.parametrize("rates,causal", [((0.5, 0.5), True), ((0.3, 0.7), False)])
def test_drop_forward_and_gradients(rates, causal):
    g = torch.Generator().manual_seed(int(rates[0] * 10 + rates[1] * 100))
    q, k, v = qkv(2, 2, 53, 32)
    q_keep = torch.rand(2, 2, 53, generator=g) >= rates[0]
    k_keep = torch.rand(2, 2, 53, generator=g) >= rates[1]
    spec = AttentionSpec(causal=causal, policy=Drop(q_rate=rates[0], k_rate=rates[1]))
    out, lse = _check(spec, q, k, v, q_keep, k_keep)
    assert (out[~q_keep] == 0).all() and torch.isneginf(lse[~q_keep]).all()


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 256), (torch.float16, 32)])
def test_drop_head_dims(dtype, D):
    g = torch.Generator().manual_seed(D)
    q, k, v = qkv(1, 2, 37, D, dtype=dtype)
    spec = AttentionSpec(causal=True, policy=Drop(q_rate=0.3, k_rate=0.3))
    _check(spec, q, k, v, torch.rand(1, 2, 37, generator=g) > 0.3, torch.rand(1, 2, 37, generator=g) > 0.3)


def test_drop_all_dropped_heads_and_stranded_queries():
    """A head with every query dropped, a head with every key dropped, and kept queries that precede
    every kept key (stranded): zeros, lse=-inf, zero gradients, never NaN (SCFA App. B)."""
    q, k, v = qkv(1, 3, 40, 32)
    q_keep = torch.ones(1, 3, 40, dtype=torch.bool)
    k_keep = torch.ones(1, 3, 40, dtype=torch.bool)
    q_keep[0, 0] = False
    k_keep[0, 1] = False
    k_keep[0, 2, :20] = False  # queries 0..19 of head 2 have no kept key at or before them
    spec = AttentionSpec(causal=True, policy=Drop())
    out, lse = _check(spec, q, k, v, q_keep, k_keep)
    assert (out[0, :2] == 0).all() and torch.isneginf(lse[0, :2]).all()
    assert (out[0, 2, :20] == 0).all() and torch.isneginf(lse[0, 2, :20]).all()


def test_drop_gqa_cross_attention_dropout_fp16():
    g = torch.Generator().manual_seed(9)
    q, k, v = qkv(1, 4, 37, 64, Hk=2, Nk=51, dtype=torch.float16)
    q_keep = torch.rand(1, 4, 37, generator=g) >= 0.4
    k_keep = torch.rand(1, 2, 51, generator=g) >= 0.4
    spec = AttentionSpec(causal=True, dropout_p=0.25, policy=Drop(q_rate=0.4, k_rate=0.4))
    _check(spec, q, k, v, q_keep, k_keep, dropout_p=0.25, seed=2 ** 31 + 17)


def _core_tiles(lo, hi, bm, bn):
    """Per query tile of ``bm`` sorted rows, the key tiles of ``bn`` that lie inside every row's range."""
    out = []
    for r0 in range(0, lo.shape[-1], bm):
        c_lo, c_hi = int(lo[..., r0:r0 + bm].max()), int(hi[..., r0:r0 + bm].min())
        out.append([j for j in range(0, c_hi, bn) if j >= c_lo and j + bn <= c_hi])
    return out


@pytest.mark.sample(1)
@pytest.mark.parametrize("causal,padded", [(False, False), (True, False), (False, True), (True, True)])
def test_tiles_inside_every_rows_range_skip_the_range_test(causal, padded):
    """Key tiles inside every row's kept range (the ranges' core) skip the per-logit range test: in the
    span that query tiles compute from their ranges (the forward and dQ of a site with no other
    predicate) and in the tile lists (with padding, and in every dK/dV pass). Few drops make long
    ranges, so most visited tiles are such tiles; tiles at the ranges' ends, rows of dropped queries
    and padding still take the tests."""
    g = torch.Generator().manual_seed(31 + 2 * causal + padded)
    N, bm = 90, 16  # (the interpreter's tiles)
    q, k, v = qkv(2, 2, N, 32)
    q_keep = torch.rand(2, 2, N, generator=g) >= 0.15
    k_keep = torch.rand(2, 2, N, generator=g) >= 0.15
    preds = None
    if padded:
        valid = torch.ones(2, N, dtype=torch.bool)
        valid[1, N - 11:] = False
        preds = Predicates(q_valid=valid, k_valid=valid)
    spec = AttentionSpec(causal=causal, policy=Drop(q_rate=0.15, k_rate=0.15))
    site = TB.Site(spec, q, k, v, None, 0.0, 0, preds, q_keep, k_keep)
    assert site.sched_q == (TB.SCHED_LIST if padded else TB.SCHED_RANGE) and site.sched == TB.SCHED_LIST
    lay = site.layout
    core = [_core_tiles(lay.lo[b, h], lay.hi[b, h], bm, bm) for b in range(2) for h in range(2)]
    assert sum(len(c) for row in core for c in row) >= 8  # the case has such tiles
    # the lists flag exactly those (query-outer, and key-outer for the dK/dV pass), padded tiles aside
    for outer_q in (True, False):
        lst, cnt = site.lists(bm, bm, outer_q)
        if lst is None:  # (the forward's range span)
            assert outer_q and not padded
            continue
        full = set()
        for b in range(2):
            for h in range(2):
                for o in range(lst.shape[2]):
                    for e in lst[b, h, o, :cnt[b, h, o]].tolist():
                        if e & 1:
                            full.add((b, h, o, e >> 1) if outer_q else (b, h, e >> 1, o))
        want = {(b, h, t, j // bm) for b in range(2) for h in range(2) for t, js in enumerate(core[2 * b + h])
                for j in js}
        if padded:  # tiles holding padding (in sorted order: through the permutations) are never full
            qv = [valid[b_][lay.q_perm[b_, h_].long()] for b_ in range(2) for h_ in range(2)]
            kv = [valid[b_][lay.k_perm[b_, h_].long()] for b_ in range(2) for h_ in range(2)]
            want = {w for w in want if bool(qv[2 * w[0] + w[1]][w[2] * bm:(w[2] + 1) * bm].all()
                                           and kv[2 * w[0] + w[1]][w[3] * bm:(w[3] + 1) * bm].all())}
        assert full == want
    _check(spec, q, k, v, q_keep, k_keep, preds=preds)


def test_drop_bool_mask_bf16():
    g = torch.Generator().manual_seed(13)
    q, k, v = qkv(2, 2, 40, 32, dtype=torch.bfloat16)
    q_keep = torch.rand(2, 2, 40, generator=g) >= 0.5
    k_keep = torch.rand(2, 2, 40, generator=g) >= 0.5
    mask = torch.rand(40, 40, generator=g) >= 0.2  # (Nq, Nk), broadcast over batch and heads
    spec = AttentionSpec(causal=False, mask_kind="bool", policy=Drop())
    _check(spec, q, k, v, q_keep, k_keep, attn_mask=mask)


# ---------------------------------------------------------------------------------------------
# the op and errors


@pytest.mark.parametrize("policy", ["hash", "drop"])
def test_through_the_op_autograd(policy):
    from attncomp.functional import attention

    g = torch.Generator().manual_seed(21)
    q, k, v = qkv(1, 2, 40, 32, requires_grad=True)
    if policy == "hash":
        qa, ka = _buckets(g, (1, 2, 40), 3), _buckets(g, (1, 2, 40), 3)
        extra = dict(q_buckets=qa, k_buckets=ka)
    else:
        qa, ka = torch.rand(1, 2, 40, generator=g) >= 0.5, torch.rand(1, 2, 40, generator=g) >= 0.5
        extra = dict(q_keep=qa, k_keep=ka)
    out = attention(q, k, v, is_causal=True, policy=policy, backend="triton", **extra)
    go = torch.randn_like(out)
    out.backward(go)
    spec = AttentionSpec(causal=True, policy=Hash() if policy == "hash" else Drop())
    rq, rk, rv, _ = R.attention_backward(q.detach().double(), k.detach().double(), v.detach().double(), None,
                                         go.double(), spec=spec, q_aux=qa, k_aux=ka)
    for a, b in ((q.grad, rq), (k.grad, rk), (v.grad, rv)):
        assert_close(a, b, torch.float32)


def test_missing_policy_tensors_are_named():
    q, k, v = qkv(1, 1, 16, 32)
    with pytest.raises(ValueError, match="q_buckets and k_buckets"):
        TB.attention_forward(AttentionSpec(policy=Hash()), q, k, v, q_aux=torch.zeros(1, 1, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="q_keep and k_keep"):
        TB.attention_forward(AttentionSpec(policy=Drop()), q, k, v, k_aux=torch.ones(1, 1, 16, dtype=torch.bool))


@pytest.mark.parametrize("policy", [Hash(n_buckets=4, seed=3), Drop(q_rate=0.3, k_rate=0.4, seed=5)],
                         ids=["hash", "drop"])
def test_policy_tensors_derived_on_the_device(policy):
    """Without bucket/keep tensors the backend derives them in the layout kernels: LSH buckets (of the
    policy's fixed seed) and keep draws of the call's seed, equal to ``attncomp.policy``'s (so the
    result is the reference's with those tensors)."""
    from attncomp.ops import materialize_aux
    from tests.utils import fresh_seed

    q, k, v = qkv(1, 4, 37, 32, Hk=2)
    spec = AttentionSpec(causal=True, policy=policy)
    seed = fresh_seed()
    out, lse = TB.attention_forward(spec, q, k, v, seed=seed)
    qa, ka = materialize_aux(spec, q, k, seed=seed)
    ro, _ = R.attention(q.double(), k.double(), v.double(), spec=spec, q_aux=qa, k_aux=ka)
    assert_close(out, ro, torch.float32)
    other = TB.attention_forward(spec, q, k, v, seed=seed + 1)[0]
    # hash buckets do not depend on the call's seed; keep draws do
    assert torch.equal(other, out) == (policy.name == "hash")


class _KernelSpy:
    """``TB._attention_kernel`` that records each launch's meta-parameters."""

    def __init__(self, real):
        self.real, self.launches = real, []

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.launches.append(kw)
            return self.real[grid](*args, **kw)

        return go

    def __getattr__(self, name):
        return getattr(self.real, name)


_SORTED_KV_CASES = {  # spec kwargs, (B, Hq, Hk, Nq, Nk, D, Dv), dtype, dropout
    "causal-gqa": (dict(causal=True), (2, 4, 2, 45, 45, 32, 32), torch.float32, 0.0),
    "bottom-right-cross": (dict(causal=True, causal_align="bottom_right"), (1, 2, 2, 21, 53, 64, 48),
                           torch.float32, 0.0),
    "full-fp16": (dict(), (1, 2, 1, 37, 29, 16, 16), torch.float16, 0.0),
    "window-dropout": (dict(window_left=9, window_right=0), (1, 2, 2, 40, 40, 32, 32), torch.float32, 0.2),
}


@pytest.mark.sample(2)
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
@pytest.mark.parametrize("case", list(_SORTED_KV_CASES))
def test_drop_forward_reads_its_kept_keys_from_sorted_copies(case, tma, monkeypatch):
    """A ``drop`` forward whose query tiles span their ranges reads its kept keys' K/V rows in sorted order
    from the copies the counting sort's scatter launch made (``KV_SORTED``), by address loads or through
    TMA descriptors of the copies. Every buffer is poisoned (the copies' slots past the kept keys and
    their zero rows too: a tile reaching there must not read them into P V); k and v are strided views.
    Output and lse against the float64 reference with the call's draws, and the backward (which gathers
    through the permutation, from the remembered layout) against its gradients."""
    from attncomp.codegen.triton import configs
    from attncomp.ops import materialize_aux
    from tests.utils import fresh_seed, poison

    kw, (B, Hq, Hk, Nq, Nk, D, Dv), dtype, p = _SORTED_KV_CASES[case]
    monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 0)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    spy = _KernelSpy(TB._attention_kernel)
    monkeypatch.setattr(TB, "_attention_kernel", spy)
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Nk, Hk, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, Nk, Hk, Dv, generator=g).to(dtype).transpose(1, 2)
    spec = AttentionSpec(policy=Drop(q_rate=0.3, k_rate=0.5, seed=4), dropout_p=p, **kw)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, TMA=int(tma))
    site = TB.Site(spec, q, k, v, None, p, seed, sorted_kv=True)
    assert site.kv_sorted and site.tag == "drop+kv" and site.tma_ok
    out, lse = TB.attention_forward(spec, q, k, v, dropout_p=p, seed=seed, config=cfg)
    (fwd,) = spy.launches
    assert fwd["KV_SORTED"] and fwd["TMA"] == tma and fwd["SCHED"] == TB.SCHED_RANGE
    qa, ka = materialize_aux(spec, q, k, seed=seed)
    d = torch.float64
    ro, rl = R.attention(q.to(d), k.to(d), v.to(d), spec=spec, q_aux=qa, k_aux=ka, dropout_p=p, seed=seed)
    assert_close(out, ro, dtype, "out")
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    torch.testing.assert_close(lse[fin].double(), rl[fin].double(), atol=1e-3, rtol=1e-3)
    go = torch.randn(out.shape, generator=g).to(dtype)
    grads = TB.attention_backward(spec, q, k, v, None, out, lse, go, dropout_p=p, seed=seed)
    assert not any(x.get("KV_SORTED") for x in spy.launches[1:])
    ref = R.attention_backward(q.to(d), k.to(d), v.to(d), None, go.to(d), spec=spec, q_aux=qa, k_aux=ka,
                               dropout_p=p, seed=seed)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(a.double(), b, atol=atol * max(1.0, b.abs().max().item()), rtol=rtol,
                                   msg=lambda m: f"{name}\n{m}")


def test_sorted_copies_only_for_forwards_with_range_spans_and_enough_queries(monkeypatch):
    """Copies are made for a forward's ``drop`` site with range spans and at least
    ``configs.SORTED_KV_MIN_Q`` queries; not for padding (tile lists), hash, given keep masks, the
    backward's site, ``ATTNCOMP_SORTED_KV=0``, or fewer queries (a decode step)."""
    from attncomp.codegen.triton import configs

    q, k, v = qkv(1, 2, 40, 16)
    drop = AttentionSpec(causal=True, policy=Drop(q_rate=0.3, k_rate=0.5))
    monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 40)

    def site(spec=drop, q=q, k=k, v=v, fwd=True, preds=None, aux=(None, None)):
        return TB.Site(spec, q, k, v, None, 0.0, 3, preds, *aux, sorted_kv=fwd)

    s = site()
    assert s.kv_sorted and s.layout.kv is not None and site().kv_sorted  # (a forward derives afresh)
    assert not site(q=q[:, :, :39]).kv_sorted  # fewer queries than the bound
    assert not site(fwd=False).kv_sorted and site(fwd=False).layout.kv is None
    assert not site(AttentionSpec(causal=True, policy=Hash(n_buckets=4))).kv_sorted
    keep = (torch.rand(1, 2, 40) > 0.3, torch.rand(1, 2, 40) > 0.5)
    assert not site(aux=keep).kv_sorted
    pad = Predicates(k_valid=torch.arange(40)[None] < 33)
    assert not site(preds=pad).kv_sorted
    monkeypatch.setenv("ATTNCOMP_SORTED_KV", "0")
    assert not site().kv_sorted


@pytest.mark.sample(1)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 37), (1, 4, 4, 5, 29)], ids=["gqa", "decode"])
def test_drop_site_without_masks_draws_from_the_op_seed(shape, monkeypatch):
    """As compiled graphs call a ``drop`` site: no keep masks, the op's seed. The Triton backend draws
    them in the counting sort once (the backward finds that sort), the reference backend through
    ``materialize_aux``: both from the op's seed, so both give the float64 reference's output and
    gradients with the masks of that seed; another seed draws other masks."""
    from attncomp import ops
    from tests.utils import fresh_seed

    B, Hq, Hk, Nq, Nk = shape
    seed = fresh_seed()
    q, k, v = qkv(B, Hq, Nq, 32, Hk=Hk, Nk=Nk, requires_grad=True)
    pol = Drop(q_rate=0.3, k_rate=0.4, seed=2)
    sorts = []
    real = TB.derive_layout, TB.layout_from_aux
    monkeypatch.setattr(TB, "derive_layout", lambda *a, **kw: sorts.append("derive") or real[0](*a, **kw))
    monkeypatch.setattr(TB, "layout_from_aux", lambda *a, **kw: sorts.append("sort") or real[1](*a, **kw))
    go = torch.randn(B, Hq, Nq, 32, generator=torch.Generator().manual_seed(seed))

    def run(backend, s):
        spec = AttentionSpec(causal=True, causal_align="bottom_right", policy=pol, backend=backend)
        for t in (q, k, v):
            t.grad = None
        out, _ = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                              spec.to_json(), 0.0, s)
        out.backward(go)
        return out.detach(), q.grad, k.grad, v.grad

    got = run("triton", seed)
    assert sorts == ["derive"]  # the backward found the forward's sort
    spec_r = AttentionSpec(causal=True, causal_align="bottom_right", policy=pol)
    tq, tk = ops.materialize_aux(spec_r, q, k, seed=seed)
    d = torch.float64
    qd, kd, vd = (t.detach().to(d) for t in (q, k, v))
    ro, _ = R.attention(qd, kd, vd, spec=spec_r, q_aux=tq, k_aux=tk)
    rg = R.attention_backward(qd, kd, vd, None, go.to(d), spec=spec_r, q_aux=tq, k_aux=tk)[:3]
    for a, b in zip(got, (ro,) + rg):
        assert_close(a, b, torch.float32)
    for a, b in zip(run("reference", seed), (ro,) + rg):
        assert_close(a, b, torch.float32)
    assert not torch.equal(run("triton", seed + 1)[0], got[0])


@pytest.mark.sample(1)
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 37), (1, 4, 4, 5, 29)], ids=["gqa", "decode"])
def test_policy_aux_draws_with_the_sort(shape, monkeypatch):
    """``attncomp::policy_aux`` (keep masks for a caller, and for graphs compiled before drop sites drew
    in the op): on the Triton backend they are drawn by the counting sort's kernels, bit for bit the
    torch draws, and the site's forward and backward reuse that sort (window cut in the scatter)
    instead of sorting the masks again; a site with position tensors (whole groups, no window) and a
    cleared cache still compute the reference's result."""
    from attncomp import ops
    from tests.utils import fresh_seed

    B, Hq, Hk, Nq, Nk = shape
    seed = fresh_seed()
    q, k, v = qkv(B, Hq, Nq, 32, Hk=Hk, Nk=Nk, requires_grad=True)
    spec = AttentionSpec(causal=True, causal_align="bottom_right", policy=Drop(q_rate=0.3, k_rate=0.4, seed=2),
                         backend="triton")
    sj = spec.to_json()
    sorts = []
    real = TB.derive_layout, TB.layout_from_aux, TB.window_ranges
    monkeypatch.setattr(TB, "derive_layout", lambda *a, **kw: sorts.append("derive") or real[0](*a, **kw))
    monkeypatch.setattr(TB, "layout_from_aux", lambda *a, **kw: sorts.append("sort") or real[1](*a, **kw))
    monkeypatch.setattr(TB, "window_ranges", lambda *a, **kw: sorts.append("window") or real[2](*a, **kw))
    qa, ka = ops.policy_aux(sj, q, k, seed)
    assert sorts == ["derive"]
    tq, tk = ops.materialize_aux(spec, q, k, seed=seed)
    assert torch.equal(qa, tq) and torch.equal(ka, tk)  # bit for bit the torch draws

    def run(qa, ka, q_pos=None):
        for t in (q, k, v):
            t.grad = None
        out, _ = torch.ops.attncomp.attention(q, k, v, None, qa, ka, None, q_pos, None, None, None, None, None,
                                              sj, 0.0, 0)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        out.backward(go)
        return out.detach(), q.grad, k.grad, v.grad, go

    sorts.clear()
    got = run(qa, ka)
    assert sorts == []  # forward and backward found the sort of the draws
    spec_r = AttentionSpec(causal=True, causal_align="bottom_right", policy=Drop())
    d = torch.float64
    ro, _ = R.attention(q.detach().to(d), k.detach().to(d), v.detach().to(d), spec=spec_r, q_aux=tq, k_aux=tk)
    rg = R.attention_backward(q.detach().to(d), k.detach().to(d), v.detach().to(d), None, got[4].to(d),
                              spec=spec_r, q_aux=tq, k_aux=tk)[:3]
    for a, b in zip(got[:4], (ro,) + rg):
        assert_close(a, b, torch.float32)
    # the same masks sorted afresh (cache cleared) give the same bits
    TB._LAYOUT_CACHE.clear()
    again = run(qa, ka)
    assert sorts == ["sort"]  # once: the backward finds it
    for a, b in zip(got[:4], again[:4]):
        assert torch.equal(a, b)
    # position tensors: the remembered layout's window does not apply, the groups' ranges do
    qa2, ka2 = ops.policy_aux(sj, q, k, seed)
    sorts.clear()
    qp = (torch.arange(Nq) + Nk - Nq)[None]
    pos = run(qa2, ka2, q_pos=qp)
    assert sorts == ["window", "window"]  # forward and backward: the remembered sort, whole groups
    for a, b in zip(pos[:4], (ro,) + rg):
        assert_close(a, b, torch.float32)
    # negative twin: another draw seed gives other masks
    qb, kb = ops.policy_aux(sj, q, k, seed + 1)
    assert not (torch.equal(qb, qa) and torch.equal(kb, ka))
