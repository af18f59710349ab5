"""The reference backend against an independent brute-force statement of DESIGN.md §4.

``brute_force`` below re-derives the §4 table with explicit Python loops over query rows ``(b, h, i)``
and key groups, in float64, sharing no code with ``attncomp/codegen/reference.py``. Every test draws
fresh inputs from a seed taken with ``torch.randint``; the seed is in every failure message.

Logits are compared for DFSS selection, so DFSS cases use integer-valued inputs: every dot product is
then exact in float32 and float64 alike (no near-tie can rank differently in the reference's compute
dtype and here), and equal logits are frequent, which exercises the lower-index tie rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from attncomp.codegen import reference as R
from attncomp.policy import DFSS, ET, SPION, Dense, Drop, Hash, Policy, uniform_hash
from attncomp.spec import AttentionSpec, Predicates
from tests.utils import assert_close, fresh_seed

F64 = torch.float64
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)



def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Brute force: DESIGN.md §4, one query row at a time.


def _default_nm(dtype: torch.dtype):
    return (2, 4) if dtype in (torch.float16, torch.bfloat16) else (1, 2)


def _full_bias_allowed(mask, causal, full, pred=None):
    """Per-entry additive bias (float64) and allowed flags of the mask, causality and the structured
    predicates ``pred`` (see :func:`_pred_allows`), as nested lists for the selection and as a float64
    tensor for the differentiable part."""
    B, Hq, Nq, Nk = full
    if mask is None:
        bias = torch.zeros(full, dtype=F64)
        allowed = torch.ones(full, dtype=torch.bool)
    elif mask.dtype == torch.bool:
        bias = torch.zeros(full, dtype=F64)
        allowed = torch.broadcast_to(mask, full).clone()
    else:
        bias = torch.broadcast_to(mask.detach().to(F64), full).clone()
        allowed = bias != float("-inf")
    allowed = allowed.tolist()
    if pred is not None:
        for b in range(B):
            for h in range(Hq):
                for i in range(Nq):
                    for j in range(Nk):
                        if not _pred_allows(pred, causal, b, i, j, Nq, Nk):
                            allowed[b][h][i][j] = False
    elif causal:
        for b in range(B):
            for h in range(Hq):
                for i in range(Nq):
                    for j in range(Nk):
                        if j > i:
                            allowed[b][h][i][j] = False
    return bias, allowed


def _at(t, b, i):
    """Element (b, i) of a (B or 1, N) tensor, as a Python value."""
    return t[b if t.shape[0] > 1 else 0, i].item()


def _pred_allows(pred, causal, b, i, j, Nq, Nk):
    """DESIGN.md §4.1 for one entry, written out: the window on positions (causal caps the right side
    at 0; default positions arange, queries shifted by Nk - Nq when bottom-right), equal segments,
    valid key, valid query."""
    win, p = pred["win"], pred["preds"]
    qp = _at(p.q_pos, b, i) if p.q_pos is not None else i + (Nk - Nq if win.get("causal_align") == "bottom_right" else 0)
    kp = _at(p.k_pos, b, j) if p.k_pos is not None else j
    left, right = win.get("window_left"), win.get("window_right")
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None and not kp >= qp - left:
        return False
    if right is not None and not kp <= qp + right:
        return False
    if p.q_seg is not None and _at(p.q_seg, b, i) != _at(p.k_seg, b, j):
        return False
    if p.k_valid is not None and not _at(p.k_valid, b, j):
        return False
    if p.q_valid is not None and not _at(p.q_valid, b, i):
        return False
    return True


def brute_force(q, k, v, mask=None, *, causal=False, scale=None, policy: Policy = Dense(), dtype=None,
                q_aux=None, k_aux=None, block_pattern=None, dropout_p=0.0, seed=0, bias_leaf=None, pred=None):
    """Return ``(out, lse, keep)`` in float64; ``keep`` a bool ``(B, Hq, Nq, Nk)`` tensor.

    ``q, k, v`` are float64 (they may require grad). ``dtype`` is the input dtype the policy's
    defaults resolve for. ``bias_leaf`` (full-shape float64, requires grad) replaces the float mask in
    the differentiable part, so its gradient can be taken. The selection is computed without grad.
    """
    B, Hq, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    grp = Hq // Hk
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bias, allowed = _full_bias_allowed(mask, causal, (B, Hq, Nq, Nk), pred)
    if bias_leaf is not None:
        bias = bias_leaf
    qd, kd = q.detach(), k.detach()
    keep = [[[[False] * Nk for _ in range(Nq)] for _ in range(Hq)] for _ in range(B)]
    out_rows, lse_rows = [], []
    for b in range(B):
        for h in range(Hq):
            hk = h // grp
            for i in range(Nq):
                al = allowed[b][h][i]
                with torch.no_grad():
                    s_all = (scale * (kd[b, hk] @ qd[b, h, i]) + bias[b, h, i].detach()).tolist()
                kept = []
                if isinstance(policy, DFSS):
                    n, m = (policy.n, policy.m) if policy.m is not None else _default_nm(dtype)
                    for g0 in range(0, Nk, m):
                        group = [j for j in range(g0, min(g0 + m, Nk)) if al[j]]
                        group.sort(key=lambda j: (-s_all[j], j))
                        kept += sorted(group[:n])
                elif isinstance(policy, Hash):
                    for j in range(Nk):
                        same = int(q_aux[b, h, i]) == int(k_aux[b, hk, j])
                        if al[j] and same and not (policy.exclude_self and i == j):
                            kept.append(j)
                elif isinstance(policy, Drop):
                    for j in range(Nk):
                        if al[j] and bool(q_aux[b, h, i]) and bool(k_aux[b, hk, j]):
                            kept.append(j)
                elif isinstance(policy, SPION):
                    bs = policy.block_size
                    ph = h if block_pattern.shape[0] > 1 else 0
                    for j in range(Nk):
                        if al[j] and (bool(block_pattern[ph, i // bs, j // bs]) or i // bs == j // bs):
                            kept.append(j)
                else:  # dense, et
                    kept = [j for j in range(Nk) if al[j]]
                for j in kept:
                    keep[b][h][i][j] = True
                if not kept:
                    out_rows.append(torch.zeros(Dv, dtype=F64))
                    lse_rows.append(torch.tensor(float("-inf"), dtype=F64))
                    continue
                idx = torch.tensor(kept, dtype=torch.long)
                s = scale * (k[b, hk, idx] @ q[b, h, i]) + bias[b, h, i, idx]
                mx = s.max().detach()
                e = torch.exp(s - mx)
                z = e.sum()
                p = e / z
                lse_rows.append(mx + torch.log(z))
                if dropout_p > 0:
                    flat = ((b * Hq + h) * Nq + i) * Nk + idx
                    survive = (uniform_hash(seed, flat) >= dropout_p).to(F64)
                    p = p * survive / (1.0 - dropout_p)
                out_rows.append(p @ v[b, hk, idx])
    out = torch.stack(out_rows).reshape(B, Hq, Nq, Dv)
    lse = torch.stack(lse_rows).reshape(B, Hq, Nq)
    return out, lse, torch.tensor(keep, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# Case construction.

SHAPES = {
    # B, Hq, Hk, Nq, Nk, D, Dv
    "mha": (2, 2, 2, 19, 19, 8, 6),
    "gqa_cross": (2, 4, 2, 13, 37, 8, 5),
}

MASKS = ("none", "causal", "bool_keypad", "bool_full", "float_2d", "float_1hqk", "float_finfo_min",
         "causal_float")


def make_mask(kind, B, Hq, Nq, Nk, dtype, g, integer=False):
    """Return ``(mask, causal)``. Fully excluded rows are planted on purpose."""
    fdtype = dtype
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool_keypad":
        lens = torch.randint(1, Nk + 1, (B,), generator=g)
        lens[0] = 0  # batch 0: every key is padding -> all its rows are empty
        m = torch.arange(Nk)[None, :] < lens[:, None]
        return m.view(B, 1, 1, Nk), False
    if kind == "bool_full":
        m = torch.rand(B, Hq, Nq, Nk, generator=g) < 0.7
        m[0, -1, 1] = False
        return m, False

    def values(*shape):
        if integer:
            return torch.randint(-3, 4, shape, generator=g).to(F64)
        return torch.randn(*shape, generator=g, dtype=F64) * 2

    if kind in ("float_2d", "causal_float"):
        m = values(Nq, Nk)
        m[torch.rand(Nq, Nk, generator=g) < 0.2] = float("-inf")
        m[torch.rand(Nq, Nk, generator=g) < 0.1] = torch.finfo(fdtype).min
        m[2] = float("-inf")
        return m.to(fdtype), kind == "causal_float"
    if kind == "float_1hqk":
        m = values(1, Hq, Nq, Nk)
        m[torch.rand(1, Hq, Nq, Nk, generator=g) < 0.25] = float("-inf")
        m[0, 1, 3] = float("-inf")
        return m.to(fdtype), False
    if kind == "float_finfo_min":
        # finfo.min is finite: allowed. A row made of it alone is a softmax over equal logits.
        m = values(B, 1, Nq, Nk)
        m[:, :, 0] = torch.finfo(fdtype).min
        m[1, 0, 4, ::2] = torch.finfo(fdtype).min
        return m.to(fdtype), False
    raise AssertionError(kind)


@dataclass
class PolicyCase:
    name: str
    policy: Policy
    integer: bool = False  # integer-valued q, k (and float mask) for logit ties
    spion_heads: str = "hq"  # block_pattern leading dim: "hq" or "one"


POLICY_CASES = [
    PolicyCase("dense", Dense()),
    PolicyCase("et", ET()),
    PolicyCase("dfss_default", DFSS(), integer=True),
    PolicyCase("dfss_1_2", DFSS(1, 2), integer=True),
    PolicyCase("dfss_2_4", DFSS(2, 4), integer=True),
    PolicyCase("dfss_3_4", DFSS(3, 4), integer=True),
    PolicyCase("dfss_3_8", DFSS(3, 8), integer=True),
    PolicyCase("dfss_7_8", DFSS(7, 8), integer=True),
    PolicyCase("dfss_1_16", DFSS(1, 16), integer=True),
    PolicyCase("dfss_5_16", DFSS(5, 16), integer=True),
    PolicyCase("dfss_2_4_real", DFSS(2, 4)),
    PolicyCase("hash", Hash(n_buckets=4)),
    PolicyCase("hash_exclude_self", Hash(n_buckets=2, exclude_self=True)),
    PolicyCase("drop", Drop()),
    PolicyCase("spion_hq", SPION(block_size=16)),
    PolicyCase("spion_one", SPION(block_size=16), spion_heads="one"),
]
PC = {c.name: c for c in POLICY_CASES}


def make_case(pc: PolicyCase, shape, mask_kind, dtype, seed, *, integer=None):
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hk, Nq, Nk, D, Dv = shape
    integer = pc.integer if integer is None else integer
    if integer:
        q = torch.randint(-2, 3, (B, Hq, Nq, D), generator=g).to(dtype)
        k = torch.randint(-2, 3, (B, Hk, Nk, D), generator=g).to(dtype)
    else:
        q = torch.randn(B, Hq, Nq, D, generator=g, dtype=F64).to(dtype)
        k = torch.randn(B, Hk, Nk, D, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, Hk, Nk, Dv, generator=g, dtype=F64).to(dtype)
    mask, causal = make_mask(mask_kind, B, Hq, Nq, Nk, dtype, g, integer=integer)
    pol = pc.policy
    q_aux = k_aux = bp = None
    if isinstance(pol, Hash):
        q_aux = torch.randint(0, pol.n_buckets, (B, Hq, Nq), generator=g, dtype=torch.int64)
        k_aux = torch.randint(0, pol.n_buckets, (B, Hk, Nk), generator=g).to(torch.int32)
        q_aux[0, 0, 0] = pol.n_buckets + 5  # a query whose bucket no key has
    elif isinstance(pol, Drop):
        q_aux = torch.rand(B, Hq, Nq, generator=g) < 0.7
        k_aux = torch.rand(B, Hk, Nk, generator=g) < 0.7
        q_aux[0, 0, 1] = False
        k_aux[-1, Hk - 1] = False  # a KV head whose keys are all dropped: its group's rows are empty
    elif isinstance(pol, SPION):
        bs = pol.block_size
        lead = Hq if pc.spion_heads == "hq" else 1
        bp = torch.rand(lead, ceil_div(Nq, bs), ceil_div(Nk, bs), generator=g) < 0.4
    # integer logits need an exact scale so that ties stay ties in every compute dtype
    scale = 0.5 if integer else None
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, scale=scale, policy=pol, q_aux=q_aux, k_aux=k_aux,
                block_pattern=bp)


def spec_of(c, dtype=None, dropout_p=0.0):
    mk = "none" if c["mask"] is None else ("bool" if c["mask"].dtype == torch.bool else "float")
    win = c["pred"]["win"] if c.get("pred") else {}
    return AttentionSpec(causal=c["causal"], mask_kind=mk, scale=c["scale"], dropout_p=dropout_p,
                         dtype=None if dtype is None else str(dtype).replace("torch.", ""), policy=c["policy"],
                         **win)


def preds_of(c):
    return c["pred"]["preds"] if c.get("pred") else None


def run_reference(c, spec, dropout_p=0.0, seed=0):
    return R.attention(c["q"], c["k"], c["v"], c["mask"], spec=spec, q_aux=c["q_aux"], k_aux=c["k_aux"],
                       block_pattern=c["block_pattern"], dropout_p=dropout_p, seed=seed, preds=preds_of(c))


def run_brute(c, dtype, dropout_p=0.0, seed=0, grad=False):
    q, k, v = (c[n].detach().to(F64).requires_grad_(grad) for n in ("q", "k", "v"))
    mask = c["mask"]
    bias_leaf = None
    if grad and mask is not None and mask.is_floating_point():
        B, Hq, Nq = q.shape[:3]
        bias_leaf = torch.broadcast_to(mask.to(F64), (B, Hq, Nq, k.shape[2])).clone().requires_grad_(True)
    out, lse, keep = brute_force(q, k, v, mask, causal=c["causal"], scale=c["scale"], policy=c["policy"],
                                 dtype=dtype, q_aux=c["q_aux"], k_aux=c["k_aux"],
                                 block_pattern=c["block_pattern"], dropout_p=dropout_p, seed=seed,
                                 bias_leaf=bias_leaf, pred=c.get("pred"))
    return out, lse, keep, (q, k, v, bias_leaf)


def grads_of(out, go, leaves):
    live = [t for t in leaves if t is not None]
    if not out.requires_grad:  # every row empty: nothing depends on the inputs
        return [None if t is None else torch.zeros_like(t) for t in leaves]
    gs = torch.autograd.grad((out * go.to(F64)).sum(), live, allow_unused=True)
    gs = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(live, gs)]
    it = iter(gs)
    return [None if t is None else next(it) for t in leaves]


def check_against_brute(c, dtype, seed, *, dropout_p=0.0, drop_seed=0, backward=True, spec_dtype=False):
    msg = f"(seed={seed}, dtype={dtype}, policy={c['policy'].describe()}, dropout={dropout_p})"
    spec = spec_of(c, dtype if spec_dtype else None, dropout_p)
    out, lse = run_reference(c, spec, dropout_p, drop_seed)
    bf_out, bf_lse, bf_keep, leaves = run_brute(c, dtype, dropout_p, drop_seed, grad=backward)

    # the selection itself, through the reference's public keep_mask
    s, allowed = R.logits(spec if spec.dtype else spec.replace(dtype=str(dtype).replace("torch.", "")),
                          c["q"], c["k"], c["mask"], preds_of(c))
    sel = R.keep_mask(spec.replace(dtype=str(dtype).replace("torch.", "")), s, allowed, c["q_aux"], c["k_aux"],
                      c["block_pattern"])
    if not torch.equal(sel, bf_keep):
        bad = (sel != bf_keep).nonzero()[:5].tolist()
        raise AssertionError(f"kept entries differ at (b, h, i, j) {bad} {msg}")

    assert out.dtype == dtype and out.shape == bf_out.shape, msg
    # lse is float64 for float64 inputs, float32 for the others (the op's contract)
    assert lse.dtype == (F64 if dtype == F64 else torch.float32) and lse.shape == bf_lse.shape, msg
    assert_close(out, bf_out, dtype, msg="out " + msg)
    assert_close(lse, bf_lse.detach().to(lse.dtype), dtype, msg="lse " + msg)
    empty = ~bf_keep.any(-1)
    assert torch.all(out[empty] == 0), "rows with no kept key must output 0 " + msg
    assert torch.all(torch.isneginf(lse[empty])), "rows with no kept key must have lse=-inf " + msg
    if not backward:
        return empty

    g = torch.Generator().manual_seed(seed + 1)
    go = torch.randn(bf_out.shape, generator=g, dtype=F64).to(dtype)
    want = grads_of(bf_out, go, list(leaves))
    float_mask = c["mask"] is not None and c["mask"].is_floating_point()
    dq, dk, dv, dbias = R.attention_backward(c["q"], c["k"], c["v"], c["mask"], go, spec=spec, q_aux=c["q_aux"],
                                             k_aux=c["k_aux"], block_pattern=c["block_pattern"],
                                             dropout_p=dropout_p, seed=drop_seed, need_mask_grad=float_mask,
                                             preds=preds_of(c))
    for nm, got, exp, ref_in in (("dq", dq, want[0], c["q"]), ("dk", dk, want[1], c["k"]),
                                 ("dv", dv, want[2], c["v"])):
        assert got.dtype == ref_in.dtype and got.shape == ref_in.shape, f"{nm} {msg}"
        assert_close(got, exp, dtype, msg=f"{nm} {msg}")
    if float_mask:
        assert dbias is not None and dbias.shape == want[3].shape, msg
        assert_close(dbias, want[3], torch.float32 if dtype == F64 else dtype, msg="dbias " + msg)
        if dtype == F64:
            assert_close(dbias, want[3], F64, msg="dbias " + msg)
    else:
        assert dbias is None, msg
    # gradients of empty query rows vanish
    assert torch.all(dq[empty] == 0), msg
    return empty


# ---------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.sample(32)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("pname", list(PC))
def test_policy_mask_matrix_float64(pname, mask_kind, shape):
    """Every policy under every mask kind, MHA self-attention and GQA cross-attention, fwd + bwd."""
    seed = fresh_seed()
    c = make_case(PC[pname], SHAPES[shape], mask_kind, F64, seed)
    check_against_brute(c, F64, seed)


@pytest.mark.parametrize("mask_kind", ("causal", "causal_float", "bool_full"))
@pytest.mark.parametrize("pname", list(PC))
def test_tall_cross_attention(pname, mask_kind):
    """Nq > Nk: with top-left causality, queries i >= Nk see every key."""
    seed = fresh_seed()
    c = make_case(PC[pname], (1, 4, 2, 35, 18, 8, 4), mask_kind, F64, seed)
    check_against_brute(c, F64, seed)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("mask_kind", ("bool_keypad", "float_2d", "causal"))
@pytest.mark.parametrize("pname", ("dense", "dfss_default", "dfss_2_4", "dfss_3_8", "hash", "drop", "spion_hq"))
def test_policy_dtypes(pname, mask_kind, dtype):
    """Lower precision inputs: compared with the float64 brute force at the dtype's tolerance."""
    seed = fresh_seed()
    c = make_case(PC[pname], SHAPES["gqa_cross"], mask_kind, dtype, seed)
    check_against_brute(c, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dfss_default_follows_spec_dtype(dtype):
    """DFSS() resolves 2:4 for fp16/bf16 and 1:2 for fp32/fp64, from the spec's dtype when given."""
    seed = fresh_seed()
    c = make_case(PC["dfss_default"], SHAPES["mha"], "none", dtype, seed)
    check_against_brute(c, dtype, seed, spec_dtype=True, backward=False)
    n, m = _default_nm(dtype)
    c2 = dict(c, policy=DFSS(n, m))
    a = run_reference(c, spec_of(c, dtype))[0]
    b = run_reference(c2, spec_of(c2))[0]
    assert torch.equal(a, b), f"seed={seed}"


@pytest.mark.parametrize("m", (2, 4, 8, 16))
def test_dfss_ties_keep_lower_index(m):
    """All logits of a row equal: each group keeps its first n allowed keys (lowest indices)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, m, (1,), generator=g))
    B, H, Nq, Nk, D = 1, 2, 5, int(torch.randint(m + 1, 40, (1,), generator=g)), 4
    q = torch.zeros(B, H, Nq, D, dtype=F64)  # q·k = 0 for every key: a full tie
    k = torch.randn(B, H, Nk, D, generator=g, dtype=F64)
    v = torch.eye(Nk, dtype=F64).expand(B, H, Nk, Nk).contiguous()  # out[i, j] = p[i, j]
    allowed = torch.rand(B, H, Nq, Nk, generator=g) < 0.6
    out, _ = R.attention(q, k, v, allowed, spec=AttentionSpec(mask_kind="bool", policy=DFSS(n, m)))
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                want = []
                for g0 in range(0, Nk, m):
                    want += [j for j in range(g0, min(g0 + m, Nk)) if allowed[b, h, i, j]][:n]
                got = out[b, h, i].nonzero().flatten().tolist()
                assert got == want, f"(seed={seed}, n={n}, m={m}, row {(b, h, i)})"
                if want:
                    assert_close(out[b, h, i, want], torch.full((len(want),), 1.0 / len(want), dtype=F64))


def test_dfss_partial_last_group_is_a_group():
    """Nk % m != 0: the last partial group keeps its own n largest (or all, when it has <= n keys)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    m, n = 8, 3
    Nk = 8 * 2 + int(torch.randint(1, 8, (1,), generator=g))
    q = torch.randn(1, 1, 6, 4, generator=g, dtype=F64)
    k = torch.randn(1, 1, Nk, 4, generator=g, dtype=F64)
    v = torch.eye(Nk, dtype=F64)[None, None]
    out, _ = R.attention(q, k, v, spec=AttentionSpec(policy=DFSS(n, m)))
    s = (q @ k.transpose(-1, -2))[0, 0]
    for i in range(6):
        kept = set(out[0, 0, i].nonzero().flatten().tolist())
        tail = list(range(16, Nk))
        want_tail = set(sorted(tail, key=lambda j: -s[i, j].item())[:n])
        assert kept & set(tail) == want_tail, f"seed={seed}, row {i}"
        assert len(kept) == 2 * n + min(n, len(tail)), f"seed={seed}, row {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pname", ("dense", "dfss_2_4", "hash", "drop", "spion_one"))
