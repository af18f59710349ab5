"""Fused attention forward: one program per (query tile, batch x query head).

Flash-style: the program keeps its query tile, a running row maximum ``m``, a running sum ``l``
and an output accumulator in registers, and streams key/value tiles through them (online softmax),
so no ``N x N`` tensor exists anywhere. Under ``causal`` the tiles strictly below the diagonal run
in a loop without the causal test and the tiles crossing it in a second loop with it; tiles above
the diagonal are never visited. Writes ``out`` and the natural-log ``lse`` (``-inf`` for a row that
kept no key; such a row outputs zeros).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _dropout_scale, _key_order, _score_tile


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv,
    lo, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn,
    seed, row_base, dropout_p, inv_keep,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    MAY_EMPTY: tl.constexpr, PRESCALE: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into the running ``(acc, l_i, m_i)`` of one query tile."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        kj = start_n + offs_n
        if CHECK_K:
            kT = tl.load(k_ptrs + start_n * stride_kn, mask=(kj[None, :] < Nk) & (offs_d[:, None] < HEAD_D), other=0.0)
        elif HEAD_D != BLOCK_D:
            kT = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[:, None] < HEAD_D, other=0.0)
        else:
            kT = tl.load(k_ptrs + start_n * stride_kn)
        qk = _dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        s = _score_tile(qk, offs_m[:, None], kj[None, :], mask_ptrs + start_n * stride_mn, Nq, Nk, qk_scale,
                        BLOCK_M, BLOCK_N, CAUSAL, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M, False, PRESCALE)
        if PRESCALE:
            sc = 1.0
        else:
            sc = qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1) * sc)
        if MAY_EMPTY:
            # a row with nothing kept so far keeps m = -inf; subtract 0 instead to avoid inf - inf
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s * sc - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = p * _dropout_scale(seed, row_base[:, None], kj[None, :], dropout_p, inv_keep)
        if CHECK_K:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=(kj[:, None] < Nk) & (offs_dv[None, :] < HEAD_DV), other=0.0)
        elif HEAD_DV != BLOCK_DV:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_dv[None, :] < HEAD_DV, other=0.0)
        else:
            v = tl.load(v_ptrs + start_n * stride_vn)
        acc = _dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, Mask, Out, Lse,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hq, Nq, Nk, qk_scale, seed, dropout_p, inv_keep,
    GROUPS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, DROPOUT: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    # heavy (late) query tiles first: under causal they have the most key tiles
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // Hq
    h = off_bh % Hq
    hk = h // GROUPS
    MAY_EMPTY: tl.constexpr = MASK_KIND != 0

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = _key_order(BLOCK_N, NM_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    k_ptrs = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :]
    mask_ptrs = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh \
        + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    if CHECK_Q or BLOCK_D != HEAD_D:
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_D), other=0.0)
    else:
        q = tl.load(q_ptrs)

    if DROPOUT:
        row_base = ((off_bh.to(tl.int64) * Nq + offs_m) * Nk).to(tl.uint32)
    else:
        row_base = offs_m.to(tl.uint32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(Nk, (start_m + 1) * BLOCK_M)
        # key tiles entirely at or below every row's diagonal need no causal test
        mid = tl.minimum((start_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N, hi)
        mid = tl.maximum(mid, 0)
    else:
        hi = Nk
        mid = Nk
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv,
        0, mid, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn, seed, row_base, dropout_p, inv_keep,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M,
        DROPOUT, MAY_EMPTY, PRESCALE)
    if CAUSAL:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, offs_m, offs_n, offs_d, offs_dv,
            mid, hi, Nq, Nk, qk_scale, stride_kn, stride_vn, stride_mn, seed, row_base, dropout_p, inv_keep,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, MASK_KIND, CHECK_Q, CHECK_K, POLICY, NM_N, NM_M,
            DROPOUT, MAY_EMPTY, PRESCALE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(Lse + off_bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
    if CHECK_Q or BLOCK_DV != HEAD_DV:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < HEAD_DV))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
