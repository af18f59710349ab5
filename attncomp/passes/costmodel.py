"""Analytic cost model for the E.T. value/output path: FLOPs and bytes of both forms of a site.

Original form (per site)::

    V  = X W_V^T + b_V              2 B Nk dm H dv       (+ B Nk H dv bias)
    Z  = S_h V_h, per head          2 B H Nq Nk dv
    out = concat_h(Z_h) W_O^T + b_O 2 B Nq H dv do       (+ B Nq do bias)

Folded form (E.T. eq. 5, ``M_h = W_V,h^T W_O,h^T``, ``dm x do`` per head)::

    V'_h = X M_h (+ c_h)            2 B Nk dm H do       (+ B Nk H do when the value bias stays per head)
    Z'_h = S_h V'_h                 2 B H Nq Nk do
    out = sum_h Z'_h + b'           B Nq (H-1) do        (+ B Nq do bias)

``dm``: model width (V projection input), ``dv``: value head dim, ``do``: output width. The scores
``S`` (``QK^T``, scale, mask, softmax) are the same in both forms and counted apart
(:func:`scores_flops`). Bytes count the operands each GEMM reads and writes once (weights,
activations), at the site's element size; ``S`` never leaves a fused kernel and is not counted.

With ``dv = dm / H`` and ``do = dm`` the folded form costs about ``H/2`` times the original's
value-path FLOPs: folding pays only when ``H == 1`` or when ``M_h`` is pruned and run by a sparse
GEMM (``m_density`` < 1 scales the ``X M`` term; the dense runtime uses 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

__all__ = ["FoldCost", "fold_cost", "scores_flops"]


@dataclass(frozen=True)
class FoldCost:
    B: int
    Nq: int
    Nk: int
    H: int
    d_model: int
    d_head_v: int
    d_out: int
    itemsize: int
    flops_original: int
    flops_folded: int
    bytes_original: int
    bytes_folded: int
    flops_scores: int

    @property
    def cheaper_folded(self) -> bool:
        """The folded form wins on FLOPs (ties broken by bytes)."""
        if self.flops_folded != self.flops_original:
            return self.flops_folded < self.flops_original
        return self.bytes_folded < self.bytes_original

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["ratio_flops"] = self.flops_folded / max(1, self.flops_original)
        return d

    def summary(self) -> str:
        return (f"value path {_si(self.flops_original)}FLOP / {_si(self.bytes_original)}B original vs "
                f"{_si(self.flops_folded)}FLOP / {_si(self.bytes_folded)}B folded "
                f"({self.flops_folded / max(1, self.flops_original):.2f}x; scores {_si(self.flops_scores)}FLOP "
                f"either way) at B={self.B} Nq={self.Nq} Nk={self.Nk} H={self.H} d_model={self.d_model} "
                f"d_head={self.d_head_v} d_out={self.d_out}")


def _si(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.3g} "


def scores_flops(B: int, H: int, Nq: int, Nk: int, D: int) -> int:
    """``QK^T`` plus scale, softmax (max, subtract, exp, sum, divide): shared by both forms."""
    return 2 * B * H * Nq * Nk * D + 6 * B * H * Nq * Nk


def fold_cost(B: int, Nq: int, Nk: int, H: int, d_model: int, d_head_v: int, d_out: int, *,
              d_head_qk: int = None, itemsize: int = 4, v_bias: bool = True, o_bias: bool = True,
              per_head_bias: bool = False, m_density: float = 1.0) -> FoldCost:
    """FLOPs and bytes of the original and the folded value/output path of one site.

    ``per_head_bias``: the folded form keeps the value bias inside ``V'`` (exact for any ``S``)
    instead of folding it into ``b'``.
    """
    F = H * d_head_v
    fl_orig = 2 * B * Nk * d_model * F + 2 * B * H * Nq * Nk * d_head_v + 2 * B * Nq * F * d_out
    fl_orig += (B * Nk * F if v_bias else 0) + (B * Nq * d_out if o_bias else 0)
    fl_fold = int(2 * B * Nk * d_model * H * d_out * m_density) + 2 * B * H * Nq * Nk * d_out
    fl_fold += B * Nq * (H - 1) * d_out
    fl_fold += B * Nk * H * d_out if (per_head_bias and v_bias) else 0
    fl_fold += B * Nq * d_out if (o_bias or (v_bias and not per_head_bias)) else 0
    by_orig = (B * Nk * d_model + F * d_model + B * Nk * F          # V projection
               + B * Nk * F + B * Nq * F                           # S V
               + B * Nq * F + d_out * F + B * Nq * d_out)          # O projection
    by_fold = (B * Nk * d_model + int(H * d_out * d_model * m_density) + B * Nk * H * d_out
               + B * Nk * H * d_out + B * H * Nq * d_out
               + B * H * Nq * d_out + B * Nq * d_out)
    return FoldCost(B, Nq, Nk, H, d_model, d_head_v, d_out, itemsize, fl_orig, fl_fold,
                    by_orig * itemsize, by_fold * itemsize,
                    scores_flops(B, H, Nq, Nk, d_head_qk or d_head_v))
