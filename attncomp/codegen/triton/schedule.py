"""Tile schedules built on the device: per query tile the list of key tiles it visits (and per key
tile the list of query tiles, for the dK/dV pass).

Two launches, no host loop over tiles and no device-to-host read:

1. :func:`_tile_summaries`, both sides in one launch: for every tile of ``BLOCK`` tokens (in row order, i.e.
   through the sorted layout's permutation for ``hash``/``drop``) the min/max position, min/max
   segment id, whether any token is valid, and on the query side of a sorted layout the hull
   ``[min lo, max hi)`` of the kept key ranges. O(N) reads.
2. :func:`_tile_lists`: one program per outer tile, streaming the inner tiles' summaries in chunks;
   :func:`_tile_visit` decides per (query tile, key tile) pair whether any entry may be kept, and
   the pairs that pass are compacted with a prefix sum into a padded list plus a count.

Both directions use the same test on the same summaries, so the forward, dQ and dK/dV passes visit
the same pairs. A pair is visited iff it may hold a kept entry; the kernels then apply the exact
entry predicate (:func:`.template._entry`).

Summaries are int64 ``(B or 1, H or 1, tiles, 10)``: ``[pmin, pmax, smin, smax, any, rlo, rhi, all, clo,
chi]`` (``any``/``all``: whether any / every token of the tile is valid; ``[rlo, rhi)`` the hull of the
valid rows' nonempty kept key ranges, ``[clo, chi)`` their core: the keys every row in ``N`` keeps, empty
where one row's range is); lists are int32 ``(B or 1, H or 1, outer tiles, inner tiles)`` with counts
``(B or 1, H or 1, outer)``. An entry is ``2 * tile + full``: ``full`` when the §4.1 predicates
(positions, segments, padding), a SPION pattern and a sorted layout's ranges allow every entry of the
pair, so that the kernels skip their per-logit tests there.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import cdiv
from .launch import fast_launch
from .template import _tok_vals

__all__ = ["tile_summaries", "tile_lists"]

_FIELDS = 10
_NF = tl.constexpr(_FIELDS)


def _empty(shape, dtype, device) -> torch.Tensor:
    """The summaries and lists come from here (tests swap it for a filling one: nothing may read an
    element the kernels did not write)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _summary_side(Sum, Perm, Pos, Seg, Val, Lo, Hi, t, r, nt, N, Hs, s_pos, s_seg, s_val, off,
                  BLOCK: tl.constexpr, PERMUTED: tl.constexpr, POS: tl.constexpr, SEG: tl.constexpr,
                  VAL: tl.constexpr, RANGE: tl.constexpr):
    """The summary of tile ``t`` (of ``nt``) of row ``r`` of one side."""
    b = r // Hs
    offs = t * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    if PERMUTED:
        idx = tl.load(Perm + r.to(tl.int64) * N + offs, mask=valid, other=0)
    else:
        idx = offs
    p, sg, v = _tok_vals(idx, valid, b, Pos, s_pos, Seg, s_seg, Val, s_val, off, POS, SEG, VAL)
    ok = valid & v
    if RANGE:
        lo = tl.load(Lo + r.to(tl.int64) * N + offs, mask=valid, other=0)
        hi = tl.load(Hi + r.to(tl.int64) * N + offs, mask=valid, other=0)
        ok = ok & (lo < hi)
    big = 2147483647  # int32 values (see template._tok_vals): a sentinel above all of them
    base = Sum + (r.to(tl.int64) * nt + t) * _NF
    tl.store(base + 0, tl.min(tl.where(ok, p, big), 0))
    tl.store(base + 1, tl.max(tl.where(ok, p, -big), 0))
    tl.store(base + 2, tl.min(tl.where(ok, sg, big), 0))
    tl.store(base + 3, tl.max(tl.where(ok, sg, -big), 0))
    tl.store(base + 4, tl.max(ok.to(tl.int32), 0))
    tl.store(base + 7, tl.min(tl.where(valid, v.to(tl.int32), 1), 0))
    if RANGE:
        tl.store(base + 5, tl.min(tl.where(ok, lo, big), 0))
        tl.store(base + 6, tl.max(tl.where(ok, hi, -big), 0))
        tl.store(base + 8, tl.max(tl.where(valid, lo, -big), 0))
        tl.store(base + 9, tl.min(tl.where(valid, hi, big), 0))


