"""TVM backend: TIR kernels (one flash-style template specialised per tile schedule and predicate,
:mod:`.kernels`) compiled by apache-tvm for the CPU (``llvm``, :mod:`.build`) and, ahead of time, to
CUDA cubins (:mod:`.cuda`) that :mod:`attncomp.runtime.cubin` launches without TVM. ``tvm`` itself is
imported only when a kernel is built.

What runs where:

* CPU tensors: every policy (dense/et, dfss N:M, hash, drop, spion), every mask kind, the §4.1
  predicates, the §4.2 score modifiers (ALiBi, relative bias, soft-cap, sinks, with the gradients of
  their tensors), GQA, dropout; forward and backward; float16/bfloat16 computed in float32, float64 in
  float64.
* CUDA tensors: the same variants (modifiers included) from prebuilt cubins (``python -m attncomp build-kernels``; the
  backward kernels too unless ``--no-backward``): the forward (:mod:`.cuda`; for dfss 2:4 and 1:2 on
  float16/bfloat16 inputs the sparse tensor-core kernel of :mod:`.sparse`,
  ``ATTNCOMP_TVM_DFSS_KERNEL=scalar`` selects the scalar one) and the dK/dV and dQ kernels
  (:mod:`.cuda_bwd`). A missing cubin is an error that names it and the command that builds it.

What the CPU machines check: the CUDA kernels build to sm_90/sm_80 cubins (ptxas); the sparse
tensor-core kernel's schedule with emulated warp instructions (packing, metadata, fragment layouts)
and the backward kernels' schedule, both built for llvm, against the reference.

What a GPU run has to check (the CPU machines cannot): ``tests/codegen/test_tvm_gpu.py`` with the
cubins of ``build-kernels --arch sm_90 --head-dim 64 --out build/tvm-cubins`` (the forward
of every policy passed on an H100 before the mma.sp and backward kernels existed; those are unrun on
a GPU so far), the timing rows of ``python -m attncomp bench kernels --backend tvm`` against SDPA (mma.sp
against the scalar dfss kernel, forward+backward), and sm_80 cubins on an A100-class GPU.
"""

from .backend import TVMBackend

__all__ = ["TVMBackend"]
