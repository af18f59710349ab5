"""Triton backend against the reference backend, on the CPU through Triton's interpreter.

Every case draws fresh inputs, fills every buffer the backend allocates with NaN before the
launch (so an element a kernel forgets to write fails the comparison), and compares the forward
``out``/``lse`` and the backward ``dq``/``dk``/``dv`` with ``attncomp.codegen.reference`` run in
float64 on the same inputs, under the per-dtype tolerances of ``tests/utils.py``.

Shapes are tiny (the interpreter runs each tile op through numpy) but cover partial tiles,
``Nq != Nk``, GQA, padded head dims, every mask kind, empty rows, DFSS groups of 2 to 16 with ties,
and dropout, whose keep pattern must equal the reference's bit for bit.
"""

from __future__ import annotations

import os
import types

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import template as _template  # noqa: E402
from attncomp.codegen.triton import configs  # noqa: E402
from attncomp.codegen.triton.common import _uniform_hash  # noqa: E402
from attncomp.policy import DFSS, Dense, ET, Drop, Hash, SPION, get_policy, uniform_hash  # noqa: E402
from attncomp.spec import AttentionSpec, dtype_name  # noqa: E402
from tests.utils import TOL, assert_close, fresh_seed, poisoned_empty  # noqa: E402

if not isinstance(_template._attention_kernel, triton.runtime.interpreter.InterpretedFunction):
    # the kernels were imported (compiled mode) before this module set TRITON_INTERPRET
    pytest.skip("Triton kernels already imported without TRITON_INTERPRET=1; run this module alone",
                allow_module_level=True)

BACKEND = TB.TritonBackend()


@pytest.fixture(autouse=True)
def _poisoned_buffers(monkeypatch):
    """The backend's allocator hands out NaN-filled tensors (ints: a sentinel)."""
    monkeypatch.setattr(TB, "_empty", poisoned_empty)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)



def make_inputs(B, Hq, Nq, D, *, Hk=None, Nk=None, Dv=None, dtype=torch.float32, quantized=False, seed=None):
    """q, k, v; ``quantized`` draws multiples of 1/2 in [-1.5, 1.5] for q and k, so every logit is
    exact in any precision and equal logits (ties) are frequent."""
    g = _gen(fresh_seed() if seed is None else seed)
    Hk, Nk, Dv = Hk or Hq, Nk or Nq, Dv or D

    def qk_values(*shape):
        if quantized:
            return torch.randint(-3, 4, shape, generator=g).float() / 2
        return torch.randn(*shape, generator=g)

    q = qk_values(B, Hq, Nq, D).to(dtype)
    k = qk_values(B, Hk, Nk, D).to(dtype)
    v = torch.randn(B, Hk, Nk, Dv, generator=g).to(dtype)
    return q, k, v


def make_mask(kind, B, Hq, Nq, Nk, g, dtype=torch.float32):
    """Masks of every kind the op accepts (DESIGN.md §4), with some entries excluded."""
    if kind == "none":
        return None
    if kind == "key_padding":  # bool (B, 1, 1, Nk)
        m = torch.ones(B, 1, 1, Nk, dtype=torch.bool)
        for b in range(B):
            m[b, ..., Nk - 1 - b * 3:] = False
        return m
    if kind == "bool_full":  # bool (B, Hq, Nq, Nk)
        return torch.rand(B, Hq, Nq, Nk, generator=g) > 0.3
    if kind == "bool_2d":  # bool (Nq, Nk): broadcast over batch and heads
        return torch.rand(Nq, Nk, generator=g) > 0.4
    if kind == "float":  # additive (B, 1, Nq, Nk) with -inf entries
        m = torch.randint(-2, 2, (B, 1, Nq, Nk), generator=g).to(dtype)
        m[torch.rand(B, 1, Nq, Nk, generator=g) < 0.25] = float("-inf")
        return m
    if kind == "float_heads":  # additive (1, Hq, Nq, Nk)
        m = torch.randn(1, Hq, Nq, Nk, generator=g).to(dtype)
        m[torch.rand(1, Hq, Nq, Nk, generator=g) < 0.2] = float("-inf")
        return m
    if kind == "float_row":  # additive (1, 1, Nq, 1): one bias per query row
        return torch.randn(1, 1, Nq, 1, generator=g).to(dtype)
    raise ValueError(kind)


