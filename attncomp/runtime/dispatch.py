"""Choose the backend that runs a spec on given tensors.

``auto``: Triton on CUDA tensors when Triton is importable and supports the spec, the reference
backend elsewhere. A named backend is used as asked; if it cannot run the spec, a clear error says
why (nothing silently falls back to different numerics).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from ..codegen import get_backend
from ..spec import AttentionSpec

log = logging.getLogger(__name__)

__all__ = ["select_backend", "triton_available"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(spec: AttentionSpec, q: torch.Tensor):
    name = spec.backend
    if name == "auto":
        if q.is_cuda and triton_available():
            try:
                be = get_backend("triton")
            except ImportError:
                be = None
            if be is not None and be.supports(spec, q) is None:
                return be
        return get_backend("reference")
    be = get_backend(name)
    reason = be.supports(spec, q)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} cannot run this site ({spec.describe()}): {reason}")
    return be
