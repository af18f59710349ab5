"""Models compiled by ``attncomp.compile`` under DDP and FSDP2 (gloo, 2 processes): gradients equal
single-process training on the same global batch, in both wrapping orders, with and without
example inputs, for every policy with a backward."""

import pytest

from tests.distributed import harness, workers

#: cases that need the compiled module to behave like the model it wraps (DESIGN §1: parameters
#: registered before the first call, the wrapper's forward and hooks run, no deepcopy of the
#: wrapped module), which ``attncomp.compile`` does not do yet
PENDING_COMPILE = {
    "ddp-compile_then_wrap-lazy-dense": "compiled module lists no parameters before its first call, so DDP refuses it",
    "ddp-wrap_then_compile-lazy-hash": "attncomp.compile cannot capture a DistributedDataParallel module",
    "ddp-wrap_then_compile-example-drop": "attncomp.compile cannot capture a DistributedDataParallel module",
    "fsdp2-compile_then_wrap-lazy-drop": "compiled module deep-copies the FSDP2-sharded model at capture",
    "fsdp2-compile_then_wrap-example-hash": "graphs captured before fully_shard keep the unsharded parameters, "
                                            "so the sharded ones get no gradient",
    "fsdp2-wrap_then_compile-lazy-dfss": "compiled module deep-copies the FSDP2-sharded model at capture",
    "fsdp2-wrap_then_compile-example-dense": "compiled module deep-copies the FSDP2-sharded model at capture",
}
CASES = [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=PENDING_COMPILE[n])) if n in PENDING_COMPILE
         else n for n in (workers.dp_case_name(c) for c in workers.DP_CASES)]


@pytest.fixture(scope="module")
def dp_results():
    return harness.spawn("tests.distributed.workers:data_parallel", world=2, timeout=420, pg_timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_compiled_model_trains_like_single_process(dp_results, case):
    for rank, res in enumerate(dp_results):
        r = res[case]
        assert "raised" not in r, f"rank {rank}: {r.get('raised')}"
        assert r["params_before_call"] == r["n_params"], \
            f"rank {rank}: the compiled module exposes {r['params_before_call']} of {r['n_params']} parameters"
        for step, e in enumerate(r["errors"]):
            assert e < 1e-9, f"rank {rank}, step {step}: gradients differ from single-process training by {e:.3g}"
        assert "report_raised" not in r, f"rank {rank}: attncomp.report of the compiled module: {r['report_raised']}"
        assert r["rewritten"] >= 1, f"rank {rank}: no attention site was rewritten"


def test_drop_draws_reproducible_per_step_and_rank_independent(dp_results):
    res = dp_results[0]["_drop"]
    assert "raised" not in res, res.get("raised")
    assert res["same_across_ranks"] == 0.0
    assert res["reproducible"] == 0.0
    assert res["step_change"] > 1e-6