def spec_for(q, *, causal=False, policy=Dense(), scale=None, mask=None):
    mk = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return AttentionSpec(causal=causal, mask_kind=mk, scale=scale, dtype=dtype_name(q.dtype),
                         head_dim=q.shape[-1], gqa_groups=1, policy=policy)


def check(spec, q, k, v, mask=None, *, dropout_p=0.0, seed=0, backward=True):
    """Run the Triton backend and the float64 reference on the same inputs and compare."""
    dtype = q.dtype
    out, lse = BACKEND.forward(spec, q, k, v, mask, None, None, None, dropout_p, seed)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref_out, ref_lse = R.attention(q.double(), k.double(), v.double(), m64, spec=spec, dropout_p=dropout_p, seed=seed)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, "out")
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with lse = -inf differ"
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin].float(), torch.float32, "lse")
    if not backward:
        return out, lse
    go = torch.randn(out.shape, generator=_gen(fresh_seed())).to(dtype)
    dq, dk, dv, dm = BACKEND.backward(spec, q, k, v, mask, None, None, None, dropout_p, seed, out, lse, go)
    assert dm is None
    rq, rk, rv, _ = R.attention_backward(q.double(), k.double(), v.double(), m64, go.double(), spec=spec,
                                         dropout_p=dropout_p, seed=seed)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert a.shape == b.shape and a.dtype == dtype, name
        assert_close(a, b, dtype, name)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Dense attention: shapes, masks, dtypes.

CASES = [
    # (B, Hq, Hk, Nq, Nk, D, Dv, dtype, causal, mask)
    (1, 2, 2, 1, 1, 32, 32, torch.float32, False, "none"),
    (2, 2, 2, 17, 17, 32, 32, torch.float32, True, "none"),
    (1, 2, 2, 40, 40, 48, 48, torch.float32, False, "key_padding"),
    (1, 2, 2, 33, 21, 64, 32, torch.float32, True, "bool_full"),
    (1, 2, 2, 21, 45, 32, 80, torch.float32, False, "float"),
    (1, 2, 2, 40, 40, 32, 32, torch.float32, True, "float_heads"),
    (1, 2, 2, 23, 23, 32, 32, torch.float32, False, "bool_2d"),
    (1, 2, 2, 19, 30, 32, 32, torch.float32, True, "float_row"),
    (1, 4, 2, 37, 37, 32, 32, torch.float32, True, "none"),
    (2, 4, 2, 24, 40, 32, 32, torch.float16, False, "key_padding"),
    (1, 2, 2, 40, 40, 32, 32, torch.bfloat16, True, "none"),
    (1, 2, 2, 33, 33, 80, 80, torch.bfloat16, False, "float"),
    (1, 2, 1, 71, 71, 32, 32, torch.float16, True, "none"),
    (1, 1, 1, 33, 33, 128, 128, torch.float32, False, "none"),
]


@pytest.mark.sample(3)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}Hq{}Hk{}Nq{}Nk{}D{}Dv{}-{}-{}-{}".format(
    *c[:7], str(c[7]).replace("torch.", ""), "causal" if c[8] else "full", c[9]))
def test_dense_matches_reference(case):
    B, Hq, Hk, Nq, Nk, D, Dv, dtype, causal, mask_kind = case
    q, k, v = make_inputs(B, Hq, Nq, D, Hk=Hk, Nk=Nk, Dv=Dv, dtype=dtype)
    mask = make_mask(mask_kind, B, Hq, Nq, Nk, _gen(fresh_seed()), dtype=dtype)
    check(spec_for(q, causal=causal, mask=mask), q, k, v, mask)


def test_explicit_scale_and_et_policy():
    q, k, v = make_inputs(1, 2, 20, 32)
    check(spec_for(q, scale=0.37, policy=ET()), q, k, v)


def test_negative_scale():
    q, k, v = make_inputs(1, 2, 20, 32)
    check(spec_for(q, scale=-0.2, causal=True), q, k, v, backward=False)


