"""Fused attention backward, FlashAttention-2 style, in three launches.

1. ``_bwd_preprocess``: ``delta_i = rowsum(dO_i * O_i)`` (with dropout this equals the
   ``rowsum(dP * P)`` of the softmax gradient), and ``lse`` moved to log2 units, ``+inf`` for rows
   that kept no key so that their recomputed probabilities are exactly 0.
2. ``_bwd_dkdv``: one program per (key tile, batch x KV head). It holds its K and V tiles and
   loops over the query tiles of every query head of its GQA group, recomputing the probabilities
   from ``lse`` (nothing ``N x N`` is stored), accumulating ``dV = P^T dO`` and ``dK = dS^T Q``.
   It works on transposed tiles (keys by queries) so that ``P^T`` and ``dS^T`` feed the tensor
   cores straight from registers. Summing over the group inside one program keeps it free of
   atomics and deterministic.
3. ``_bwd_dq``: one program per (query tile, batch x query head), looping over key tiles:
   ``dQ = dS K``.

The probabilities are recomputed with :func:`~attncomp.codegen.triton.common._score_tile`, the same
function as in the forward, so the same entries are kept (DFSS's selection included) and gradients
flow only through kept entries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _dropout_scale, _key_order, _score_tile


@triton.jit
def _bwd_preprocess(
    Out, DO, Lse, Delta, Lse2,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    Hq, Nq,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    off_bh = tl.program_id(1)
    b = off_bh // Hq
    h = off_bh % Hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    inb = (offs_m[:, None] < Nq) & (offs_dv[None, :] < HEAD_DV)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
                + offs_dv[None, :], mask=inb, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dom
                 + offs_dv[None, :], mask=inb, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = off_bh.to(tl.int64) * Nq + offs_m
    tl.store(Delta + row, delta, mask=offs_m < Nq)
    lse = tl.load(Lse + row, mask=offs_m < Nq, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Lse2 + row, lse2, mask=offs_m < Nq)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_ptrs, do_ptrs, mask_ptrs, Lse2, Delta, row0, offs_m0, offs_n, offs_d, offs_dv,
    lo, hi, Nq, Nk, qk_scale, stride_qm, stride_dom, stride_mm,
    seed, dropout_p, inv_keep,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    PRESCALE: tl.constexpr, NATURAL: tl.constexpr,
):
    """Fold query tiles ``[lo, hi)`` of one query head into the ``dk``/``dv`` of one key tile.

    Tiles are keys by queries (``S^T``), so that ``P^T`` and ``dS^T`` feed the tensor cores from
    registers; with ``NATURAL`` they are queries by keys, the orientation in which a row-wise
    selection (DFSS) sees a group's members in one thread, and ``P``/``dS`` are transposed through
    shared memory instead.
    """
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if NATURAL:
            q_mask = (offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_D)
        else:
            q_mask = (offs_m[None, :] < Nq) & (offs_d[:, None] < HEAD_D)
        if CHECK_Q:
            q = tl.load(q_ptrs + start_m * stride_qm, mask=q_mask, other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dom, mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < HEAD_DV), other=0.0)
            lse2 = tl.load(Lse2 + row0 + offs_m, mask=offs_m < Nq, other=float("inf"))
            di = tl.load(Delta + row0 + offs_m, mask=offs_m < Nq, other=0.0)
        else:
            if BLOCK_D != HEAD_D:
                q = tl.load(q_ptrs + start_m * stride_qm, mask=q_mask, other=0.0)
            else:
                q = tl.load(q_ptrs + start_m * stride_qm)
            if BLOCK_DV != HEAD_DV:
                do = tl.load(do_ptrs + start_m * stride_dom, mask=offs_dv[None, :] < HEAD_DV, other=0.0)
            else:
                do = tl.load(do_ptrs + start_m * stride_dom)
            lse2 = tl.load(Lse2 + row0 + offs_m)
            di = tl.load(Delta + row0 + offs_m)
        if PRESCALE:
            sc = 1.0
        else:
            sc = qk_scale
        if NATURAL:
            qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
            s = _score_tile(qk, offs_m[:, None], offs_n[None, :], mask_ptrs + start_m * stride_mm, Nq, Nk, qk_scale,
                            BLOCK_M, BLOCK_N, CAUSAL, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M, False, PRESCALE)
            p = tl.math.exp2(s * sc - lse2[:, None])
            dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
            if DROPOUT:
                row_base = ((row0 + offs_m) * Nk).to(tl.uint32)
                scl = _dropout_scale(seed, row_base[:, None], offs_n[None, :], dropout_p, inv_keep)
                dv = _dot(tl.trans((p * scl).to(do.dtype)), do, dv)
                dp = dp * scl
            else:
                dv = _dot(tl.trans(p.to(do.dtype)), do, dv)
            ds = p * (dp - di[:, None])
            dk = _dot(tl.trans(ds.to(q.dtype)), q, dk)
        else:
            qkT = _dot(k, q, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
            sT = _score_tile(qkT, offs_m[None, :], offs_n[:, None], mask_ptrs + start_m * stride_mm, Nq, Nk, qk_scale,
                             BLOCK_M, BLOCK_N, CAUSAL, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M, True, PRESCALE)
            pT = tl.math.exp2(sT * sc - lse2[None, :])
            dpT = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
            if DROPOUT:
                row_base = ((row0 + offs_m) * Nk).to(tl.uint32)
                scl = _dropout_scale(seed, row_base[None, :], offs_n[:, None], dropout_p, inv_keep)
                dv = _dot((pT * scl).to(do.dtype), do, dv)
                dpT = dpT * scl
            else:
                dv = _dot(pT.to(do.dtype), do, dv)
            dsT = pT * (dpT - di[None, :])
            dk = _dot(dsT.to(q.dtype), tl.trans(q), dk)
    return dk, dv


@triton.jit
def _bwd_dkdv(
    Q, K, V, Mask, DO, DK, DV, Lse2, Delta,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hk, Nq, Nk, qk_scale, sm_scale, seed, dropout_p, inv_keep,
    GROUPS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    PRESCALE: tl.constexpr, NATURAL: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1)
    b = off_bhk // Hk
    hk = off_bhk % Hk
    Hq = Hk * GROUPS

    offs_n = start_n + _key_order(BLOCK_N, NM_M)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_ptrs = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :]
    if CHECK_K or BLOCK_D != HEAD_D:
        k = tl.load(k_ptrs, mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < HEAD_D), other=0.0)
    else:
        k = tl.load(k_ptrs)
    if CHECK_K or BLOCK_DV != HEAD_DV:
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < HEAD_DV), other=0.0)
    else:
        v = tl.load(v_ptrs)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    if CAUSAL:
        # query tiles that reach the diagonal of this key tile, then the ones entirely below it
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(Nq, BLOCK_M) * BLOCK_M)
        mid = tl.maximum(mid, lo)
    else:
        lo = 0
        mid = 0
    for g in range(GROUPS):
        h = hk * GROUPS + g
        off_bh = b * Hq + h
        row0 = off_bh.to(tl.int64) * Nq
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        m_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        if NATURAL:
            q_ptrs = q_base + offs_m0[:, None] * stride_qm + offs_d[None, :]
            mask_ptrs = m_base + offs_m0[:, None] * stride_mm + offs_n[None, :] * stride_mn
        else:
            q_ptrs = q_base + offs_m0[None, :] * stride_qm + offs_d[:, None]
            mask_ptrs = m_base + offs_m0[None, :] * stride_mm + offs_n[:, None] * stride_mn
        do_ptrs = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + offs_m0[:, None] * stride_dom \
            + offs_dv[None, :]
        if CAUSAL:
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_ptrs, do_ptrs, mask_ptrs, Lse2, Delta, row0, offs_m0, offs_n, offs_d, offs_dv,
                lo, mid, Nq, Nk, qk_scale, stride_qm, stride_dom, stride_mm, seed, dropout_p, inv_keep,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, MASK_KIND, CHECK_Q, CHECK_K,
                POLICY, NM_N, NM_M, DROPOUT, PRESCALE, NATURAL)
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, mask_ptrs, Lse2, Delta, row0, offs_m0, offs_n, offs_d, offs_dv,
            mid, Nq, Nq, Nk, qk_scale, stride_qm, stride_dom, stride_mm, seed, dropout_p, inv_keep,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, MASK_KIND, CHECK_Q, CHECK_K,
            POLICY, NM_N, NM_M, DROPOUT, PRESCALE, NATURAL)

    dk = dk * sm_scale
    dk_ptrs = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :]
    if CHECK_K or BLOCK_D != HEAD_D:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=(offs_n[:, None] < Nk) & (offs_d[None, :] < HEAD_D))
    else:
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
    if CHECK_K or BLOCK_DV != HEAD_DV:
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < HEAD_DV))
    else:
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, di, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv, row_base,
    lo, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn,
    seed, dropout_p, inv_keep,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into the ``dq`` of one query tile."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        kj = start_n + offs_n
        if CHECK_K:
            kT = tl.load(k_ptrs + start_n * stride_kn, mask=(kj[None, :] < Nk) & (offs_d[:, None] < HEAD_D), other=0.0)
            vT = tl.load(v_ptrs + start_n * stride_vn, mask=(kj[None, :] < Nk) & (offs_dv[:, None] < HEAD_DV), other=0.0)
        else:
            if BLOCK_D != HEAD_D:
                kT = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[:, None] < HEAD_D, other=0.0)
            else:
                kT = tl.load(k_ptrs + start_n * stride_kn)
            if BLOCK_DV != HEAD_DV:
                vT = tl.load(v_ptrs + start_n * stride_vn, mask=offs_dv[:, None] < HEAD_DV, other=0.0)
            else:
                vT = tl.load(v_ptrs + start_n * stride_vn)
        qk = _dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        s = _score_tile(qk, offs_m[:, None], kj[None, :], mask_ptrs + start_n * stride_mn, Nq, Nk, qk_scale,
                        BLOCK_M, BLOCK_N, CAUSAL, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M, False, PRESCALE)
        if PRESCALE:
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        dp = _dot(do, vT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        if DROPOUT:
            dp = dp * _dropout_scale(seed, row_base[:, None], kj[None, :], dropout_p, inv_keep)
        ds = p * (dp - di[:, None])
        dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq


@triton.jit
def _bwd_dq(
    Q, K, V, Mask, DO, DQ, Lse2, Delta,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hq, Nq, Nk, qk_scale, sm_scale, seed, dropout_p, inv_keep,
    GROUPS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // Hq
    h = off_bh % Hq
    hk = h // GROUPS

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = _key_order(BLOCK_N, NM_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row0 = off_bh.to(tl.int64) * Nq

    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :]
    if CHECK_Q or BLOCK_D != HEAD_D:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_D), other=0.0)
    else:
        q = tl.load(q_ptrs)
    if CHECK_Q or BLOCK_DV != HEAD_DV:
        do = tl.load(do_ptrs, mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < HEAD_DV), other=0.0)
    else:
        do = tl.load(do_ptrs)
    if CHECK_Q:
        lse2 = tl.load(Lse2 + row0 + offs_m, mask=offs_m < Nq, other=float("inf"))
        di = tl.load(Delta + row0 + offs_m, mask=offs_m < Nq, other=0.0)
    else:
        lse2 = tl.load(Lse2 + row0 + offs_m)
        di = tl.load(Delta + row0 + offs_m)
    if DROPOUT:
        row_base = ((row0 + offs_m) * Nk).to(tl.uint32)
    else:
        row_base = offs_m.to(tl.uint32)

    k_ptrs = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[None, :] * stride_vn + offs_dv[:, None]
    mask_ptrs = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh \
        + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(Nk, (start_m + 1) * BLOCK_M)
        mid = tl.maximum(tl.minimum((start_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N, hi), 0)
    else:
        hi = Nk
        mid = Nk
    dq = _dq_tiles(
        dq, q, do, lse2, di, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv, row_base,
        0, mid, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn, seed, dropout_p, inv_keep,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, MASK_KIND, CHECK_Q, CHECK_K,
        POLICY, NM_N, NM_M, DROPOUT, PRESCALE)
    if CAUSAL:
        dq = _dq_tiles(
            dq, q, do, lse2, di, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv, row_base,
            mid, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn, seed, dropout_p, inv_keep,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, MASK_KIND, CHECK_Q, CHECK_K,
            POLICY, NM_N, NM_M, DROPOUT, PRESCALE)

    dq = dq * sm_scale
    dq_ptrs = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    if CHECK_Q or BLOCK_D != HEAD_D:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_D))
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
