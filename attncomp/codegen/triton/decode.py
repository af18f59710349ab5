"""The decode kernel: few queries against a long key cache, split over the keys (DESIGN §6, Generation).

A decoding step has ``Nq <= 16`` queries and ``Nk`` cached keys. The template's forward gives such a call
one program per (query tile, batch x query head): ``B * Hq`` programs, each streaming the whole cache, and
under GQA every query head of a group reads its KV head's keys again. Here:

* **one program per (split of the keys, batch x KV head)**: the ``GROUPS * Nq`` query rows of a KV head's
  group (every query head, every query) are one tile of rows, so each K/V tile is read once for the whole
  group; the keys are cut into ``n_split`` contiguous runs of tiles so that ``B * Hk * n_split`` programs
  fill the GPU however small ``B * Hk`` is (flash-decoding);
* each program writes its run's running max, sum and unnormalised output (float32) to a workspace, and
  :func:`_decode_merge` combines the runs of each row by their log-sum-exp into ``out`` and ``lse``.

Everything else is the template's: the §4.1 predicates, the residual mask, the score modifiers and the
policies' keep rules through :func:`.template._entry` and :func:`.template._modify` (each query row carries its
own head), so a decode step keeps exactly what the template (and the reference) keeps. ``drop`` runs without a
sorted layout: a token's keep bit comes from its position hash (as :func:`.layout._group_ids` draws it), or from
the keep masks the caller gave, and the keys it drops are masked out of the K and V loads. Every key tile is
visited; tiles that the position window excludes are skipped.
``hash`` runs here when its buckets are given, as a KV cache that keeps its keys' buckets gives them
(:mod:`attncomp.kvcache`): each program first lists the keys of its run whose bucket is some row's of the group
(reading the buckets, 4 bytes a key, into a list in a workspace), then visits only those, a tile at a time, so it
reads the K and V rows of those keys only. (Masking the other keys out of every tile's K and V loads instead took
0.89 ms against dense's 0.94 ms on the H200 at B=32, 32 q / 8 kv heads and 32k keys, reading 23% of them; listed
first, 0.42 ms: ``bench decode``, policy ``hash-cache``.) With buckets derived per call it takes the template's
sorted layout, which reads only the keys of each query's bucket, which beat reading them all (H200, 32k keys, bf16,
LSH buckets computed from the key tiles in a version of these kernels: 0.46 ms against 1.40 ms per step at B=32,
0.07 against 0.14 ms at B=1, ``bench decode``).

The forward only: a backward through a decode call runs the template's passes on the ``lse`` this writes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...opspec import half_given_aux
from ...policy import Drop, Hash
from ...spec import AttentionSpec
from .common import LOG2E, _dot, _uniform_hash, cdiv, next_pow2
from .configs import interpret_mode
from .layout import draw_words
from .template import _entry, _key_order, _load_tile, _modify, _span, _tok_vals

__all__ = ["MAX_QUERIES", "MAX_ROWS", "eligible", "split_count", "decode_forward"]

#: queries per call at most (a decoding step, or a few speculative tokens)
MAX_QUERIES = 16
#: query rows of one KV head's group at most (``GROUPS * Nq``): one tile of rows
MAX_ROWS = 64
#: programs to aim for per GPU (split count = this over ``B * Hk``, at most one split per key tile)
_TARGET_PROGRAMS = 264

def _empty(shape, dtype, device, strides=None) -> torch.Tensor:
    """The workspaces come from here (tests swap it for a NaN-filling one)."""
    return torch.empty(shape, dtype=dtype, device=device)


AUX_NONE = 0
AUX_KEEP = 1     # drop: keep masks given (q_aux, k_aux bool)
AUX_DRAW = 2     # drop: keep bits drawn in the kernel
AUX_BUCKETS = 3  # hash: the buckets given (q_aux, k_aux int32): a KV cache's, kept per key


@triton.jit
def _keep_bits(Aux, row, offs, valid, n, rate, seed_word, pos_off, AUX: tl.constexpr):
    """``drop``'s keep bits of tokens ``offs`` of one side's row ``b * H + h``: given, or drawn as the
    layout kernels draw them (:func:`.layout._group_ids`)."""
    if AUX == 1:
        return tl.load(Aux + row.to(tl.int64) * n + offs, mask=valid, other=0) != 0
    else:
        u = _uniform_hash(seed_word, (row.to(tl.int64) * 65537 + offs + pos_off).to(tl.uint32))
        return u >= rate


@triton.jit(do_not_specialize=["pos_off", "win_left", "win_right", "q_seed", "k_seed"])
def _decode_split(
    Q, K, V, MWs, LWs, AccWs, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    QPerm, KPerm, Lo, Hi, QPos, KPos, QSeg, KSeg, QVal, KVal, Mask, Pat, List, Cnt,
    s_qpos, s_kpos, s_qseg, s_kseg, s_qval, s_kval, smb, smh, smm, smn, sph, spr, spc, slb, slh, slt, scb, sch,
    pos_off, win_left, win_right, Hq, Nq, Nk, qk_scale, sm_scale, tiles_per_split,
    Slopes, Lut, Sinks, DSlopes, DLut, softcap, rel_md,
    QAux, KAux, q_rate, k_rate, q_seed, k_seed, Scratch,
    GROUPS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
    CHECK_K: tl.constexpr, POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr,
    EXCLUDE_SELF: tl.constexpr, PRESCALE: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, SEG: tl.constexpr, QVAL: tl.constexpr, KVAL: tl.constexpr, SPION_BS: tl.constexpr,
    ALIBI: tl.constexpr = False, REL: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    MPOS: tl.constexpr = False, AUX: tl.constexpr = 0,
):
    """One run of key tiles of one (batch, KV head): the online softmax of its group's query rows over
    them, written unnormalised to the workspace (``MWs``/``LWs``: ``(B * Hk, n_split, BLOCK_M)`` running
    max in log2 units and sum; ``AccWs``: ``(B * Hk, n_split, BLOCK_M, BLOCK_DV)``)."""
    MODS: tl.constexpr = ALIBI or REL or SOFTCAP
    CHECK_READ: tl.constexpr = CHECK_K or AUX != 0  # drop's dropped keys are masked out of the loads
    TPOS: tl.constexpr = 2 if MPOS else POS
    split = tl.program_id(0)
    bhk = tl.program_id(1)
    Hk = Hq // GROUPS
    b = bhk // Hk
    hk = bhk % Hk
    # row r of the tile: query r % Nq of head hk * GROUPS + r // Nq (rows past the group read head hk's
    # first query and are never stored)
    r = tl.arange(0, BLOCK_M)
    rval = r < GROUPS * Nq
    qi = tl.where(rval, r % Nq, 0)
    h = hk * GROUPS + tl.where(rval, r // Nq, 0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * sqb + h[:, None].to(tl.int64) * sqh + qi[:, None].to(tl.int64) * sqm
                + offs_d[None, :], mask=rval[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    qp, qs, qv = _tok_vals(qi, rval, b, QPos, s_qpos, QSeg, s_qseg, QVal, s_qval, pos_off, TPOS, SEG, QVAL)
    qrow = b * Hq + h
    if AUX == 3:
        # hash: each row's bucket (rows past the group: -1, no key's)
        q_keep = tl.load(QAux + qrow.to(tl.int64) * Nq + qi, mask=rval, other=-1)
    elif AUX != 0:
        # queries shorter than keys are the last Nq positions (as the layout kernels draw them)
        q_keep = _keep_bits(QAux, qrow, qi, rval, Nq, q_rate, q_seed, tl.where(Nq < Nk, Nk - Nq, 0), AUX)
    else:
        q_keep = qi
    if PRESCALE:
        sc = 1.0
    else:
        sc = qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # the key tiles the window reaches from any of the queries, within this split's run
    n_lo, n_hi = _span(0, Nq - 1, pos_off, win_left, win_right, BLOCK_N, tl.cdiv(Nk, BLOCK_N), POS, HAS_LEFT,
                       HAS_RIGHT)
    t_lo = tl.maximum(split * tiles_per_split, n_lo)
    t_hi = tl.minimum(split * tiles_per_split + tiles_per_split, n_hi)
    k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    krow = b * Hk + hk
    if AUX == 3:
        # hash with the buckets given: first the run's keys in the bucket of some row of the group are listed (their
        # buckets read, 4 bytes a key), then only those are visited, a tile at a time: their K and V rows are the only
        # ones read, with no load waiting on another in the same tile
        lst = Scratch + (bhk.to(tl.int64) * tl.num_programs(0) + split) * tiles_per_split * BLOCK_N
        cnt = tl.zeros([], dtype=tl.int32)
        for t in range(t_lo, t_hi):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            kb = tl.load(KAux + krow.to(tl.int64) * Nk + offs_n, mask=offs_n < Nk, other=-2)
            want = (tl.max((q_keep[:, None] == kb[None, :]).to(tl.int32), 0) > 0) & (offs_n < Nk)
            w = want.to(tl.int32)
            tl.store(lst + cnt + tl.cumsum(w, 0) - 1, offs_n, mask=want)
            cnt += tl.sum(w, 0)
        tl.debug_barrier()  # (the list's stores are seen by every thread of the program)
        it_lo = 0
        it_hi = tl.cdiv(cnt, BLOCK_N)
    else:
        it_lo = t_lo
        it_hi = t_hi
    for t in range(it_lo, it_hi):
        if AUX == 3:
            # the listed keys: each is in some row's bucket; a row keeps those in its own
            lane = t * BLOCK_N + tl.arange(0, BLOCK_N)
            nval = lane < cnt
            offs_n = tl.load(lst + lane, mask=nval, other=0)
            start_n = 0
            kb = tl.load(KAux + krow.to(tl.int64) * Nk + offs_n, mask=nval, other=-2)
            same = q_keep[:, None] == kb[None, :]
            nread = nval
        else:
            start_n = t * BLOCK_N
            offs_n = start_n + _key_order(BLOCK_N, NM_M)
            nval = offs_n < Nk
            if AUX != 0:
                # drop: the keys this step drops are not read (their rows load as zeros; their logits are -inf below)
                kk = _keep_bits(KAux, krow, offs_n, nval, Nk, k_rate, k_seed, 0, AUX)
                nread = nval & kk
            else:
                nread = nval
        kT = _load_tile(k_base, offs_n, nread, skn, offs_d, HEAD_D, BLOCK_D, CHECK_READ, True)
        kp, ks, kv = _tok_vals(offs_n, nval, b, KPos, s_kpos, KSeg, s_kseg, KVal, s_kval, 0, TPOS, SEG, KVAL)
        qk = _dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        if MODS:
            qk, tc, rel = _modify(qk, qp[:, None], kp[None, :], h[:, None], Slopes, Lut, sm_scale, softcap, rel_md,
                                  Hq, ALIBI, REL, SOFTCAP)
            esc = 1.0
        else:
            esc = qk_scale
        s = _entry(qk, qi[:, None], offs_n[None, :], qi[:, None], offs_n[None, :], qp[:, None], qs[:, None],
                   qv[:, None], qi[:, None], qi[:, None], kp[None, :], ks[None, :], kv[None, :], b, h[:, None], True,
                   start_n, Mask, smb, smh, smm, smn, Pat, sph, spr, spc, Nq, Nk, win_left, win_right, esc,
                   BLOCK_M, BLOCK_N, MASK_KIND, CHECK_K, POLICY, NM_N, NM_M, EXCLUDE_SELF, POS, HAS_LEFT,
                   HAS_RIGHT, SEG, QVAL, KVAL, SPION_BS, False, PRESCALE)
        if AUX == 3:
            s = tl.where(same, s, float("-inf"))
        elif AUX != 0:
            s = tl.where(q_keep[:, None] & kk[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * sc)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s * sc - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, offs_n, nread, svn, offs_dv, HEAD_DV, BLOCK_DV, CHECK_READ, False)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    ws = (bhk.to(tl.int64) * tl.num_programs(0) + split) * BLOCK_M
    tl.store(MWs + ws + r, m_i)
    tl.store(LWs + ws + r, l_i)
    tl.store(AccWs + (ws + r[:, None]) * BLOCK_DV + offs_dv[None, :], acc)


@triton.jit
def _decode_merge(MWs, LWs, AccWs, O, Lse, Sinks, sob, soh, som, Hq, Nq, n_split,
                  GROUPS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  S_P2: tl.constexpr, SINKS: tl.constexpr):
    """``out`` and the natural-log ``lse`` of one query row (program ``(row, b * Hk + hk)``) from its
    splits' partial results: each run's sum and output weighted by ``exp2(m_run - m)``; a row that keeps
    no key outputs 0 (``lse = -inf``, or the sink's logit where the site has sinks, as the template)."""
    r = tl.program_id(0)
    bhk = tl.program_id(1)
    if r < GROUPS * Nq:
        Hk = Hq // GROUPS
        b = bhk // Hk
        h = (bhk % Hk) * GROUPS + r // Nq
        i = r % Nq
        sp = tl.arange(0, S_P2)
        sval = sp < n_split
        ws = (bhk.to(tl.int64) * n_split + sp) * BLOCK_M + r
        m = tl.load(MWs + ws, mask=sval, other=float("-inf"))
        l = tl.load(LWs + ws, mask=sval, other=0.0)
        offs_dv = tl.arange(0, BLOCK_DV)
        acc = tl.load(AccWs + ws[:, None] * BLOCK_DV + offs_dv[None, :], mask=sval[:, None], other=0.0)
        m_max = tl.max(m, 0)
        m_sub = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_sub)
        l_sum = tl.sum(l * w, 0)
        o = tl.sum(acc * w[:, None], 0)
        if SINKS:
            sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_max, sink)
            alpha = tl.math.exp2(m_sub - m_f)
            l_f = l_sum * alpha + tl.math.exp2(sink - m_f)
            lse = (m_f + tl.math.log2(l_f)) * 0.6931471805599453
            o = o * (alpha / l_f)
        else:
            empty = l_sum == 0.0
            l_safe = tl.where(empty, 1.0, l_sum)
            lse = tl.where(empty, float("-inf"), (m_sub + tl.math.log2(l_safe)) * 0.6931471805599453)
            o = o / l_safe
        tl.store(Lse + (b * Hq + h).to(tl.int64) * Nq + i, lse)
        optr = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + i.to(tl.int64) * som + offs_dv
        tl.store(optr, o.to(O.dtype.element_ty), mask=offs_dv < HEAD_DV)