@fast_launch
@triton.jit
def _tile_summaries(QSum, KSum, QPerm, KPerm, QPos, KPos, QSeg, KSeg, QVal, KVal, Lo, Hi, Nq, Nk, ntq, ntk, rows_q,
                    Hqs, Hks, sq_pos, sk_pos, sq_seg, sk_seg, sq_val, sk_val, q_off,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PERMUTED: tl.constexpr, POS: tl.constexpr,
                    QSEG: tl.constexpr, KSEG: tl.constexpr, QVAL: tl.constexpr, KVAL: tl.constexpr,
                    RANGE: tl.constexpr):
    """Both sides in one launch: programs ``(t, r)`` with ``r < rows_q`` summarise query tiles (rows
    of ``Hqs`` heads), the others key tiles (row ``r - rows_q``, rows of ``Hks`` heads)."""
    t = tl.program_id(0)
    r = tl.program_id(1)
    if r < rows_q:
        if t < ntq:
            _summary_side(QSum, QPerm, QPos, QSeg, QVal, Lo, Hi, t, r, ntq, Nq, Hqs, sq_pos, sq_seg, sq_val, q_off,
                          BLOCK_Q, PERMUTED, POS, QSEG, QVAL, RANGE)
    else:
        if t < ntk:
            _summary_side(KSum, KPerm, KPos, KSeg, KVal, Lo, Hi, t, r - rows_q, ntk, Nk, Hks, sk_pos, sk_seg, sk_val,
                          0, BLOCK_K, PERMUTED, POS, KSEG, KVAL, False)