def test_empty_rows_zero_output_no_nan(pname, dtype):
    """A row without a kept key: zero output, lse=-inf, zero gradient, no NaN anywhere (incl. autograd
    through the reference forward)."""
    seed = fresh_seed()
    c = make_case(PC[pname], SHAPES["gqa_cross"], "float_2d", dtype, seed)
    c["mask"][5] = float("-inf")
    empty = check_against_brute(c, dtype, seed)
    assert empty.any()
    q, k, v = (c[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    out, lse = R.attention(q, k, v, c["mask"], spec=spec_of(c), q_aux=c["q_aux"], k_aux=c["k_aux"],
                           block_pattern=c["block_pattern"])
    (out.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any(), f"NaN gradient through reference.attention (seed={seed})"
    assert torch.all(q.grad[empty] == 0)


@pytest.mark.parametrize("mask_kind", ("none", "float_2d", "bool_full"))
@pytest.mark.parametrize("pname", ("dense", "dfss_2_4", "hash", "spion_hq"))
def test_autograd_through_reference_forward(pname, mask_kind):
    """``reference.attention`` is differentiable with ordinary autograd and agrees with the brute force."""
    seed = fresh_seed()
    c = make_case(PC[pname], SHAPES["gqa_cross"], mask_kind, F64, seed)
    q, k, v = (c[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    out, _ = R.attention(q, k, v, c["mask"], spec=spec_of(c), q_aux=c["q_aux"], k_aux=c["k_aux"],
                         block_pattern=c["block_pattern"])
    bf_out, _, _, leaves = run_brute(c, F64, grad=True)
    go = torch.randn_like(bf_out)
    got = torch.autograd.grad((out * go).sum(), (q, k, v))
    want = grads_of(bf_out, go, list(leaves[:3]))
    for nm, a, b in zip("qkv", got, want):
        assert_close(a, b, F64, msg=f"d{nm} (seed={seed})")


# -- dropout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", (0.1, 0.5, 0.8))
def test_dropout_keep_is_uniform_hash(p):
    seed = fresh_seed()
    shape = (2, 3, 7, 11)
    idx = torch.arange(math.prod(shape)).view(shape)
    got = R.dropout_keep(seed, p, shape, "cpu")
    assert torch.equal(got, uniform_hash(seed, idx) >= p), f"seed={seed}"
    assert abs((~got).float().mean().item() - p) < 0.08, f"seed={seed}"
    assert not torch.equal(got, R.dropout_keep(seed + 1, p, shape, "cpu")), f"seed={seed}"


@pytest.mark.parametrize("gqa", (False, True))
def test_dropout_mask_and_scaling_seen_through_output(gqa):
    """With v = I, ``out[i, j]`` is the dropped, rescaled probability: zero exactly where
    ``uniform_hash(seed, idx) < p`` (idx row-major in (B, Hq, Nq, Nk)), ``softmax / (1 - p)`` elsewhere."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    p = float(torch.empty(()).uniform_(0.1, 0.9, generator=g))
    B, Hq, Hk, Nq, Nk = 2, 4, (2 if gqa else 4), 9, 14
    q = torch.randn(B, Hq, Nq, 8, generator=g, dtype=F64)
    k = torch.randn(B, Hk, Nk, 8, generator=g, dtype=F64)
    v = torch.eye(Nk, dtype=F64).expand(B, Hk, Nk, Nk).contiguous()
    out, lse = R.attention(q, k, v, spec=AttentionSpec(dropout_p=p), dropout_p=p, seed=seed)
    ref_no_drop, lse0 = R.attention(q, k, v, spec=AttentionSpec())
    survive = uniform_hash(seed, torch.arange(B * Hq * Nq * Nk).view(B, Hq, Nq, Nk)) >= p
    assert torch.equal(out != 0, survive), f"seed={seed}, p={p}"
    kk = k.repeat_interleave(Hq // Hk, dim=1)
    probs = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(8), dim=-1)
    assert_close(out, torch.where(survive, probs / (1 - p), torch.zeros_like(probs)), F64)
    assert torch.equal(lse, lse0), "dropout must not change lse"


@pytest.mark.parametrize("dtype", (torch.float64, torch.float16), ids=str)
@pytest.mark.parametrize("pname", ("dense", "dfss_2_4", "drop", "spion_hq"))
def test_dropout_against_brute(pname, dtype):
    seed = fresh_seed()
    c = make_case(PC[pname], SHAPES["gqa_cross"], "float_2d", dtype, seed)
    p = float(torch.randint(1, 9, (1,)).item()) / 10
    check_against_brute(c, dtype, seed, dropout_p=p, drop_seed=fresh_seed())


def test_reference_backend_object_matches_functions():
    seed = fresh_seed()
    c = make_case(PC["hash"], SHAPES["gqa_cross"], "float_1hqk", F64, seed)
    spec = spec_of(c)
    be = R.ReferenceBackend()
    assert be.supports(spec, c["q"]) is None
    out, lse = be.forward(spec, c["q"], c["k"], c["v"], c["mask"], c["q_aux"], c["k_aux"], None, 0.0, 0)
    bf_out, bf_lse, _, _ = run_brute(c, F64)
    assert_close(out, bf_out, F64)
    assert_close(lse, bf_lse.detach().float(), torch.float32)


# -- structured mask predicates (DESIGN.md §4.1) -------------------------------------------------


def _sorted_ids(g, B, N, n_ids):
    return torch.sort(torch.randint(0, n_ids, (B, N), generator=g), dim=1).values


def make_pred(kind, B, Nq, Nk, seed):
    """``{"win": AttentionSpec fields, "preds": Predicates, "causal": bool}`` for a predicate kind;
    rows with no allowed key are planted where the kind allows it."""
    g = torch.Generator().manual_seed(seed ^ 0x5A5A)
    win, causal = {}, False
    p = dict(q_pos=None, k_pos=None, q_seg=None, k_seg=None, q_valid=None, k_valid=None)
    if kind == "causal_bottom_right":
        win, causal = {"causal_align": "bottom_right"}, True
    elif kind == "window":
        win = {"window_left": 3, "window_right": 2}
    elif kind == "window_causal":
        win, causal = {"window_left": 4}, True
    elif kind == "window_left_bottom_right":
        win = {"window_left": 2, "causal_align": "bottom_right"}
    elif kind == "window_negative_right":
        win = {"window_left": 5, "window_right": -1}      # strictly earlier keys, at most 5 back
    elif kind == "positions":
        # packed documents: positions restart; a window on them, causal
        starts = torch.randint(0, max(Nq, Nk), (B, 1), generator=g)
        p["q_pos"] = (torch.arange(Nq)[None] + starts) % 7
        p["k_pos"] = (torch.arange(Nk)[None] + starts) % 7
        win, causal = {"window_left": 3}, True
    elif kind == "segments":
        p["q_seg"], p["k_seg"] = _sorted_ids(g, B, Nq, 3), _sorted_ids(g, B, Nk, 3).to(torch.int32)
        p["q_seg"][0, 0] = 9                             # a query whose segment has no key
    elif kind == "k_valid":
        p["k_valid"] = torch.rand(B, Nk, generator=g) < 0.7
        p["k_valid"][0] = False                          # batch 0: no valid key at all
    elif kind == "q_valid":
        p["q_valid"] = torch.rand(B, Nq, generator=g) < 0.6
    elif kind == "broadcast":
        p["q_seg"], p["k_seg"] = _sorted_ids(g, 1, Nq, 2), _sorted_ids(g, 1, Nk, 2)
        p["k_valid"] = torch.rand(1, Nk, generator=g) < 0.8
        p["q_pos"] = torch.arange(Nq, dtype=torch.int32)[None] * 2
        win = {"window_right": 3}
    elif kind == "all":
        p["q_pos"] = torch.randint(0, Nk, (B, Nq), generator=g)
        p["k_pos"] = torch.arange(Nk, dtype=torch.int32)[None].expand(B, Nk).contiguous()
        p["q_seg"], p["k_seg"] = _sorted_ids(g, B, Nq, 2), _sorted_ids(g, B, Nk, 2)
        p["q_valid"] = torch.rand(B, Nq, generator=g) < 0.8
        p["k_valid"] = torch.rand(B, Nk, generator=g) < 0.8
        win, causal = {"window_left": 6, "causal_align": "bottom_right"}, True
    else:
        raise AssertionError(kind)
    return {"win": win, "preds": Predicates(**p), "causal": causal}


PREDS = ("causal_bottom_right", "window", "window_causal", "window_left_bottom_right", "window_negative_right",
         "positions", "segments", "k_valid", "q_valid", "broadcast", "all")


def pred_case(pname, shape, mask_kind, pred_kind, dtype, seed):
    c = make_case(PC[pname], SHAPES[shape] if isinstance(shape, str) else shape, mask_kind, dtype, seed)
    B, Nq, Nk = c["q"].shape[0], c["q"].shape[2], c["k"].shape[2]
    pred = make_pred(pred_kind, B, Nq, Nk, seed)
    c["pred"] = pred
    c["causal"] = c["causal"] or pred["causal"]
    return c


#: one case per policy family (the N:M variants differ only in the selection, tested above)
PRED_POLICIES = ("dense", "et", "dfss_default", "dfss_3_8", "hash", "hash_exclude_self", "drop", "spion_one")


@pytest.mark.sample(22)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pname", PRED_POLICIES)
@pytest.mark.parametrize("pred_kind", PREDS)
def test_predicates_every_policy_float64(pred_kind, pname, shape):
    """Every predicate kind alone (and all together), every policy, MHA and GQA cross-attention
    (Nq != Nk: bottom-right alignment is decode), forward, lse, selection and backward."""
    seed = fresh_seed()
    c = pred_case(pname, shape, "none", pred_kind, F64, seed)
    check_against_brute(c, F64, seed)


@pytest.mark.parametrize("mask_kind", ("bool_full", "float_1hqk", "causal_float"))
@pytest.mark.parametrize("pname", ("dense", "dfss_3_4", "hash", "drop", "spion_one", "et"))
@pytest.mark.parametrize("pred_kind", ("window", "segments", "k_valid", "all"))
def test_predicates_with_residual_mask(pred_kind, pname, mask_kind):
    """Predicates AND a dense residual mask (bool or float, with the mask's own gradient)."""
    seed = fresh_seed()
    c = pred_case(pname, "gqa_cross", mask_kind, pred_kind, F64, seed)
    check_against_brute(c, F64, seed)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("pname", ("dense", "dfss_2_4", "hash"))
def test_predicates_low_precision(pname, dtype):
    seed = fresh_seed()
    c = pred_case(pname, "gqa_cross", "float_2d", "all", dtype, seed)
    check_against_brute(c, dtype, seed)


def test_predicates_decode_single_query():
    """One new token over a KV cache: bottom-right causal lets it see every key; top-left only key 0."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 1, 8, generator=g, dtype=F64)
    k = torch.randn(1, 2, 11, 8, generator=g, dtype=F64)
    v = torch.randn(1, 2, 11, 4, generator=g, dtype=F64)
    full, _ = R.attention(q, k, v, spec=AttentionSpec())
    br, _ = R.attention(q, k, v, spec=AttentionSpec(causal=True, causal_align="bottom_right"))
    tl, _ = R.attention(q, k, v, spec=AttentionSpec(causal=True))
    assert_close(br, full, F64, msg=f"seed={seed}")
    assert_close(tl, v[:, :, :1], F64, msg=f"seed={seed}")
    win, _ = R.attention(q, k, v, spec=AttentionSpec(causal=True, causal_align="bottom_right", window_left=2))
    assert_close(win, R.attention(q, k[:, :, -3:], v[:, :, -3:], spec=AttentionSpec())[0], F64)


def test_predicate_mask_is_not_larger_than_the_logits():
    """The predicates are built from O(N) vectors into at most (B, 1, Nq, Nk), never per head."""
    spec = AttentionSpec(causal=True, window_left=3)
    preds = Predicates(q_seg=torch.zeros(3, 5, dtype=torch.long), k_seg=torch.zeros(3, 7, dtype=torch.long),
                       k_valid=torch.ones(1, 7, dtype=torch.bool))
    m = R.predicate_mask(spec, 5, 7, "cpu", preds)
    assert m.shape == (3, 1, 5, 7) and m.dtype == torch.bool
    assert R.predicate_mask(AttentionSpec(), 5, 7, "cpu", Predicates.none()) is None
