"""When ``backend="auto"`` runs a site on the CPU with TVM's kernels.

On a CPU, ``auto`` gives sites that keep every allowed entry without dropout to SDPA's CPU kernel
(faster than these kernels on dense attention); everything else (the sparse policies, dropout) used to
fall to the reference, which builds the full ``N x N`` logits. Measured on the 2-core CPU machine
(``python -m attncomp bench kernels --backend tvm``, results in ``benchmarks/results/kernels_cpu.json``, N 1024-2048),
the TVM kernels run those sites 3.7x to 22.5x faster than the reference forward and 2.7x to 8x forward
plus backward (and ``spion`` faster than SDPA's dense kernel), so ``auto`` takes them when apache-tvm
is installed, except:

* tiny problems (``Nq * Nk < 256 * 256``), where a first call's kernel build (about a second per
  kernel variant, once per machine thanks to the disk cache) outweighs the gain;
* float64 inputs, which serve accuracy checks: the reference (the oracle) runs them;
* ``ATTNCOMP_TVM_AUTO=0`` turns the choice off.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from . import build as _build

__all__ = ["cpu_choice", "MIN_PROBLEM"]

#: smallest ``Nq * Nk`` for which ``auto`` uses the TVM kernels on a CPU
MIN_PROBLEM = 256 * 256


def cpu_choice(spec, q: torch.Tensor, n_keys: int, v: Optional[torch.Tensor] = None,
               preds=None) -> Optional[Tuple[object, str]]:
    """``(backend, why)`` when ``auto`` should run this CPU site on TVM's kernels, else ``None``."""
    if os.environ.get("ATTNCOMP_TVM_AUTO", "1").strip() == "0" or not _build.tvm_available():
        return None
    if q.device.type != "cpu" or q.dtype == torch.float64 or int(q.shape[-2]) * int(n_keys) < MIN_PROBLEM:
        return None
    from .. import get_backend

    be = get_backend("tvm")
    if be.supports(spec, q, preds) is not None:
        return None
    if v is not None and v.shape[-1] != q.shape[-1] and be.supports(spec, v, preds) is not None:
        return None
    return be, "TVM llvm kernels (measured faster than the reference on a CPU for this policy)"
