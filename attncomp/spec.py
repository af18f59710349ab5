"""``AttentionSpec``: the frozen, hashable description of one attention site.

Every matched site becomes one ``attncomp::attention`` op whose ``spec`` argument is the canonical
JSON of an :class:`AttentionSpec`. A spec contains everything that changes which kernel runs or what
it computes, and nothing that changes per call (tensors, shapes that vary with the batch).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .policy import Dense, Policy, policy_from_json

__all__ = ["AttentionSpec", "Predicates", "MASK_KINDS", "BACKENDS", "CAUSAL_ALIGNS"]

MASK_KINDS = ("none", "bool", "float")
CAUSAL_ALIGNS = ("top_left", "bottom_right")
BACKENDS = ("auto", "reference", "triton", "sdpa", "tvm")

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    if dtype is None:
        return None
    return str(dtype).replace("torch.", "")


class Predicates(NamedTuple):
    """The per-token tensors of the structured-mask predicates (DESIGN.md §4.1), each optional.

    ``q_pos (B or 1, Nq)``/``k_pos (B or 1, Nk)`` int positions for the causal/window bound (default
    ``arange``, see :attr:`AttentionSpec.causal_align`); ``q_seg``/``k_seg`` int segment ids (both or
    neither: key j is allowed for query i iff the ids are equal); ``k_valid (B or 1, Nk)`` bool
    (key j allowed iff true); ``q_valid (B or 1, Nq)`` bool (a query with ``False`` outputs zeros and
    ``lse = -inf``). Backends receive them as one keyword argument ``preds``.
    """

    q_pos: Optional[Tensor] = None
    k_pos: Optional[Tensor] = None
    q_seg: Optional[Tensor] = None
    k_seg: Optional[Tensor] = None
    q_valid: Optional[Tensor] = None
    k_valid: Optional[Tensor] = None

    @staticmethod
    def none() -> "Predicates":
        return _NO_PREDS

    def any(self) -> bool:
        """Whether any predicate tensor is present."""
        return any(t is not None for t in self)

    def kinds(self) -> tuple:
        """Names of the predicates present, in words: ``positions``, ``segments``, ``padding``..."""
        out = []
        if self.q_pos is not None or self.k_pos is not None:
            out.append("positions")
        if self.q_seg is not None or self.k_seg is not None:
            out.append("segments")
        if self.k_valid is not None:
            out.append("key padding")
        if self.q_valid is not None:
            out.append("query padding")
        return tuple(out)


_NO_PREDS = Predicates()


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention site computes (DESIGN.md §3-4).

    ``scale`` is the factor applied to ``q·k`` inside the op; ``None`` means ``1/sqrt(D)``.
    ``dtype``/``head_dim``/``gqa_groups`` are what the compiler saw at the site (``None`` if unknown);
    backends re-check the actual tensors on every call.
    """

    causal: bool = False
    mask_kind: str = "none"
    scale: Optional[float] = None
    dropout_p: float = 0.0
    dtype: Optional[str] = None
    head_dim: Optional[int] = None
    gqa_groups: int = 1
    policy: Policy = field(default_factory=Dense)
    backend: str = "auto"
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    causal_align: str = "top_left"

    def __post_init__(self):
        if self.mask_kind not in MASK_KINDS:
            raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {self.mask_kind!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; valid backends: {', '.join(BACKENDS)}")
        if not 0.0 <= float(self.dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.policy, Policy):
            raise ValueError(f"policy must be a Policy, got {type(self.policy).__name__}")
        for nm in ("window_left", "window_right"):
            w = getattr(self, nm)
            if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
                raise ValueError(f"{nm} must be an int or None (unbounded), got {w!r}")
        if self.window_left is not None and self.window_right is not None \
                and self.window_left + self.window_right < 0:
            raise ValueError(f"window ({self.window_left}, {self.window_right}) allows no key: "
                             "q_pos - left <= k_pos <= q_pos + right needs left + right >= 0")
        if self.causal_align not in CAUSAL_ALIGNS:
            raise ValueError(f"causal_align must be one of {CAUSAL_ALIGNS}, got {self.causal_align!r}")

    # -- the position bound: causal and the window together -----------------------------------
    def bounds(self) -> tuple:
        """``(left, right)`` of the effective position window, ``None`` where unbounded: the window
        with ``right`` capped at 0 when causal."""
        right = self.window_right
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return self.window_left, right

    def uses_positions(self) -> bool:
        """Whether any position bound applies (causal or a window side)."""
        left, right = self.bounds()
        return left is not None or right is not None

    # -- serialisation: the op carries the spec as a string -----------------------------------
    def to_json(self) -> str:
        return _spec_to_json(self)

    @staticmethod
    def from_json(s: str) -> "AttentionSpec":
        return _spec_from_json(s)

    def replace(self, **kw) -> "AttentionSpec":
        return dataclasses.replace(self, **kw)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def torch_dtype(self) -> Optional[torch.dtype]:
        return _DTYPES.get(self.dtype) if self.dtype else None

    def describe(self, preds: Optional["Predicates"] = None) -> str:
        """The site in words: policy, ``causal`` / ``causal (bottom-right)``, ``window(left, right)``,
        the residual mask, and the predicate tensors in ``preds`` when they are known."""
        bits = [self.policy.describe()]
        if self.causal:
            bits.append("causal" if self.causal_align == "top_left" else "causal (bottom-right)")
        if self.window_left is not None or self.window_right is not None:
            f = (lambda w: "inf" if w is None else str(w))
            bits.append(f"window({f(self.window_left)}, {f(self.window_right)})"
                        + (" bottom-right" if self.causal_align == "bottom_right" and not self.causal else ""))
        if preds is not None:
            bits.extend(preds.kinds())
        if self.mask_kind != "none":
            bits.append(f"{self.mask_kind} mask")
        if self.scale is not None:
            bits.append(f"scale={self.scale:.4g}")
        if self.dropout_p:
            bits.append(f"dropout={self.dropout_p}")
        if self.gqa_groups > 1:
            bits.append(f"gqa={self.gqa_groups}")
        return ", ".join(bits)


@functools.lru_cache(maxsize=4096)
def _spec_to_json(spec: AttentionSpec) -> str:
    # cached: the op's host path serialises its spec on every call
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    d["policy"] = spec.policy.to_json()
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _spec_from_json(s: str) -> AttentionSpec:
    d = json.loads(s)
    d["policy"] = policy_from_json(d["policy"])
    return AttentionSpec(**d)
