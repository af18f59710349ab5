"""TVM backend: TIR kernels (one flash-style template specialised per tile schedule and predicate,
:mod:`.kernels`) compiled by apache-tvm for the CPU (``llvm``, :mod:`.build`) and, ahead of time, to
CUDA cubins (:mod:`.cuda`) that :mod:`attncomp.runtime.cubin` launches without TVM. ``tvm`` itself is
imported only when a kernel is built.

What runs where:

* CPU tensors: every policy (dense/et, dfss N:M, hash, drop, spion), every mask kind, the §4.1
  predicates, GQA, dropout; forward and backward; float16/bfloat16 computed in float32, float64 in
  float64.
* CUDA tensors: the forward of the same variants from prebuilt cubins (``python -m attncomp
  build-kernels``); the CUDA backward is not built yet (a clear error says so).

What a GPU run has to check (the CPU machines cannot): ``tests/codegen/test_tvm_gpu.py`` with the
cubins of ``build-kernels --arch sm_90 --head-dim 64 --out build/tvm-cubins`` (passed on an H100), the
timing rows of ``benchmarks/attention_tvm.py --device cuda`` against SDPA, sm_80 cubins on an A100-class
GPU, and, once written, a ``mma.sp`` DFSS kernel against the dense one.
"""

from .backend import TVMBackend

__all__ = ["TVMBackend"]
