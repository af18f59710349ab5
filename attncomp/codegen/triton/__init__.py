"""Triton backend: fused (flash-style) attention kernels, forward and backward.

``TritonBackend`` is what ``attncomp.codegen.get_backend("triton")`` returns. Importing this package
imports ``triton``; passes never do, the runtime imports it only when it dispatches here.
"""

from .backend import TritonBackend, attention_backward, attention_forward

__all__ = ["TritonBackend", "attention_forward", "attention_backward"]
