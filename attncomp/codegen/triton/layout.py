"""Sorted layouts of ``hash`` and ``drop`` (Sparse Causal Flash Attention, seed 002), built on the device,
and the policy derivations fused with them.

Both policies reduce to one schedule: queries (per query head) and keys (per KV head) are stably
sorted by a per-token group id, the hash bucket; for ``drop`` 0 for kept tokens, 1 for dropped
queries and 2 for dropped keys (so a dropped query shares a group with no key, and the stable sort
is the compaction "kept tokens first, in order"). Sorted query ``m`` then keeps exactly the sorted
keys ``lo[m] <= p < hi[m]`` of its group (before the other predicates, which the kernels apply on
original positions). The kernel template reads the permutations to gather rows; only a ``drop``
forward asks for sorted copies of its kept keys' K and V rows (``Layout.kv``), written by the
scatter launch, which its key tiles then read in row order (through TMA where the tiles ask for it).

Two ways to build it, both without a device-to-host read:

* a counting sort in Triton when the ids lie in a known range (``drop``; ``hash`` with buckets
  derived here): per-chunk histograms, a scan over chunks, a stable scatter that also writes the
  ranges (three launches, each over both sides). The group ids themselves are computed in the histogram kernel
  (:func:`_group_ids`): read as given, drawn (the ``drop`` keep draw,
  :func:`attncomp.policy.keep_mask` bit for bit, through the same counter-based hash), or hashed
  (angular LSH, :func:`attncomp.policy.lsh_buckets`: one random rotation per KV head, shared by its
  queries and keys, on L2-normalised vectors; :func:`_lsh_hist_side` on the tensor cores);
* ``torch.sort(stable=True)`` and ``searchsorted`` for caller-given bucket ids of any range.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ...policy import Drop, Hash, _rotation, _stream_seed
from .common import _uniform_hash, cdiv, next_pow2, seed_word, window_bound
from .configs import interpret_mode
from .launch import fast_launch
from .record import constant

__all__ = ["Layout", "layout_from_aux", "derive_layout", "counting_layout", "sorted_layout", "window_ranges",
           "GK_IDS", "GK_KEEP", "GK_DRAW", "GK_LSH"]

GK_IDS = 0   # group ids given (int), shifted by g_off
GK_KEEP = 1  # keep mask given (bool): kept -> 0, dropped -> DROP_ID
GK_DRAW = 2  # keep mask drawn here (counter-based hash of the flat token index)
GK_LSH = 3   # angular LSH buckets of the token vectors

_CHUNK = 32
#: LSH histogram programs: about ``LSH_ELEMS`` elements of x each (a power of two of whole chunks, at most
#: ``LSH_MAX_CHUNKS``), on ``LSH_WARPS`` warps. H100 (``sorted_breakdown.py --lsh``, B=4, H=16, N=16384, bf16):
#: two warps 105 / 231 us at D=64 / 128 against 127 / 255 us on four, 177 / 430 us on eight; 4096 or 16384
#: elements no faster
LSH_ELEMS, LSH_MAX_CHUNKS, LSH_WARPS = 8192, 4, 2
#: sorted K/V copies (``Layout.kv``): slots past the kept keys written as zeros, so that a key tile of up to
#: this many keys that reaches past them reads finite rows (its logits there are masked, its P is 0)
KV_COPY_PAD = 128


class Layout(NamedTuple):
    """Sorted order and kept ranges, all int32: ``q_perm``/``lo``/``hi`` ``(B, Hq, Nq)``, ``k_perm``
    ``(B, Hk, Nk)``; ``q_groups``/``k_groups`` the ids the sort used (in original order)."""

    q_perm: torch.Tensor
    k_perm: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    q_groups: Optional[torch.Tensor] = None
    k_groups: Optional[torch.Tensor] = None
    #: ``(off, left, right)`` when the ranges are cut to that position window (:func:`window_ranges`),
    #: ``None`` when they are whole groups
    window: Optional[Tuple[int, Optional[int], Optional[int]]] = None
    #: ``(k_sorted, v_sorted)``, contiguous ``(B, Hk, Nk, D)``: the K and V rows of group 0's keys (``drop``'s
    #: kept keys) at their sorted slots, then ``KV_COPY_PAD`` zero rows; other slots unwritten. ``None``
    #: where not asked for (:func:`counting_layout`'s ``kv``)
    kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


@triton.jit
def _group_ids(Src, row, offs, valid, N, g_off, rate, seed_word, pos_off, drop_id, GK: tl.constexpr):
    """Group ids (int32, from 0) of tokens ``offs`` of row ``row = b * H + h`` of one side: given ids,
    given keep masks or drawn keep masks (LSH buckets: :func:`_lsh_hist_side`)."""
    if GK == 0:
        g = (tl.load(Src + row * N + offs, mask=valid, other=0).to(tl.int64) - g_off).to(tl.int32)
    elif GK == 1:
        keep = tl.load(Src + row * N + offs, mask=valid, other=0) != 0
        g = tl.where(keep, 0, drop_id)
    else:
        u = _uniform_hash(seed_word, (row.to(tl.int64) * 65537 + offs + pos_off).to(tl.uint32))
        g = tl.where(u >= rate, 0, drop_id)
    return tl.where(valid, g, 0)


@triton.jit
def _hist_side(Src, Grp, Hist, Keep, c, row, N, n_chunks, g_off, rate, seed_word, pos_off, drop_id,
               GK: tl.constexpr, KEEP: tl.constexpr, CHUNK: tl.constexpr, R_P2: tl.constexpr):
    """Group ids of chunk ``c`` of CHUNK tokens of one side's row (written to ``Grp``; with ``KEEP``
    also whether each token is kept, group 0, as bytes to ``Keep``) and their histogram."""
    if c < n_chunks:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < N
        g = _group_ids(Src, row, offs, valid, N, g_off, rate, seed_word, pos_off, drop_id, GK)
        tl.store(Grp + row * N + offs, g, mask=valid)
        if KEEP:
            tl.store(Keep + row * N + offs, (g == 0).to(tl.int8), mask=valid)
        hist = tl.histogram(g, R_P2, mask=valid)
        tl.store(Hist + (row * n_chunks + c) * R_P2 + tl.arange(0, R_P2), hist)


@triton.jit
def _lsh_hist_side(Src, Rot, Grp, Hist, p, row, N, n_chunks, H, G_ROT, Hk, sb, sh, sn, HEAD_D: tl.constexpr,
                   BLOCK_D: tl.constexpr, NB2: tl.constexpr, NB2P: tl.constexpr, XS: tl.constexpr,
                   CHUNK: tl.constexpr, CPP: tl.constexpr, R_P2: tl.constexpr):
    """LSH buckets of the ``CPP`` chunks from ``p * CPP`` of one side's row, in one block of tokens,
    and each chunk's histogram. ``argmax([xR, -xR])`` does not change when ``x`` is scaled, so the
    vectors are not normalised; ``xR`` runs on the tensor cores with float32 accuracy: ``R`` comes in
    three bfloat16 parts (``Rot``: ``(3, Hk, HEAD_D, NB2)``, summing to the float32 rotation) and ``x``
    in ``XS`` (1 for bfloat16 inputs, 2 for float16, 3 for float32), so that every product is exact
    and only the float32 sums round. ``XS == 0`` (Triton's interpreter, which has no bfloat16 dot):
    one float32 product with the parts' sum, the float32 rotation itself."""
    T: tl.constexpr = CHUNK * CPP
    if p * CPP < n_chunks:
        offs = p * T + tl.arange(0, T)
        valid = offs < N
        b = row // H
        h = row % H
        offs_d = tl.arange(0, BLOCK_D)
        dval = offs_d < HEAD_D
        x = tl.load(Src + b * sb + h * sh + offs[:, None].to(tl.int64) * sn + offs_d[None, :],
                    mask=valid[:, None] & dval[None, :], other=0.0)
        offs_c = tl.arange(0, NB2P)
        rmask = dval[:, None] & (offs_c[None, :] < NB2)
        rot = Rot + (h // G_ROT) * (HEAD_D * NB2) + offs_d[:, None] * NB2 + offs_c[None, :]
        part = Hk * HEAD_D * NB2
        r1 = tl.load(rot, mask=rmask, other=0.0)
        r2 = tl.load(rot + part, mask=rmask, other=0.0)
        r3 = tl.load(rot + 2 * part, mask=rmask, other=0.0)
        xr = tl.zeros([T, NB2P], tl.float32)
        if XS == 0:  # (the interpreter: the float32 rotation, exactly the parts' sum)
            rf = r1.to(tl.float32) + r2.to(tl.float32) + r3.to(tl.float32)
            xr = tl.dot(x.to(tl.float32), rf, xr, input_precision="ieee")
        elif XS == 1:
            x1 = x.to(tl.bfloat16)
        elif XS > 1:
            xf = x.to(tl.float32)
            x1 = xf.to(tl.bfloat16)
            rest = xf - x1.to(tl.float32)
            x2 = rest.to(tl.bfloat16)
            if XS == 3:
                x3 = (rest - x2.to(tl.float32)).to(tl.bfloat16)
                xr = tl.dot(x3, r3, tl.dot(x3, r2, tl.dot(x3, r1, xr)))
            xr = tl.dot(x2, r3, tl.dot(x2, r2, tl.dot(x2, r1, xr)))
        if XS > 0:
            xr = tl.dot(x1, r3, tl.dot(x1, r2, tl.dot(x1, r1, xr)))
        cval = offs_c[None, :] < NB2
        pos = tl.where(cval, xr, float("-inf"))
        neg = tl.where(cval, -xr, float("-inf"))
        # argmax of [xr, -xr], the first index on ties (as torch.argmax)
        pmax = tl.max(pos, 1)
        nmax = tl.max(neg, 1)
        ip = tl.min(tl.where(pos == pmax[:, None], offs_c[None, :], NB2P), 1)
        ineg = tl.min(tl.where(neg == nmax[:, None], offs_c[None, :], NB2P), 1)
        g = tl.where(valid, tl.where(pmax >= nmax, ip, NB2 + ineg), 0).to(tl.int32)
        tl.store(Grp + row * N + offs, g, mask=valid)
        cid = p * CPP + tl.arange(0, CPP)
        r = tl.arange(0, R_P2)
        one = ((tl.reshape(g, (CPP, CHUNK))[:, :, None] == r[None, None, :])
               & tl.reshape(valid, (CPP, CHUNK))[:, :, None])
        tl.store(Hist + (row * n_chunks + cid[:, None]) * R_P2 + r[None, :], tl.sum(one.to(tl.int32), 1),
                 mask=(cid < n_chunks)[:, None])


@fast_launch(volatile=("q_seed", "k_seed"))
@triton.jit(do_not_specialize=["q_seed", "k_seed"])  # one kernel for every draw: replays swap the seed words
def _layout_hist(QSrc, KSrc, Rot, QGrp, KGrp, QHist, KHist, QKeep, KKeep, Nq, Nk, q_nch, k_nch, Hq, Hk, G_ROT,
                 sqb, sqh, sqn, skb, skh, skn, g_off, q_rate, k_rate, q_seed, k_seed, q_pos_off, k_rows,
                 GK: tl.constexpr, KEEP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                 NB2: tl.constexpr, NB2P: tl.constexpr, CHUNK: tl.constexpr, R_P2: tl.constexpr,
                 XS: tl.constexpr = 1, CPP: tl.constexpr = 1):
    """:func:`_hist_side` of both sides in one launch: programs ``(chunk, row)``, the key rows first
    (dropped keys are group 2), then the query rows (dropped queries: group 1). LSH buckets: programs
    ``(CPP chunks, row)`` (:func:`_lsh_hist_side`; one rotation per KV head, shared by its ``G_ROT``
    query heads)."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    if GK == 3:
        if r < k_rows:
            _lsh_hist_side(KSrc, Rot, KGrp, KHist, c, r, Nk, k_nch, Hk, 1, Hk, skb, skh, skn, HEAD_D, BLOCK_D, NB2,
                           NB2P, XS, CHUNK, CPP, R_P2)
        else:
            _lsh_hist_side(QSrc, Rot, QGrp, QHist, c, r - k_rows, Nq, q_nch, Hq, G_ROT, Hk, sqb, sqh, sqn, HEAD_D,
                           BLOCK_D, NB2, NB2P, XS, CHUNK, CPP, R_P2)
    elif r < k_rows:
        _hist_side(KSrc, KGrp, KHist, KKeep, c, r, Nk, k_nch, g_off, k_rate, k_seed, 0, 2, GK, KEEP, CHUNK, R_P2)
    else:
        _hist_side(QSrc, QGrp, QHist, QKeep, c, r - k_rows, Nq, q_nch, g_off, q_rate, q_seed, q_pos_off, 1, GK, KEEP,
                   CHUNK, R_P2)


@triton.jit
def _scan_side(Hist, StartPos, Start, Count, row, n_chunks, CB: tl.constexpr, R_P2: tl.constexpr):
    """One row: group sizes ``Count``, group starts ``Start`` and ``StartPos[chunk, g]``, the first
    sorted slot of the chunk's tokens of group ``g``."""
    r = tl.arange(0, R_P2)
    tot = tl.zeros([R_P2], tl.int32)
    for c0 in range(0, n_chunks, CB):
        cc = c0 + tl.arange(0, CB)
        h = tl.load(Hist + (row * n_chunks + cc[:, None]) * R_P2 + r[None, :], mask=(cc < n_chunks)[:, None], other=0)
        tot += tl.sum(h, 0)
    start = tl.cumsum(tot, 0) - tot
    tl.store(Start + row * R_P2 + r, start)
    tl.store(Count + row * R_P2 + r, tot)
    carry = start
    for c0 in range(0, n_chunks, CB):
        cc = c0 + tl.arange(0, CB)
        cm = (cc < n_chunks)[:, None]
        h = tl.load(Hist + (row * n_chunks + cc[:, None]) * R_P2 + r[None, :], mask=cm, other=0)
        tl.store(StartPos + (row * n_chunks + cc[:, None]) * R_P2 + r[None, :], tl.cumsum(h, 0) - h + carry[None, :],
                 mask=cm)
        carry += tl.sum(h, 0)


@fast_launch
@triton.jit
def _layout_scan(QHist, KHist, QStartPos, KStartPos, QStart, KStart, QCount, KCount, q_nch, k_nch, k_rows,
                 CB: tl.constexpr, R_P2: tl.constexpr):
    """:func:`_scan_side` of both sides in one launch: one program per row, the key rows first."""
    r = tl.program_id(0).to(tl.int64)
    if r < k_rows:
        _scan_side(KHist, KStartPos, KStart, KCount, r, k_nch, CB, R_P2)
    else:
        _scan_side(QHist, QStartPos, QStart, QCount, r - k_rows, q_nch, CB, R_P2)


@triton.jit
def _group_rank(KGrp, KStartPos, rk, g, t, valid, Nk, k_nch, end, CHUNK: tl.constexpr, R_P2: tl.constexpr):
    """Per query: the sorted slot of the first key of group ``g`` at a position ``>= t`` (``t`` in
    ``[0, Nk]``; ``end`` past the group): the chunk's first slot of the group plus the group's keys
    of that chunk before ``t``."""
    c = t // CHUNK
    inside = valid & (c < k_nch)
    base = tl.load(KStartPos + (rk * k_nch + c) * R_P2 + g, mask=inside, other=0)
    j = c[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    kg = tl.load(KGrp + rk * Nk + j, mask=inside[:, None] & (j < t[:, None]), other=-1)
    return tl.where(inside, base + tl.sum((kg == g[:, None]).to(tl.int32), 1), end)


@triton.jit
def _copy_rows(Src, sb, sh, sn, Dst, row, Hk, N, offs, pos, take, write, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``offs`` of row ``row = b * Hk + h`` of ``Src`` to slots ``pos`` of the contiguous ``Dst``:
    copied where ``take``, zeros where ``write`` only."""
    d = tl.arange(0, BLOCK)
    dm = (d < HEAD)[None, :]
    src = Src + (row // Hk) * sb + (row % Hk) * sh + offs[:, None].to(tl.int64) * sn + d[None, :]
    x = tl.load(src, mask=take[:, None] & dm, other=0.0)
    tl.store(Dst + (row * N + pos[:, None].to(tl.int64)) * HEAD + d[None, :], x, mask=write[:, None] & dm)


@triton.jit
def _scatter_side(Grp, StartPos, Perm, c, row, N, n_chunks, KStart, KCount, Lo, Hi, H, GROUPS,
                  KGrp, KStartPos, Nk, k_nch, win_off, win_left, win_right,
                  RANGES: tl.constexpr, WIN_L: tl.constexpr, WIN_R: tl.constexpr,
                  CHUNK: tl.constexpr, R_P2: tl.constexpr,
                  K=None, V=None, KS=None, VS=None, skb=0, skh=0, skn=0, svb=0, svh=0, svn=0,
                  COPY: tl.constexpr = False, HEAD_D: tl.constexpr = 16, BLOCK_D: tl.constexpr = 16,
                  HEAD_DV: tl.constexpr = 16, BLOCK_DV: tl.constexpr = 16, PAD: tl.constexpr = 0):
    """Tokens of chunk ``c`` of one side's row to their sorted slots (stable: rank among the chunk's
    earlier tokens of the group); with ``RANGES`` (query side) also each sorted query's range of
    sorted keys of its group, cut to the keys ``i + win_off - win_left <= j <= i + win_off + win_right``
    where ``WIN_L``/``WIN_R`` (the window of :func:`window_ranges`, from the keys' chunk starts).
    With ``COPY`` (key side; ``H`` is then the KV heads) group 0's K and V rows are also copied to
    their slots of ``KS``/``VS``, and the ``PAD`` slots after group 0's written as zeros."""
    if c < n_chunks:
        ar = tl.arange(0, CHUNK)
        offs = c * CHUNK + ar
        valid = offs < N
        g = tl.load(Grp + row * N + offs, mask=valid, other=0)
        rank = tl.sum(((g[:, None] == g[None, :]) & (ar[None, :] < ar[:, None])).to(tl.int32), 1)
        pos = tl.load(StartPos + (row * n_chunks + c) * R_P2 + g, mask=valid, other=0) + rank
        tl.store(Perm + row * N + pos, offs, mask=valid)
        if COPY:
            take = valid & (g == 0)
            write = take | (valid & (pos < tl.load(KCount + row * R_P2) + PAD))
            _copy_rows(K, skb, skh, skn, KS, row, H, N, offs, pos, take, write, HEAD_D, BLOCK_D)
            _copy_rows(V, svb, svh, svn, VS, row, H, N, offs, pos, take, write, HEAD_DV, BLOCK_DV)
        if RANGES:
            rk = (row // H) * (H // GROUPS) + (row % H) // GROUPS
            kst = tl.load(KStart + rk * R_P2 + g, mask=valid, other=0)
            end = kst + tl.load(KCount + rk * R_P2 + g, mask=valid, other=0)
            lo = kst
            hi = end
            p = offs.to(tl.int64) + win_off
            if WIN_L:
                t = tl.minimum(tl.maximum(p - win_left, 0), Nk)
                lo = _group_rank(KGrp, KStartPos, rk, g, t, valid, Nk, k_nch, end, CHUNK, R_P2)
            if WIN_R:
                t = tl.minimum(tl.maximum(p + win_right + 1, 0), Nk)
                hi = tl.maximum(_group_rank(KGrp, KStartPos, rk, g, t, valid, Nk, k_nch, end, CHUNK, R_P2), lo)
            tl.store(Lo + row * N + pos, lo, mask=valid)
            tl.store(Hi + row * N + pos, hi, mask=valid)


@fast_launch
@triton.jit
def _layout_scatter(QGrp, KGrp, QStartPos, KStartPos, QPerm, KPerm, Nq, Nk, q_nch, k_nch, KStart, KCount, Lo, Hi,
                    Hq, GROUPS, win_off, win_left, win_right, k_rows, K, V, KS, VS, skb, skh, skn, svb, svh, svn,
                    WIN_L: tl.constexpr, WIN_R: tl.constexpr, CHUNK: tl.constexpr, R_P2: tl.constexpr,
                    COPY: tl.constexpr = False, HEAD_D: tl.constexpr = 16, BLOCK_D: tl.constexpr = 16,
                    HEAD_DV: tl.constexpr = 16, BLOCK_DV: tl.constexpr = 16, PAD: tl.constexpr = 0):
    """:func:`_scatter_side` of both sides in one launch: programs ``(chunk, row)``, the key rows
    first (with ``COPY``: their K/V rows of group 0 to the sorted copies), then the query rows with
    their ranges."""
    c = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    if r < k_rows:
        _scatter_side(KGrp, KStartPos, KPerm, c, r, Nk, k_nch, KStart, KCount, Lo, Hi, Hq // GROUPS, 1,
                      KGrp, KStartPos, Nk, k_nch, 0, 0, 0, False, False, False, CHUNK, R_P2,
                      K, V, KS, VS, skb, skh, skn, svb, svh, svn, COPY, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, PAD)
    else:
        _scatter_side(QGrp, QStartPos, QPerm, c, r - k_rows, Nq, q_nch, KStart, KCount, Lo, Hi, Hq, GROUPS,
                      KGrp, KStartPos, Nk, k_nch, win_off, win_left, win_right, True, WIN_L, WIN_R, CHUNK, R_P2)


def _side_source(kind: int, src: torch.Tensor):
    if kind == GK_LSH:
        x = src if src.stride(-1) == 1 else src.contiguous()
        return x, (x.stride(0), x.stride(1), x.stride(2))
    if kind in (GK_IDS, GK_KEEP):
        x = src.contiguous()
        return (x.view(torch.uint8) if x.dtype == torch.bool else x), (0, 0, 0)
    return src, (0, 0, 0)


def counting_layout(q_src: torch.Tensor, k_src: torch.Tensor, n_groups: int, *, kind: int,
                    q_shape: Tuple[int, int, int], k_shape: Tuple[int, int, int], g_off: int = 0,
                    rot: Optional[torch.Tensor] = None, q_rate: float = 0.0, k_rate: float = 0.0,
                    q_seed_word: int = 0, k_seed_word: int = 0,
                    window: Optional[Tuple[int, Optional[int], Optional[int]]] = None,
                    keep: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Layout:
    """The layout by counting sort; group ids computed on the device per ``kind`` (``GK_*``) from
    ``q_src``/``k_src`` (ids, keep masks, or the q/k tensors for LSH; ignored for draws).
    Ids must lie in ``[g_off, g_off + n_groups)``. With ``window`` the ranges are those of
    :func:`window_ranges` with it, computed in the same launch. ``keep``: bool ``(q_keep, k_keep)``
    of the sides' shapes, written with whether each token is in group 0 (kept, for ``drop``).
    ``kv``: the ``(k, v)`` of the keys, whose group-0 rows the scatter launch copies into ``Layout.kv``.
    Three launches, each over both sides."""
    (B, Hq, Nq), (_, Hk, Nk) = q_shape, k_shape
    dev = q_src.device
    i32 = torch.int32
    R_P2 = next_pow2(max(n_groups, 2))
    CB = max(1, min(256, 2048 // R_P2))
    D = q_src.shape[-1] if kind == GK_LSH else 16
    nb2 = rot.shape[-1] if kind == GK_LSH else 1
    lsh = dict(HEAD_D=D, BLOCK_D=max(16, next_pow2(D)), NB2=nb2, NB2P=max(16, next_pow2(nb2)))
    qx, (sqb, sqh, sqn) = _side_source(kind, q_src)
    kx, (skb, skh, skn) = _side_source(kind, k_src)
    q_rows, k_rows = B * Hq, B * Hk
    q_nch, k_nch = cdiv(Nq, _CHUNK), cdiv(Nk, _CHUNK)
    qg = torch.empty((B, Hq, Nq), dtype=i32, device=dev)
    kg = torch.empty((B, Hk, Nk), dtype=i32, device=dev)
    q_hist = torch.empty((q_rows, q_nch, R_P2), dtype=i32, device=dev)
    k_hist = torch.empty((k_rows, k_nch, R_P2), dtype=i32, device=dev)
    q_keep, k_keep = (qg, kg) if keep is None else (t.view(torch.uint8) for t in keep)
    cpp = 1
    if kind == GK_LSH:  # blocks of a power of two of whole chunks; x in as many bfloat16 parts as its dtype needs
        cpp = 1 << (max(1, min(LSH_MAX_CHUNKS, LSH_ELEMS // (_CHUNK * lsh["BLOCK_D"]))).bit_length() - 1)
        lsh["XS"] = 0 if interpret_mode() else {torch.bfloat16: 1, torch.float16: 2}.get(qx.dtype, 3)
    _layout_hist[(cdiv(max(q_nch, k_nch), cpp), k_rows + q_rows)](
        qx, kx, qx if rot is None else rot, qg, kg, q_hist, k_hist, q_keep, k_keep, Nq, Nk, q_nch, k_nch, Hq, Hk,
        Hq // Hk, sqb, sqh, sqn, skb, skh, skn, g_off, float(q_rate), float(k_rate), q_seed_word, k_seed_word,
        # queries shorter than keys are the last Nq positions (as attncomp.ops.materialize_aux draws them)
        Nk - Nq if Nq < Nk else 0, k_rows, GK=kind, KEEP=keep is not None, CHUNK=_CHUNK, R_P2=R_P2, CPP=cpp,
        num_warps=1 if kind != GK_LSH else LSH_WARPS, **lsh)
    q_sp, k_sp = torch.empty_like(q_hist), torch.empty_like(k_hist)
    q_st = torch.empty((q_rows, R_P2), dtype=i32, device=dev)
    k_st = torch.empty((k_rows, R_P2), dtype=i32, device=dev)
    q_ct, k_ct = torch.empty_like(q_st), torch.empty_like(k_st)
    _layout_scan[(k_rows + q_rows,)](q_hist, k_hist, q_sp, k_sp, q_st, k_st, q_ct, k_ct, q_nch, k_nch, k_rows,
                                     CB=CB, R_P2=R_P2)
    q_perm = torch.empty((B, Hq, Nq), dtype=i32, device=dev)
    lo, hi = torch.empty_like(q_perm), torch.empty_like(q_perm)
    k_perm = torch.empty((B, Hk, Nk), dtype=i32, device=dev)
    w_off, w_left, w_right = window if window is not None else (0, None, None)
    if w_left is None and w_right is None:
        window = None
    copies, kx, vx, copy_kw, kv_strides = None, k_perm, k_perm, {}, (0,) * 6
    if kv is not None:
        kx, vx = (t if t.stride(-1) == 1 else t.contiguous() for t in kv)
        d, dv = kx.shape[-1], vx.shape[-1]
        copies = (torch.empty((B, Hk, Nk, d), dtype=kx.dtype, device=dev),
                  torch.empty((B, Hk, Nk, dv), dtype=vx.dtype, device=dev))
        copy_kw = dict(COPY=True, HEAD_D=d, BLOCK_D=next_pow2(max(d, 16)), HEAD_DV=dv, BLOCK_DV=next_pow2(max(dv, 16)),
                       PAD=KV_COPY_PAD)
        kv_strides = (*kx.stride()[:3], *vx.stride()[:3])
    ks, vs = copies if copies is not None else (k_perm, k_perm)
    _layout_scatter[(max(q_nch, k_nch), k_rows + q_rows)](
        qg, kg, q_sp, k_sp, q_perm, k_perm, Nq, Nk, q_nch, k_nch, k_st, k_ct, lo, hi, Hq, Hq // Hk,
        int(w_off), window_bound(w_left), window_bound(w_right), k_rows, kx, vx, ks, vs, *kv_strides,
        WIN_L=w_left is not None, WIN_R=w_right is not None, CHUNK=_CHUNK, R_P2=R_P2, num_warps=2, **copy_kw)
    return Layout(q_perm, k_perm, lo, hi, qg, kg, window, copies)


def sorted_layout(q_groups: torch.Tensor, k_groups: torch.Tensor) -> Layout:
    """The layout through ``torch.sort`` (stable) and ``searchsorted``: any integer ids."""
    Hq, Hk = q_groups.shape[1], k_groups.shape[1]
    qg, q_perm = torch.sort(q_groups.to(torch.int64), dim=-1, stable=True)
    kg, k_perm = torch.sort(k_groups.to(torch.int64), dim=-1, stable=True)
    if Hq != Hk:
        B, _, Nk = kg.shape
        kg = kg[:, :, None, :].expand(B, Hk, Hq // Hk, Nk).reshape(B, Hq, Nk)
    kg = kg.contiguous()
    lo = torch.searchsorted(kg, qg, out_int32=True)
    hi = torch.searchsorted(kg, qg, right=True, out_int32=True)
    return Layout(q_perm.to(torch.int32), k_perm.to(torch.int32), lo, hi, q_groups, k_groups)


def window_ranges(lay: Layout, off: int, left: Optional[int], right: Optional[int]) -> Layout:
    """The layout with each sorted query's key range cut to the position window around default
    positions (query ``i`` at ``i + off``, key ``j`` at ``j``): keys of a group are sorted by
    position, so ``i + off - left <= j <= i + off + right`` is a sub-range of the group's run, found
    by ``searchsorted`` on ``group * (Nk + 1) + j``. Causal sites then skip the tiles above each
    bucket's diagonal (SCFA's first/last tile) and need no position test per logit. Reads only the
    permutations and groups: with no bound on either side it gives back whole groups' ranges.
    (:func:`counting_layout` computes the same ranges in its scatter launch.)"""
    Hq, Nk = lay.q_perm.shape[1], lay.k_perm.shape[2]
    M = Nk + 1
    qp, kp = lay.q_perm.long(), lay.k_perm.long()
    qg = torch.gather(lay.q_groups.long(), -1, qp)
    kc = torch.gather(lay.k_groups.long(), -1, kp) * M + kp
    if kc.shape[1] != Hq:
        B, Hk, _ = kc.shape
        kc = kc[:, :, None, :].expand(B, Hk, Hq // Hk, Nk).reshape(B, Hq, Nk)
    kc = kc.contiguous()
    pos = qp + off
    lo_t = qg * M + (pos - left).clamp(0, Nk) if left is not None else qg * M
    hi_t = qg * M + (pos + right).clamp(-1, Nk - 1) if right is not None else qg * M + (Nk - 1)
    lo = torch.searchsorted(kc, lo_t, out_int32=True)
    hi = torch.maximum(torch.searchsorted(kc, hi_t, right=True, out_int32=True), lo)
    return lay._replace(lo=lo, hi=hi, window=None if left is None and right is None else (off, left, right))


def layout_from_aux(spec, q_aux: torch.Tensor, k_aux: torch.Tensor, window=None) -> Layout:
    """The layout of one call from the policy tensors given to the op (buckets or keep masks); the
    counting sort of keep masks cuts its ranges to ``window`` (:func:`window_ranges`), the
    ``torch.sort`` path leaves that to the caller."""
    B, Hq, Nq = q_aux.shape
    Hk, Nk = k_aux.shape[1], k_aux.shape[2]
    if isinstance(spec.policy, Drop):
        return counting_layout(q_aux, k_aux, 3, kind=GK_KEEP, q_shape=(B, Hq, Nq), k_shape=(B, Hk, Nk),
                               window=window)
    return sorted_layout(q_aux, k_aux)


_ROT_CACHE: dict = {}


def _rotation_on(D: int, n_buckets: int, Hk: int, seed: int, device) -> torch.Tensor:
    key = (D, n_buckets, Hk, seed, str(device))
    r = _ROT_CACHE.get(key)
    if r is None:
        # (a constant that recorded plans read as it is: .record)
        # three bfloat16 parts that sum to the float32 rotation (_lsh_hist_side's exact products)
        r32 = _rotation(D, n_buckets, Hk, seed, device, torch.float32)
        r1 = r32.to(torch.bfloat16)
        r2 = (r32 - r1.float()).to(torch.bfloat16)
        r3 = (r32 - r1.float() - r2.float()).to(torch.bfloat16)
        r = _ROT_CACHE[key] = constant(torch.stack([r1, r2, r3]).contiguous())
    return r


def draw_words(seed: int) -> Tuple[int, int]:
    """The seed words of ``drop``'s query and key draws of ``seed`` (streams 0 and 1), as the
    histogram kernel takes them."""
    return seed_word(_stream_seed(seed, 0)), seed_word(_stream_seed(seed, 1))


def derive_layout(spec, q: torch.Tensor, k: torch.Tensor, seed: Optional[int] = None, window=None,
                  keep: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                  kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Layout:
    """The policy's per-token tensors derived on the device and sorted in the same kernels:
    LSH buckets (``hash``, as :func:`attncomp.policy.lsh_buckets`) or keep draws (``drop``, as
    :func:`attncomp.policy.keep_mask` with streams 0 and 1 of ``seed``, default the policy's).
    ``layout.q_groups``/``k_groups`` hold the buckets, or 0 (kept) / nonzero (dropped); the ranges
    are cut to ``window`` (:func:`window_ranges`); ``drop`` also writes its keep masks to ``keep``
    (bool ``(q_keep, k_keep)``) where given, and its kept keys' rows of ``kv = (k, v)`` to ``Layout.kv``."""
    pol = spec.policy
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    shapes = dict(q_shape=(B, Hq, Nq), k_shape=(B, Hk, Nk), window=window)
    if isinstance(pol, Hash):
        rot = _rotation_on(D, pol.n_buckets, Hk, pol.seed, q.device)
        return counting_layout(q, k, pol.n_buckets, kind=GK_LSH, rot=rot, **shapes)
    if isinstance(pol, Drop):
        qw, kw = draw_words(pol.seed if seed is None else seed)
        return counting_layout(q, k, 3, kind=GK_DRAW, q_rate=pol.q_rate, k_rate=pol.k_rate, q_seed_word=qw,
                               k_seed_word=kw, keep=keep, kv=kv, **shapes)
    raise ValueError(f"policy {pol.name!r} has no sorted layout (hash and drop do)")
