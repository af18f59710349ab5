"""Models compiled by ``attncomp.compile`` under DDP and FSDP2 (gloo, 2 processes): gradients equal
single-process training on the same global batch, in both wrapping orders, with and without
example inputs, for every policy with a backward."""

import pytest

from tests.distributed import harness, workers

#: cases that fail on what attncomp.compile does now (not on the wrappers' side): training through
#: hash and drop sites fails even in one process, and a compiled FSDP2-wrapped model neither keeps
#: its report nor follows the parameters FSDP2 swaps in after an optimizer step
_HASH = "attncomp.compile: training through hash sites fails in dynamo/Inductor compilation (also in one process)"
_DROP = "attncomp.compile: drop sites' lifted per-call seed has no dynamo source (also in one process)"
PENDING_COMPILE = {
    "ddp-wrap_then_compile-lazy-hash": _HASH,
    "ddp-wrap_then_compile-example-drop": _DROP,
    "fsdp2-compile_then_wrap-lazy-drop": _DROP,
    "fsdp2-compile_then_wrap-example-hash": _HASH,
    "fsdp2-wrap_then_compile-lazy-dfss": "attncomp.compile of an FSDP2-wrapped model: no report, gradients differ",
    "fsdp2-wrap_then_compile-example-dense": "attncomp.compile of an FSDP2-wrapped model: gradients differ after "
                                             "the first optimizer step (the graph does not see the updated "
                                             "parameters), no report",
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


@pytest.mark.xfail(strict=True, reason=_DROP)
def test_drop_draws_reproducible_per_step_and_rank_independent(dp_results):
    res = dp_results[0]["_drop"]
    assert "raised" not in res, res.get("raised")
    assert res["same_across_ranks"] == 0.0
    assert res["reproducible"] == 0.0
    assert res["step_change"] > 1e-6
