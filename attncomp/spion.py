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