def test_noncontiguous_inputs():
    q, k, v = make_inputs(1, 3, 24, 32)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # (B, N, H, D) storage
    assert not q.is_contiguous()
    check(spec_for(q, causal=True), q, k, v)


# ---------------------------------------------------------------------------------------------
# Rows that keep no key: zeros, lse = -inf, finite gradients.

@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_rows(mask_kind):
    B, H, N = 1, 2, 24
    q, k, v = make_inputs(B, H, N, 32)
    allowed = torch.rand(B, H, N, N) > 0.3
    allowed[:, 0, 3] = False      # an empty row inside a tile
    allowed[:, 1, N - 1] = False  # an empty row in the last (partial) tile
    allowed[:, :, :, 0] = False   # with causal, row 0 has no key left
    if mask_kind == "bool":
        mask = allowed
    else:
        mask = torch.where(allowed, torch.randn(B, H, N, N), torch.tensor(float("-inf")))
    spec = spec_for(q, causal=True, mask=mask)
    out, lse = check(spec, q, k, v, mask)
    assert torch.all(out[:, 0, 3] == 0) and torch.all(out[:, 1, N - 1] == 0) and torch.all(out[:, :, 0] == 0)
    assert torch.isneginf(lse[:, 0, 3]).all() and torch.isneginf(lse[:, :, 0]).all()


def test_all_keys_masked_everywhere():
    q, k, v = make_inputs(1, 2, 17, 32)
    mask = torch.zeros(1, 1, 1, 17, dtype=torch.bool)
    out, lse = check(spec_for(q, mask=mask), q, k, v, mask)
    assert torch.all(out == 0) and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# DFSS: N:M selection inside the kernel.

DFSS_CASES = [
    # (n, m, Nq, Nk, causal, mask, dtype)
    (None, None, 40, 40, False, "none", torch.bfloat16),  # default 2:4
    (None, None, 37, 37, True, "none", torch.float32),    # default 1:2
    (1, 2, 33, 45, False, "key_padding", torch.float32),
    (1, 4, 37, 37, True, "none", torch.float32),
    (2, 4, 30, 43, False, "float", torch.float16),
    (3, 4, 21, 21, True, "bool_full", torch.float32),
    (3, 8, 37, 45, False, "none", torch.float32),
    (5, 8, 24, 24, True, "float_heads", torch.float32),
    (1, 16, 19, 37, False, "none", torch.float32),
    (9, 16, 24, 24, True, "bool_full", torch.float32),
]


@pytest.mark.sample(2)
@pytest.mark.parametrize("case", DFSS_CASES, ids=lambda c: "{}of{}-Nq{}Nk{}-{}-{}-{}".format(
    c[0], c[1], c[2], c[3], "causal" if c[4] else "full", c[5], str(c[6]).replace("torch.", "")))
def test_dfss_matches_reference(case):
    n, m, Nq, Nk, causal, mask_kind, dtype = case
    pol = DFSS() if n is None else DFSS(n, m)
    q, k, v = make_inputs(1, 2, Nq, 32, Nk=Nk, dtype=dtype, quantized=True)
    mask = make_mask(mask_kind, 1, 2, Nq, Nk, _gen(fresh_seed()), dtype=dtype)
    check(spec_for(q, causal=causal, policy=pol, mask=mask), q, k, v, mask)


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_dfss_ties_keep_lower_index(m):
    """Every key of a query row has the same logit: the first n of every group are kept."""
    n = m // 2
    Nq, Nk, D = 3, 2 * m + 3, 32
    q = torch.ones(1, 1, Nq, D)
    k = torch.ones(1, 1, Nk, D)
    v = torch.eye(Nk)[None, None]  # out[i, j] = weight of key j
    spec = spec_for(q, policy=DFSS(n, m))
    out, _ = check(spec, q, k, v)
    kept = out[0, 0, :, :Nk] > 0
    expect = torch.tensor([(j % m) < n for j in range(Nk)])
    assert torch.equal(kept, expect.expand(Nq, Nk))