def eligible(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, dropout_p: float, k_aux=None) -> bool:
    """Whether a forward call is a decoding step this kernel runs: at most :data:`MAX_QUERIES` queries,
    fewer than the keys, at most :data:`MAX_ROWS` rows per KV head's group, no dropout, and not ``hash`` unless
    its buckets are given (``k_aux``: a KV cache's; derived ones take the sorted layout, above)."""
    Nq, Nk = int(q.shape[2]), int(k.shape[2])
    return (0 < Nq <= MAX_QUERIES and Nk > Nq and dropout_p == 0.0 and q.shape[0] * q.shape[1] > 0
            and (q.shape[1] // k.shape[1]) * Nq <= MAX_ROWS
            and (k_aux is not None or not isinstance(spec.policy, Hash)))


def _config(site, interp: bool) -> dict:
    """The launch configuration: on the H200 at D=128, bf16, 8 KV heads and 32k keys, 64-key tiles with 2 warps
    and 2 stages were within 5% of the best of 108 configurations at each of B = 1, 8 and 32, timed per call
    (``python -m attncomp bench decode --sweep``, one run; at B=1 the call's host work dominates); larger head dims
    take 32-key tiles and 4 warps (registers)."""
    if interp:
        return dict(BLOCK_N=max(16, 4 * site.nm_m), num_warps=1, num_stages=1)  # (N:M: whole groups of 4 x M)
    if site.block_d > 128:
        return dict(BLOCK_N=max(32, 4 * site.nm_m), num_warps=4, num_stages=2)
    return dict(BLOCK_N=max(64, 4 * site.nm_m), num_warps=2, num_stages=2)


def split_count(n_tiles: int, programs_per_split: int, target: int = _TARGET_PROGRAMS) -> int:
    """Runs of key tiles per (batch, KV head): enough for ``target`` programs over the GPU, at most one per tile and
    at most 128 (the merge reads them all)."""
    return max(1, min(n_tiles, cdiv(target, programs_per_split), 128))


def decode_forward(site, spec: AttentionSpec, q, k, v, out, lse, q_aux=None, k_aux=None, seed: Optional[int] = None,
                   config: Optional[dict] = None, n_split: Optional[int] = None) -> None:
    """Run the decode kernels for ``site`` (a :class:`.backend.Site` built with ``unsorted=True``: ``drop`` comes as
    ``spec``'s policy, with no sorted layout), writing ``out`` and ``lse``.
    ``config``/``n_split``: a launch configuration and split count instead of the defaults (tests, tuning)."""
    B, Hq, Nq, Nk, G = site.B, site.Hq, site.Nq, site.Nk, site.groups
    Hk = Hq // G
    interp = interpret_mode()
    cfg = dict(_config(site, interp), **(config or {}))
    bn = cfg["BLOCK_N"]
    bm = max(16, next_pow2(G * Nq))
    n_tiles = cdiv(Nk, bn)
    if n_split is None:
        n_split = split_count(n_tiles, B * Hk)
    tps = cdiv(n_tiles, n_split)
    n_split = cdiv(n_tiles, tps)
    dev = q.device
    mws = _empty((B * Hk, n_split, bm), torch.float32, dev)
    lws = _empty((B * Hk, n_split, bm), torch.float32, dev)
    aws = _empty((B * Hk, n_split, bm, site.block_dv), torch.float32, dev)

    pol = spec.policy
    if isinstance(pol, Hash) and q_aux is None and k_aux is None:
        raise ValueError("hash decoding steps with derived buckets run the template's sorted layout, not the "
                         "decode kernels")
    if (q_aux is None) != (k_aux is None) and isinstance(pol, (Drop, Hash)):
        raise half_given_aux(pol)
    aux, qw, kw = AUX_NONE, 0, 0
    q_rate = k_rate = 0.0
    if isinstance(pol, Hash):
        aux = AUX_BUCKETS
        q_aux, k_aux = (t.contiguous() if t.dtype == torch.int32 else t.to(torch.int32).contiguous()
                        for t in (q_aux, k_aux))
    elif isinstance(pol, Drop):
        if q_aux is not None:
            aux = AUX_KEEP
            q_aux, k_aux = (t.contiguous().view(torch.uint8) if t.dtype == torch.bool else t.contiguous()
                            for t in (q_aux, k_aux))
        else:
            aux = AUX_DRAW
            qw, kw = draw_words(pol.seed if seed is None else seed)
        q_rate, k_rate = float(pol.q_rate), float(pol.k_rate)
    meta = site.meta(bm, bn)
    for key in ("SCHED", "DROPOUT", "CHECK_Q", "SINKS"):
        meta.pop(key, None)
    meta["CHECK_K"] = Nk % bn != 0
    dummy = q
    # hash with given buckets: each program's list of the keys it visits (see _decode_split)
    scratch = _empty((B * Hk, n_split, tps * bn), torch.int32, dev) if aux == AUX_BUCKETS else dummy
    _decode_split[(n_split, B * Hk)](
        q, k, v, mws, lws, aws, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *site.pred_args(None, None),
        Hq, Nq, Nk, site.scale * LOG2E, site.scale, tps, *site.mod_args(),
        dummy if q_aux is None else q_aux, dummy if k_aux is None else k_aux, q_rate, k_rate, qw, kw, scratch,
        BLOCK_M=bm, BLOCK_N=bn, AUX=aux,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **meta)
    _decode_merge[(bm, B * Hk)](
        mws, lws, aws, out, lse, dummy if site.sink_t is None else site.sink_t, *out.stride()[:3], Hq, Nq, n_split,
        GROUPS=G, HEAD_DV=site.Dv, BLOCK_DV=site.block_dv, BLOCK_M=bm, S_P2=max(2, next_pow2(n_split)),
        SINKS=site.sinks, num_warps=1 if interp else 4)
