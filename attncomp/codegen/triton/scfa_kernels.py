"""Triton kernels for the ``hash`` and ``drop`` policies (Sparse Causal Flash Attention, seed 002).

Both policies reduce to one problem once the host side (:mod:`.scfa`) has stably sorted queries and
keys by a per-token group id (the hash bucket; for ``drop`` 0 for kept tokens and a distinct id for
dropped queries and dropped keys): query ``m`` of the sorted order keeps exactly the sorted keys
``p`` with ``lo[m] <= p < hi[m]``. The interval is exact, not a bound: keys sorted by (group,
original position) put the keys of a group in a contiguous run, in increasing original position,
so "same group and ``j <= i``" is a prefix of that run. Symmetrically key ``p`` is kept by the
sorted queries ``qlo[p] <= m < qhi[p]`` (used by the dK/dV kernel).

So a query tile visits only the key tiles in ``[min lo, max hi)`` (the first/last key tile of SCFA's
Alg. 1-2, at key rather than tile granularity), and the in-tile mask is two integer compares; tiles
every row keeps entirely skip even those. ``exclude_self``, ``attn_mask`` and dropout are applied on
the original positions, which the kernels read from the permutations (they also gather q/k/v rows
through them and scatter outputs back, so no sorted copies of q, k, v are ever made).

Softmax statistics follow SCFA App. B: a row whose running maximum is still ``-inf`` uses 0 in
its place, and a row that never keeps a key ends with ``l = 0``, output 0 and ``lse = -inf``.

Dropout uses :func:`attncomp.policy.uniform_hash` bit for bit, on uint32: the same Triton function
as the dense/DFSS kernels (``common._uniform_hash``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = [
    "scfa_fwd_kernel",
    "scfa_bwd_preprocess_kernel",
    "scfa_bwd_dkdv_kernel",
    "scfa_bwd_dq_kernel",
    "dropout_keep",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# Triton's CPU interpreter multiplies bfloat16 tiles wrongly; under it the products get float32
# copies (exact: products of 16-bit floats are exact in float32, as on the tensor cores).
_UPCAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

try:  # the dense/DFSS kernels' copy of the counter-based hash, so both draw the same dropout mask
    from .common import _uniform_hash as uniform_hash
except ImportError:  # pragma: no cover - the shared module is missing or renamed
    @triton.jit
    def uniform_hash(seed, idx):
        """``attncomp.policy.uniform_hash`` on uint32 (``seed``: the host's pre-mixed seed word)."""
        x = idx ^ seed.to(tl.uint32)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        x = x ^ (x >> 16)
        x = x * 0x27D4EB2F
        x = x ^ (x >> 15)
        return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def dropout_keep(seed_u32, idx_u32, p_drop):
    """Whether a probability survives dropout: ``uniform_hash(seed, idx) >= p_drop``."""
    return uniform_hash(seed_u32, idx_u32) >= p_drop


@triton.jit
def _mm(a, b):
    if _UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _phases(lo_min, lo_max, hi_min, hi_max, BLOCK: tl.constexpr):
    """Split ``[lo_min, hi_max)`` into tiles of BLOCK starting at ``lo_min``: masked tiles up to
    ``f0``, tiles every row keeps entirely (``[lo_max, hi_min)`` holds them) up to ``f1``, then
    masked tiles up to ``hi_max``."""
    has_full = lo_max < hi_min
    f0 = lo_min + ((lo_max - lo_min + BLOCK - 1) // BLOCK) * BLOCK
    f1 = f0 + (tl.maximum(hi_min - f0, 0) // BLOCK) * BLOCK
    f0 = tl.where(has_full, f0, hi_max)
    f1 = tl.where(has_full, f1, hi_max)
    return f0, f1


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, qi, lo, hi, n_from, n_to, n_bound,
              k_base, v_base, kperm_base, mask_base,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
              qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
              offs_d, offs_dv, D, DV,
              BLOCK_N: tl.constexpr, RANGE_MASK: tl.constexpr,
              EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    dmask = offs_d < D
    dvmask = offs_dv < DV
    for start_n in range(n_from, n_to, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if RANGE_MASK:
            kj = tl.load(kperm_base + offs_n, mask=offs_n < n_bound, other=0)
        else:
            kj = tl.load(kperm_base + offs_n)
        k = tl.load(k_base + kj[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=dmask[None, :], other=0.0)
        v = tl.load(v_base + kj[:, None] * stride_vn + offs_dv[None, :] * stride_vd, mask=dvmask[None, :], other=0.0)
        s = _mm(q, tl.trans(k)) * qk_scale
        if MASK_KIND == 2:
            bias = tl.load(mask_base + qi[:, None] * stride_mi + kj[None, :] * stride_mj).to(tl.float32)
            s = s + bias * LOG2E
        if RANGE_MASK:
            s = tl.where((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]), s, float("-inf"))
        if EXCLUDE_SELF:
            s = tl.where(qi[:, None] != kj[None, :], s, float("-inf"))
        if MASK_KIND == 1:
            allowed = tl.load(mask_base + qi[:, None] * stride_mi + kj[None, :] * stride_mj)
            s = tl.where(allowed != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            idx = (drop_row + qi.to(tl.uint32))[:, None] * Nk.to(tl.uint32) + kj.to(tl.uint32)[None, :]
            p = tl.where(dropout_keep(seed_u32, idx, p_drop), p * inv_keep, 0.0)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed"])
def scfa_fwd_kernel(Q, K, V, Out, Lse, QPerm, KPerm, Lo, Hi, Mask,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_on, stride_od,
                    stride_mb, stride_mh, stride_mi, stride_mj,
                    qk_scale, seed, p_drop, inv_keep,
                    Hq, Hk, Nq, Nk, D, DV,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mval = offs_m < Nq
    tok = bh.to(tl.int64) * Nq
    qi = tl.load(QPerm + tok + offs_m, mask=mval, other=0)
    lo = tl.load(Lo + tok + offs_m, mask=mval, other=0)
    hi = tl.load(Hi + tok + offs_m, mask=mval, other=0)
    n_lo = tl.min(tl.where(mval, lo, Nk), 0)
    n_hi = tl.max(hi, 0)
    f0, f1 = _phases(n_lo, tl.max(lo, 0), tl.min(tl.where(mval, hi, Nk), 0), n_hi, BLOCK_N)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q = tl.load(q_base + qi[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=mval[:, None] & (offs_d < D)[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    kperm_base = KPerm + (b * Hk + hk).to(tl.int64) * Nk
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    seed_u32 = seed.to(tl.uint32)
    drop_row = bh.to(tl.uint32) * Nq.to(tl.uint32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, qi, lo, hi, n_lo, f0, n_hi,
                              k_base, v_base, kperm_base, mask_base,
                              stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                              qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                              offs_d, offs_dv, D, DV,
                              BLOCK_N, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, qi, lo, hi, f0, f1, n_hi,
                              k_base, v_base, kperm_base, mask_base,
                              stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                              qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                              offs_d, offs_dv, D, DV,
                              BLOCK_N, False, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, qi, lo, hi, f1, n_hi, n_hi,
                              k_base, v_base, kperm_base, mask_base,
                              stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                              qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                              offs_d, offs_dv, D, DV,
                              BLOCK_N, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_base = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + qi[:, None] * stride_on + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=mval[:, None] & (offs_dv < DV)[None, :])
    tl.store(Lse + tok + qi, lse, mask=mval)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def scfa_bwd_preprocess_kernel(Out, DO, Delta,
                               stride_ob, stride_oh, stride_on, stride_od,
                               stride_gb, stride_gh, stride_gn, stride_gd,
                               Hq, Nq, DV,
                               BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``delta[i] = rowsum(dO_i * O_i)`` in original order (float32)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    msk = (offs_m < Nq)[:, None] & (offs_dv < DV)[None, :]
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od, mask=msk, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
                 + offs_m[:, None] * stride_gn + offs_dv[None, :] * stride_gd, mask=msk, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * Nq + offs_m, delta, mask=offs_m < Nq)


@triton.jit
def _dkdv_loop(dk, dv, k, v, kj, qlo, qhi, m_from, m_to, m_bound,
               q_base, do_base, qperm_base, lse_base, delta_base, mask_base,
               stride_qn, stride_qd, stride_gn, stride_gd, stride_mi, stride_mj,
               qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
               offs_d, offs_dv, D, DV,
               BLOCK_M: tl.constexpr, RANGE_MASK: tl.constexpr,
               EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    dmask = offs_d < D
    dvmask = offs_dv < DV
    for start_m in range(m_from, m_to, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if RANGE_MASK:
            qi = tl.load(qperm_base + offs_m, mask=offs_m < m_bound, other=0)
        else:
            qi = tl.load(qperm_base + offs_m)
        q = tl.load(q_base + qi[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=dmask[None, :], other=0.0)
        do = tl.load(do_base + qi[:, None] * stride_gn + offs_dv[None, :] * stride_gd, mask=dvmask[None, :], other=0.0)
        lse = tl.load(lse_base + qi)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
        delta = tl.load(delta_base + qi)
        sT = _mm(k, tl.trans(q)) * qk_scale
        if MASK_KIND == 2:
            bias = tl.load(mask_base + qi[None, :] * stride_mi + kj[:, None] * stride_mj).to(tl.float32)
            sT = sT + bias * LOG2E
        pT = tl.math.exp2(sT - lse2[None, :])
        if RANGE_MASK:
            pT = tl.where((offs_m[None, :] >= qlo[:, None]) & (offs_m[None, :] < qhi[:, None]), pT, 0.0)
        if EXCLUDE_SELF:
            pT = tl.where(kj[:, None] != qi[None, :], pT, 0.0)
        if MASK_KIND == 1:
            allowed = tl.load(mask_base + qi[None, :] * stride_mi + kj[:, None] * stride_mj)
            pT = tl.where(allowed != 0, pT, 0.0)
        dpT = _mm(v, tl.trans(do))
        if DROPOUT:
            idx = (drop_row + qi.to(tl.uint32))[None, :] * Nk.to(tl.uint32) + kj.to(tl.uint32)[:, None]
            z = dropout_keep(seed_u32, idx, p_drop)
            dv += _mm(tl.where(z, pT * inv_keep, 0.0).to(do.dtype), do)
            dpT = tl.where(z, dpT * inv_keep, 0.0)
        else:
            dv += _mm(pT.to(do.dtype), do)
        dsT = pT * (dpT - delta[None, :])
        dk += _mm(dsT.to(q.dtype), q)
    return dk, dv


@triton.jit(do_not_specialize=["seed"])
def scfa_bwd_dkdv_kernel(Q, K, V, DO, DK, DV_, Lse, Delta, QPerm, KPerm, QLo, QHi, Mask,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_gb, stride_gh, stride_gn, stride_gd,
                         stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                         stride_mb, stride_mh, stride_mi, stride_mj,
                         qk_scale, sm_scale, seed, p_drop, inv_keep,
                         Hq, Hk, Nq, Nk, D, DV,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    """dK, dV of one tile of sorted keys of one KV head, summed over the query heads of its group."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    G = Hq // Hk
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    nval = offs_n < Nk
    kj = tl.load(KPerm + bhk.to(tl.int64) * Nk + offs_n, mask=nval, other=0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    k = tl.load(k_base + kj[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=nval[:, None] & (offs_d < D)[None, :], other=0.0)
    v = tl.load(v_base + kj[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=nval[:, None] & (offs_dv < DV)[None, :], other=0.0)
    seed_u32 = seed.to(tl.uint32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        bh = b * Hq + h
        tokk = bh.to(tl.int64) * Nk
        qlo = tl.load(QLo + tokk + offs_n, mask=nval, other=0)
        qhi = tl.load(QHi + tokk + offs_n, mask=nval, other=0)
        m_lo = tl.min(tl.where(nval, qlo, Nq), 0)
        m_hi = tl.max(qhi, 0)
        f0, f1 = _phases(m_lo, tl.max(qlo, 0), tl.min(tl.where(nval, qhi, Nq), 0), m_hi, BLOCK_M)
        tokq = bh.to(tl.int64) * Nq
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
        mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        drop_row = bh.to(tl.uint32) * Nq.to(tl.uint32)
        dk, dv = _dkdv_loop(dk, dv, k, v, kj, qlo, qhi, m_lo, f0, m_hi,
                            q_base, do_base, QPerm + tokq, Lse + tokq, Delta + tokq, mask_base,
                            stride_qn, stride_qd, stride_gn, stride_gd, stride_mi, stride_mj,
                            qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                            offs_d, offs_dv, D, DV,
                            BLOCK_M, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)
        dk, dv = _dkdv_loop(dk, dv, k, v, kj, qlo, qhi, f0, f1, m_hi,
                            q_base, do_base, QPerm + tokq, Lse + tokq, Delta + tokq, mask_base,
                            stride_qn, stride_qd, stride_gn, stride_gd, stride_mi, stride_mj,
                            qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                            offs_d, offs_dv, D, DV,
                            BLOCK_M, False, EXCLUDE_SELF, MASK_KIND, DROPOUT)
        dk, dv = _dkdv_loop(dk, dv, k, v, kj, qlo, qhi, f1, m_hi, m_hi,
                            q_base, do_base, QPerm + tokq, Lse + tokq, Delta + tokq, mask_base,
                            stride_qn, stride_qd, stride_gn, stride_gd, stride_mi, stride_mj,
                            qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                            offs_d, offs_dv, D, DV,
                            BLOCK_M, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    dk = dk * sm_scale
    dk_base = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
    dv_base = DV_ + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
    tl.store(dk_base + kj[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=nval[:, None] & (offs_d < D)[None, :])
    tl.store(dv_base + kj[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV_.dtype.element_ty),
             mask=nval[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, qi, lo, hi, n_from, n_to, n_bound,
             k_base, v_base, kperm_base, mask_base,
             stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
             qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
             offs_d, offs_dv, D, DV,
             BLOCK_N: tl.constexpr, RANGE_MASK: tl.constexpr,
             EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    dmask = offs_d < D
    dvmask = offs_dv < DV
    for start_n in range(n_from, n_to, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if RANGE_MASK:
            kj = tl.load(kperm_base + offs_n, mask=offs_n < n_bound, other=0)
        else:
            kj = tl.load(kperm_base + offs_n)
        k = tl.load(k_base + kj[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=dmask[None, :], other=0.0)
        v = tl.load(v_base + kj[:, None] * stride_vn + offs_dv[None, :] * stride_vd, mask=dvmask[None, :], other=0.0)
        s = _mm(q, tl.trans(k)) * qk_scale
        if MASK_KIND == 2:
            bias = tl.load(mask_base + qi[:, None] * stride_mi + kj[None, :] * stride_mj).to(tl.float32)
            s = s + bias * LOG2E
        p = tl.math.exp2(s - lse2[:, None])
        if RANGE_MASK:
            p = tl.where((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]), p, 0.0)
        if EXCLUDE_SELF:
            p = tl.where(qi[:, None] != kj[None, :], p, 0.0)
        if MASK_KIND == 1:
            allowed = tl.load(mask_base + qi[:, None] * stride_mi + kj[None, :] * stride_mj)
            p = tl.where(allowed != 0, p, 0.0)
        dp = _mm(do, tl.trans(v))
        if DROPOUT:
            idx = (drop_row + qi.to(tl.uint32))[:, None] * Nk.to(tl.uint32) + kj.to(tl.uint32)[None, :]
            dp = tl.where(dropout_keep(seed_u32, idx, p_drop), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds.to(k.dtype), k)
    return dq


@triton.jit(do_not_specialize=["seed"])
def scfa_bwd_dq_kernel(Q, K, V, DO, DQ, Lse, Delta, QPerm, KPerm, Lo, Hi, Mask,
                       stride_qb, stride_qh, stride_qn, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_gb, stride_gh, stride_gn, stride_gd,
                       stride_dqb, stride_dqh, stride_dqn, stride_dqd,
                       stride_mb, stride_mh, stride_mi, stride_mj,
                       qk_scale, sm_scale, seed, p_drop, inv_keep,
                       Hq, Hk, Nq, Nk, D, DV,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       EXCLUDE_SELF: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr):
    """dQ of one tile of sorted queries of one query head."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // (Hq // Hk)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mval = offs_m < Nq
    tok = bh.to(tl.int64) * Nq
    qi = tl.load(QPerm + tok + offs_m, mask=mval, other=0)
    lo = tl.load(Lo + tok + offs_m, mask=mval, other=0)
    hi = tl.load(Hi + tok + offs_m, mask=mval, other=0)
    n_lo = tl.min(tl.where(mval, lo, Nk), 0)
    n_hi = tl.max(hi, 0)
    f0, f1 = _phases(n_lo, tl.max(lo, 0), tl.min(tl.where(mval, hi, Nk), 0), n_hi, BLOCK_N)

    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + qi[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=mval[:, None] & (offs_d < D)[None, :], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
                 + qi[:, None] * stride_gn + offs_dv[None, :] * stride_gd,
                 mask=mval[:, None] & (offs_dv < DV)[None, :], other=0.0)
    lse = tl.load(Lse + tok + qi, mask=mval, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    delta = tl.load(Delta + tok + qi, mask=mval, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    kperm_base = KPerm + (b * Hk + hk).to(tl.int64) * Nk
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    seed_u32 = seed.to(tl.uint32)
    drop_row = bh.to(tl.uint32) * Nq.to(tl.uint32)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_loop(dq, q, do, lse2, delta, qi, lo, hi, n_lo, f0, n_hi,
                  k_base, v_base, kperm_base, mask_base,
                  stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                  qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                  offs_d, offs_dv, D, DV,
                  BLOCK_N, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    dq = _dq_loop(dq, q, do, lse2, delta, qi, lo, hi, f0, f1, n_hi,
                  k_base, v_base, kperm_base, mask_base,
                  stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                  qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                  offs_d, offs_dv, D, DV,
                  BLOCK_N, False, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    dq = _dq_loop(dq, q, do, lse2, delta, qi, lo, hi, f1, n_hi, n_hi,
                  k_base, v_base, kperm_base, mask_base,
                  stride_kn, stride_kd, stride_vn, stride_vd, stride_mi, stride_mj,
                  qk_scale, seed_u32, p_drop, inv_keep, drop_row, Nk,
                  offs_d, offs_dv, D, DV,
                  BLOCK_N, True, EXCLUDE_SELF, MASK_KIND, DROPOUT)
    dq = dq * sm_scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + qi[:, None] * stride_dqn + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=mval[:, None] & (offs_d < D)[None, :])


# ---------------------------------------------------------------------------------------------
# Layout: a stable counting sort by group id (ids shifted to [0, R_P2)), in three launches per
# side: per-chunk histograms, a scan over chunks, and a scatter that also writes each token's
# kept interval. Replaces torch.sort + searchsorted (see scfa.build_layout).


@triton.jit
def layout_hist_kernel(Grp, Hist, N, n_chunks, g_off, CHUNK: tl.constexpr, R_P2: tl.constexpr):
    """``Hist[row, chunk, g]``: tokens of group ``g`` in each chunk of CHUNK tokens of a row."""
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < N
    g = (tl.load(Grp + row * N + offs, mask=valid, other=0).to(tl.int64) - g_off).to(tl.int32)
    h = tl.histogram(tl.where(valid, g, 0), R_P2, mask=valid)
    tl.store(Hist + (row * n_chunks + c) * R_P2 + tl.arange(0, R_P2), h)


@triton.jit
def layout_scan_kernel(Hist, StartPos, Excl, Start, Count, n_chunks, CB: tl.constexpr, R_P2: tl.constexpr):
    """Per row: group sizes ``Count``, group starts ``Start`` (exclusive scan over groups), tokens of
    the group in earlier chunks ``Excl``, and ``StartPos = Start + Excl`` (first sorted slot of the
    chunk's tokens of each group)."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R_P2)
    tot = tl.zeros([R_P2], tl.int32)
    for c0 in range(0, n_chunks, CB):
        cc = c0 + tl.arange(0, CB)
        h = tl.load(Hist + (row * n_chunks + cc[:, None]) * R_P2 + r[None, :], mask=(cc < n_chunks)[:, None], other=0)
        tot += tl.sum(h, 0)
    start = tl.cumsum(tot, 0) - tot
    tl.store(Start + row * R_P2 + r, start)
    tl.store(Count + row * R_P2 + r, tot)
    carry = tl.zeros([R_P2], tl.int32)
    for c0 in range(0, n_chunks, CB):
        cc = c0 + tl.arange(0, CB)
        cm = (cc < n_chunks)[:, None]
        h = tl.load(Hist + (row * n_chunks + cc[:, None]) * R_P2 + r[None, :], mask=cm, other=0)
        ex = tl.cumsum(h, 0) - h + carry[None, :]
        off = (row * n_chunks + cc[:, None]) * R_P2 + r[None, :]
        tl.store(Excl + off, ex, mask=cm)
        tl.store(StartPos + off, ex + start[None, :], mask=cm)
        carry += tl.sum(h, 0)


@triton.jit
def _chunk_rank(g, CHUNK: tl.constexpr):
    """Stable rank of each token among the earlier tokens of its group inside the chunk."""
    ar = tl.arange(0, CHUNK)
    same = (g[:, None] == g[None, :]) & (ar[None, :] < ar[:, None])
    return tl.sum(same.to(tl.int32), 1)


@triton.jit
def layout_query_kernel(QG, QStartPos, KG, KStart, KCount, KExcl, QPerm, Lo, Hi,
                        Nq, Nk, nch_q, nch_k, Hq, Hk, g_off,
                        CAUSAL: tl.constexpr, CHUNK: tl.constexpr, R_P2: tl.constexpr):
    """Scatter query positions to their sorted slots, with each one's kept interval of sorted keys:
    its group's keys, only those at original positions ``<= i`` under causality."""
    c = tl.program_id(0)
    rq = tl.program_id(1)
    b = rq // Hq
    rk = (b * Hk + (rq % Hq) // (Hq // Hk)).to(tl.int64)
    rq = rq.to(tl.int64)
    ar = tl.arange(0, CHUNK)
    i = c * CHUNK + ar
    valid = i < Nq
    g = (tl.load(QG + rq * Nq + i, mask=valid, other=0).to(tl.int64) - g_off).to(tl.int32)
    g = tl.where(valid, g, 0)
    pos = tl.load(QStartPos + (rq * nch_q + c) * R_P2 + g) + _chunk_rank(g, CHUNK)
    tl.store(QPerm + rq * Nq + pos, i, mask=valid)
    kst = tl.load(KStart + rk * R_P2 + g)
    kcnt = tl.load(KCount + rk * R_P2 + g)
    if CAUSAL:
        excl = tl.load(KExcl + (rk * nch_k + c) * R_P2 + g, mask=valid & (c < nch_k), other=0)
        kval = i < Nk  # key chunk c holds key positions i (same chunking)
        kg = (tl.load(KG + rk * Nk + i, mask=kval, other=0).to(tl.int64) - g_off).to(tl.int32)
        kg = tl.where(kval, kg, -1)
        part = tl.sum(((g[:, None] == kg[None, :]) & (ar[None, :] <= ar[:, None])).to(tl.int32), 1)
        hi = tl.where(i < Nk, kst + excl + part, kst + kcnt)
    else:
        hi = kst + kcnt
    tl.store(Lo + rq * Nq + pos, kst, mask=valid)
    tl.store(Hi + rq * Nq + pos, hi, mask=valid)


@triton.jit
def layout_key_kernel(KG, KStartPos, QG, QStart, QCount, QExcl, KPerm, QLo, QHi,
                      Nq, Nk, nch_q, nch_k, Hq, Hk, g_off,
                      CAUSAL: tl.constexpr, WRITE_PERM: tl.constexpr, WRITE_Q: tl.constexpr,
                      CHUNK: tl.constexpr, R_P2: tl.constexpr):
    """Scatter key positions to their sorted slots; with WRITE_Q, also each sorted key's interval of
    sorted queries keeping it, per query head of its group (the backward's dK/dV ranges)."""
    c = tl.program_id(0)
    rk = tl.program_id(1)
    b = rk // Hk
    hk = rk % Hk
    G = Hq // Hk
    rk = rk.to(tl.int64)
    ar = tl.arange(0, CHUNK)
    j = c * CHUNK + ar
    valid = j < Nk
    g = (tl.load(KG + rk * Nk + j, mask=valid, other=0).to(tl.int64) - g_off).to(tl.int32)
    g = tl.where(valid, g, 0)
    pos = tl.load(KStartPos + (rk * nch_k + c) * R_P2 + g) + _chunk_rank(g, CHUNK)
    if WRITE_PERM:
        tl.store(KPerm + rk * Nk + pos, j, mask=valid)
    if WRITE_Q:
        qval = j < Nq  # query chunk c holds query positions j
        for gq in range(0, G):
            rq = (b * Hq + hk * G + gq).to(tl.int64)
            qst = tl.load(QStart + rq * R_P2 + g)
            qcnt = tl.load(QCount + rq * R_P2 + g)
            if CAUSAL:
                excl = tl.load(QExcl + (rq * nch_q + c) * R_P2 + g, mask=valid & (c < nch_q), other=0)
                qg = (tl.load(QG + rq * Nq + j, mask=qval, other=0).to(tl.int64) - g_off).to(tl.int32)
                qg = tl.where(qval, qg, -1)
                below = tl.sum(((g[:, None] == qg[None, :]) & (ar[None, :] < ar[:, None])).to(tl.int32), 1)
                qlo = tl.where(j < Nq, qst + excl + below, qst + qcnt)
            else:
                qlo = qst
            tl.store(QLo + rq * Nk + pos, qlo, mask=valid)
            tl.store(QHi + rq * Nk + pos, qst + qcnt, mask=valid)