def test_dfss_selection_follows_spec_dtype():
    """The default N:M comes from the spec's dtype (here fp16 -> 2:4) even for fp32 tensors."""
    q, k, v = make_inputs(1, 2, 24, 32, quantized=True)
    spec = spec_for(q, policy=DFSS()).replace(dtype="float16")
    check(spec, q, k, v)


@pytest.mark.parametrize("natural", [0, 1])
def test_backward_config_options(natural):
    """A separate dQ tile shape and both orientations of the dK/dV tiles give the same gradients."""
    q, k, v = make_inputs(1, 2, 37, 32, Nk=45, quantized=True)
    mask = make_mask("bool_full", 1, 2, 37, 45, _gen(fresh_seed()))
    spec = spec_for(q, causal=True, policy=DFSS(2, 4), mask=mask)
    out, lse = BACKEND.forward(spec, q, k, v, mask, None, None, None, 0.1, 7)
    go = torch.randn_like(out)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 1, "num_stages": 1, "DQ": (32, 16, 1, 1), "NATURAL": natural}
    got = TB.attention_backward(spec, q, k, v, mask, out, lse, go, 0.1, 7, config=cfg)
    ref = R.attention_backward(q.double(), k.double(), v.double(), mask, go.double(), spec=spec, dropout_p=0.1, seed=7)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert_close(a, b, torch.float32, name)


# ---------------------------------------------------------------------------------------------
# Dropout: the in-kernel hash is bit-identical to attncomp.policy.uniform_hash.

