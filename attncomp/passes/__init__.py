"""Graph passes. Each pass is one file with one public function ``name(gm, ctx) -> PassResult``;
its module docstring states what it matches, what must hold before, and what it guarantees.
Passes never import triton or tvm."""

from .base import CompileContext, PassResult, SiteReport, counters

__all__ = ["CompileContext", "PassResult", "SiteReport", "counters"]
