"""Code generators. Each backend is an object with ``name``, ``supports(spec, q) -> reason | None``,
``forward(...) -> (out, lse)`` and ``backward(...) -> (dq, dk, dv, dmask | None)``; backends are
imported only when first used, so passes and CPU-only installs never import triton or tvm."""

from __future__ import annotations

import importlib
from typing import Dict

__all__ = ["get_backend", "BACKEND_PATHS"]

BACKEND_PATHS: Dict[str, str] = {
    "reference": "attncomp.codegen.reference:ReferenceBackend",
    "triton": "attncomp.codegen.triton:TritonBackend",
    "sdpa": "attncomp.codegen.sdpa:SdpaBackend",
    "tvm": "attncomp.codegen.tvm:TVMBackend",
}

_instances: Dict[str, object] = {}


def get_backend(name: str):
    """Return the (lazily imported, cached) backend object called ``name``."""
    if name not in _instances:
        if name not in BACKEND_PATHS:
            raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(sorted(BACKEND_PATHS))}")
        mod, _, cls = BACKEND_PATHS[name].partition(":")
        _instances[name] = getattr(importlib.import_module(mod), cls)()
    return _instances[name]
