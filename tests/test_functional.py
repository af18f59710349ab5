"""``attncomp.functional.attention``: the drop-in for ``F.scaled_dot_product_attention``.

Dense attention is checked against PyTorch's SDPA in float64; every policy is checked forward and
backward against the reference backend (itself checked against a brute force in
``tests/codegen/test_reference.py``) and with ``torch.autograd.gradcheck``. Fresh random inputs each
run; the seed is in every failure message.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import attncomp
from attncomp.codegen import reference as R
from attncomp.functional import attention
from attncomp.policy import DFSS, ET, SPION, Dense, Drop, Hash, lsh_buckets
from attncomp.spec import AttentionSpec
from tests.utils import assert_close, fresh_seed

F64 = torch.float64



def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand_qkv(g, B, Hq, Hk, Nq, Nk, D, Dv, dtype=F64, grad=False):
    def mk(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_(grad)

    return mk(B, Hq, Nq, D), mk(B, Hk, Nk, D), mk(B, Hk, Nk, Dv)


def make_mask(kind, g, B, H, Nq, Nk, dtype=F64):
    """Return ``(attn_mask, is_causal)`` for a mask kind; fully excluded rows planted on purpose."""
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool_keypad":
        lens = torch.randint(1, Nk + 1, (B,), generator=g)
        return (torch.arange(Nk)[None] < lens[:, None]).view(B, 1, 1, Nk), False
    if kind == "bool_full":
        m = torch.rand(B, H, Nq, Nk, generator=g) < 0.6
        m[-1, 0, 0] = False
        return m, False
    if kind == "bool_2d":
        return torch.rand(Nq, Nk, generator=g) < 0.6, False
    if kind == "float_2d":
        m = torch.randn(Nq, Nk, generator=g, dtype=F64)
        m[torch.rand(Nq, Nk, generator=g) < 0.2] = float("-inf")
        m[1] = float("-inf")
        m[2, ::3] = torch.finfo(dtype).min
        return m.to(dtype), False
    if kind == "float_1hqk":
        m = torch.randn(1, H, Nq, Nk, generator=g, dtype=F64) * 3
        m[torch.rand(1, H, Nq, Nk, generator=g) < 0.2] = float("-inf")
        return m.to(dtype), False
    if kind == "float_b1qk":
        return (torch.randn(B, 1, Nq, Nk, generator=g, dtype=F64)).to(dtype), False
    raise AssertionError(kind)


MASKS = ("none", "causal", "bool_keypad", "bool_full", "bool_2d", "float_2d", "float_1hqk", "float_b1qk")


# ---------------------------------------------------------------------------------------------
# dense == SDPA


@pytest.mark.parametrize("gqa", (False, True), ids=("mha", "gqa"))
@pytest.mark.parametrize("scale", (None, "random"))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("cross", ("self", "wide", "tall"))
def test_dense_matches_sdpa_float64(mask_kind, scale, gqa, cross):
    seed = fresh_seed()
    g = gen(seed)
    B, Hq, Hk = 2, 4, (2 if gqa else 4)
    Nq, Nk = {"self": (13, 13), "wide": (11, 17), "tall": (19, 7)}[cross]
    q, k, v = rand_qkv(g, B, Hq, Hk, Nq, Nk, 8, 6, grad=True)
    mask, causal = make_mask(mask_kind, g, B, Hq, Nq, Nk)
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_(True)
    sc = None if scale is None else float(torch.empty(()).uniform_(0.05, 1.5, generator=g))
    msg = f"(seed={seed}, mask={mask_kind}, scale={sc}, gqa={gqa}, cross={cross})"

    out = attention(q, k, v, attn_mask=mask, is_causal=causal, scale=sc, enable_gqa=gqa, policy="dense")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=sc, enable_gqa=gqa)
    assert out.shape == want.shape and out.dtype == F64, msg
    assert_close(out, want, F64, msg=msg)

    go = torch.randn(want.shape, generator=g, dtype=F64)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    got = torch.autograd.grad(out, leaves, go)
    exp = torch.autograd.grad(want, leaves, go)
    for nm, a, b in zip(("dq", "dk", "dv", "dmask"), got, exp):
        assert a.shape == b.shape, f"{nm} shape {tuple(a.shape)} != {tuple(b.shape)} {msg}"
        assert_close(a, b, F64, msg=f"{nm} {msg}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_dense_low_precision_close_to_sdpa_float64(dtype):
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 4, 2, 9, 21, 16, 16, dtype=dtype)
    mask, _ = make_mask("float_1hqk", g, 2, 4, 9, 21, dtype=dtype)
    out = attention(q, k, v, attn_mask=mask, enable_gqa=True, policy="dense")
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), enable_gqa=True)
    assert out.dtype == dtype
    assert_close(out, want, dtype, msg=f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# Every policy, forward and backward.

B_, HQ, HK, NQ, NK, D_, DV = 2, 4, 2, 13, 37, 8, 5


def policy_inputs(name, g, shape=(B_, HQ, HK, NQ, NK)):
    """``(policy, kwargs)`` for ``attention``, with the policy's tensors where the case gives them."""
    B, Hq, Hk, Nq, Nk = shape
    if name == "dense":
        return Dense(), {}
    if name == "et":
        return ET(), {}
    if name == "dfss_default":
        return "dfss", {}
    if name == "dfss_2_4":
        return DFSS(2, 4), {}
    if name == "dfss_5_16":
        return DFSS(5, 16), {}
    if name == "hash_given":
        return Hash(n_buckets=4, exclude_self=True), dict(
            q_buckets=torch.randint(0, 4, (B, Hq, Nq), generator=g),
            k_buckets=torch.randint(0, 4, (B, Hk, Nk), generator=g).int())
    if name == "hash_lsh":
        return Hash(n_buckets=4, seed=int(torch.randint(0, 1000, (1,), generator=g))), {}
    if name == "drop_given":
        qk = torch.rand(B, Hq, Nq, generator=g) < 0.6
        kk = torch.rand(B, Hk, Nk, generator=g) < 0.6
        return Drop(), dict(q_keep=qk, k_keep=kk)
    if name == "drop_drawn":
        return Drop(q_rate=0.3, k_rate=0.4, seed=int(torch.randint(0, 1000, (1,), generator=g))), {}
    if name in ("spion", "spion_one"):
        lead = Hq if name == "spion" else 1
        return SPION(block_size=16), dict(block_pattern=torch.rand(lead, -(-Nq // 16), -(-Nk // 16), generator=g) < 0.5)
    raise AssertionError(name)


POLICY_NAMES = ("dense", "et", "dfss_default", "dfss_2_4", "dfss_5_16", "hash_given", "hash_lsh", "drop_given",
                "drop_drawn", "spion", "spion_one")


def aux_for_reference(pol, kw, q, k):
    """The policy tensors the reference needs: given ones, or LSH buckets / drawn masks derived here."""
    if isinstance(pol, Hash):
        if "q_buckets" in kw:
            return kw["q_buckets"], kw["k_buckets"]
        return lsh_buckets(q.detach(), k.detach(), pol.n_buckets, pol.seed)
    if isinstance(pol, Drop):
        if "q_keep" in kw:
            return kw["q_keep"], kw["k_keep"]
        return None, None  # drawn: checked separately (test_drop_drawn_*)
    return None, None


MASK_DTYPES = [(m, F64) for m in ("none", "causal", "float_2d", "bool_keypad")] + [
    ("float_2d", torch.float32), ("causal", torch.float16), ("bool_keypad", torch.bfloat16)]


@pytest.mark.parametrize("mask_kind,dtype", MASK_DTYPES, ids=[f"{m}-{str(d)[6:]}" for m, d in MASK_DTYPES])
@pytest.mark.parametrize("pname", [p for p in POLICY_NAMES if p != "drop_drawn"])  # drawn: test_drop_drawn_*
def test_policy_forward_backward_matches_reference(pname, mask_kind, dtype):
    seed = fresh_seed()
    g = gen(seed)
    pol, kw = policy_inputs(pname, g)
    q, k, v = rand_qkv(g, B_, HQ, HK, NQ, NK, D_, DV, dtype=dtype, grad=True)
    mask, causal = make_mask(mask_kind, g, B_, HQ, NQ, NK, dtype=dtype)
    msg = f"(seed={seed}, policy={pname}, mask={mask_kind}, dtype={dtype})"

    out = attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, policy=pol, **kw)
    resolved = attncomp.get_policy(pol).resolved(dtype)
    mk = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    spec = AttentionSpec(causal=causal, mask_kind=mk, policy=resolved)
    qa, ka = aux_for_reference(resolved, kw, q, k)
    want, _ = R.attention(q.detach(), k.detach(), v.detach(), mask, spec=spec, q_aux=qa, k_aux=ka,
                          block_pattern=kw.get("block_pattern"))
    assert out.dtype == dtype and out.shape == (B_, HQ, NQ, DV), msg
    assert not torch.isnan(out).any(), msg
    assert torch.equal(out.detach(), want), f"functional forward differs from the reference backend {msg}"

    go = torch.randn(out.shape, generator=g, dtype=F64).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), go)
    exp = R.attention_backward(q.detach(), k.detach(), v.detach(), mask, go, spec=spec, q_aux=qa, k_aux=ka,
                               block_pattern=kw.get("block_pattern"))
    for nm, a, b in zip(("dq", "dk", "dv"), got, exp[:3]):
        assert not torch.isnan(a).any(), f"NaN in {nm} {msg}"
        assert_close(a, b, dtype, msg=f"{nm} {msg}")


