"""The context-parallel loop with the ring emulated by threads in one process: 4 ranks on the CPU
(float64, against the single-process result), and on one GPU the flash-style block backwards."""

import pytest
import torch

from tests.distributed import workers

#: float64 against the single-process call (relative for thread_ring_case, absolute in the drop test):
#: the op's lse is float64 for float64 inputs, so the ring carries no float32 rounding (measured about 1e-15)
F64_TOL = 1e-12


@pytest.mark.parametrize("policy", ["dense", "dfss", "drop", "hash"])
@pytest.mark.parametrize("layout,causal", [("contiguous", True), ("balanced", True), ("balanced", False)])
def test_four_ranks_match_single_process(policy, layout, causal):
    err = workers.thread_ring_case(4, policy, layout, causal, torch.float64, "cpu", n=8)
    assert max(err.values()) < F64_TOL, err


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
    assert max(err.values()) < F64_TOL, err


def test_drop_draw_seed_is_global_and_fresh_per_seed():
    # keep masks drawn from draw_seed over the whole sequence: equal to the single-process call
    # given the same draws, and different draws for a different seed
    from attncomp.distributed import context_parallel_attention, shard_sequence
    from attncomp.policy import keep_mask
    from tests.distributed.threadring import thread_ring

    import attncomp

    world, B, H, n, D = 2, 1, 2, 8, 4
    N = world * n
    Q, K, V, _ = workers._full(3, B, H, H, N, D, D, torch.float64)
    outs = {}
    for seed in (11, 12):
        qk, kk = keep_mask((B, H, N), 0.5, seed, 0), keep_mask((B, H, N), 0.5, seed, 1)
        exp = attncomp.functional.attention(Q, K, V, is_causal=True, policy="drop", q_keep=qk, k_keep=kk)
        with thread_ring(world) as run:
            got = run(lambda r: context_parallel_attention(
                *(shard_sequence(t, r, world, "balanced") for t in (Q, K, V)), is_causal=True, policy="drop",
                layout="balanced", draw_seed=seed))
        for r in range(world):
            assert (got[r] - shard_sequence(exp, r, world, "balanced")).abs().max() < F64_TOL
        outs[seed] = exp
    assert (outs[11] - outs[12]).abs().max() > 1e-3
