"""SPION (seed 003): block patterns from averaged attention maps, and the training procedure.

Pattern generation (Alg. 3-4)
-----------------------------
:func:`generate_pattern` turns averaged attention probabilities ``(..., L, L)`` into a boolean block
pattern ``(..., n, n)``, ``n = ceil(L / B)``:

1. **Diagonal filter (Eq. 3).** ``conv(i, j) = sum_{f=-h..h} A(i+f, j+f)`` with ``h = (F-1)/2``: an
   ``F x F`` identity filter, centred, ``A`` zero-padded so that ``conv`` stays ``L x L``.
2. **Average pooling (Eq. 4).** ``pool(I, J)`` is the mean of ``conv`` over block ``(I, J)``; the last
   block row/column, when ``B`` does not divide ``L``, averages over the entries it has.
3. **Flood fill (Alg. 4)** from every block of the first row, left to right, then of the first
   column, top to bottom, over ``pool`` with the threshold ``t`` = the ``threshold`` quantile of
   ``pool`` (linear interpolation between order statistics, as ``numpy.quantile``). From block
   ``(r, c)`` (nothing happens on the last row or column, Alg. 4 line 1), ``m`` is the largest value
   among the *unvisited* neighbours down ``(r+1, c)``, right ``(r, c+1)`` and diagonal ``(r+1, c+1)``
   ("avoiding duplicate comparisons with elements that have already been selected"); each neighbour
   in that order that equals ``m``, is still unvisited, and is ``> t`` is marked and filled from in
   turn (so exact ties are all followed, the down branch first).
4. The diagonal blocks are kept (Alg. 3 lines 5-6: after the fills, so the fills may walk along the
   diagonal).

The two readings of Alg. 4 that its printed form leaves open, and what this implementation takes:

* *Recursion only from a block that passed the threshold.* The text says a neighbour above ``t`` is
  "the critical element" and "after determining the critical element, the algorithm recursively
  compares ... the critical element" (and §2.2: a small value "prevents the fill operation"), so
  lines 6/10/14 run inside the ``> t`` branch. Taken literally (recursing from every largest
  neighbour), every walk would run to the matrix edge and mark nothing more.
* *``r, c`` after a recursive call.* Alg. 4 returns its state tuple ``(pool, r, c, fl, t)`` and the
  caller assigns it, which would move the caller's ``r, c`` to the child's. The text describes the
  three comparisons as those of "the current element", and ``m`` (line 3) is computed once for
  them, so ``r, c`` stay the current block's: the assignment only threads the state through.

Variants (paper §5): ``"spion"`` (SPION-CF, filter and flood fill), ``"spion-f"`` (flood fill on the
pooled map without the filter), ``"spion-c"`` (filter, then the diagonal plus the off-diagonal blocks
with the largest pooled values until the pattern holds ``max(n, round(alpha * n * n))`` blocks; ties
keep the lower row-major index): ``alpha`` sets the density directly.

The fill is computed for all maps at once (layers and heads stacked in the leading dims): one
depth-first walk per map advanced in lockstep with tensor operations, a step per marked block; the
filter and pooling are one stride-``B`` convolution with ``B x B`` kernels (each tile times the
weights with which its entries reach the pooled blocks around it).

Training procedure (Alg. 2)
---------------------------
See :class:`SpionState`, :func:`calibrate`, :func:`set_patterns` and :func:`patterns`.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Tuple

import torch

__all__ = ["generate_pattern", "pool_map", "flood_fill", "fit_pattern", "VARIANTS"]

VARIANTS = ("spion", "spion-c", "spion-f")


# ---------------------------------------------------------------------------------------------
# Eq. 3-4: diagonal filter and average pooling, as one product over tiles.

def _tile_weights(B: int, h: int, dtype) -> Tuple[torch.Tensor, int]:
    """``W[k, a, b]``: how many filter taps carry entry ``(a, b)`` of the tile at block offset
    ``(dI, dJ)`` (k enumerates ``dI, dJ`` in ``[-r, r]``) into the pooled sum of a block."""
    r = -(-h // B)
    f = torch.arange(-h, h + 1)
    a = torch.arange(B)
    ws = []
    for dI in range(-r, r + 1):
        ra = (dI * B + a[:, None] - f[None, :])  # (B, F): output row offset inside the block
        oka = (ra >= 0) & (ra < B)
        for dJ in range(-r, r + 1):
            rb = (dJ * B + a[:, None] - f[None, :])
            okb = (rb >= 0) & (rb < B)
            ws.append((oka[:, None, :] & okb[None, :, :]).sum(-1))
    return torch.stack(ws).to(dtype), r


def _conv_rect(A: torch.Tensor, i0: int, i1: int, j0: int, j1: int, h: int) -> torch.Tensor:
    """``conv`` (Eq. 3) at output rows ``[i0, i1)`` and columns ``[j0, j1)`` (any ints, zero outside)."""
    L = A.shape[-1]
    out = A.new_zeros(A.shape[:-2] + (i1 - i0, j1 - j0))
    for f in range(-h, h + 1):
        xs, xe = max(i0 + f, 0), min(i1 + f, L)
        ys, ye = max(j0 + f, 0), min(j1 + f, L)
        if xs >= xe or ys >= ye:
            continue
        out[..., xs - i0 - f:xe - i0 - f, ys - j0 - f:ye - j0 - f] += A[..., xs:xe, ys:ye]
    return out


def pool_map(A: torch.Tensor, block_size: int, filter_size: int = 31) -> torch.Tensor:
    """``pool_out`` of Alg. 3: the diagonal filter (Eq. 3, ``filter_size`` taps, 1 = none) and
    average pooling to ``block_size`` blocks (Eq. 4) of ``A (..., L, L)``; float64 ``(..., n, n)``.

    Linear in ``A``, so the pooled map of a mean is the mean of the pooled maps: training records
    this statistic per step instead of ``L x L`` maps.
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"attention maps must have shape (..., L, L), got {tuple(A.shape)}")
    if not isinstance(filter_size, int) or filter_size < 1 or filter_size % 2 == 0:
        raise ValueError(f"filter_size must be a positive odd int, got {filter_size!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    ct = torch.float64 if A.dtype == torch.float64 else torch.float32
    A = A.to(ct)
    lead = A.shape[:-2]
    L, B, h = A.shape[-1], block_size, filter_size // 2
    n = -(-L // B)
    Lp = n * B
    if Lp != L:
        A = torch.nn.functional.pad(A, (0, Lp - L, 0, Lp - L))
    W, r = _tile_weights(B, h, ct)
    # a stride-B convolution with B x B kernels is the product of each tile with each weight
    R = torch.nn.functional.conv2d(A.reshape(-1, 1, Lp, Lp), W.to(A.device)[:, None], stride=B)
    R = torch.nn.functional.pad(R, (r, r, r, r))
    S = torch.zeros(R.shape[0], n, n, dtype=ct, device=A.device)
    k = 0
    for dI in range(-r, r + 1):
        for dJ in range(-r, r + 1):
            S += R[:, k, r + dI:r + dI + n, r + dJ:r + dJ + n]
            k += 1
    S = S.to(torch.float64).reshape(lead + (n, n))
    if Lp != L:
        # outputs past L (the padded part of the last block row/column) are not part of conv_out
        Ah = A.reshape(lead + (Lp, Lp))
        extra_r = _conv_rect(Ah, L, Lp, 0, Lp, h).to(torch.float64)          # rows >= L
        extra_c = _conv_rect(Ah, 0, L, L, Lp, h).to(torch.float64)          # rows < L, cols >= L
        S[..., n - 1, :] -= extra_r.reshape(lead + (Lp - L, n, B)).sum((-3, -1))
        extra_c = torch.nn.functional.pad(extra_c, (0, 0, 0, Lp - L))
        S[..., :, n - 1] -= extra_c.reshape(lead + (n, B, Lp - L)).sum((-2, -1))
    rows = torch.full((n,), float(B), dtype=torch.float64, device=S.device)
    rows[-1] = L - (n - 1) * B
    return S / (rows[:, None] * rows[None, :])


# ---------------------------------------------------------------------------------------------
# The recorded statistic: pool_map of one call's probabilities, tile by tile, without N x N.

def _taps(x: torch.Tensor, y: torch.Tensor, ti: torch.Tensor, tj: torch.Tensor, B: int, L: int,
          h: int) -> torch.Tensor:
    """How many taps of the diagonal filter carry entry ``(x, y)`` of ``A`` into block ``(ti, tj)`` of
    ``conv`` (output rows and columns past ``L`` are not part of ``conv``):
    ``#{f in [-h, h] : x - f in rows(ti), y - f in cols(tj)}``."""
    rs, cs = ti * B, tj * B
    re, ce = (rs + B).clamp_max(L), (cs + B).clamp_max(L)
    lo = torch.maximum(torch.maximum(x - re + 1, y - ce + 1), torch.full_like(x, -h))
    hi = torch.minimum(torch.minimum(x - rs, y - cs), torch.full_like(x, h))
    return (hi - lo + 1).clamp_min(0)


def _offsets(r: int):
    return [(eI, eJ) for eI in range(-r, r + 1) for eJ in range(-r, r + 1)]


def _shift_add(T: torch.Tensor, r: int) -> torch.Tensor:
    """Block sums ``(H, n, n)`` from tile partials ``T (H, (2r+1)^2, n, n)`` (``T[:, e, I', J']``:
    tile ``(I', J')``'s share of block ``(I' + e_I, J' + e_J)``)."""
    H, _, n, _ = T.shape
    S = T.new_zeros(H, n + 2 * r, n + 2 * r)
    for e, (eI, eJ) in enumerate(_offsets(r)):
        S[:, r + eI:r + eI + n, r + eJ:r + eJ + n] += T[:, e]
    return S[:, r:r + n, r:r + n]


def _slice_rows(t: Optional[torch.Tensor], x0: int, x1: int, dim: int) -> Optional[torch.Tensor]:
    if t is None or t.shape[dim] == 1:
        return t
    return t.narrow(dim, x0, x1 - x0)


def _torch_partials(spec, q, k, attn_mask, preds, lse, B: int, h: int, per_head: bool,
                    chunk: Optional[int]) -> torch.Tensor:
    """The tile partials of :func:`block_statistic` in PyTorch, ``chunk`` query rows at a time
    (logits ``(batch, Hq, chunk, N)`` at most; default: about 4M logits per chunk)."""
    from .codegen import reference
    from .spec import Predicates

    Bt, Hq, N, _ = q.shape
    n, r = -(-N // B), -(-h // B)
    if chunk is None:
        chunk = (1 << 22) // max(1, Bt * Hq * N)
    rows = max(B, -(-int(chunk) // B) * B)
    preds = preds if preds is not None else Predicates.none()
    q_pos, k_pos = preds.q_pos, preds.k_pos
    if any(b is not None for b in spec.bounds()):
        dq, dk = reference.default_positions(spec, N, N, q.device)
        q_pos = dq if q_pos is None else q_pos
        k_pos = dk if k_pos is None else k_pos
    mask = attn_mask
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    Hs = Hq if per_head else 1
    T = torch.zeros(Hs, (2 * r + 1) ** 2, n, n, dtype=torch.float64, device=q.device)
    y = torch.arange(n * B, device=q.device)[None, :]
    a = torch.arange(B, device=q.device)
    W = torch.stack([_taps(a[:, None], a[None, :], torch.tensor(eI), torch.tensor(eJ), B, 1 << 40, h)
                     for eI, eJ in _offsets(r)]).to(torch.float64)       # taps into whole blocks
    for x0 in range(0, N, rows):
        x1 = min(N, x0 + rows)
        pc = Predicates(_slice_rows(q_pos, x0, x1, 1), k_pos, _slice_rows(preds.q_seg, x0, x1, 1), preds.k_seg,
                        _slice_rows(preds.q_valid, x0, x1, 1), preds.k_valid)
        s, allowed = reference.logits(spec, q[:, :, x0:x1], k, _slice_rows(mask, x0, x1, 2), pc)
        lc = lse[:, :, x0:x1, None].to(s.dtype)
        lc = lc.masked_fill(lc == float("-inf"), float("inf"))   # a row without allowed keys: zeros
        p = s.sub_(lc).masked_fill_(~allowed, float("-inf")).exp_()   # s is the chunk's own tensor
        del s, allowed
        pm = p.sum(0)                                              # (Hq, C, N): weights are per entry
        del p
        if not per_head:
            pm = pm.sum(0, keepdim=True)
        pm = pm.to(torch.float64)
        t0, t1 = x0 // B, -(-x1 // B)
        pm = torch.nn.functional.pad(pm, (0, n * B - N, 0, (t1 - t0) * B - (x1 - x0)))
        # every tile with the weights of a whole target block: one product with (2r+1)^2 B x B weights
        T[:, :, t0:t1] = torch.einsum("hiajb,kab->hkij", pm.reshape(Hs, t1 - t0, B, n, B), W)
        if N % B:
            # targets in the last (partial) block row or column: the exact taps, on those strips only
            x = torch.arange(t0 * B, t1 * B, device=q.device)[:, None]
            for e, (eI, eJ) in enumerate(_offsets(r)):
                j = n - 1 - eJ
                if 0 <= j < n:
                    yj = y[:, j * B:(j + 1) * B]
                    w = _taps(x, yj, x // B + eI, yj // B + eJ, B, N, h).to(torch.float64)
                    T[:, e, t0:t1, j] = (pm[:, :, j * B:(j + 1) * B] * w).reshape(Hs, t1 - t0, B * B).sum(-1)
                i = n - 1 - eI
                if t0 <= i < t1:
                    xi = x[(i - t0) * B:(i - t0 + 1) * B]
                    w = _taps(xi, y, xi // B + eI, y // B + eJ, B, N, h).to(torch.float64)
                    T[:, e, i] = (pm[:, (i - t0) * B:(i - t0 + 1) * B] * w).reshape(Hs, B, n, B).sum((1, 3))
    return T


_TRITON_FAILED: Optional[str] = None     # why the Triton statistic kernel could not run, once it failed


def block_statistic(spec, q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor], preds,
                    lse: torch.Tensor, *, block_size: int, filter_size: int, per_head: bool = False,
                    impl: str = "auto", chunk: Optional[int] = None) -> torch.Tensor:
    """The statistic one SPION training call records, from the op's inputs and its ``lse``:
    ``pool_map(P averaged over the batch (and the heads unless per_head), block_size, filter_size)``,
    float64 ``(1 or Hq, n, n)``, where ``P = exp(s - lse)`` on the allowed entries of the logits ``s``
    (the op's scale, mask and predicates) and 0 elsewhere (and on rows with ``lse = -inf``).

    Exact (up to rounding): entry ``(x, y)`` of ``P`` reaches pooled block ``(I, J)`` with the number
    of filter taps ``f`` for which ``(x - f, y - f)`` lies in the block (and before ``L``), so each
    ``Bs x Bs`` tile of ``P`` adds taps-weighted sums to the blocks within ``ceil(h / Bs)`` block
    offsets of it. ``impl``: ``"triton"`` (the kernel of
    :mod:`attncomp.codegen.triton.spion_stats`, one query tile per program), ``"torch"`` (query rows
    in chunks of ``chunk``) or ``"auto"`` (Triton for CUDA tensors; if it raises, a warning and
    PyTorch from then on). Memory: the ``(B, Hq,
    (2r+1)^2, n, n)`` tile partials and one tile (Triton) or one chunk of logits (PyTorch).
    """
    from .spec import AttentionSpec

    if isinstance(spec, str):
        spec = AttentionSpec.from_json(spec)
    Bt, Hq, N, D = q.shape
    if k.shape[2] != N:
        raise ValueError(f"the SPION statistic is for self-attention (Nq == Nk), got {N} and {k.shape[2]}")
    B, h = int(block_size), int(filter_size) // 2
    n, r = -(-N // B), -(-h // B)
    if impl == "auto":
        global _TRITON_FAILED
        if q.is_cuda and _TRITON_FAILED is None:
            try:
                return block_statistic(spec, q, k, attn_mask, preds, lse, block_size=block_size,
                                       filter_size=filter_size, per_head=per_head, impl="triton")
            except Exception as e:  # no Triton, or a kernel that fails here: training goes on
                _TRITON_FAILED = f"{type(e).__name__}: {e}"
                warnings.warn("attncomp.spion: the Triton statistic kernel failed "
                              f"({_TRITON_FAILED}); recording with the PyTorch path from now on")
        impl = "torch"
    if impl == "triton":
        from .codegen.triton.spion_stats import spion_partials
        from .codegen import reference
        from .spec import Predicates

        pr = preds if preds is not None else Predicates.none()
        left, right = spec.bounds()
        q_pos, k_pos = pr.q_pos, pr.k_pos
        if left is not None or right is not None:
            dq, dk = reference.default_positions(spec, N, N, q.device)
            q_pos = dq if q_pos is None else q_pos
            k_pos = dk if k_pos is None else k_pos
        scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
        R = spion_partials(q, k, lse, scale=scale, block_size=B, filter_size=filter_size, attn_mask=attn_mask,
                           left=left, right=right, q_pos=q_pos, k_pos=k_pos, q_seg=pr.q_seg, k_seg=pr.k_seg,
                           q_valid=pr.q_valid, k_valid=pr.k_valid)
        T = R.sum(0, dtype=torch.float64)
        if not per_head:
            T = T.sum(0, keepdim=True)
    elif impl == "torch":
        T = _torch_partials(spec, q, k, attn_mask, preds, lse, B, h, per_head, chunk)
    else:
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    S = _shift_add(T, r)
    rows = torch.full((n,), float(B), dtype=torch.float64, device=S.device)
    rows[-1] = N - (n - 1) * B
    return S / (rows[:, None] * rows[None, :] * (Bt * (1 if per_head else Hq)))


# ---------------------------------------------------------------------------------------------
# Alg. 4: the flood fill, one walk per map in lockstep.

def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row ``q`` quantile of ``x (M, N)`` float64, linear interpolation (``numpy`` default)."""
    s = torch.sort(x, dim=-1).values
    N = s.shape[-1]
    pos = q * (N - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, N - 1)
    frac = pos - lo
    return s[:, lo] + (s[:, hi] - s[:, lo]) * frac


def flood_fill(pool: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Alg. 3 lines 2-4 with Alg. 4 (see the module docstring for the readings taken) on pooled maps
    ``(M, n, n)`` with thresholds ``t (M,)``; returns the visited blocks ``(M, n, n)`` bool (the
    diagonal is not added here)."""
    M, n, _ = pool.shape
    dev = pool.device
    P = pool.reshape(M, n * n).to(torch.float64)
    fl = torch.zeros(M, n * n, dtype=torch.bool, device=dev)
    if n < 2:
        return fl.view(M, n, n)
    t = t.to(torch.float64).reshape(M)
    ninf = torch.tensor(float("-inf"), dtype=torch.float64, device=dev)
    offs = torch.tensor([n, 1, n + 1], device=dev)          # down, right, diagonal
    rows = torch.arange(M, device=dev)

    def edge(idx):  # last row or column: Alg. 4 line 1
        return (idx // n == n - 1) | (idx % n == n - 1)

    Pf, flf = P.view(-1), fl.view(-1)

    def unvisited_max(ms, idx):  # maps ms, blocks idx: max over their unvisited neighbours
        nb = ms[:, None] * (n * n) + (idx[:, None] + offs).clamp_max(n * n - 1)
        v = torch.where(flf[nb], ninf, Pf[nb])
        return torch.where(edge(idx), ninf, v.amax(1))

    # seeds: the first row left to right, then the first column top to bottom
    seeds = torch.cat([torch.arange(n, device=dev), torch.arange(n, device=dev) * n])
    S = seeds.numel()
    snb = (seeds[:, None] + offs).clamp_max(n * n - 1)                      # (S, 3)
    live = (P[:, snb].amax(-1) > t[:, None]) & ~edge(seeds)[None]           # (M, S): may mark something
    # next live seed at or after each position (S = none left)
    pos = torch.where(live, torch.arange(S, device=dev)[None], torch.full_like(live, S, dtype=torch.long))
    nxt = torch.flip(torch.cummin(torch.flip(pos, [1]), 1).values, [1])
    nxt = torch.cat([nxt, torch.full((M, 1), S, dtype=torch.long, device=dev)], 1)
    ptr = nxt[:, 0].clone()

    depth = 2 * n + 2
    st_idx = torch.zeros(M, depth, dtype=torch.long, device=dev)
    st_m = torch.zeros(M, depth, dtype=torch.float64, device=dev)
    st_br = torch.zeros(M, depth, dtype=torch.long, device=dev)
    sp = torch.zeros(M, dtype=torch.long, device=dev)
    branch = torch.arange(3, device=dev)

    while True:
        empty = sp == 0
        start = empty & (ptr < S)
        busy = ~empty
        if not bool(start.any()) and not bool(busy.any()):
            break
        if bool(start.any()):
            ms = rows[start]
            sidx = seeds[ptr[ms]]
            st_idx[ms, 0] = sidx
            st_m[ms, 0] = unvisited_max(ms, sidx)
            st_br[ms, 0] = 0
            sp[ms] = 1
            ptr[ms] = nxt[ms, ptr[ms] + 1]
        if not bool(busy.any()):
            continue
        mb = rows[busy]
        top = sp[mb] - 1
        idx, m, br = st_idx[mb, top], st_m[mb, top], st_br[mb, top]
        nb = (idx[:, None] + offs).clamp_max(n * n - 1)
        gnb = mb[:, None] * (n * n) + nb
        ok = (Pf[gnb] == m[:, None]) & ~flf[gnb] \
            & (m > t[mb])[:, None] & (branch[None] >= br[:, None]) & ~edge(idx)[:, None]
        found = ok.any(1)
        k = torch.where(ok, branch[None], torch.full_like(ok, 3, dtype=torch.long)).amin(1)
        # maps with nothing left in the top frame pop it
        pop = mb[~found]
        sp[pop] -= 1
        mf = mb[found]
        if mf.numel():
            kf = k[found]
            child = nb[found, kf]
            flf[mf * (n * n) + child] = True
            st_br[mf, top[found]] = kf + 1
            cm = unvisited_max(mf, child)
            grow = cm > t[mf]          # a child that can mark nothing would pop at once: skip it
            mg = mf[grow]
            if mg.numel():
                d = sp[mg]
                st_idx[mg, d] = child[grow]
                st_m[mg, d] = cm[grow]
                st_br[mg, d] = 0
                sp[mg] = d + 1
    return fl.view(M, n, n)


def generate_pattern(scores: torch.Tensor, block_size: int, *, filter_size: int = 31, threshold: float = 0.96,
                     variant: str = "spion", alpha: Optional[float] = None) -> torch.Tensor:
    """The SPION block pattern of averaged attention probabilities ``scores`` ``(L, L)`` or
    ``(H, L, L)`` (any leading dims): bool ``(ceil(L/B), ceil(L/B))`` or ``(H, ...)``.

    ``threshold``: the quantile of the pooled map a block must exceed to be filled (paper:
    0.96-0.99). ``variant``: ``"spion"`` (filter + flood fill), ``"spion-f"`` (flood fill, no filter),
    ``"spion-c"`` (filter + the blocks of largest pooled value, ``alpha`` the density). See the module
    docstring for the exact rules.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown SPION variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise ValueError("scores must be a floating-point tensor of shape (L, L) or (H, L, L)")
    if variant == "spion-c":
        if alpha is None or isinstance(alpha, bool) or not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"variant 'spion-c' needs alpha (the density) in (0, 1], got {alpha!r}")
    elif not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    fs = 1 if variant == "spion-f" else filter_size
    pool = pool_map(scores, block_size, fs)
    return pattern_from_pool(pool, threshold=threshold, variant=variant, alpha=alpha)


def pattern_from_pool(pool: torch.Tensor, *, threshold: float = 0.96, variant: str = "spion",
                      alpha: Optional[float] = None) -> torch.Tensor:
    """Steps 3-4 of :func:`generate_pattern` on an already pooled map ``(..., n, n)``."""
    if not torch.isfinite(pool).all():
        raise ValueError("attention maps must be finite")
    if pool.device.type != "cpu":
        # the pooled maps are small (n = L / block_size) and the fill is a chain of small dependent
        # steps, each a launch on a GPU: the whole generation of 12 layers at L=4096, B=64 took 1.9 s
        # with everything on an H100 and 0.3 s on a 2-core CPU; one copy each way instead (0.46 s on
        # the H100 since)
        return pattern_from_pool(pool.cpu(), threshold=threshold, variant=variant, alpha=alpha).to(pool.device)
    lead, n = pool.shape[:-2], pool.shape[-1]
    P = pool.reshape(-1, n, n).to(torch.float64)
    M = P.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=P.device)
    if variant == "spion-c":
        total = max(n, int(round(float(alpha) * n * n)))
        flat = P.reshape(M, n * n).masked_fill(eye.reshape(1, -1), float("-inf"))
        order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :total - n]
        out = torch.zeros(M, n * n, dtype=torch.bool, device=P.device)
        out.scatter_(1, order, True)
        out = out.view(M, n, n) | eye
    else:
        t = _quantile(P.reshape(M, n * n), float(threshold))
        out = flood_fill(P, t) | eye
    return out.reshape(lead + (n, n))


# ---------------------------------------------------------------------------------------------
# Patterns at other lengths.

def fit_pattern(pattern: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """A pattern ``(H, n, n)`` made at the calibration length, fitted to ``(H, nq, nk)`` blocks.

    Cropped to the top-left ``nq x nk`` blocks (queries and keys index blocks from position 0, as the
    op does). Blocks past the calibrated ``n`` are kept iff their diagonal offset ``d = J - I`` is
    part of the pattern's band: at least half of the pattern's blocks on diagonal ``d`` are kept
    (the main diagonal always is), so a banded pattern extends as a band and scattered blocks do not
    repeat.
    """
    H, n, _ = pattern.shape
    if nq <= n and nk <= n:
        return pattern[:, :nq, :nk]
    dev = pattern.device
    offs = torch.arange(-(n - 1), n, device=dev)
    I = torch.arange(n, device=dev)
    J = I[None, :] - I[:, None]                                  # (n, n) offsets
    onehot = (J[None] == offs[:, None, None])                    # (2n-1, n, n)
    counts = onehot.sum((1, 2))
    kept = (pattern[:, None] & onehot[None]).sum((2, 3))          # (H, 2n-1)
    band = 2 * kept >= counts[None]
    band[:, n - 1] = True
    qi = torch.arange(nq, device=dev)[:, None]
    kj = torch.arange(nk, device=dev)[None, :]
    d = (kj - qi)
    inside = (d >= -(n - 1)) & (d <= n - 1)
    ext = torch.zeros(H, nq, nk, dtype=torch.bool, device=dev)
    ext[:, inside] = band[:, (d + n - 1)[inside]]
    m_q, m_k = min(nq, n), min(nk, n)
    ext[:, :m_q, :m_k] = pattern[:, :m_q, :m_k]
    return ext


# ---------------------------------------------------------------------------------------------
# The training procedure (Alg. 2): per-site state, the pattern op, calibration.
#
# Statistic. For a site called with probabilities ``P (B, Hq, N, N)`` (the dense softmax over the
# allowed entries: mask, causal/window, segments and padding applied), one step records
# ``A = pool_map(mean_b P, block_size, F)``: the filtered (Eq. 3, ``F = filter_size``, 1 for
# ``spion-f``), average-pooled (Eq. 4) map, averaged over the batch and, unless ``per_head``, over
# the heads: ``(1 or Hq, n, n)`` float64. This is the exact map, not an approximation: the filter is
# a sum along diagonals, so ``A`` is a taps-weighted sum of ``P`` over a band of diagonals around each
# block, and :func:`block_statistic` accumulates it tile by tile from q, k and the row log-sum-exp
# ``lse`` that the attention op returned (``P = exp(s - lse)``): a Triton kernel on CUDA
# (:mod:`attncomp.codegen.triton.spion_stats`), query chunks in PyTorch elsewhere; no ``N x N``
# tensor exists at once (beyond one chunk of logits on the PyTorch path). In the graph,
# ``attncomp::spion_pattern`` (before the op) runs a call that is recorded dense (every block) and
# ``attncomp::spion_record`` (after it) records the call from its ``lse``. Only calls with
# ``Nq == Nk`` are recorded; the first recorded length is the site's calibration length ``L``, and
# calls of other lengths are not recorded.
#
# Transition (Alg. 2 lines 5-7). Alg. 2 compares the maps of successive epochs; here an "epoch" is
# ``interval`` recorded training steps of the site and ``A_i`` the mean of their maps. Alg. 2 calls
# ``frobenius(A_{i-1}, A_i)`` the distance of two maps (Eq. 2 as printed, ``| ||A_{i-1}||_F -
# ||A_i||_F |``, is blind to a change that keeps the norm, so it is not used); with ``alpha`` a
# fraction it must be relative: ``d_i = ||A_i - A_{i-1}||_F / ||A_i - mean(A_i)||_F``
# (:func:`map_distance`; relative to the map's structure, since a near-uniform map before the
# attention forms has a large norm and barely changes). Alg. 2's test ``|d_{i-1} - d_i| < alpha``
# holds whenever the maps change at a steady rate, fast or slow, so it fires during the first
# epochs; the site switches at the end of interval ``i >= 2`` when ``d_{i-1} < alpha`` and
# ``d_i < alpha`` (:func:`transition`: two successive small changes, which implies Alg. 2's test),
# to the pattern of ``A_i``. The call that ends the interval runs dense; the next runs the pattern.
# ``calibrate`` instead runs the given batches (eval mode, no grad), records every site, and switches
# each to the pattern of the mean of those maps. Until a site switches it runs dense (a pattern with
# every block kept: exactly dense attention).
#
# Patterns at other lengths follow :func:`fit_pattern`.

import re
import threading
import uuid
import weakref
from typing import Any, Iterable, List, Union

from torch import Tensor

__all__ += ["SpionState", "calibrate", "set_patterns", "patterns", "summary", "state_of", "block_statistic",
            "map_distance", "transition"]

_STATES: Dict[str, "SpionState"] = {}
_BY_POLICY: Dict[int, str] = {}
_LOCK = threading.RLock()


def canonical_name(name: str) -> str:
    """Site names from different capture routes (``layers[0].attn``, ``layers.0.attn``) agree."""
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", str(name)).strip(".")


class SiteState:
    """Calibration state and pattern of one attention site (one layer)."""

    def __init__(self, name: str, index: int, heads: Optional[int]):
        self.name, self.index, self.heads = name, index, heads
        self.length: Optional[int] = None
        self.steps = 0          # recorded training steps (dense phase, alpha set)
        self.calls = 0          # training calls of the site
        self.acc: Optional[Tensor] = None
        self.acc_count = 0
        self.prev_map: Optional[Tensor] = None     # the previous interval's mean map
        self.distances: List[float] = []            # d_i of each interval i >= 1 (map_distance)
        self.record_next = False                    # the pattern op ran this call dense to record it
        self.cal_sum: Optional[Tensor] = None
        self.cal_count = 0
        self.pattern: Optional[Tensor] = None
        self.switch_step: Optional[int] = None
        self.source = ""
        self.reports: List[Any] = []
        self.buffers: List[Tuple[Any, str]] = []

    @property
    def density(self) -> Optional[float]:
        return None if self.pattern is None else float(self.pattern.float().mean())

    def describe(self) -> str:
        if self.pattern is None:
            rec = f", {self.steps} step(s) recorded at L={self.length}" if self.steps else ""
            return f"dense phase (no pattern yet{rec})"
        H, n, _ = self.pattern.shape
        heads = f", {H} heads" if H > 1 else ""
        return (f"block pattern {n}x{n} blocks{heads}, density {self.density:.3f}, "
                f"switched at training step {self.switch_step} ({self.source})")


class SpionState:
    """The SPION state of one compile (shared by its graphs: training and eval, every recompile)."""

    def __init__(self, policy):
        self.policy = policy
        self.uid = uuid.uuid4().hex[:12]
        self.sites: Dict[str, SiteState] = {}
        self.pending: Dict[Union[str, int], Tensor] = {}
        self.calibrating = False
        self.lock = threading.RLock()

    # -- sites ------------------------------------------------------------------------------------
    def site(self, name: str, heads: int) -> SiteState:
        key = canonical_name(name)
        with self.lock:
            s = self.sites.get(key)
            if s is None:
                s = SiteState(key, len(self.sites), heads)
                self.sites[key] = s
                pat = self.pending.pop(key, None)
                if pat is None:
                    pat = self.pending.pop(s.index, None)
                if pat is not None:
                    self._set(s, pat, "set_patterns")
            return s

    def key(self, site: SiteState) -> str:
        return f"{self.uid}:{site.name}"

    def lookup(self, name: str) -> SiteState:
        if isinstance(name, int) and not isinstance(name, bool):
            for s in self.sites.values():
                if s.index == name:
                    return s
            raise KeyError(f"no attention site number {name}; sites: {self._names()}")
        s = self.sites.get(canonical_name(name))
        if s is None:
            raise KeyError(f"no attention site {name!r}; sites: {self._names()}")
        return s

    def _names(self) -> str:
        return ", ".join(f"{s.index}: {s.name}" for s in self.sites.values()) or "none captured yet"

    # -- recording --------------------------------------------------------------------------------
    def recording(self, site: SiteState) -> bool:
        if self.calibrating:
            return True
        from . import ops

        # the compiled module's mode (a custom op's body runs with autograd below it, so grad mode
        # says nothing); unknown (torch.compile route) counts as training, as for dropout
        training = ops._training.get() is not False
        return training and site.pattern is None and self.policy.alpha is not None

    def observe(self, site: SiteState, q, k, attn_mask, preds, spec_json: str, lse) -> None:
        """Record one call's statistic (:func:`block_statistic` from the op's ``lse``)."""
        Nq, Nk = q.shape[2], k.shape[2]
        if Nq != Nk or (site.length is not None and Nq != site.length):
            return
        pol = self.policy
        with torch.no_grad():
            A = block_statistic(spec_json, q.detach(), k.detach(), attn_mask, preds, lse.detach(),
                                block_size=pol.block_size, per_head=pol.per_head,
                                filter_size=1 if pol.variant == "spion-f" else pol.filter_size)
        with self.lock:
            site.length = Nq
            if self.calibrating:
                site.cal_sum = A if site.cal_sum is None else site.cal_sum + A
                site.cal_count += 1
                return
            self.record(site, A)

    def record(self, site: SiteState, A: Tensor) -> None:
        """One training step's map ``A``: at the end of each interval, the interval mean, its
        distance to the previous one, and Alg. 2's transition test (:func:`transition`)."""
        with self.lock:
            site.steps += 1
            site.acc = A if site.acc is None else site.acc + A
            site.acc_count += 1
            if site.acc_count < self.policy.interval:
                return
            mean = site.acc / site.acc_count
            site.acc, site.acc_count = None, 0
            if site.prev_map is not None:
                site.distances.append(map_distance(site.prev_map, mean))
            site.prev_map = mean
            if transition(site.distances, self.policy.alpha):
                self._set(site, self.make_pattern(mean), "auto (Alg. 2)")

    def make_pattern(self, pooled: Tensor) -> Tensor:
        pol = self.policy
        return pattern_from_pool(pooled, threshold=pol.threshold, variant=pol.variant, alpha=pol.density)

    # -- patterns ---------------------------------------------------------------------------------
    def _set(self, site: SiteState, pattern: Optional[Tensor], source: str) -> None:
        if pattern is not None:
            pattern = pattern.detach().to(device="cpu", dtype=torch.bool)
            if pattern.dim() == 2:
                pattern = pattern[None]
            if pattern.dim() != 3 or pattern.shape[1] != pattern.shape[2] or \
                    (site.heads is not None and pattern.shape[0] not in (1, site.heads)):
                raise ValueError(f"pattern for {site.name!r} must have shape (n, n), (1, n, n) or "
                                 f"({site.heads or 'H'}, n, n), got {tuple(pattern.shape)}")
            if site.length is not None and pattern.shape[1] != -(-site.length // self.policy.block_size):
                raise ValueError(f"pattern for {site.name!r} has {pattern.shape[1]} blocks per side; the site "
                                 f"was calibrated at L={site.length} with block size {self.policy.block_size} "
                                 f"({-(-site.length // self.policy.block_size)} blocks)")
            pattern = pattern.contiguous()
        site.pattern = pattern
        site.switch_step = site.calls if pattern is not None else None
        site.source = source if pattern is not None else ""
        for gm, attr in list(site.buffers):
            g = gm()
            if g is not None:
                buf = getattr(g, attr)
                setattr(g, attr, pattern.to(buf.device) if pattern is not None
                        else torch.zeros((buf.shape[0], 0, 0), dtype=torch.bool, device=buf.device))
        for rep in site.reports:
            rep.details["spion"] = site.describe()

    def stored(self, site: SiteState) -> Tensor:
        if site.pattern is not None:
            return site.pattern.clone()
        return torch.zeros((1, 0, 0), dtype=torch.bool)


def map_distance(prev: Tensor, cur: Tensor) -> float:
    """``d = ||A_i - A_{i-1}||_F / ||A_i - mean(A_i)||_F``: the Frobenius distance between successive
    interval maps relative to the structure of the current one (its deviation from its mean).

    Relative to ``||A_i||_F`` itself, a near-uniform map (attention not formed yet) looks stable: its
    mean dominates the norm, so any change is small next to it. ``0`` for equal maps; ``inf`` for a
    change of a constant map."""
    diff = float(torch.linalg.vector_norm((cur - prev).to(torch.float64)))
    c = cur.to(torch.float64)
    struct = float(torch.linalg.vector_norm(c - c.mean()))
    if diff == 0.0:
        return 0.0
    return diff / struct if struct > 0.0 else float("inf")


def transition(distances: List[float], alpha: Optional[float]) -> bool:
    """Alg. 2's transition test on the distances ``d_1 .. d_i`` so far: the last two are below
    ``alpha`` (``d_{i-1} < alpha`` and ``d_i < alpha``, which implies Alg. 2's
    ``|d_{i-1} - d_i| < alpha``; needs ``i >= 2``, three interval maps, as Alg. 2's ``i > 1``)."""
    if alpha is None or len(distances) < 2:
        return False
    return distances[-2] < alpha and distances[-1] < alpha


def state_for(policy) -> SpionState:
    """The state of the compile that uses ``policy`` (one per policy object)."""
    with _LOCK:
        uid = _BY_POLICY.get(id(policy))
        if uid is not None and _STATES.get(uid) is not None and _STATES[uid].policy is policy:
            return _STATES[uid]
        st = SpionState(policy)
        _STATES[st.uid] = st
        _BY_POLICY[id(policy)] = st.uid

        def _drop(i=id(policy), u=st.uid):
            with _LOCK:
                _STATES.pop(u, None)
                if _BY_POLICY.get(i) == u:
                    del _BY_POLICY[i]

        weakref.finalize(policy, _drop)
        return st


def state_of(fast) -> SpionState:
    """The SPION state of a module returned by ``attncomp.compile(..., policy=SPION(...))`` (or of the
    object returned by ``attncomp.backend``)."""
    from .policy import SPION

    pol = None
    for obj in (fast, getattr(fast, "_orig_mod", None)):
        if obj is None:
            continue
        st = getattr(obj, "_attncomp", None)
        pol = getattr(st, "policy", None) or getattr(obj, "policy", None)
        if pol is not None:
            break
    if not isinstance(pol, SPION):
        raise TypeError("expected a module compiled with policy SPION (attncomp.compile(model, policy='spion'))")
    return state_for(pol)


# -- the op that hands each site its pattern ----------------------------------------------------

@torch.library.custom_op("attncomp::spion_pattern", mutates_args=())
def _spion_pattern(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], q_pos: Optional[Tensor],
                   k_pos: Optional[Tensor], q_seg: Optional[Tensor], k_seg: Optional[Tensor],
                   q_valid: Optional[Tensor], k_valid: Optional[Tensor], stored: Optional[Tensor], spec: str,
                   key: str, block_size: int, heads: int) -> Tensor:
    """The block pattern of one SPION site for this call: ``(H or 1, ceil(Nq/Bs), ceil(Nk/Bs))`` bool.

    While the site is in its dense phase, and on every call while calibrating: every block (exact
    dense attention), the call marked for ``attncomp::spion_record`` after the op when training or
    calibrating. After its switch: its pattern, fitted to the call's length. A package loaded without the live state uses ``stored`` (the pattern at export);
    ``heads``: 0 for per-head patterns (leading dim ``Hq``), else 1.
    """
    nq, nk = -(-q.shape[2] // block_size), -(-k.shape[2] // block_size)
    uid, _, name = key.partition(":")
    st = _STATES.get(uid)
    site = st.sites.get(name) if st is not None else None
    pat = None
    if site is not None:
        site.heads = q.shape[1]
        from . import ops

        if ops._training.get() is not False and not st.calibrating:
            site.calls += 1
        # a recorded call runs dense (calibration of a switched site included): its lse is the
        # dense softmax's, from which attncomp::spion_record recomputes the probabilities
        site.record_next = st.recording(site)
        pat = None if site.record_next else site.pattern
    elif stored is not None and stored.shape[-1] > 0:
        pat = stored
    if pat is None:
        return torch.ones((heads or q.shape[1], nq, nk), dtype=torch.bool, device=q.device)
    return fit_pattern(pat.to(q.device), nq, nk).clone(memory_format=torch.contiguous_format)


@_spion_pattern.register_fake
def _(q, k, attn_mask, q_pos, k_pos, q_seg, k_seg, q_valid, k_valid, stored, spec, key, block_size, heads):
    nq = (q.shape[2] + block_size - 1) // block_size
    nk = (k.shape[2] + block_size - 1) // block_size
    return q.new_empty((heads or q.shape[1], nq, nk), dtype=torch.bool)


@torch.library.custom_op("attncomp::spion_record", mutates_args=())
def _spion_record(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], q_pos: Optional[Tensor],
                  k_pos: Optional[Tensor], q_seg: Optional[Tensor], k_seg: Optional[Tensor],
                  q_valid: Optional[Tensor], k_valid: Optional[Tensor], lse: Tensor, spec: str,
                  key: str) -> Tensor:
    """Record the statistic of the call the site's ``attncomp::spion_pattern`` ran dense for
    recording (:func:`block_statistic` from q, k, the masks and the op's ``lse``). Returns a zero
    scalar that the graph adds to the site's output, so the call is part of the data flow (no pass
    or compiler removes it) and changes nothing."""
    uid, _, name = key.partition(":")
    st = _STATES.get(uid)
    site = st.sites.get(name) if st is not None else None
    if site is not None and site.record_next:
        site.record_next = False
        from .spec import Predicates

        preds = None
        if any(t is not None for t in (q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)):
            preds = Predicates(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
        st.observe(site, q, k, attn_mask, preds, spec, lse)
    return q.new_zeros(())


@_spion_record.register_fake
def _(q, k, attn_mask, q_pos, k_pos, q_seg, k_seg, q_valid, k_valid, lse, spec, key):
    return q.new_empty(())


def _spion_record_backward(ctx, grad):
    return (None,) * 12       # a constant zero: no gradient for any input


_spion_record.register_autograd(_spion_record_backward)


# -- user API -----------------------------------------------------------------------------------

def set_patterns(fast, patterns: Dict[Union[str, int], Optional[Tensor]]) -> None:
    """Set the block pattern of sites explicitly: ``{site name or number: bool (n, n) or (H, n, n)}``
    (``None`` returns a site to its dense phase). Sites not captured yet (before the first call) get
    their pattern when they are."""
    st = state_of(fast)
    with st.lock:
        for key, pat in patterns.items():
            try:
                site = st.lookup(key)
            except KeyError:
                if st.sites:
                    raise
                st.pending[key if isinstance(key, int) else canonical_name(key)] = pat
                continue
            st._set(site, pat, "set_patterns")


def calibrate(fast, batches: Iterable[Any]) -> Dict[str, Tensor]:
    """Run ``batches`` through ``fast`` (eval mode, no grad), record every SPION site and switch each
    to the pattern of its averaged map. A batch is a tuple of positional arguments, a dict of keyword
    arguments or a single tensor. Returns ``{site: pattern}``."""
    st = state_of(fast)
    was = fast.training
    with st.lock:
        for s in st.sites.values():
            s.cal_sum, s.cal_count = None, 0
        st.calibrating = True
    try:
        fast.eval()
        with torch.no_grad():
            for b in batches:
                if isinstance(b, dict):
                    fast(**b)
                elif isinstance(b, (tuple, list)):
                    fast(*b)
                else:
                    fast(b)
    finally:
        st.calibrating = False
        fast.train(was)
    out = {}
    with st.lock:
        for s in st.sites.values():
            if s.cal_count:
                st._set(s, st.make_pattern(s.cal_sum / s.cal_count), f"calibrate, {s.cal_count} batch(es)")
                s.cal_sum, s.cal_count = None, 0
            if s.pattern is not None:
                out[s.name] = s.pattern
    if not out:
        raise RuntimeError("calibrate recorded no SPION site: did the batches run the model's attention "
                           "(self-attention with Nq == Nk)?")
    return out


def patterns(fast) -> Dict[str, Optional[Tensor]]:
    """``{site: pattern or None}`` in site order."""
    st = state_of(fast)
    return {s.name: s.pattern for s in sorted(st.sites.values(), key=lambda s: s.index)}


def summary(fast) -> str:
    """One line per site: pattern size, density and switch step, or the dense phase."""
    st = state_of(fast)
    rows = [f"{s.index:>3}  {s.name}: {s.describe()}" for s in sorted(st.sites.values(), key=lambda s: s.index)]
    return "\n".join(rows) or "no SPION site captured yet"