@triton.jit
def _pattern_cover(Pat, spr, spc, qt, kt, ival, TBq, TBk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """``(any, all)``: whether the query tiles ``qt`` x key tiles ``kt`` overlap a kept block of the
    pattern (a diagonal block is always kept), and whether every block they overlap is kept (then
    the kernels skip the per-logit membership test). Tiles and blocks are powers of two: one
    divides the other."""
    PR: tl.constexpr = BLOCK_M // BS if BLOCK_M > BS else 1
    PC: tl.constexpr = BLOCK_N // BS if BLOCK_N > BS else 1
    rb0 = qt * BLOCK_M // BS
    rb1 = tl.minimum((qt * BLOCK_M + BLOCK_M - 1) // BS, TBq - 1)
    cb0 = kt * BLOCK_N // BS
    cb1 = tl.minimum((kt * BLOCK_N + BLOCK_N - 1) // BS, TBk - 1)
    hit = tl.maximum(rb0, cb0) <= tl.minimum(rb1, cb1)
    every = ival
    for r in tl.static_range(PR):
        for c in tl.static_range(PC):
            rr = rb0 + r
            cc = cb0 + c
            m = ival & (rr <= rb1) & (cc <= cb1)
            blk = tl.load(Pat + rr.to(tl.int64) * spr + cc.to(tl.int64) * spc, mask=m, other=0)
            hit = hit | (blk != 0)
            every = every & ((blk != 0) | (rr == cc) | ~m)
    return hit, every


@triton.jit
def _field(base, f, ival):
    return tl.load(base + f, mask=ival, other=0)


@triton.jit
def _tile_visit(QS, KS, qt, kt, ival, Pat, spr, spc, TBq, TBk, win_left, win_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, SEG: tl.constexpr, QVAL: tl.constexpr, KVAL: tl.constexpr,
                RANGE: tl.constexpr, SPION_BS: tl.constexpr):
    """``(visit, full)`` for query tiles ``qt`` and key tiles ``kt`` (equal-shape vectors): whether
    they may share a kept entry, and whether the §4.1 predicates (and a SPION pattern, and a sorted
    layout's ranges) allow all their entries."""
    qs = QS + qt.to(tl.int64) * _NF
    ks = KS + kt.to(tl.int64) * _NF
    ok = ival & (_field(qs, 4, ival) != 0) & (_field(ks, 4, ival) != 0)
    full = ok
    if POS != 0:
        if HAS_LEFT:
            ok = ok & (_field(ks, 1, ival) >= _field(qs, 0, ival) - win_left)
            full = full & (_field(ks, 0, ival) >= _field(qs, 1, ival) - win_left)
        if HAS_RIGHT:
            ok = ok & (_field(ks, 0, ival) <= _field(qs, 1, ival) + win_right)
            full = full & (_field(ks, 1, ival) <= _field(qs, 0, ival) + win_right)
    if SEG:
        qlo = _field(qs, 2, ival)
        klo = _field(ks, 2, ival)
        ok = ok & (_field(ks, 3, ival) >= qlo) & (klo <= _field(qs, 3, ival))
        full = full & (_field(qs, 3, ival) == qlo) & (_field(ks, 3, ival) == klo) & (qlo == klo)
    if QVAL:
        full = full & (_field(qs, 7, ival) != 0)
    if KVAL:
        full = full & (_field(ks, 7, ival) != 0)
    if RANGE:
        ok = ok & (_field(qs, 5, ival) < (kt + 1) * BLOCK_N) & (_field(qs, 6, ival) > kt * BLOCK_N)
        full = full & (_field(qs, 8, ival) <= kt * BLOCK_N) & (_field(qs, 9, ival) >= (kt + 1) * BLOCK_N)
    if SPION_BS > 0:
        hit, every = _pattern_cover(Pat, spr, spc, qt, kt, ival, TBq, TBk, BLOCK_M, BLOCK_N, SPION_BS)
        ok = ok & hit
        full = full & every
    return ok, full & ok


@fast_launch
@triton.jit
def _tile_lists(List, Cnt, QSum, KSum, Pat,
                s_lb, s_lh, s_lt, s_cb, s_ch, s_qb, s_qh, s_kb, s_kh, sph, spr, spc,
                Hl, GROUPS_K, T_inner, TBq, TBk, win_left, win_right,
                OUTER_Q: tl.constexpr, CH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                POS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SEG: tl.constexpr,
                QVAL: tl.constexpr, KVAL: tl.constexpr, RANGE: tl.constexpr, SPION_BS: tl.constexpr):
    o = tl.program_id(0)
    r = tl.program_id(1)
    b = (r // Hl).to(tl.int64)
    h = (r % Hl).to(tl.int64)
    qsum = QSum + b * s_qb + h * s_qh
    ksum = KSum + b * s_kb + (h // GROUPS_K) * s_kh
    pat = Pat + h * sph
    lrow = List + b * s_lb + h * s_lh + o.to(tl.int64) * s_lt
    cnt = 0
    for c0 in range(0, T_inner, CH):
        it = c0 + tl.arange(0, CH)
        ival = it < T_inner
        outer = tl.zeros([CH], dtype=tl.int32) + o
        if OUTER_Q:
            qt = outer
            kt = it
        else:
            qt = it
            kt = outer
        visit, full = _tile_visit(qsum, ksum, qt, kt, ival, pat, spr, spc, TBq, TBk, win_left, win_right,
                                  BLOCK_M, BLOCK_N, POS, HAS_LEFT, HAS_RIGHT, SEG, QVAL, KVAL, RANGE, SPION_BS)
        vi = visit.to(tl.int32)
        pos = cnt + tl.cumsum(vi, 0) - vi
        tl.store(lrow + pos, it * 2 + full.to(tl.int32), mask=visit)
        cnt += tl.sum(vi, 0)
    tl.store(Cnt + b * s_cb + h * s_ch + o, cnt)


def _bstride(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.shape[0] == 1 else t.stride(0)


def tile_summaries(block_m: int, block_n: int, nq: int, nk: int, rows_b: int, hq: int, hk: int, q_perm, k_perm,
                   q_pos, k_pos, q_seg, k_seg, q_val, k_val, lo, hi, q_off: int, pos_kind: int, device):
    """``(qsum, ksum)``: the summaries ``(rows_b, hq, cdiv(nq, block_m), 10)`` of the query side and
    ``(rows_b, hk, cdiv(nk, block_n), 10)`` of the key side (see the module docstring), one launch.

    ``q_perm``/``lo``/``hi``: ``(rows_b, hq, nq)``, ``k_perm``: ``(rows_b, hk, nk)``, both perms or
    neither; ``*_pos``/``*_seg``/``*_val``: ``(B or 1, n)`` or ``None``; ``pos_kind``: 2 when positions
    are given, else positions are ``index + off`` (``q_off`` on the query side, 0 on the key side)."""
    ntq, ntk = cdiv(nq, block_m), cdiv(nk, block_n)
    # every field the lists read is written (the range hull only with ``lo``/``hi``, the only case
    # that reads it): no fill launch; one buffer for both sides
    both = _empty((rows_b * (hq * ntq + hk * ntk) * _FIELDS,), torch.int64, device)
    qsum = both[:rows_b * hq * ntq * _FIELDS].view(rows_b, hq, ntq, _FIELDS)
    ksum = both[rows_b * hq * ntq * _FIELDS:].view(rows_b, hk, ntk, _FIELDS)
    d = both
    _tile_summaries[(max(ntq, ntk), rows_b * (hq + hk))](
        qsum, ksum, d if q_perm is None else q_perm, d if k_perm is None else k_perm, d if q_pos is None else q_pos,
        d if k_pos is None else k_pos, d if q_seg is None else q_seg, d if k_seg is None else k_seg,
        d if q_val is None else q_val, d if k_val is None else k_val, d if lo is None else lo, d if hi is None else hi,
        nq, nk, ntq, ntk, rows_b * hq, hq, hk, _bstride(q_pos), _bstride(k_pos), _bstride(q_seg), _bstride(k_seg),
        _bstride(q_val), _bstride(k_val), q_off,
        BLOCK_Q=block_m, BLOCK_K=block_n, PERMUTED=q_perm is not None, POS=pos_kind, QSEG=q_seg is not None,
        KSEG=k_seg is not None, QVAL=q_val is not None, KVAL=k_val is not None, RANGE=lo is not None,
        num_warps=1 if max(block_m, block_n) <= 32 else 4,
    )
    return qsum, ksum


def tile_lists(qsum: torch.Tensor, ksum: torch.Tensor, *, outer_q: bool, block_m: int, block_n: int,
               rows_h: int, groups_k: int, pattern=None, spion_bs: int = 0, pos_kind: int = 0,
               win_left: Optional[int] = None, win_right: Optional[int] = None, seg: bool = False,
               q_val: bool = False, k_val: bool = False, sorted_ranges: bool = False):
    """``(list, count)``: for every outer tile (query tiles if ``outer_q`` else key tiles) the inner
    tiles it visits (entries ``2 * tile + full``), in increasing order, padded; ``rows_h`` list heads (1 or Hq); the key summary's
    head of list head ``h`` is ``h // groups_k``."""
    rows_b = max(qsum.shape[0], ksum.shape[0])
    tq, tk = qsum.shape[2], ksum.shape[2]
    t_out, t_in = (tq, tk) if outer_q else (tk, tq)
    dev = qsum.device
    lst = _empty((rows_b, rows_h, t_out, t_in), torch.int32, dev)
    cnt = _empty((rows_b, rows_h, t_out), torch.int32, dev)

    def st(t, d):
        return 0 if t.shape[d] == 1 else t.stride(d)

    if pattern is None:
        pat, sph, spr, spc, tbq, tbk = lst, 0, 0, 0, 1, 1
    else:
        pat = pattern.view(torch.uint8) if pattern.dtype == torch.bool else pattern
        sph, spr, spc = st(pat, 0), pat.stride(1), pat.stride(2)
        tbq, tbk = pat.shape[1], pat.shape[2]
    ch = min(128, max(16, triton.next_power_of_2(t_in)))
    _tile_lists[(t_out, rows_b * rows_h)](
        lst, cnt, qsum, ksum, pat,
        lst.stride(0), lst.stride(1), lst.stride(2), cnt.stride(0), cnt.stride(1),
        st(qsum, 0), st(qsum, 1), st(ksum, 0), st(ksum, 1), sph, spr, spc,
        rows_h, groups_k, t_in, tbq, tbk,
        0 if win_left is None else int(win_left), 0 if win_right is None else int(win_right),
        OUTER_Q=outer_q, CH=ch, BLOCK_M=block_m, BLOCK_N=block_n, POS=pos_kind,
        HAS_LEFT=win_left is not None, HAS_RIGHT=win_right is not None, SEG=seg, QVAL=q_val, KVAL=k_val,
        RANGE=sorted_ranges,
        SPION_BS=spion_bs, num_warps=1 if ch <= 32 else 4,
    )
    return lst, cnt