@pytest.mark.parametrize("pname", POLICY_NAMES)
def test_policy_gradcheck(pname):
    """Finite differences through the op (selection fixed by integer aux or by continuous inputs)."""
    seed = fresh_seed()
    g = gen(seed)
    B, Hq, Hk, Nq, Nk = 1, 4, 2, 5, 18  # two key blocks of 16 for spion; a partial dfss group
    pol, kw = policy_inputs(pname, g, (B, Hq, Hk, Nq, Nk))
    q, k, v = rand_qkv(g, B, Hq, Hk, Nq, Nk, 4, 3, grad=True)
    mask = (torch.randn(1, Hq, Nq, Nk, generator=g, dtype=F64) * 2).requires_grad_(True)

    def f(q, k, v, m):
        return attention(q, k, v, attn_mask=m, enable_gqa=True, policy=pol, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v, mask), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True), \
        f"seed={seed}"


@pytest.mark.parametrize("mask_shape", ("2d", "b1qk", "1hqk", "full"))
def test_float_mask_gradient_reduced_to_mask_shape(mask_shape):
    seed = fresh_seed()
    g = gen(seed)
    B, H, Nq, Nk = 2, 3, 5, 7
    q, k, v = rand_qkv(g, B, H, H, Nq, Nk, 4, 4, grad=True)
    shape = {"2d": (Nq, Nk), "b1qk": (B, 1, Nq, Nk), "1hqk": (1, H, Nq, Nk), "full": (B, H, Nq, Nk)}[mask_shape]
    m = torch.randn(shape, generator=g, dtype=F64, requires_grad=True)
    out = attention(q, k, v, attn_mask=m, policy="dense")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    go = torch.randn(out.shape, generator=g, dtype=F64)
    (gm,) = torch.autograd.grad(out, m, go)
    (wm,) = torch.autograd.grad(want, m, go)
    assert gm.shape == m.shape
    assert_close(gm, wm, F64, msg=f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# Defaults and backends.


@pytest.mark.parametrize("dtype", (F64, torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_default_policy_is_dfss_resolved_per_dtype(dtype):
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 2, 2, 9, 16, 8, 8, dtype=dtype)
    n, m = (2, 4) if dtype in (torch.float16, torch.bfloat16) else (1, 2)
    out = attention(q, k, v)
    assert torch.equal(out, attention(q, k, v, policy=DFSS(n, m))), f"seed={seed}"
    other = (1, 2) if (n, m) == (2, 4) else (2, 4)
    assert not torch.equal(out, attention(q, k, v, policy=DFSS(*other))), f"seed={seed}"


def test_backend_reference_equals_auto_on_cpu():
    seed = fresh_seed()
    q, k, v = rand_qkv(gen(seed), 1, 2, 2, 7, 9, 4, 4)
    a = attention(q, k, v, policy="dense", backend="auto")       # SDPA's CPU kernel
    b = attention(q, k, v, policy="dense", backend="reference")
    assert_close(a, b, F64, msg=f"seed={seed}")
    a = attention(q, k, v, policy="dfss", backend="auto")        # the reference
    assert torch.equal(a, attention(q, k, v, policy="dfss", backend="reference"))


def test_dropout_seed_reproducible_and_matches_reference():
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 4, 2, 9, 12, 8, 8)
    p = float(torch.empty(()).uniform_(0.1, 0.7, generator=g))
    s = fresh_seed()
    out = attention(q, k, v, dropout_p=p, enable_gqa=True, policy="dense", seed=s)
    assert torch.equal(out, attention(q, k, v, dropout_p=p, enable_gqa=True, policy="dense", seed=s))
    want, _ = R.attention(q, k, v, spec=AttentionSpec(dropout_p=p), dropout_p=p, seed=s)
    assert_close(out, want, F64, msg=f"seed={seed}")
    assert not torch.equal(out, attention(q, k, v, dropout_p=p, enable_gqa=True, policy="dense", seed=s + 1))
    # without a seed: drawn from torch's generator, so torch.manual_seed makes it reproducible
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        a = attention(q, k, v, dropout_p=p, enable_gqa=True, policy="dense")
        torch.manual_seed(seed)
        b = attention(q, k, v, dropout_p=p, enable_gqa=True, policy="dense")
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# hash without buckets: LSH


def test_hash_without_buckets_uses_lsh():
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 4, 2, 13, 17, 8, 8)
    for pol in (Hash(n_buckets=4, seed=seed % 1000), "hash"):
        p = attncomp.get_policy(pol)
        out = attention(q, k, v, enable_gqa=True, policy=pol)
        qb, kb = lsh_buckets(q, k, p.n_buckets, p.seed)
        want = attention(q, k, v, enable_gqa=True, policy=pol, q_buckets=qb, k_buckets=kb)
        assert torch.equal(out, want), f"seed={seed}, policy={p.describe()}"


