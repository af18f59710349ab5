"""The context-parallel loop with the ring emulated by threads in one process: 4 ranks on the CPU
(float64, against the single-process result), and on one GPU the flash-style block backwards."""

import pytest
import torch

from tests.distributed import workers


@pytest.mark.parametrize("policy", ["dense", "dfss", "drop", "hash"])
@pytest.mark.parametrize("layout,causal", [("contiguous", True), ("balanced", True), ("balanced", False)])
def test_four_ranks_match_single_process(policy, layout, causal):
    err = workers.thread_ring_case(4, policy, layout, causal, torch.float64, "cpu", n=8)
    assert max(err.values()) < 2e-6, err


def test_thread_ring_detects_a_wrong_merge(monkeypatch):
    # negative twin: a ring whose merge drops the partial outputs of other ranks is caught
    from attncomp import distributed as D

    monkeypatch.setattr(D, "_merge", lambda oa, la, ob, lb: (oa + 0 * ob.to(oa.dtype), torch.maximum(la, lb)))
    err = workers.thread_ring_case(2, "dense", "contiguous", False, torch.float64, "cpu")
    assert err["out"] > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy", ["dense", "dfss", "drop", "hash"])
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("balanced", True)])
def test_gpu_two_ranks_match_one_pass(policy, layout, causal, dtype):
    err = workers.thread_ring_case(2, policy, layout, causal, dtype, "cuda", Hq=8, n=384, D=64, Dv=64)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    assert max(err.values()) < tol, err


@pytest.mark.parametrize("policy", ["dense", "dfss", {"name": "hash", "n_buckets": 4, "exclude_self": True}, "drop"])
def test_block_backward_in_row_chunks(monkeypatch, policy):
    # the exact block backward bounds its memory by processing rows in chunks: same gradients
    from attncomp import distributed as D

    monkeypatch.setattr(D, "_BWD_CHUNK_ELEMS", 2 * 4 * 3 * 8)  # 3 rows of 8 keys per chunk: chunks straddle
    err = workers.thread_ring_case(2, workers._policy(policy), "balanced", True, torch.float64, "cpu")
    assert max(err.values()) < 2e-6, err
