"""Models compiled by ``attncomp.compile`` under DDP and FSDP2 (gloo, 2 processes): gradients equal
single-process training on the same global batch, in both wrapping orders, with and without
example inputs, for every policy with a backward."""

import pytest

from tests.distributed import harness, workers

CASES = [workers.dp_case_name(c) for c in workers.DP_CASES]


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    return harness.spawn_once(tmp_path_factory, "dp", "tests.distributed.workers:data_parallel", world=2, timeout=420,
                              pg_timeout=120)


@pytest.mark.sample(2)
@pytest.mark.parametrize("case", CASES)
def test_compiled_model_trains_like_single_process(dp_results, case):
    for rank, res in enumerate(dp_results):
        r = res[case]
        assert "raised" not in r, f"rank {rank}: {r.get('raised')}"
        assert r["params_before_call"] == r["n_params"], \
            f"rank {rank}: the compiled module exposes {r['params_before_call']} of {r['n_params']} parameters"
        assert r["params_replaced_by_compile"] == 0, \
            f"rank {rank}: after attncomp.compile, {r['params_replaced_by_compile']} parameter(s) of the module " \
            "are other tensors than before (an optimizer built then would update the wrong tensors)"
        for step, e in enumerate(r["errors"]):
            assert e < 1e-9, f"rank {rank}, step {step}: gradients differ from single-process training by {e:.3g}"
        assert "report_raised" not in r, f"rank {rank}: attncomp.report of the compiled module: {r['report_raised']}"
        assert r["rewritten"] >= 1, f"rank {rank}: no attention site was rewritten"
        if case.startswith("fsdp2-wrap_then_compile-example"):  # the compile-time call's reshard is reported
            assert any("FSDP2" in n for n in r["notes"]), f"rank {rank}: report notes {r['notes']}"


@pytest.mark.parametrize("case", workers.FSDP_EXAMPLE_CASES)
def test_fsdp2_example_compile_leaves_parameters_sharded(dp_results, case):
    """attncomp.compile(..., example_inputs=...) runs a forward that no backward follows: FSDP2 modules
    it left unsharded are put back, so an optimizer built afterwards trains the sharded parameters."""
    for rank, res in enumerate(dp_results):
        r = res["_fsdp_example_" + case]
        assert "raised" not in r, f"rank {rank}: {r.get('raised')}"
        assert r["replaced"] == 0 and r["unsharded"] == 0, \
            f"rank {rank}: after compile {r['replaced']} parameter(s) are other tensors, {r['unsharded']} not sharded"
        assert any("FSDP2" in n for n in r["notes"]), f"rank {rank}: report notes {r['notes']}"
        assert r["rewritten"] >= 1, f"rank {rank}: no attention site was rewritten"
        for step, e in enumerate(r["errors"]):
            assert e < 1e-9, f"rank {rank}, step {step}: gradients differ from single-process training by {e:.3g}"


def test_report_says_when_calls_ran_without_a_graph(dp_results):
    for rank, res in enumerate(dp_results):
        r = res["_fsdp_frames_used_up"]
        assert "raised" not in r, f"rank {rank}: {r.get('raised') if isinstance(r, dict) else r}"
        first, second = r
        assert first["rewritten"] >= 1 and first["graphs"] >= 1, f"rank {rank}: {first}"
        assert second["rewritten"] == 0 and second["graphs"] == 0, f"rank {rank}: {second}"
        assert second["notes"][0].startswith("no graph captured: 1 call(s) ran without attncomp"), \
            f"rank {rank}: {second['notes']}"


def test_drop_draws_reproducible_per_step_and_rank_independent(dp_results):
    res = dp_results[0]["_drop"]
    assert "raised" not in res, res.get("raised")
    assert res["same_across_ranks"] == 0.0
    assert res["reproducible"] == 0.0
    assert res["step_change"] > 1e-6