@pytest.mark.parametrize("dtype", (F64, torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("n_buckets", (2, 4, 16))
def test_lsh_buckets_range_shape_dtype(n_buckets, dtype):
    seed = fresh_seed()
    q, k, _ = rand_qkv(gen(seed), 2, 4, 2, 64, 80, 16, 16, dtype=dtype)
    qb, kb = lsh_buckets(q, k, n_buckets, seed)
    assert qb.shape == (2, 4, 64) and kb.shape == (2, 2, 80)
    assert not qb.is_floating_point() and not kb.is_floating_point()
    for b in (qb, kb):
        assert int(b.min()) >= 0 and int(b.max()) < n_buckets, f"seed={seed}"
    # random directions use every bucket
    assert set(torch.cat([qb.flatten(), kb.flatten()]).tolist()) == set(range(n_buckets)), f"seed={seed}"


def test_lsh_rotation_shared_by_q_and_k_of_a_head():
    """Identical (or positively scaled) vectors in q and in k of the same head, including a query head
    and its group's KV head under GQA, land in the same bucket."""
    seed = fresh_seed()
    g = gen(seed)
    B, Hq, Hk, N, D = 2, 4, 2, 50, 16
    k = torch.randn(B, Hk, N, D, generator=g, dtype=F64)
    scale = torch.rand(B, Hq, N, 1, generator=g, dtype=F64) * 5 + 0.1
    q = k.repeat_interleave(Hq // Hk, dim=1) * scale  # q[:, h] = c * k[:, h // groups]
    qb, kb = lsh_buckets(q, k, 16, seed)
    assert torch.equal(qb, kb.repeat_interleave(Hq // Hk, dim=1)), f"seed={seed}"


def test_lsh_deterministic_per_seed_and_seed_dependent():
    seed = fresh_seed()
    q, k, _ = rand_qkv(gen(seed), 2, 2, 2, 64, 64, 16, 16)
    a = lsh_buckets(q, k, 16, seed)
    b = lsh_buckets(q.clone(), k.clone(), 16, seed)
    c = lsh_buckets(q, k, 16, seed + 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]), f"seed={seed}"
    # through the functional API as well
    v = torch.randn(2, 2, 64, 16, dtype=F64)
    o1 = attention(q, k, v, policy=Hash(n_buckets=16, seed=seed))
    o2 = attention(q, k, v, policy=Hash(n_buckets=16, seed=seed))
    o3 = attention(q, k, v, policy=Hash(n_buckets=16, seed=seed + 1))
    assert torch.equal(o1, o2) and not torch.equal(o1, o3)


# ---------------------------------------------------------------------------------------------
# drop without keep masks: drawn with the rates, from the seed


def _observed_keep(out, groups):
    """With ``v = I`` and no other restriction, a kept query has a nonzero row and ``out[i, j] > 0``
    exactly for its kept keys: recover the keep masks from the output alone."""
    q_keep = (out != 0).any(-1)  # (B, Hq, Nq)
    cols = (out != 0).any(-2)  # (B, Hq, Nk): keys seen by some query of the head
    B, Hq, Nk = cols.shape
    k_keep = cols.view(B, Hq // groups, groups, Nk)
    return q_keep, k_keep


def test_drop_drawn_rates_reproducible_and_seeded():
    seed = fresh_seed()
    g = gen(seed)
    q_rate = float(torch.empty(()).uniform_(0.1, 0.8, generator=g))
    k_rate = float(torch.empty(()).uniform_(0.1, 0.8, generator=g))
    B, Hq, Hk, N, D = 2, 4, 2, 256, 8
    q = torch.randn(B, Hq, N, D, generator=g, dtype=F64)
    k = torch.randn(B, Hk, N, D, generator=g, dtype=F64)
    v = torch.eye(N, dtype=F64).expand(B, Hk, N, N)
    pol = Drop(q_rate=q_rate, k_rate=k_rate, seed=seed % 100000)
    out = attention(q, k, v, enable_gqa=True, policy=pol)
    msg = f"(seed={seed}, q_rate={q_rate:.3f}, k_rate={k_rate:.3f})"
    q_keep, k_keep_per_qhead = _observed_keep(out, Hq // Hk)
    # every query head of a group sees the same kept keys: masks are per KV head
    assert torch.equal(k_keep_per_qhead[:, :, 0], k_keep_per_qhead[:, :, 1]), msg
    k_keep = k_keep_per_qhead[:, :, 0]
    assert abs(1 - q_keep.double().mean().item() - q_rate) < 0.05, msg
    assert abs(1 - k_keep.double().mean().item() - k_rate) < 0.05, msg
    # the draw is the drop policy with those masks given
    want = attention(q, k, v, enable_gqa=True, policy=pol, q_keep=q_keep, k_keep=k_keep)
    assert torch.equal(out, want), msg
    # reproducible from the seed; another seed draws other masks
    assert torch.equal(out, attention(q, k, v, enable_gqa=True, policy=pol)), msg
    other = attention(q, k, v, enable_gqa=True, policy=Drop(q_rate=q_rate, k_rate=k_rate, seed=seed % 100000 + 1))
    q2, k2 = _observed_keep(other, Hq // Hk)
    assert not torch.equal(q2, q_keep) and not torch.equal(k2[:, :, 0], k_keep), msg


@pytest.mark.parametrize("given", (True, False))
def test_dropped_queries_output_zero_and_get_zero_grad(given):
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 4, 2, 13, 17, 8, 8, grad=True)
    if given:
        qk = torch.rand(2, 4, 13, generator=g) < 0.5
        kw = dict(q_keep=qk, k_keep=torch.ones(2, 2, 17, dtype=torch.bool))
        pol = Drop()
    else:
        pol = Drop(q_rate=0.5, k_rate=0.0, seed=seed % 1000)
        kw = {}
        qk = None
    out = attention(q, k, v, enable_gqa=True, policy=pol, **kw)
    rows_zero = (out == 0).all(-1)
    if qk is not None:
        assert torch.equal(rows_zero, ~qk), f"seed={seed}"
    assert rows_zero.any() and not rows_zero.all(), f"seed={seed}"
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.all(dq[rows_zero] == 0) and not torch.isnan(dq).any()


# ---------------------------------------------------------------------------------------------
# Bad input: ValueError naming what was expected.


def _base(seed=None, Hq=4, Hk=2, Nq=13, Nk=17, D=8):
    g = gen(fresh_seed() if seed is None else seed)
    return rand_qkv(g, 2, Hq, Hk, Nq, Nk, D, 6)


def _raises(match, *args, **kw):
    with pytest.raises(ValueError, match=match):
        attention(*args, **kw)


@pytest.mark.parametrize("which,shape,expected", [
    ("q_buckets", (2, 4, 12), r"\(2, 4, 13\)"),
    ("q_buckets", (2, 2, 13), r"\(2, 4, 13\)"),
    ("k_buckets", (2, 4, 17), r"\(2, 2, 17\)"),  # per KV head, not per query head
    ("k_buckets", (2, 2, 17, 1), r"\(2, 2, 17\)"),
])
def test_bucket_shape_errors(which, shape, expected):
    q, k, v = _base()
    kw = dict(q_buckets=torch.zeros(2, 4, 13, dtype=torch.int64), k_buckets=torch.zeros(2, 2, 17, dtype=torch.int64))
    kw[which] = torch.zeros(shape, dtype=torch.int64)
    _raises(expected, q, k, v, enable_gqa=True, policy="hash", **kw)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bool, torch.float16))
def test_bucket_dtype_errors(dtype):
    q, k, v = _base()
    kw = dict(q_buckets=torch.zeros(2, 4, 13, dtype=dtype), k_buckets=torch.zeros(2, 2, 17, dtype=torch.int32))
    _raises(r"q_buckets.*integer", q, k, v, enable_gqa=True, policy="hash", **kw)


def test_buckets_must_come_in_pairs():
    q, k, v = _base()
    _raises("k_buckets", q, k, v, enable_gqa=True, policy="hash", q_buckets=torch.zeros(2, 4, 13, dtype=torch.int64))


def test_non_tensor_buckets_raise_value_error():
    q, k, v = _base()
    _raises("q_buckets", q, k, v, enable_gqa=True, policy="hash", q_buckets=[[0] * 13] * 4 * 2,
            k_buckets=torch.zeros(2, 2, 17, dtype=torch.int32))


@pytest.mark.parametrize("which,shape,dtype,expected", [
    ("q_keep", (2, 4, 12), torch.bool, r"\(2, 4, 13\)"),
    ("k_keep", (2, 4, 17), torch.bool, r"\(2, 2, 17\)"),
    ("q_keep", (2, 4, 13), torch.int64, "bool"),
    ("k_keep", (2, 2, 17), torch.float32, "bool"),
])
def test_keep_mask_errors(which, shape, dtype, expected):
    q, k, v = _base()
    kw = dict(q_keep=torch.ones(2, 4, 13, dtype=torch.bool), k_keep=torch.ones(2, 2, 17, dtype=torch.bool))
    kw[which] = torch.ones(shape, dtype=dtype)
    _raises(expected, q, k, v, enable_gqa=True, policy="drop", **kw)


@pytest.mark.parametrize("shape,dtype,expected", [
    ((4, 1, 1), torch.bool, r"\(4 or 1, 1, 2\)"),
    ((2, 1, 2), torch.bool, r"\(4 or 1, 1, 2\)"),
    ((1, 2, 2), torch.bool, r"\(4 or 1, 1, 2\)"),
    ((1, 2), torch.bool, r"\(4 or 1, 1, 2\)"),
    ((4, 1, 2), torch.int64, "bool"),
    (None, None, "block_pattern"),
])
def test_block_pattern_errors(shape, dtype, expected):
    q, k, v = _base()
    bp = None if shape is None else torch.ones(shape, dtype=dtype)
    _raises(expected, q, k, v, enable_gqa=True, policy=SPION(block_size=16), block_pattern=bp)


@pytest.mark.parametrize("kw", [dict(policy="dense", q_buckets=torch.zeros(2, 4, 13, dtype=torch.int64)),
                                dict(policy="hash", q_keep=torch.ones(2, 4, 13, dtype=torch.bool)),
                                dict(policy="dfss", block_pattern=torch.ones(1, 1, 2, dtype=torch.bool))],
                         ids=("buckets_for_dense", "keep_for_hash", "pattern_for_dfss"))
def test_policy_tensors_for_the_wrong_policy(kw):
    q, k, v = _base()
    with pytest.raises(ValueError):
        attention(q, k, v, enable_gqa=True, **kw)


@pytest.mark.parametrize("shape", [(13, 18), (2, 4, 12, 17), (3, 1, 1, 17), (1, 3, 13, 17), (1, 2, 4, 13, 17)])
@pytest.mark.parametrize("policy", ("dense", "dfss", "hash"))
def test_mask_not_broadcastable(shape, policy):
    q, k, v = _base()
    _raises(r"\(2, 4, 13, 17\)", q, k, v, attn_mask=torch.zeros(shape), enable_gqa=True, policy=policy)


def test_non_tensor_mask_raises_value_error():
    q, k, v = _base()
    _raises("attn_mask", q, k, v, attn_mask=[[True] * 17] * 13, enable_gqa=True, policy="dense")


def test_mask_bad_dtype():
    q, k, v = _base()
    _raises("bool or floating", q, k, v, attn_mask=torch.zeros(13, 17, dtype=torch.int64), enable_gqa=True)


@pytest.mark.parametrize("policy", ("dense", "dfss", "hash", "drop", "et"))
def test_heads_not_a_multiple(policy):
    q, k, v = _base(Hq=3, Hk=2)
    _raises(r"multiple", q, k, v, enable_gqa=True, policy=policy)


@pytest.mark.parametrize("policy", ("dense", "dfss", "hash", "drop"))
def test_head_dim_mismatch(policy):
    q, _, v = _base()
    k = torch.randn(2, 2, 17, 5, dtype=F64)
    _raises(r"head dim", q, k, v, enable_gqa=True, policy=policy)


def test_dtype_mismatch():
    q, k, v = _base()
    _raises("dtype", q, k.float(), v, enable_gqa=True, policy="dense")


@pytest.mark.parametrize("policy", ("dense", "dfss", "hash"))
def test_gqa_needs_enable_gqa(policy):
    q, k, v = _base(Hq=4, Hk=2)
    _raises("enable_gqa", q, k, v, policy=policy)


@pytest.mark.parametrize("policy", ("dense", "dfss"))
def test_is_causal_with_attn_mask_is_and(policy):
    """Unlike SDPA, is_causal and attn_mask may come together: both restrict (AND)."""
    seed = fresh_seed()
    g = gen(seed)
    q, k, v = rand_qkv(g, 2, 4, 2, 13, 17, 8, 8)
    m = torch.rand(13, 17, generator=g) < 0.6
    got = attention(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True, policy=policy)
    tril = torch.ones(13, 17, dtype=torch.bool).tril()
    want = attention(q, k, v, attn_mask=m & tril, enable_gqa=True, policy=policy, backend="reference")
    assert_close(got, want, F64, msg=f"seed={seed}")
    assert not torch.allclose(got, attention(q, k, v, attn_mask=m, enable_gqa=True, policy=policy))


@pytest.mark.parametrize("p", (-0.1, 1.0, 1.5))
def test_dropout_out_of_range(p):
    q, k, v = _base()
    _raises(r"\[0, 1\)", q, k, v, dropout_p=p, enable_gqa=True)


def test_unknown_policy_names_valid_ones():
    q, k, v = _base()
    with pytest.raises(ValueError) as e:
        attention(q, k, v, enable_gqa=True, policy="nope")
    for name in ("dense", "dfss", "hash", "drop", "spion", "et"):
        assert name in str(e.value)


def test_unknown_backend_names_valid_ones():
    q, k, v = _base()
    with pytest.raises(ValueError) as e:
        attention(q, k, v, enable_gqa=True, policy="dense", backend="nope")
    assert "nope" in str(e.value) and "reference" in str(e.value) and "auto" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Structured mask predicates (DESIGN.md §4.1): the same function as the N x N mask they stand for.


def predicate_case(kind, g, B, Nq, Nk):
    """``(kwargs, bool mask (B, 1, Nq, Nk))``: a predicate set and the dense mask it means, the
    latter built entry by entry from the definition."""
    ar_q, ar_k = torch.arange(Nq), torch.arange(Nk)
    kw, qp, kp, left, right = {}, ar_q[None].expand(B, Nq), ar_k[None].expand(B, Nk), None, None
    ok = torch.ones(B, 1, Nq, Nk, dtype=torch.bool)
    if kind == "causal_bottom_right":
        kw = dict(is_causal=True, causal_align="bottom_right")
        qp, right = qp + (Nk - Nq), 0
    elif kind == "sliding_window":
        kw = dict(is_causal=True, window=(5, None))
        left, right = 5, 0
    elif kind == "window_positions":
        qpos = torch.randint(0, Nk, (B, Nq), generator=g)
        kw = dict(window=(2, 3), q_pos=qpos)
        qp, left, right = qpos, 2, 3
    elif kind == "documents":
        qs = torch.sort(torch.randint(0, 3, (B, Nq), generator=g)).values
        ks = torch.sort(torch.randint(0, 3, (B, Nk), generator=g)).values
        kw = dict(q_seg=qs, k_seg=ks)
        ok &= (qs[:, None, :, None] == ks[:, None, None, :])
    elif kind == "padding":
        kv, qv = torch.rand(B, Nk, generator=g) < 0.7, torch.rand(B, Nq, generator=g) < 0.7
        kw = dict(k_valid=kv, q_valid=qv)
        ok &= kv[:, None, None, :] & qv[:, None, :, None]
    for b in range(B):
        for i in range(Nq):
            for j in range(Nk):
                if left is not None and kp[b, j] < qp[b, i] - left:
                    ok[b, 0, i, j] = False
                if right is not None and kp[b, j] > qp[b, i] + right:
                    ok[b, 0, i, j] = False
    return kw, ok


@pytest.mark.parametrize("kind", ("causal_bottom_right", "sliding_window", "window_positions", "documents", "padding"))
@pytest.mark.parametrize("pname", [p for p in POLICY_NAMES if p != "drop_drawn"])
def test_predicates_equal_their_materialised_mask(pname, kind):
    seed = fresh_seed()
    g = gen(seed)
    pol, kw = policy_inputs(pname, g)
    q, k, v = rand_qkv(g, B_, HQ, HK, NQ, NK, D_, D_, grad=True)
    pkw, mask = predicate_case(kind, g, B_, NQ, NK)
    msg = f"(seed={seed}, policy={pname}, predicates={kind})"
    out = attention(q, k, v, enable_gqa=True, policy=pol, **kw, **pkw)
    want = attention(q, k, v, attn_mask=mask, enable_gqa=True, policy=pol, backend="reference", **kw)
    assert_close(out, want, F64, msg=msg)
    go = torch.randn(out.shape, generator=g, dtype=F64)
    for nm, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go)):
        assert_close(a, b, F64, msg=f"d{nm} {msg}")
    # negative twin: without the predicates the result differs, wherever the reference says it should
    # (a random SPION pattern can keep only blocks that the predicates allow entirely)
    free = attention(q, k, v, enable_gqa=True, policy=pol, **kw)
    if not torch.allclose(attention(q, k, v, enable_gqa=True, policy=pol, backend="reference", **kw), want):
        assert not torch.allclose(free, out), msg
