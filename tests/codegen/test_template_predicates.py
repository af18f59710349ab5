"""The kernel template with the structured-mask predicates (DESIGN §4.1), under Triton's interpreter.

Every policy (dense, dfss, hash, drop, spion) x every predicate (causal top-left and bottom-right,
a window on position vectors, packed segments, key and query padding), alone and combined, with
and without a residual mask, with GQA, odd lengths (not multiples of the tiles) and head dims 32-256:
a pairwise-covering list of cases, forward and backward against the reference run in float64, with
every buffer the backend allocates poisoned (NaN) before the kernels write it. Then: the tile lists
skip exactly the tiles without an allowed entry, and the host path never reads the device.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import schedule as S  # noqa: E402
from attncomp.policy import DFSS, SPION  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates, dtype_name  # noqa: E402
from tests.codegen.template_cases import (CASES, close, make_mask, make_policy, make_preds,  # noqa: E402
                                           make_qkv)
from tests.utils import TOL, fresh_seed, poisoned_empty  # noqa: E402

BACKEND = TB.TritonBackend()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    monkeypatch.setattr(S, "_empty", poisoned_empty)



def _ids(c):
    return "-".join([c[0], "+".join(c[1]) or "nopred", c[2], f"B{c[3]}H{c[4]}/{c[5]}", f"N{c[6]}x{c[7]}", f"D{c[8]}",
                     dtype_name(c[9])])


def _close(name, a, b, dtype, scale_by_max=False):
    close(name, a, b, TOL[dtype], grad=scale_by_max)


def run_case(policy, kinds, mask_kind, B, Hq, Hk, Nq, Nk, D, dtype, *, dropout_p=0.0, backward=True):
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv(policy, g, B, Hq, Hk, Nq, Nk, D, dtype)
    fields, preds = make_preds(kinds, g, B, Nq, Nk)
    mask = make_mask(mask_kind, g, B, Hq, Nq, Nk)
    pol, qa, ka, bp = make_policy(policy, g, B, Hq, Hk, Nq, Nk)
    spec = AttentionSpec(mask_kind=mask_kind, dtype=dtype_name(dtype), policy=pol, **fields)
    seed = fresh_seed()
    out, lse = BACKEND.forward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, preds=preds)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    args = dict(spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, dropout_p=dropout_p, seed=seed, preds=preds)
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, **args)
    _close("out", out, ro, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "rows without a kept key differ"
    fin = torch.isfinite(rl)
    _close("lse", lse[fin], rl[fin], torch.float32)
    if not backward:
        return out, lse
    go = torch.randn(out.shape, generator=g).to(dtype)
    got = BACKEND.backward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, out, lse, go, preds=preds)
    ref = R.attention_backward(q.double(), k.double(), v.double(), m64, go.double(), **args)
    assert got[3] is None
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        _close(name, a, b, dtype, scale_by_max=True)
    return out, lse


@pytest.mark.sample(5)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_policy_x_predicates_matches_reference(case):
    run_case(*case)


_PADDED = [c for c in CASES if {"q_valid", "k_valid"} & set(c[1])]


@pytest.mark.sample(2)
@pytest.mark.parametrize("case", _PADDED, ids=[_ids(c) for c in _PADDED])
def test_padding_through_tile_lists(case, monkeypatch):
    """Padding alone takes the span schedule at these sizes (validity tested per logit); from
    ``PAD_LIST_MIN`` it takes tile lists that skip padded tiles: both match the reference."""
    q = torch.zeros(1, 1, case[7], 32)
    spec, preds = AttentionSpec(), Predicates(k_valid=torch.ones(1, case[7], dtype=torch.bool))
    assert TB.Site(spec, q, q, q, None, 0.0, 0, preds).sched == TB.SCHED_SPAN
    monkeypatch.setattr(TB, "PAD_LIST_MIN", 0)
    assert TB.Site(spec, q, q, q, None, 0.0, 0, preds).sched == TB.SCHED_LIST
    run_case(*case)


@pytest.mark.parametrize("policy", ["dense", "hash"])
def test_predicates_with_dropout(policy):
    run_case(policy, ("bottom_right", "segments", "k_valid"), "none", 2, 2, 1, 33, 40, 32, torch.float32,
             dropout_p=0.3)


def test_query_padding_rows_are_zero():
    out, lse = run_case("dense", ("q_valid", "causal"), "none", 1, 2, 2, 37, 37, 32, torch.float32, backward=False)
    assert (out == 0).all(dim=-1).any() and torch.isneginf(lse).any()


def test_negative_twin_predicates_change_the_result():
    """Dropping a predicate from the call gives another result: the kernels do read them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 32, generator=g) for _ in range(3))
    fields, preds = make_preds(("segments", "k_valid"), g, 1, 37, 37)
    spec = AttentionSpec(**fields)
    a, _ = BACKEND.forward(spec, q, k, v, None, None, None, None, 0.0, 0, preds=preds)
    b, _ = BACKEND.forward(spec, q, k, v, None, None, None, None, 0.0, 0, preds=Predicates(k_valid=preds.k_valid))
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------------------------------------
# Tile schedules: exactly the tiles holding an allowed entry


