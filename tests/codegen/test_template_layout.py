"""Sorted layouts of ``hash``/``drop`` and the policy derivations fused with them, under the interpreter.

The entries a layout lets the kernels visit (sorted query ``m`` keeps sorted keys ``lo[m] <= p < hi[m]``)
must be exactly the reference's kept set before the other predicates, for the counting sort (Triton)
and the ``torch.sort`` path alike; the fused derivations must reproduce ``attncomp.policy``'s LSH
buckets and keep draws.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

from attncomp.codegen.triton import layout as L  # noqa: E402
from attncomp.policy import Drop, Hash, keep_mask, lsh_buckets  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402


def _visited(lay, B, Hq, Nq, Nk):
    """Kept entries in original coordinates from the query-side ranges."""
    keep = torch.zeros(B, Hq, Nq, Nk, dtype=torch.bool)
    g = Hq // lay.k_perm.shape[1]
    p = torch.arange(Nk)
    for b in range(B):
        for h in range(Hq):
            inside = (p[None, :] >= lay.lo[b, h, :, None]) & (p[None, :] < lay.hi[b, h, :, None])
            keep[b, h, lay.q_perm[b, h].long()[:, None], lay.k_perm[b, h // g].long()[None, :]] = inside
    return keep


def _is_perm(perm):
    n = perm.shape[-1]
    return torch.equal(perm.long().sort(-1).values, torch.arange(n).expand_as(perm))


def _stable_by_group(perm, groups):
    """Sorted by group, original order inside a group."""
    g = torch.gather(groups.long(), -1, perm.long())
    key = g * perm.shape[-1] + perm.long()
    return bool((key[..., 1:] > key[..., :-1]).all())


@pytest.mark.parametrize("method", ["count", "sort"])
@pytest.mark.parametrize("case", range(4))
def test_hash_layout_is_exactly_the_bucket_set(method, case):
    g = torch.Generator().manual_seed(case)
    B, Hq, Hk = [(1, 2, 2), (2, 4, 2), (1, 3, 1), (2, 2, 2)][case]
    Nq, Nk, nb = [(37, 37, 4), (50, 33, 8), (65, 70, 2), (17, 40, 16)][case]
    qb = torch.randint(0, nb, (B, Hq, Nq), generator=g, dtype=torch.int32)
    kb = torch.randint(0, nb, (B, Hk, Nk), generator=g, dtype=torch.int32)
    if case == 3:
        qb[..., ::2] = nb - 1  # a crowded bucket
    if method == "count":
        lay = L.counting_layout(qb, kb, nb, kind=L.GK_IDS, q_shape=(B, Hq, Nq), k_shape=(B, Hk, Nk))
    else:
        lay = L.sorted_layout(qb, kb)
    assert lay.q_perm.dtype == lay.lo.dtype == torch.int32
    assert _is_perm(lay.q_perm) and _is_perm(lay.k_perm)
    assert _stable_by_group(lay.q_perm, qb) and _stable_by_group(lay.k_perm, kb)
    kbq = kb.repeat_interleave(Hq // Hk, dim=1)
    assert torch.equal(_visited(lay, B, Hq, Nq, Nk), qb[..., :, None] == kbq[..., None, :])


def test_sort_path_takes_any_ids():
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([-(2 ** 31), -5, 0, 3, 2 ** 31 - 1], dtype=torch.int32)
    qb = ids[torch.randint(0, 5, (1, 2, 30), generator=g)]
    kb = ids[torch.randint(0, 5, (1, 2, 30), generator=g)]
    lay = L.layout_from_aux(AttentionSpec(policy=Hash()), qb, kb)
    assert torch.equal(_visited(lay, 1, 2, 30, 30), qb[..., :, None] == kb[..., None, :])


@pytest.mark.parametrize("gqa", [False, True])
def test_drop_layout_from_keep_masks(gqa):
    g = torch.Generator().manual_seed(3)
    B, Hq, Nq, Nk = 2, 4, 45, 38
    Hk = 2 if gqa else Hq
    qk = torch.rand(B, Hq, Nq, generator=g) > 0.4
    kk = torch.rand(B, Hk, Nk, generator=g) > 0.4
    kk[0, 0] = False  # a head without keys
    lay = L.layout_from_aux(AttentionSpec(policy=Drop()), qk, kk)
    kkq = kk.repeat_interleave(Hq // Hk, dim=1)
    assert torch.equal(_visited(lay, B, Hq, Nq, Nk), qk[..., :, None] & kkq[..., None, :])
    # kept tokens first, in order (the compaction of SCFA's QK-drop)
    n_kept = qk.sum(-1)
    for b in range(B):
        for h in range(Hq):
            assert torch.equal(lay.q_perm[b, h, :n_kept[b, h]].long(), qk[b, h].nonzero().flatten())


# ---------------------------------------------------------------------------------------------
# Fused derivations


@pytest.mark.parametrize("rates,seed", [((0.5, 0.5), 0), ((0.3, 0.8), 12345), ((0.0, 0.9), 2 ** 31 + 7)])
def test_drop_draws_fused_equal_policy_keep_mask(rates, seed):
    B, Hq, Hk, Nq, Nk = 2, 4, 2, 37, 29
    q = torch.randn(B, Hq, Nq, 32)
    k = torch.randn(B, Hk, Nk, 32)
    spec = AttentionSpec(policy=Drop(q_rate=rates[0], k_rate=rates[1], seed=3))
    lay = L.derive_layout(spec, q, k, seed=seed)
    qk = keep_mask((B, Hq, Nq), rates[0], seed, 0)
    kk = keep_mask((B, Hk, Nk), rates[1], seed, 1)
    assert torch.equal(lay.q_groups == 0, qk) and torch.equal(lay.k_groups == 0, kk)  # bit for bit
    kkq = kk.repeat_interleave(Hq // Hk, dim=1)
    assert torch.equal(_visited(lay, B, Hq, Nq, Nk), qk[..., :, None] & kkq[..., None, :])
    # negative twin: another seed draws other masks
    other = L.derive_layout(spec, q, k, seed=seed + 1)
    assert not (torch.equal(other.q_groups == 0, qk) and torch.equal(other.k_groups == 0, kk))


@pytest.mark.parametrize("D,Dv,Nk,k_rate,dtype", [(32, 32, 29, 0.5, torch.float32), (48, 80, 150, 0.3, torch.bfloat16),
                                                  (16, 16, 300, 0.9, torch.float16), (64, 64, 40, 0.0, torch.float32)])
def test_drop_kv_copies_hold_the_kept_rows_in_sorted_order_then_zeros(D, Dv, Nk, k_rate, dtype):
    """``kv=(k, v)``: the scatter launch copies each kept key's K and V rows to its sorted slot (kept keys
    first, in order) and writes the ``KV_COPY_PAD`` slots after them as zeros; the slots past those stay
    as they were (poisoned here), and the sort itself is the same as without copies."""
    B, Hq, Hk, Nq = 2, 4, 2, 37
    g = torch.Generator().manual_seed(D + Nk)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    # strided views, as projections give them (heads inner)
    k = torch.randn(B, Nk, Hk, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, Nk, Hk, Dv, generator=g).to(dtype).transpose(1, 2)
    spec = AttentionSpec(policy=Drop(q_rate=0.5, k_rate=k_rate, seed=5))
    real = torch.empty
    try:  # every buffer of the layout poisoned
        torch.empty = lambda *a, **kw: real(*a, **kw).fill_(float("nan") if kw.get("dtype", torch.float32)
                                                             .is_floating_point else -7)
        lay = L.derive_layout(spec, q, k, seed=77, kv=(k, v))
    finally:
        torch.empty = real
    plain = L.derive_layout(spec, q, k, seed=77)
    assert torch.equal(lay.k_perm, plain.k_perm) and torch.equal(lay.lo, plain.lo) and lay.kv is not None
    assert plain.kv is None
    ks, vs = lay.kv
    assert ks.shape == (B, Hk, Nk, D) and vs.shape == (B, Hk, Nk, Dv) and ks.is_contiguous() and vs.is_contiguous()
    kept = (lay.k_groups == 0).sum(-1)
    for b in range(B):
        for h in range(Hk):
            n = int(kept[b, h])
            order = lay.k_perm[b, h, :n].long()
            assert torch.equal(order, (lay.k_groups[b, h] == 0).nonzero().flatten())
            assert torch.equal(ks[b, h, :n], k[b, h, order]) and torch.equal(vs[b, h, :n], v[b, h, order])
            pad = min(Nk, n + L.KV_COPY_PAD)
            assert (ks[b, h, n:pad] == 0).all() and (vs[b, h, n:pad] == 0).all()
            assert ks[b, h, pad:].isnan().all() and vs[b, h, pad:].isnan().all()


@pytest.mark.parametrize("D,nb,dtype", [(32, 4, torch.float32), (64, 16, torch.float16), (48, 2, torch.bfloat16),
                                        (128, 8, torch.float32)])
def test_lsh_buckets_fused_equal_policy(D, nb, dtype):
    B, Hq, Hk, N = 2, 4, 2, 45
    g = torch.Generator().manual_seed(D + nb)
    q = torch.randn(B, Hq, N, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, N, D, generator=g).to(dtype)
    spec = AttentionSpec(policy=Hash(n_buckets=nb, seed=11))
    lay = L.derive_layout(spec, q, k)
    rq, rk = lsh_buckets(q, k, nb, 11)
    # equal except where the two best projections tie to rounding (a different summation order)
    for got, ref, x, hmap in ((lay.q_groups, rq, q, Hq // Hk), (lay.k_groups, rk, k, 1)):
        diff = got != ref
        assert diff.float().mean() <= 0.01
        if diff.any():
            from attncomp.policy import _rotation

            R = _rotation(D, nb, Hk, 11, "cpu", torch.float64).repeat_interleave(hmap, dim=0)
            xr = torch.einsum("bhnd,hdc->bhnc", torch.nn.functional.normalize(x.double(), dim=-1), R)
            full = torch.cat([xr, -xr], -1)
            top2 = full.topk(2, dim=-1).values
            assert ((top2[..., 0] - top2[..., 1])[diff] < 1e-5).all()
    kbq = lay.k_groups.repeat_interleave(Hq // Hk, dim=1)
    assert torch.equal(_visited(lay, B, Hq, N, N), lay.q_groups[..., :, None] == kbq[..., None, :])
    # negative twin: another rotation seed gives other buckets
    other = L.derive_layout(AttentionSpec(policy=Hash(n_buckets=nb, seed=12)), q, k)
    assert not torch.equal(other.q_groups, lay.q_groups)


@pytest.mark.parametrize("off,left,right", [(0, None, 0), (13, None, 0), (0, 5, 0), (-4, 3, 6), (7, 0, None)])
def test_window_ranges_cut_each_bucket_run(off, left, right):
    """With default positions the window becomes part of each sorted query's key range: exactly the
    bucket's keys with ``i + off - left <= j <= i + off + right``, for the sort and counting paths."""
    g = torch.Generator().manual_seed(off + 100)
    B, Hq, Hk, Nq, Nk, nb = 2, 4, 2, 37, 50, 4
    qb = torch.randint(0, nb, (B, Hq, Nq), generator=g, dtype=torch.int32)
    kb = torch.randint(0, nb, (B, Hk, Nk), generator=g, dtype=torch.int32)
    i = torch.arange(Nq)[:, None] + off
    j = torch.arange(Nk)[None, :]
    win = torch.ones(Nq, Nk, dtype=torch.bool)
    if left is not None:
        win &= j >= i - left
    if right is not None:
        win &= j <= i + right
    expect = (qb[..., :, None] == kb.repeat_interleave(Hq // Hk, 1)[..., None, :]) & win
    for lay in (L.sorted_layout(qb, kb),
                L.counting_layout(qb, kb, nb, kind=L.GK_IDS, q_shape=(B, Hq, Nq), k_shape=(B, Hk, Nk))):
        cut = L.window_ranges(lay, off, left, right)
        assert torch.equal(_visited(cut, B, Hq, Nq, Nk), expect)
        assert (cut.lo <= cut.hi).all()
        assert cut.window == (off, left, right)
        # no bound on either side gives back the groups' ranges
        whole = L.window_ranges(cut, 0, None, None)
        assert whole.window is None and torch.equal(whole.lo, lay.lo) and torch.equal(whole.hi, lay.hi)


@pytest.mark.sample(4)
@pytest.mark.parametrize("Nq,Nk,off,left,right", [
    (37, 50, 0, None, 0), (37, 50, 13, None, 0), (64, 64, 0, None, 0),  # Nk a multiple of the chunk
    (40, 64, 24, 5, 0), (33, 31, -4, 3, 6), (70, 45, 7, 0, None), (20, 96, 76, 1 << 30, 1 << 30),
    (50, 50, 0, -3, 2)])
@pytest.mark.parametrize("kind", ["ids", "keep", "draw"])
def test_counting_sort_cuts_the_window_in_its_scatter(Nq, Nk, off, left, right, kind):
    """``counting_layout(window=...)`` computes in its scatter launch exactly the ranges that
    :func:`window_ranges` computes from the whole groups (torch ops), for every group kind."""
    g = torch.Generator().manual_seed(Nq * 7 + Nk + (off or 0))
    B, Hq, Hk = 2, 4, 2
    shapes = dict(q_shape=(B, Hq, Nq), k_shape=(B, Hk, Nk))
    if kind == "ids":
        nb = 5
        src = (torch.randint(0, nb, (B, Hq, Nq), generator=g, dtype=torch.int32),
               torch.randint(0, nb, (B, Hk, Nk), generator=g, dtype=torch.int32))
        args = dict(n_groups=nb, kind=L.GK_IDS)
    elif kind == "keep":
        src = (torch.rand(B, Hq, Nq, generator=g) > 0.3, torch.rand(B, Hk, Nk, generator=g) > 0.4)
        src[1][1, 0] = False  # a head without keys
        args = dict(n_groups=3, kind=L.GK_KEEP)
    else:
        src = (torch.empty(B, Hq, Nq, 16), torch.empty(B, Hk, Nk, 16))
        args = dict(n_groups=3, kind=L.GK_DRAW, q_rate=0.4, k_rate=0.5, q_seed_word=12345, k_seed_word=678)
    whole = L.counting_layout(*src, **args, **shapes)
    cut = L.counting_layout(*src, **args, **shapes, window=(off, left, right))
    ref = L.window_ranges(whole, off, left, right)
    assert cut.window == ref.window == (off, left, right)
    for name in ("q_perm", "k_perm", "q_groups", "k_groups"):
        assert torch.equal(getattr(cut, name), getattr(whole, name)), name
    assert torch.equal(cut.lo, ref.lo) and torch.equal(cut.hi, ref.hi)
    # the window cut something (the comparison is not between two uncut layouts)
    assert not torch.equal(cut.hi - cut.lo, whole.hi - whole.lo) or left == 1 << 30
