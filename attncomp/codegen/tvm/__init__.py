"""TVM backend: TIR kernels (one flash-style template specialised per tile schedule and predicate)
compiled by apache-tvm for the CPU (``llvm``) and, ahead of time, for CUDA. ``tvm`` itself is imported
only when a kernel is built."""

from .backend import TVMBackend

__all__ = ["TVMBackend"]
