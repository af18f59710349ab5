"""SPION's recorded statistic as a Triton kernel: block sums of the filtered probabilities.

For one attention call with logits ``s`` (scale, mask and predicates as the op applies them) and the
row log-sum-exp ``lse`` the op returned, the probabilities are ``P = exp(s - lse)`` on the allowed
entries (zero elsewhere, and on rows with ``lse = -inf``). :mod:`attncomp.spion` records
``pool(I, J) = sum_{f=-h..h} sum_{(i, j) in block (I, J), i, j < L} P(i + f, j + f)`` (Eq. 3 then the
block sums of Eq. 4, before the division by the block areas). Each entry ``(x, y)`` of ``P`` reaches
block ``(I, J)`` through ``c = #{f in [-h, h] : x - f in rows(I), y - f in cols(J)}`` taps, a closed
form (:func:`_taps`), and only blocks within ``r = ceil(h / Bs)`` block offsets of the entry's own
tile are reached. So one program per (batch * head, query tile) recomputes ``P`` tile by tile from
``q``, ``k`` and ``lse`` and writes, for each key tile and each of the ``(2r + 1)^2`` block offsets
``(e_I, e_J)``, the sum ``sum c * P`` over the tile: ``R[bh, e, I', J']`` float32. Nothing of size
``N x N`` is written; :func:`attncomp.spion.block_statistic` adds the partials of each target block.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import interpret_mode

__all__ = ["spion_partials"]


@triton.jit
def _taps(x, y, ti, tj, N, BLOCK: tl.constexpr, HF: tl.constexpr):
    """Filter taps carrying entry ``(x, y)`` into block ``(ti, tj)`` of the filtered map, whose rows
    and columns stop at ``N``."""
    rs = ti * BLOCK
    re = tl.minimum(rs + BLOCK, N)
    cs = tj * BLOCK
    ce = tl.minimum(cs + BLOCK, N)
    lo = tl.maximum(tl.maximum(x - re + 1, y - ce + 1), -HF)
    hi = tl.minimum(tl.minimum(x - rs, y - cs), HF)
    return tl.maximum(hi - lo + 1, 0)


@triton.jit
def _spion_stat_kernel(
    Q, K, LSE, M, QPOS, KPOS, QSEG, KSEG, QVAL, KVAL, R,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_lb, s_lh, s_lm,
    s_mb, s_mh, s_mm, s_mn,
    s_tok,
    s_rbh, s_re, s_ri,
    H, G, N, D, NT, scale, win_left, win_right,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HF: tl.constexpr, RR: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SEG: tl.constexpr,
    QV: tl.constexpr, KV: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = offs_m < N
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=row_in[:, None] & (offs_d < D)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    lse = tl.load(LSE + b * s_lb + h * s_lh + offs_m * s_lm, mask=row_in, other=float("-inf"))
    row_ok = row_in & (lse > float("-inf"))
    lse = tl.where(row_ok, lse, 0.0)
    tok = b * s_tok
    if HAS_LEFT or HAS_RIGHT:
        qp = tl.load(QPOS + tok + offs_m, mask=row_in, other=0)
    if SEG:
        qs = tl.load(QSEG + tok + offs_m, mask=row_in, other=0)
    if QV:
        row_ok = row_ok & (tl.load(QVAL + tok + offs_m, mask=row_in, other=0) != 0)
    x = offs_m[:, None]
    for j in range(0, NT):
        offs_n = j * BLOCK + tl.arange(0, BLOCK)
        col_in = offs_n < N
        kt = tl.load(K + b * s_kb + hk * s_kh + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                     mask=col_in[None, :] & (offs_d < D)[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        ok = row_ok[:, None] & col_in[None, :]
        if MASK_KIND == 1:
            mv = tl.load(M + b * s_mb + h * s_mh + offs_m[:, None] * s_mm + offs_n[None, :] * s_mn,
                         mask=row_in[:, None] & col_in[None, :], other=0)
            ok = ok & (mv != 0)
        if MASK_KIND == 2:
            bias = tl.load(M + b * s_mb + h * s_mh + offs_m[:, None] * s_mm + offs_n[None, :] * s_mn,
                           mask=row_in[:, None] & col_in[None, :], other=0.0).to(tl.float32)
            ok = ok & (bias != float("-inf"))
            s = s + tl.where(ok, bias, 0.0)
        if HAS_LEFT or HAS_RIGHT:
            kp = tl.load(KPOS + tok + offs_n, mask=col_in, other=0)
            if HAS_RIGHT:
                ok = ok & (kp[None, :] <= qp[:, None] + win_right)
            if HAS_LEFT:
                ok = ok & (kp[None, :] >= qp[:, None] - win_left)
        if SEG:
            ks = tl.load(KSEG + tok + offs_n, mask=col_in, other=0)
            ok = ok & (qs[:, None] == ks[None, :])
        if KV:
            ok = ok & (tl.load(KVAL + tok + offs_n, mask=col_in, other=0) != 0)[None, :]
        p = tl.where(ok, tl.exp(tl.where(ok, s - lse[:, None], 0.0)), 0.0)
        y = offs_n[None, :]
        for a in tl.static_range(2 * RR + 1):
            for c in tl.static_range(2 * RR + 1):
                cnt = _taps(x, y, pid_m + (a - RR), j + (c - RR), N, BLOCK, HF)
                val = tl.sum(tl.sum(cnt.to(tl.float32) * p, axis=1), axis=0)
                tl.store(R + bh * s_rbh + (a * (2 * RR + 1) + c) * s_re + pid_m * s_ri + j, val)


def _tok(t: Optional[torch.Tensor], dtype=torch.int64) -> Optional[torch.Tensor]:
    """A per-token tensor as contiguous ``(B or 1, N)``."""
    if t is None:
        return None
    t = t.to(dtype)
    return (t if t.dim() == 2 else t.reshape(t.shape[0] if t.dim() else 1, -1)).contiguous()


def spion_partials(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float, block_size: int,
                   filter_size: int, attn_mask: Optional[torch.Tensor] = None, left: Optional[int] = None,
                   right: Optional[int] = None, q_pos: Optional[torch.Tensor] = None,
                   k_pos: Optional[torch.Tensor] = None, q_seg: Optional[torch.Tensor] = None,
                   k_seg: Optional[torch.Tensor] = None, q_valid: Optional[torch.Tensor] = None,
                   k_valid: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``R (B, Hq, (2r+1)^2, n, n)`` float32: for query tile ``I'``, key tile ``J'`` and block offset
    ``e = (e_I, e_J)`` (row-major over ``[-r, r]^2``), the taps-weighted sum of ``P`` over the tile
    into block ``(I' + e_I, J' + e_J)`` (see the module docstring). ``q (B, Hq, N, D)``, ``k (B, Hk, N,
    D)``, ``lse (B, Hq, N)``; ``attn_mask`` broadcastable to ``(B, Hq, N, N)`` (bool: allowed; float:
    bias, ``-inf`` not allowed); ``left``/``right`` the position bounds with ``q_pos``/``k_pos``
    (``(B or 1, N)``, both given when a bound is), segments and validity flags as the op takes them.
    ``out``: a contiguous float32 tensor of that shape to write into (every element is written)."""
    B, Hq, N, D = q.shape
    Hk = k.shape[1]
    if k.shape[2] != N or lse.shape != (B, Hq, N):
        raise ValueError(f"spion_partials needs self-attention shapes, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, lse {tuple(lse.shape)}")
    bs, h = int(block_size), int(filter_size) // 2
    rr = -(-h // bs)
    n = -(-N // bs)
    ne = (2 * rr + 1) ** 2
    shape = (B, Hq, ne, n, n)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}")
    if B * Hq * N == 0:
        return out.zero_()
    dummy = q
    lse = lse.to(torch.float32)
    if attn_mask is None:
        kind, m, ms = 0, dummy, (0, 0, 0, 0)
    else:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        if m.dtype == torch.bool:
            kind, m = 1, m.view(torch.uint8)
        else:
            kind = 2
        ms = tuple(0 if m.shape[i] == 1 else m.stride(i) for i in range(4))
    has_pos = left is not None or right is not None
    if has_pos and (q_pos is None or k_pos is None):
        raise ValueError("spion_partials: position bounds need q_pos and k_pos")
    toks = [_tok(q_pos), _tok(k_pos), _tok(q_seg), _tok(k_seg), _tok(q_valid, torch.int8), _tok(k_valid, torch.int8)]
    toks = [t if t is not None and t.numel() else None for t in toks]
    tb = max((t.shape[0] for t in toks if t is not None), default=1)
    toks = [t.expand(tb, N).contiguous() if t is not None else dummy for t in toks]
    seg = q_seg is not None and k_seg is not None
    upcast = q.dtype == torch.float32 or q.dtype == torch.float64 or interpret_mode()
    if q.dtype == torch.float64:
        q, k = q.float(), k.float()
    grid = (B * Hq, n)
    _spion_stat_kernel[grid](
        q, k, lse, m, *toks, out,
        *q.stride(), *k.stride(), *lse.stride(), *ms,
        N if tb > 1 else 0,
        out.stride(1), out.stride(2), out.stride(3),
        Hq, Hq // Hk, N, D, n, float(scale),
        int(left) if left is not None else 0, int(right) if right is not None else 0,
        BLOCK=bs, BLOCK_D=max(16, triton.next_power_of_2(D)), HF=h, RR=rr,
        MASK_KIND=kind, HAS_LEFT=left is not None, HAS_RIGHT=right is not None, SEG=seg,
        QV=q_valid is not None, KV=k_valid is not None, UPCAST=bool(upcast),
        num_warps=1 if interpret_mode() else (4 if bs <= 32 else 8),
    )
    return out
