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
from typing import Optional

import torch

from .policy import Dense, Policy, policy_from_json

__all__ = ["AttentionSpec", "MASK_KINDS", "BACKENDS"]

MASK_KINDS = ("none", "bool", "float")
BACKENDS = ("auto", "reference", "triton", "tvm")

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

    # -- serialisation: the op carries the spec as a string -----------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["policy"] = self.policy.to_json()
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(s: str) -> "AttentionSpec":
        return _spec_from_json(s)

    def replace(self, **kw) -> "AttentionSpec":
        return dataclasses.replace(self, **kw)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def torch_dtype(self) -> Optional[torch.dtype]:
        return _DTYPES.get(self.dtype) if self.dtype else None

    def describe(self) -> str:
        bits = [self.policy.describe()]
        if self.causal:
            bits.append("causal")
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
def _spec_from_json(s: str) -> AttentionSpec:
    d = json.loads(s)
    d["policy"] = policy_from_json(d["policy"])
    return AttentionSpec(**d)