@pytest.mark.parametrize("kinds", [("causal", "k_valid"), ("bottom_right", "segments"), ("window",),
                                   ("q_valid", "segments", "causal")], ids="+".join)
@pytest.mark.parametrize("outer_q", [True, False], ids=["per-query-tile", "per-key-tile"])
def test_tile_lists_are_the_tiles_with_allowed_entries(kinds, outer_q, monkeypatch):
    monkeypatch.setattr(TB, "PAD_LIST_MIN", 0)  # padding alone builds lists at any size
    g = torch.Generator().manual_seed(5)
    B, Nq, Nk, bm, bn = 2, 70, 90, 16, 32
    fields, preds = make_preds(kinds, g, B, Nq, Nk)
    if "window" in kinds:  # monotone positions: a window then bounds whole tiles
        preds = preds._replace(q_pos=torch.arange(Nq)[None] * 2, k_pos=torch.arange(Nk)[None] * 2)
    spec = AttentionSpec(**fields)
    q = torch.zeros(B, 2, Nq, 32)
    k = torch.zeros(B, 1, Nk, 32)
    site = TB.Site(spec, q, k, k, None, 0.0, 0, preds)
    lst, cnt = site.lists(bm, bn, outer_q)
    allowed = R.predicate_mask(spec, Nq, Nk, "cpu", preds).expand(B, 1, Nq, Nk)[:, 0]
    tq, tk = -(-Nq // bm), -(-Nk // bn)
    pad = torch.zeros(B, tq * bm, tk * bn, dtype=torch.bool)
    pad[:, :Nq, :Nk] = allowed
    tiles = pad.view(B, tq, bm, tk, bn).any(4).any(2)  # (B, tq, tk)
    pad_all = torch.ones(B, tq * bm, tk * bn, dtype=torch.bool)  # out of bounds counts as allowed here
    pad_all[:, :Nq, :Nk] = allowed
    full = pad_all.view(B, tq, bm, tk, bn).all(4).all(2)
    if not outer_q:
        tiles, full = tiles.transpose(1, 2), full.transpose(1, 2)
    for b in range(B):
        for t in range(tiles.shape[1]):
            n = int(cnt[b if cnt.shape[0] > 1 else 0, 0, t])
            got = lst[b if lst.shape[0] > 1 else 0, 0, t, :n]
            want = tiles[b, t].nonzero().flatten()
            assert (got >> 1).tolist() == want.tolist(), (b, t)
            assert ((got & 1) == 1).tolist() == full[b, t, want].tolist(), (b, t)
    assert tiles.float().mean() < 0.9  # the case does skip tiles
    assert (tiles & ~full).any()
    if not {"window", "q_valid"} & set(kinds):  # (a narrow window or random query padding leaves no full tile)
        assert full.any()


def test_span_schedule_skips_tiles_of_a_causal_window():
    """Without per-token tensors the span is computed in the kernel: a query tile visits only the key
    tiles its window reaches (checked by poisoning keys outside it: NaN would propagate)."""
    q = torch.randn(1, 1, 64, 32)
    k = torch.randn(1, 1, 64, 32)
    v = torch.randn(1, 1, 64, 32)
    k[:, :, :16] = float("nan")  # never reached by queries >= 32 with a left window of 8
    v[:, :, :16] = float("nan")
    spec = AttentionSpec(causal=True, window_left=8)
    out, _ = BACKEND.forward(spec, q, k, v, None, None, None, None, 0.0, 0)
    assert not torch.isnan(out[:, :, 32:]).any()
    assert torch.isnan(out[:, :, :16]).any()  # negative twin: the tiles that do reach those keys


# ---------------------------------------------------------------------------------------------
# Sync-free host path


class _SyncTrap(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on device->host reads (``item``, ``tolist``, ``cpu``, ``bool(tensor)``, data-dependent
    shapes) made from attncomp's own code; Triton's interpreter may read tensors freely."""

    OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "_unique2", "unique_dim")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.OPS and _from_attncomp():
            raise AssertionError(f"device->host synchronisation in attncomp: {func}")
        return func(*args, **(kwargs or {}))


def _from_attncomp() -> bool:
    import inspect

    for fr in inspect.stack()[2:]:
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith("test_template_predicates.py"):
            continue
        return "/attncomp/" in f and "/triton/runtime/" not in f and "/triton/language/" not in f
    return False


@contextlib.contextmanager
def sync_trap(monkeypatch):
    for name in ("item", "tolist", "cpu", "__bool__", "numpy"):
        orig = getattr(torch.Tensor, name)

        def trapped(self, *a, _orig=orig, _name=name, **kw):
            if _from_attncomp():
                raise AssertionError(f"device->host synchronisation in attncomp: Tensor.{_name}")
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, trapped)
    with _SyncTrap():
        yield


@pytest.mark.parametrize("read", ["int(x.item())", "x.tolist()", "bool(x.any())", "x.nonzero()"])
def test_sync_trap_catches_a_read(read, monkeypatch):
    """Negative twin of the test below: a host read from code under attncomp/ is caught."""
    import attncomp

    code = compile(f"def f(x):\n    return {read}\n", os.path.join(os.path.dirname(attncomp.__file__), "_probe.py"),
                   "exec")
    ns = {}
    exec(code, ns)
    with sync_trap(monkeypatch):
        with pytest.raises(AssertionError, match="synchronisation"):
            ns["f"](torch.ones(3))


@pytest.mark.parametrize("policy", ["dense", "dfss", "hash", "drop", "spion"])
def test_host_path_is_sync_free(policy, monkeypatch):
    g = torch.Generator().manual_seed(1)
    B, Hq, Hk, N = 1, 2, 1, 33
    fields, preds = make_preds(("bottom_right", "segments", "k_valid", "q_valid"), g, B, N, N)
    pol, qa, ka, bp = make_policy(policy, g, B, Hq, Hk, N, N)
    spec = AttentionSpec(policy=pol, mask_kind="bool", **fields)
    q, k, v = torch.randn(B, Hq, N, 32), torch.randn(B, Hk, N, 32), torch.randn(B, Hk, N, 32)
    mask = torch.rand(B, 1, N, N) > 0.1
    with sync_trap(monkeypatch):
        out, lse = BACKEND.forward(spec, q, k, v, mask, qa, ka, bp, 0.1, 3, preds=preds)
        BACKEND.backward(spec, q, k, v, mask, qa, ka, bp, 0.1, 3, out, lse, torch.ones_like(out), preds=preds)


# ---------------------------------------------------------------------------------------------
# SPION: block sizes 16-128 against tiles smaller and larger than the blocks


@pytest.mark.sample(2)
@pytest.mark.parametrize("kinds", [("causal", "k_valid"), ()], ids=["preds", "nopreds"])
@pytest.mark.parametrize("bs,tiles", [(16, (32, 64)), (32, (16, 16)), (64, (32, 16)), (128, (16, 32)),
                                      (16, (16, 32))])
def test_spion_block_sizes_and_tiles(bs, tiles, kinds):
    """Without predicates, tiles inside one block skip the per-logit block test (the schedule marks
    them whole); tiles spanning several blocks keep it where a block they overlap is dropped."""
    g = torch.Generator().manual_seed(fresh_seed())
    B, Hq, Hk, N, D = 1, 2, 1, (136 if bs == 128 else 90), 32
    q, k, v = (torch.randn(B, h, N, D, generator=g) for h in (Hq, Hk, Hk))
    nb = -(-N // bs)
    pat = torch.rand(1, nb, nb, generator=g) > 0.5
    fields, preds = make_preds(kinds, g, B, N, N)
    spec = AttentionSpec(policy=SPION(block_size=bs), **fields)
    bm, bn = tiles
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 1, "num_stages": 1, "DQ": (bm, bn, 1, 1)}
    out, lse = TB.attention_forward(spec, q, k, v, None, config=cfg, preds=preds, block_pattern=pat)
    args = dict(spec=spec, block_pattern=pat, preds=preds)
    ro, _ = R.attention(q.double(), k.double(), v.double(), **args)
    _close("out", out, ro, torch.float32)
    go = torch.randn_like(out)
    got = TB.attention_backward(spec, q, k, v, None, out, lse, go, config=cfg, preds=preds, block_pattern=pat)
    ref = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), **args)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref[:3]):
        _close(name, a, b, torch.float32, scale_by_max=True)


def test_spion_tile_lists_follow_the_pattern():
    """A pattern with one kept off-diagonal block: each query tile lists its diagonal tile and, for
    the block's rows, the block's tile; nothing else."""
    N, bs = 64, 16
    pat = torch.zeros(1, 4, 4, dtype=torch.bool)
    pat[0, 3, 0] = True
    q = torch.zeros(1, 1, N, 32)
    site = TB.Site(AttentionSpec(policy=SPION(block_size=bs)), q, q, q, None, 0.0, 0, block_pattern=pat)
    lst, cnt = site.lists(16, 16, True)
    assert cnt.flatten().tolist() == [1, 1, 1, 2]
    assert (lst[0, 0, 3, :2] >> 1).tolist() == [0, 3] and (lst[0, 0, 1, :1] >> 1).tolist() == [1]
    # tiles of one block each: every listed pair is wholly kept, so the kernels skip the block test
    assert (lst[0, 0, 3, :2] & 1).tolist() == [1, 1]
    # 32-query tiles span a kept and a dropped block row: the pair (1, 0) is visited but not whole
    lst, cnt = site.lists(32, 16, True)
    assert cnt.flatten().tolist() == [2, 3]
    assert lst[0, 0, 1, :3].tolist() == [0 * 2, 2 * 2, 3 * 2]
    lst, cnt = site.lists(16, 16, False)  # per key tile
    assert cnt.flatten().tolist() == [2, 1, 1, 1] and (lst[0, 0, 0, :2] >> 1).tolist() == [0, 3]


def test_spion_tile_lists_are_reused_until_the_pattern_changes():
    """Lists that depend only on the pattern are built once per pattern and tile shape; writing the
    pattern in place (a refresh) builds them again, and the output follows the new pattern."""
    g = torch.Generator().manual_seed(fresh_seed())
    N, bs, D = 64, 16, 32
    q, k, v = (torch.randn(1, 2, N, D, generator=g) for _ in range(3))
    pat = torch.zeros(1, 4, 4, dtype=torch.bool)
    pat[0, 3, 0] = True
    spec = AttentionSpec(policy=SPION(block_size=bs))
    site = TB.Site(spec, q, k, v, None, 0.0, 0, block_pattern=pat)
    first = site.lists(16, 16, True)
    again = TB.Site(spec, q, k, v, None, 0.0, 0, block_pattern=pat).lists(16, 16, True)
    assert again[0] is first[0] and again[1] is first[1]
    assert TB.Site(spec, q, k, v, None, 0.0, 0, block_pattern=pat).lists(16, 16, False)[0] is not first[0]
    pat[0, 2, 0] = True  # in place: the version changes
    fresh = TB.Site(spec, q, k, v, None, 0.0, 0, block_pattern=pat).lists(16, 16, True)
    assert fresh[0] is not first[0] and fresh[1].flatten().tolist() == [1, 1, 2, 2]
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    out, _ = TB.attention_forward(spec, q, k, v, None, config=cfg, block_pattern=pat)
    ro, _ = R.attention(q.double(), k.double(), v.double(), spec=spec, block_pattern=pat)
    _close("out", out, ro, torch.float32)
    # with token predicates the lists depend on tensors too: never cached
    fields, preds = make_preds(("k_valid",), g, 1, N, N)
    ps = AttentionSpec(policy=SPION(block_size=bs), **fields)
    a = TB.Site(ps, q, k, v, None, 0.0, 0, preds=preds, block_pattern=pat).lists(16, 16, True)
    b = TB.Site(ps, q, k, v, None, 0.0, 0, preds=preds, block_pattern=pat).lists(16, 16, True)
    assert a[0] is not b[0]


# ---------------------------------------------------------------------------------------------
# Key/value tiles through TMA descriptors give the same results


@pytest.mark.parametrize("policy,kinds,Hq,Hk,N,D", [
    ("dense", ("causal",), 4, 2, 45, 40),
    ("dense", ("window", "k_valid"), 2, 2, 37, 64),
    ("dfss", (), 2, 1, 50, 32),  # 2:4 (a key order inside the tile): TMA is declined, the result the same
    ("spion", ("causal",), 2, 2, 33, 32),
    ("hash", ("causal",), 2, 2, 40, 32),  # a sorted layout: TMA is declined
])
def test_tma_descriptors_match_the_reference(policy, kinds, Hq, Hk, N, D):
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv(policy, g, 1, Hq, Hk, N, N, D, torch.float32)  # dfss: exact logits, no near-ties
    pol, qa, ka, bp = make_policy(policy, g, 1, Hq, Hk, N, N)
    fields, preds = make_preds(kinds, g, 1, N, N)
    spec = AttentionSpec(policy=pol, **fields)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "TMA": 1, "TMA_Q": 1}
    site = TB.Site(spec, q, k, v, None, 0.0, 0, preds=preds, q_aux=qa, k_aux=ka, block_pattern=bp)
    expect_tma = policy in ("dense", "spion")
    assert site.kv_descriptors(cfg, 16)[2] == expect_tma
    # the dK/dV pass streams queries: in row order for every policy but a sorted layout
    assert site.q_descriptors(cfg, 16, q, q)[2] == (policy != "hash")
    kw = dict(preds=preds, q_aux=qa, k_aux=ka, block_pattern=bp)
    out, lse = TB.attention_forward(spec, q, k, v, None, config=cfg, **kw)
    args = dict(spec=spec, block_pattern=bp, preds=preds, q_aux=qa, k_aux=ka)
    ro, _ = R.attention(q.double(), k.double(), v.double(), **args)
    _close("out", out, ro, torch.float32)
    go = torch.randn_like(out)
    got = TB.attention_backward(spec, q, k, v, None, out, lse, go, config=cfg, **kw)
    ref = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), **args)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref[:3]):
        _close(name, a, b, torch.float32, scale_by_max=True)


def test_tma_declined_for_unaligned_rows():
    """Rows whose stride is not a multiple of 16 bytes cannot be described to TMA: the address path runs."""
    g = torch.Generator().manual_seed(fresh_seed())
    base = torch.randn(1, 2, 40, 37, generator=g)
    q = k = v = base[..., :36]  # a row stride of 37 floats
    site = TB.Site(AttentionSpec(), q, k, v, None, 0.0, 0)
    assert not site.tma_ok
    # a batch broadcast by expand (stride 0) is not described to TMA either
    kb = torch.randn(1, 2, 40, 32, generator=g).expand(3, 2, 40, 32)
    assert not TB.Site(AttentionSpec(), torch.randn(3, 2, 40, 32), kb, kb, None, 0.0, 0).tma_ok
    assert TB.Site(AttentionSpec(), torch.randn(3, 2, 40, 32), kb.contiguous(), kb.contiguous(), None, 0.0, 0).tma_ok
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "TMA": 1}
    out, _ = TB.attention_forward(AttentionSpec(), q, k, v, None, config=cfg)
    ro, _ = R.attention(q.double(), k.double(), v.double(), spec=AttentionSpec())
    _close("out", out, ro, torch.float32)


# ---------------------------------------------------------------------------------------------
# 2:4 DFSS with the selection fused into the forward's exponentials (config key NM_EXP)


@pytest.mark.parametrize("kinds,mask_kind,dropout_p,dtype", [
    (("causal",), "none", 0.0, torch.float32),
    (("window", "k_valid"), "float", 0.0, torch.float32),
    (("q_valid", "segments"), "bool", 0.2, torch.float32),
    ((), "none", 0.0, torch.bfloat16),
])
def test_dfss_exp_fused_selection_matches_the_reference(kinds, mask_kind, dropout_p, dtype):
    """Only the two kept logits of each group of four are exponentiated; the outputs and lse are the
    reference's, and equal (to rounding) to the unfused selection's. Logits on a coarse grid make
    ties within groups frequent (the lower index wins them)."""
    g = torch.Generator().manual_seed(fresh_seed())
    B, Hq, Hk, N, D = 2, 2, 1, 45, 32
    q = (torch.randint(-3, 4, (B, Hq, N, D), generator=g) / 2).to(dtype)
    k = (torch.randint(-3, 4, (B, Hk, N, D), generator=g) / 2).to(dtype)
    v = torch.randn(B, Hk, N, D, generator=g).to(dtype)
    fields, preds = make_preds(kinds, g, B, N, N)
    mask = make_mask(mask_kind, g, B, Hq, N, N)
    spec = AttentionSpec(policy=DFSS(2, 4), mask_kind=mask_kind, **fields)
    site = TB.Site(spec, q, k, v, mask, dropout_p, 7, preds)
    assert site.nm_exp_ok
    base = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    kw = dict(preds=preds)
    fused, lse_f = TB.attention_forward(spec, q, k, v, mask, dropout_p, 7, config=dict(base, NM_EXP=1), **kw)
    plain, lse_p = TB.attention_forward(spec, q, k, v, mask, dropout_p, 7, config=base, **kw)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, spec=spec, preds=preds, dropout_p=dropout_p, seed=7)
    _close("out", fused, ro, dtype)
    torch.testing.assert_close(fused.float(), plain.float(), atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(torch.isneginf(lse_f), torch.isneginf(rl))
    torch.testing.assert_close(lse_f, lse_p, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_descriptors_equal_the_checked_constructors():
    """``_descriptor`` skips ``TensorDescriptor``'s checks (run once per block shape): the same fields, and a
    block shape TMA cannot take still raises."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.randn(2, 3, 40, 64).transpose(1, 2)[:, :, :2]  # strided, not contiguous
    for rows, cols in ((64, 64), (16, 64), (64, 64)):
        d = TB._descriptor(t, rows, cols)
        ref = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])
        assert d.base is t
        assert (d.shape, d.strides, d.block_shape, d.padding) == (ref.shape, ref.strides, ref.block_shape, ref.padding)
    with pytest.raises(Exception):
        TB._descriptor(t, 48, 64)  # not a power of two