@triton.jit
def _hash_kernel(Idx, Out, seed, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    idx = tl.load(Idx + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(Out + offs, _uniform_hash(seed, idx), mask=offs < n)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2 ** 31 - 1])
def test_uniform_hash_bit_exact(seed):
    idx = torch.cat([torch.arange(0, 300), torch.randint(0, 2 ** 32, (500,)), torch.tensor([2 ** 32 - 1, 2 ** 31])])
    out = torch.empty(idx.numel(), dtype=torch.float32)
    mixed = (seed * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    # the kernel reads int64 indices and keeps their low 32 bits, like the reference
    _hash_kernel[(triton.cdiv(idx.numel(), 256),)](idx, out, mixed, idx.numel(), BLOCK=256)
    assert torch.equal(out, uniform_hash(seed, idx))


@pytest.mark.parametrize("gqa", [False, True])
def test_dropout_keep_pattern_bit_exact(gqa):
    """With v = identity, out[b, h, i, j] is nonzero exactly where the probability survived."""
    B, Hq, Nq, Nk = 2, 2, 19, 32
    Hk = 1 if gqa else Hq
    q, k, _ = make_inputs(B, Hq, Nq, 32, Hk=Hk, Nk=Nk)
    v = torch.eye(Nk).expand(B, Hk, Nk, Nk).contiguous()
    p, seed = 0.35, fresh_seed()
    spec = spec_for(q)
    out, _ = check(spec, q, k, v, dropout_p=p, seed=seed)
    expect = R.dropout_keep(seed, p, (B, Hq, Nq, Nk), "cpu")
    assert torch.equal(out != 0, expect)


@pytest.mark.parametrize("policy", [Dense(), DFSS(2, 4)], ids=["dense", "dfss"])
def test_dropout_forward_backward(policy):
    q, k, v = make_inputs(1, 2, 33, 32, Nk=40, quantized=policy.name == "dfss")
    mask = make_mask("key_padding", 1, 2, 33, 40, _gen(0))
    check(spec_for(q, causal=True, policy=policy, mask=mask), q, k, v, mask, dropout_p=0.2, seed=fresh_seed())


# ---------------------------------------------------------------------------------------------
# Backend object and configurations.

def test_supports_reasons():
    q = torch.zeros(1, 1, 4, 32)
    assert BACKEND.supports(spec_for(q), q) is None
    assert BACKEND.supports(spec_for(q, policy=DFSS(1, 8)), q) is None
    for pol in (Hash(), Drop(), SPION()):
        assert BACKEND.supports(spec_for(q, policy=pol), q) is None
    assert "dtype" in BACKEND.supports(spec_for(q), q.double())
    big = torch.zeros(1, 1, 4, 512)
    assert "head dim" in BACKEND.supports(spec_for(big), big)


def test_runs_through_the_op():
    """``attncomp.functional.attention`` with ``backend="triton"`` (forward and autograd)."""
    from attncomp.functional import attention

    q, k, v = make_inputs(1, 2, 20, 32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, is_causal=True, policy="dense", backend="triton")
    ref = R.attention(q.detach().double(), k.detach().double(), v.detach().double(),
                      spec=spec_for(q, causal=True))[0]
    assert_close(out.detach(), ref, torch.float32)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_config_candidates_hold_whole_groups(m, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for d in (32, 64, 80, 128, 256):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            fwd = configs.fwd_candidates(d, d, dtype, m)
            bwd = configs.bwd_candidates(d, d, dtype, m)
            assert fwd and bwd
            assert all(c["BLOCK_N"] % max(8, 4 * m) == 0 for c in fwd)
            assert all(c["BLOCK_N"] % max(8, 4 * m) == 0 for c in bwd)
            assert all((c.get("DQ") or (0, c["BLOCK_M"]))[1] % max(8, 4 * m) == 0 for c in bwd)


def test_gpu_defaults_and_spion_blocks_order_the_candidates(monkeypatch):
    """Each GPU's measured default leads its dense lists (same set of candidates); N:M lists keep
    their own order unless the N:M table has an entry; SPION sites get tiles inside one block first."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for (kind, tier), first in configs.GPU_DEFAULTS["h100"].items():
        fn = configs.fwd_candidates if kind == "fwd" else configs.bwd_candidates
        plain, h100 = fn(tier, tier, torch.bfloat16, 1), fn(tier, tier, torch.bfloat16, 1, gpu="h100")
        assert h100[0] == first and sorted(map(str, h100)) == sorted(map(str, plain))
        if (kind, tier, False) not in configs.GPU_DEFAULTS_NM["h100"]:  # (those: the next test)
            assert fn(tier, tier, torch.bfloat16, 4, gpu="h100") == fn(tier, tier, torch.bfloat16, 4)
        spion = fn(tier, tier, torch.bfloat16, 1, block=64, gpu="h100")
        inside = [max(c["BLOCK_M"], c["BLOCK_N"], *(c.get("DQ") or (0, 0))[:2]) <= 64 for c in spion]
        assert inside[0] and inside == sorted(inside, reverse=True)


def test_nm_defaults_follow_the_right_bound(monkeypatch):
    """An N:M list leads with its GPU's measured default for the site's masking (a right bound:
    causal or a window) and keeps its own order otherwise; the set of candidates is the same."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert set(configs.GPU_DEFAULTS_NM) == {"h100", "h200"}
    for gpu, table in configs.GPU_DEFAULTS_NM.items():
        for (kind, tier, bounded), first in table.items():
            fn = configs.fwd_candidates if kind == "fwd" else configs.bwd_candidates
            plain = fn(tier, tier, torch.bfloat16, 4)
            mine = fn(tier, tier, torch.bfloat16, 4, gpu=gpu, bounded=bounded)
            other = fn(tier, tier, torch.bfloat16, 4, gpu=gpu, bounded=not bounded)
            assert mine[0] == first and plain[0] != first, gpu
            assert sorted(map(str, mine)) == sorted(map(str, plain))
            if (kind, tier, not bounded) not in table:
                assert other == plain
    # (the H200's table has only the backward at D=64: its forward lists keep their own order)
    assert configs.fwd_candidates(64, 64, torch.bfloat16, 4, gpu="h200", bounded=True) == configs.fwd_candidates(
        64, 64, torch.bfloat16, 4)


def test_a_one_launch_default_gives_way_under_deterministic_mode(monkeypatch):
    """The H100's DFSS D=64 backward default adds dQ with TMA bulk reductions (not reproducible bit for
    bit): under PyTorch's deterministic mode it is no candidate, and the list leads with two launches."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    first = configs.GPU_DEFAULTS_NM["h100"][("bwd", 64, True)]
    assert first.get("DQ_ATOMIC") == 2
    assert configs.bwd_candidates(64, 64, torch.bfloat16, 4, gpu="h100", bounded=True)[0] == first
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        cands = configs.bwd_candidates(64, 64, torch.bfloat16, 4, gpu="h100", bounded=True)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert cands and not any(c.get("DQ_ATOMIC") for c in cands)


def test_a_causal_dfss_site_launches_its_gpu_default(monkeypatch):
    """The backend asks for the candidates with the site's right bound: a causal DFSS forward on an
    H100 (tuning off) launches the N:M causal default, a non-causal one the list's first."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(configs, "gpu_tag", lambda device: "h100")
    monkeypatch.setattr(TB, "_config_memo", {})
    asked = []
    real = configs.fwd_candidates

    def spy(*a):
        asked.append(a)
        return real(*a)

    for causal in (True, False):
        site = types.SimpleNamespace(D=64, Dv=64, dtype=torch.bfloat16, nm_m=4, spion_bs=0, device=torch.device("cpu"),
                                     win_right=0 if causal else None, signature=lambda c=causal: ("spy", c),
                                     tune_key=lambda: {}, sorted_key=(), tag="")
        launched = []
        TB._run_tuned("fwd", site, launched.append, spy)
        assert asked[-1][-2] is causal and asked[-1][-1] == ""
        want = configs.GPU_DEFAULTS_NM["h100"][("fwd", 64, True)] if causal else real(64, 64, torch.bfloat16, 4)[0]
        assert launched == [want]


@pytest.mark.parametrize("policy", ["hash", "drop", "drop+kv"])
def test_a_sorted_site_launches_its_policys_gpu_default(monkeypatch, policy):
    """hash and drop sites share their kernel's meta-parameters but not their fastest tiles: the backend
    asks for the candidates with the policy, keys its choice with it, and (H100, tuning off) launches the
    policy's default, which for hash at D=128 is a tile only sorted layouts are offered. ``drop+kv``: a
    drop forward reading sorted K/V copies, keyed apart from the gathering one, whose default reads the
    copies through TMA."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(configs, "gpu_tag", lambda device: "h100")
    monkeypatch.setenv("ATTNCOMP_TRITON_TUNE", "0")
    monkeypatch.setattr(TB, "_config_memo", {})
    monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 0)
    name, copies = policy.split("+")[0], policy.endswith("+kv")
    spec = AttentionSpec(causal=True, policy=Hash(n_buckets=4) if name == "hash" else Drop())
    q, k, v = (torch.randn(1, 2, 40, 128, dtype=torch.bfloat16) for _ in range(3))
    with monkeypatch.context() as m:  # the site as the interpreter builds it
        m.setenv("TRITON_INTERPRET", "1")
        site = TB.Site(spec, q, k, v, None, 0.0, 0, None, sorted_kv=copies)
        plain = TB.Site(spec, q, k, v, None, 0.0, 0, None)
    assert site.tag == policy and site.sorted_key == (name, True, copies)
    assert site.tune_key()["layout"] == [name, True, copies]
    launched = []
    TB._run_tuned("fwd", site, launched.append, configs.fwd_candidates)
    want = configs.GPU_DEFAULTS_SORTED["h100"][("fwd", 128, policy)]
    assert launched == [want] and bool(want.get("TMA")) == copies
    cands = configs.fwd_candidates(128, 128, torch.bfloat16, 1, gpu="h100", layout=policy)
    assert configs.FWD_CONFIGS_SORTED[128][0] in cands
    assert configs.FWD_CONFIGS_SORTED[128][0] not in configs.fwd_candidates(128, 128, torch.bfloat16, 1, gpu="h100")
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "1")
        other = TB.Site(spec.replace(policy=Drop() if name == "hash" else Hash(n_buckets=4)), q, k, v, None, 0.0, 0,
                        None)
    assert other.meta(16, 16) == site.meta(16, 16) and other.signature() != site.signature()
    assert (plain.signature() != site.signature()) == copies


def test_interpreter_never_tunes(monkeypatch):
    calls = []
    cfg = configs.choose("x", {}, [{"a": 1}, {"a": 2}], lambda c: calls.append(c) or 1.0)
    assert cfg == {"a": 1} and not calls
