"""The SCFA layout (sort, permutations, kept intervals) states exactly the reference's kept set.

Pure PyTorch, no kernel: for many random bucket draws and keep masks, the entries the kernels can
visit (sorted query ``m`` keeps sorted keys ``lo[m] <= p < hi[m]``; sorted key ``p`` is kept by
sorted queries ``qlo[p] <= m < qhi[p]``) must be the reference's kept entries, no more, no less.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("numpy")
pytest.importorskip("triton")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import scfa  # noqa: E402
from attncomp.policy import Drop, Hash  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402


def _forward_set(lay, B, Hq, Nq, Nk):
    """Kept entries in original coordinates from the query-side intervals."""
    keep = torch.zeros(B, Hq, Nq, Nk, dtype=torch.bool)
    Hk = lay.k_perm.shape[1]
    g = Hq // Hk
    p = torch.arange(Nk)
    for b in range(B):
        for h in range(Hq):
            inside = (p[None, :] >= lay.lo[b, h, :, None]) & (p[None, :] < lay.hi[b, h, :, None])
            rows = lay.q_perm[b, h].long()
            cols = lay.k_perm[b, h // g].long()
            keep[b, h, rows[:, None], cols[None, :]] = inside
    return keep


def _backward_set(lay, B, Hq, Nq, Nk):
    """Kept entries in original coordinates from the key-side intervals."""
    qlo, qhi = lay.backward_intervals()
    keep = torch.zeros(B, Hq, Nq, Nk, dtype=torch.bool)
    Hk = lay.k_perm.shape[1]
    g = Hq // Hk
    m = torch.arange(Nq)
    for b in range(B):
        for h in range(Hq):
            inside = (m[None, :] >= qlo[b, h, :, None]) & (m[None, :] < qhi[b, h, :, None])  # (Nk, Nq)
            rows = lay.q_perm[b, h].long()
            cols = lay.k_perm[b, h // g].long()
            keep[b, h, rows[None, :], cols[:, None]] = inside
    return keep


def _draw_buckets(g: torch.Generator, kind: str, shape, nb: int) -> torch.Tensor:
    n = shape[-1]
    if kind == "uniform":
        return torch.randint(0, nb, shape, generator=g, dtype=torch.int32)
    if kind == "skewed":  # a few huge buckets, many tiny or empty ones
        u = torch.rand(shape, generator=g)
        return (nb * u ** 4).floor().to(torch.int32)
    if kind == "single":
        return torch.full(shape, 7, dtype=torch.int32)
    if kind == "distinct":
        return torch.stack([torch.randperm(n, generator=g) for _ in range(shape[0] * shape[1])]).view(shape).to(torch.int32)
    if kind == "wide":  # ids anywhere in int32, negative ones too
        ids = torch.tensor([-(2 ** 31), -5, 0, 3, 2 ** 31 - 1], dtype=torch.int32)
        return ids[torch.randint(0, len(ids), shape, generator=g)]
    raise AssertionError(kind)


_KINDS = ["uniform", "skewed", "single", "distinct", "wide"]


@pytest.mark.parametrize("method", ["count", "sort"])
@pytest.mark.parametrize("draw", range(25))
def test_hash_layout_is_exactly_the_kept_set(draw, method):
    g = torch.Generator().manual_seed(1000 + draw)
    kind = _KINDS[draw % len(_KINDS)]
    nb = int(torch.randint(2, 65, (1,), generator=g))
    B = 2
    Hk = int(torch.randint(1, 3, (1,), generator=g))
    Hq = Hk * int(torch.randint(1, 3, (1,), generator=g))
    Nq = int(torch.randint(1, 90, (1,), generator=g))
    Nk = Nq if draw % 3 else int(torch.randint(1, 90, (1,), generator=g))
    causal = bool(draw % 2)
    qb = _draw_buckets(g, kind, (B, Hq, Nq), nb)
    kb = _draw_buckets(g, kind, (B, Hk, Nk), nb)
    spec = AttentionSpec(causal=causal, policy=Hash(n_buckets=2 * (nb // 2) or 2))
    # 'wide' ids span more than the counting sort takes: 'auto' falls back to torch.sort
    lay = scfa.build_layout(qb, kb, causal, method=method if kind != "wide" else "auto")
    q = torch.zeros(B, Hq, Nq, 4)
    k = torch.zeros(B, Hk, Nk, 4)
    s, allowed = R.logits(spec, q, k)
    ref = R.keep_mask(spec, s, allowed, qb, kb)
    assert torch.equal(_forward_set(lay, B, Hq, Nq, Nk), ref), (kind, nb, causal)
    assert torch.equal(_backward_set(lay, B, Hq, Nq, Nk), ref), (kind, nb, causal)


@pytest.mark.parametrize("method", ["count", "sort"])
@pytest.mark.parametrize("draw", range(10))
def test_drop_layout_is_exactly_the_kept_set(draw, method):
    g = torch.Generator().manual_seed(2000 + draw)
    B, Hk = 2, 2
    Hq = Hk * (1 + draw % 2)
    Nq = int(torch.randint(1, 80, (1,), generator=g))
    Nk = Nq if draw % 3 else int(torch.randint(1, 80, (1,), generator=g))
    causal = draw % 4 != 0
    rq, rk = [(0.5, 0.5), (0.0, 0.0), (0.9, 0.2), (0.2, 0.95), (0.999, 0.5)][draw % 5]
    q_keep = torch.rand(B, Hq, Nq, generator=g) >= rq
    k_keep = torch.rand(B, Hk, Nk, generator=g) >= rk
    if draw == 7:
        q_keep[0, 0] = False  # a head with every query dropped
        k_keep[1, 1] = False  # a head with every key dropped
    spec = AttentionSpec(causal=causal, policy=Drop())
    qg, kg, rng = scfa._groups(spec, q_keep, k_keep)
    lay = scfa.build_layout(qg, kg, causal, group_range=rng, method=method)
    s, allowed = R.logits(spec, torch.zeros(B, Hq, Nq, 4), torch.zeros(B, Hk, Nk, 4))
    ref = R.keep_mask(spec, s, allowed, q_keep, k_keep)
    assert torch.equal(_forward_set(lay, B, Hq, Nq, Nk), ref)
    assert torch.equal(_backward_set(lay, B, Hq, Nq, Nk), ref)
    # compaction: kept queries first, in their original order
    for b in range(B):
        for h in range(Hq):
            n = int(q_keep[b, h].sum())
            assert torch.equal(lay.q_perm[b, h, :n].long(), q_keep[b, h].nonzero().flatten())


@pytest.mark.parametrize("method", ["count", "sort"])
def test_layout_is_stable_and_int32(method):
    qb = torch.tensor([[[3, 1, 3, 1, 2, 3]]], dtype=torch.int32)
    lay = scfa.build_layout(qb, qb, causal=True, method=method)
    assert lay.q_perm.tolist() == [[[1, 3, 4, 0, 2, 5]]]
    assert lay.lo.dtype == lay.hi.dtype == lay.q_perm.dtype == torch.int32
    # query 3 (bucket 1, position 3) keeps keys 1 and 3 -> sorted key positions [0, 2)
    assert (lay.lo[0, 0, 1].item(), lay.hi[0, 0, 1].item()) == (0, 2)


def test_wide_ids_fall_back_to_torch_sort():
    qb = torch.tensor([[[0, 5000, 0]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="counting sort"):
        scfa.build_layout(qb, qb, causal=False, method="count")
    lay = scfa.build_layout(qb, qb, causal=False)
    assert lay.q_perm.tolist() == [[[0, 2, 1]]]
