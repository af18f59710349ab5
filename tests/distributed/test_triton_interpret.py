"""The context-parallel loop on the Triton backend (forward blocks and flash-style block backwards
from the global lse), on the CPU through Triton's interpreter, ring emulated by threads."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
triton = pytest.importorskip("triton")

from attncomp import distributed as D  # noqa: E402
from attncomp.codegen.triton import template as _template  # noqa: E402
from tests.distributed import workers  # noqa: E402

if not isinstance(_template._attention_kernel, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("Triton kernels already imported without TRITON_INTERPRET=1; run this module alone",
                allow_module_level=True)


@pytest.fixture
def triton_blocks(monkeypatch):
    """Blocks on the Triton backend even on the CPU; one kernel at a time (the interpreter is not
    meant for concurrent launches from several threads)."""
    lock = threading.Lock()
    calls = {"bwd": 0}
    fwd, bwd, lse_backend = D._block_forward, D._block_backward, D._lse_backend

    def locked_fwd(spec, *a):
        with lock:
            return fwd(spec.replace(backend="triton"), *a)

    def locked_bwd(spec, *a):
        with lock:
            assert lse_backend(spec, *a[:3]) == "triton"
            calls["bwd"] += 1
            return bwd(spec, *a)

    monkeypatch.setattr(D, "_flash_device", lambda q: True)
    monkeypatch.setattr(D, "_block_forward", locked_fwd)
    monkeypatch.setattr(D, "_block_backward", locked_bwd)
    return calls


@pytest.mark.sample(2)
@pytest.mark.parametrize("policy,layout,causal", [(p, "balanced", True) for p in ("dense", "dfss", "drop", "hash")]
                         + [("dense", "contiguous", False), ("hash", "contiguous", False)])
def test_triton_block_backwards_from_the_global_lse(triton_blocks, policy, layout, causal):
    err = workers.thread_ring_case(2, policy, layout, causal, torch.float32, "cpu", B=1, Hq=2, Hk=1, n=24,
                                   D=16, Dv=16, seed=5)
    assert triton_blocks["bwd"] > 0
    assert max(err.values()) < 2e-3, err
