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
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .policy import Dense, Policy, policy_from_json

__all__ = ["AttentionSpec", "Predicates", "Modifiers", "MASK_KINDS", "BACKENDS", "CAUSAL_ALIGNS", "rel_bucket"]

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


class Modifiers(NamedTuple):
    """The tensors of the score modifiers (DESIGN.md §4.2), each optional, present iff the spec says so.

    ``alibi_slopes (Hq,)`` float: ALiBi adds ``slope[h] * (k_pos[j] - q_pos[i])``; ``rel_table
    (n_buckets, Hq)`` float, learnable: a relative-position bias ``table[bucket(k_pos[j] - q_pos[i]), h]``;
    ``sinks (Hq,)`` float, learnable: each head's softmax denominator gains ``exp(sinks[h])``.
    Backends receive them as one keyword argument ``mods`` (only when one is present)."""

    alibi_slopes: Optional[Tensor] = None
    rel_table: Optional[Tensor] = None
    sinks: Optional[Tensor] = None

    def any(self) -> bool:
        return any(t is not None for t in self)


def rel_bucket(rel: Tensor, n_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's bucket of a relative position ``rel = k_pos - q_pos`` (int tensor), as
    ``T5Attention._relative_position_bucket`` computes it (MPNet's is the bidirectional case): exact
    buckets for small distances, logarithmic ones up to ``max_distance``, the last bucket beyond; with
    ``bidirectional`` half the buckets are for keys after the query. The float32 logarithm is the
    model's own, so the buckets agree with it bit for bit."""
    rel = rel.to(torch.int64)
    out = torch.zeros_like(rel)
    n = n_buckets
    if bidirectional:
        n //= 2
        out = out + (rel > 0).to(torch.int64) * n
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = n // 2
    small = rel < exact
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact)
                     * (n - exact)).to(torch.int64)
    large = torch.clamp(large, max=n - 1)
    return out + torch.where(small, rel, large)


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
    # score modifiers (DESIGN.md §4.2), applied in this order to s = scale * q·k: ALiBi, the relative-position
    # bias, soft-capping; then a float attn_mask is added, the policy decides, predicates apply
    softcap: Optional[float] = None
    alibi: bool = False
    rel_buckets: Optional[int] = None
    rel_max_distance: Optional[int] = None
    rel_bidirectional: bool = True
    sinks: bool = False

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
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not self.softcap > 0 or math.isinf(self.softcap)):
            raise ValueError(f"softcap must be a positive finite number or None, got {self.softcap!r}")
        if self.rel_buckets is not None:
            nb, md = self.rel_buckets, self.rel_max_distance
            if isinstance(nb, bool) or not isinstance(nb, int) or nb < (4 if self.rel_bidirectional else 2):
                raise ValueError(f"rel_buckets must be an int >= {4 if self.rel_bidirectional else 2}, got {nb!r}")
            exact = (nb // 2 if self.rel_bidirectional else nb) // 2
            if isinstance(md, bool) or not isinstance(md, int) or md <= exact:
                raise ValueError(f"rel_max_distance must be an int > {exact} (the exact buckets), got {md!r}")
        elif self.rel_max_distance is not None:
            raise ValueError("rel_max_distance is given without rel_buckets")

    # -- score modifiers -----------------------------------------------------------------------
    def modifiers(self) -> tuple:
        """Names of the score modifiers present, in the order they apply: ``alibi``,
        ``relative bias``, ``softcap``, ``sinks``."""
        out = []
        if self.alibi:
            out.append("alibi")
        if self.rel_buckets is not None:
            out.append("relative bias")
        if self.softcap is not None:
            out.append("softcap")
        if self.sinks:
            out.append("sinks")
        return tuple(out)

    def modifiers_missing(self, supported, backend: str) -> Optional[str]:
        """The reason a backend that applies only the modifiers ``supported`` cannot run this spec, or
        None (backends' ``supports`` return it, so dispatch picks one that applies them all)."""
        missing = [m for m in self.modifiers() if m not in supported]
        if not missing:
            return None
        return (f"score modifier{'s' if len(missing) > 1 else ''} {', '.join(missing)} not applied by the "
                f"{backend} backend" + (f" (it applies: {', '.join(supported)})" if supported else ""))

    def describe_modifiers(self) -> str:
        """The score modifiers in words, with their constants (empty when there are none)."""
        bits = []
        if self.alibi:
            bits.append("alibi")
        if self.rel_buckets is not None:
            bits.append(f"relative bias({self.rel_buckets} buckets, max distance {self.rel_max_distance}"
                        + (", bidirectional)" if self.rel_bidirectional else ", causal)"))
        if self.softcap is not None:
            bits.append(f"softcap={self.softcap:g}")
        if self.sinks:
            bits.append("sinks")
        return ", ".join(bits)

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
        if self.modifiers():
            bits.append(self.describe_modifiers())
        if self.scale is not None:
            bits.append(f"scale={self.scale:.4g}")
        if self.dropout_p:
            bits.append(f"dropout={self.dropout_p}")
        if self.gqa_groups > 1:
            bits.append(f"gqa={self.gqa_groups}")
        return ", ".join(bits)


_MODIFIER_DEFAULTS = {"softcap": None, "alibi": False, "rel_buckets": None, "rel_max_distance": None,
                      "rel_bidirectional": True, "sinks": False}


@functools.lru_cache(maxsize=4096)
def _spec_to_json(spec: AttentionSpec) -> str:
    # cached: the op's host path serialises its spec on every call
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    d["policy"] = spec.policy.to_json()
    # modifier fields at their defaults are left out: a spec without modifiers keeps the JSON (and the
    # digests, cache keys and packages built from it) it had before they existed
    for nm, default in _MODIFIER_DEFAULTS.items():
        if d[nm] == default:
            del d[nm]
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _spec_from_json(s: str) -> AttentionSpec:
    d = json.loads(s)
    d["policy"] = policy_from_json(d["policy"])
    return AttentionSpec(**d)
