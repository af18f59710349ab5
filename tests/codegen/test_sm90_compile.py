"""The default launch configurations compile for Hopper (sm_90a) within a block's shared memory, and the
forward's without spilling registers, checked on any machine by ``tests/codegen/sm90_check.py`` (Triton compiles
for a stand-in sm_90 target; ``ptxas -v`` reads the kernels). In a subprocess: the other kernel tests of
this suite run Triton's interpreter, which replaces the kernels by Python functions for the whole process.

The D=128 backward defaults spill 28-132 bytes per thread in the dK/dV pass; the tiles that do not
(64x64 keys by queries on two warp groups, 32x64 on one) measured slower on the H100
(a configuration sweep, ``python -m attncomp bench kernels --sweep``, in git history), so spills are checked for the forward only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sm90(tmp_path, *args):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "codegen", "sm90_check.py"), "--json", str(out), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.exists(), res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text()), res


@pytest.mark.sample(1)
@pytest.mark.parametrize("gpu", ["h100", ""], ids=["h100", "h200"])
def test_default_configurations_fit_hopper(tmp_path, gpu):
    """Every head-dim tier's default forward and backward (dense and DFSS 2:4; the H100 table and the lists'
    own heads, the H200's), causal and not: compiled to warp-group MMAs, shared memory within 227 KiB, at
    least one block per SM; the forwards without spill stores."""
    rows, res = _sm90(tmp_path, "--policies", "dense,dfss", "--dims", "64,128", "--passes", "fwd,bwd",
                      "--first", "1", "--gpu", gpu, "--no-sass")
    assert res.returncode == 0, res.stdout[-3000:]
    # forward: one kernel per call; backward: the dK/dV and dQ launches (or one launch with atomics)
    assert len(rows) >= 2 * 2 * 2 * 2, rows
    for r in rows:
        assert "error" not in r, r
        assert r["fits"] and r["blocks_per_sm"] >= 1, r
        assert r["passes"] == "bwd" or r["spill"] == 0, r
        assert r["wgmma"] > 0, r  # Hopper's warp-group MMAs, not the Ampere path


def test_stats_see_spills(tmp_path):
    """The check can fail: the D=128 default forward (about 190 registers per thread, no spill) compiled
    under a 128-register cap spills, and the stats say so."""
    code = (
        "import sys, json; sys.path.insert(0, 'tests/codegen'); import sm90_check as sm90\n"
        "cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TMA=1)\n"
        "print(json.dumps([sm90.compile_config('dense', False, 128, 'fwd', cfg, options=o, sass=False)[0]"
        " for o in (None, {'maxnreg': 128})]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    free, capped = json.loads(res.stdout.strip().splitlines()[-1])
    assert free["regs"] > 128 and free["spill"] == 0, free
    assert capped["regs"] <= 128 and capped["spill"] > 0, capped


def test_gluon_forward_compiles_for_hopper(tmp_path):
    """The Gluon Hopper forward under each configuration of ``configs.GLUON_FWD`` and ``GLUON_FWD_DFSS``
    (dense and DFSS 2:4, D 64/128, causal and not) compiles for sm_90 to warp-group MMAs, within a block's
    shared memory, without spill stores."""
    rows, res = _sm90(tmp_path, "--policies", "dense,dfss", "--dims", "64,128", "--passes", "fwd", "--gluon",
                      "--gluon-only", "--no-sass")
    assert res.returncode == 0, res.stdout[-3000:]
    gluon = [r for r in rows if r["config"].startswith("gluon")]
    assert len(gluon) == len(rows), rows  # (--gluon-only: not the template's candidates)
    from attncomp.codegen.triton import configs

    want = ["dense"] * len(configs.GLUON_FWD) + ["dfss"] * len(configs.GLUON_FWD_DFSS)
    assert sorted(r["policy"] for r in gluon) == want, rows
    for r in gluon:
        assert "error" not in r, r
        assert r["fits"] and r["blocks_per_sm"] >= 1 and r["spill"] == 0 and r["wgmma"] > 0, r


@pytest.mark.parametrize("bad", [dict(BLOCK_M=256, PINGPONG=False), dict(BLOCK_M=64, PINGPONG=False),
                                 dict(BLOCK_M=192, PINGPONG=True)], ids=["256", "64", "192-turns"])
def test_warp_specialised_config_is_checked(bad):
    """A warp-specialised configuration the kernel cannot run (query tiles other than two or three warp
    groups of 64, turns with three) raises before anything is built or launched."""
    import torch

    try:
        from attncomp.codegen.triton import hopper
    except ImportError as e:  # a Triton without Gluon
        pytest.skip(str(e))
    q = torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16)
    cfg = dict(BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=2, WS=True, **bad)
    with pytest.raises(ValueError, match="warp-specialised"):
        hopper.forward(q, q, q, 0.125, False, 0, torch.empty_like(q), torch.empty(1, 1, 256), cfg)


def test_gluon_backward_compiles_for_hopper(tmp_path):
    """The backward's Gluon kernels under each configuration of ``configs.GLUON_BWD`` (dense, D 64/128, causal and
    not: the warp-specialised one-launch kernel, and the dK/dV and dQ passes that run where it cannot) and of
    ``configs.GLUON_BWD_DFSS`` (DFSS 2:4: the warp-specialised kernel) compile for
    sm_90 to warp-group MMAs, within a block's shared memory; the passes without spill stores, the
    warp-specialised kernel with at most a few loop-invariant words (D=128: 36-84 bytes in this Triton, stored
    before its step loop and read after it, per its SASS)."""
    rows, res = _sm90(tmp_path, "--policies", "dense,dfss", "--dims", "64,128", "--passes", "bwd", "--gluon",
                      "--gluon-only", "--no-sass")
    assert res.returncode == 0, res.stdout[-3000:]
    from attncomp.codegen.triton import configs

    # DFSS 2:4 (configs.GLUON_BWD_DFSS): the warp-specialised kernel alone, its key rows read in the selection's
    # order (more words on the stack than the dense kernel: 104 bytes at D=128, 132 causal, in Triton 3.6)
    nm = [r for r in rows if r["policy"] == "dfss" and r["config"].startswith("gluon bwd")]
    assert sorted((r["D"], r["causal"], r["kernel"]) for r in nm) == sorted(
        (d, c, "_bwd_ws") for d, c in configs.GLUON_BWD_DFSS), rows
    for r in nm:
        assert "error" not in r and r["fits"] and r["wgmma"] > 0 and r["spill"] <= 256, r
    gluon = [r for r in rows if r["policy"] == "dense" and r["config"].startswith(("gluon dkdv", "gluon bwd"))]

    assert {(r["D"], r["causal"]) for r in gluon} == set(configs.GLUON_BWD), rows
    for r in gluon:
        assert "error" not in r, r
        assert r["kernel"].startswith(("_bwd_dkdv", "_bwd_dq", "_bwd_ws")) and r["fits"] and r["wgmma"] > 0, r
        assert r["spill"] <= (128 if r["kernel"].startswith("_bwd_ws") else 0), r
    # the dK/dV pass, the Gluon dQ pass where a configuration names it, the warp-specialised kernel where it does
    want = sorted((d, c, k) for (d, c), cfg in configs.GLUON_BWD.items()
                  for k in ["_bwd_dkdv"] + (["_bwd_dq"] if cfg.get("DQ_GLUON") else [])
                  + (["_bwd_ws"] if cfg.get("WS") else []))
    assert sorted((r["D"], r["causal"], r["kernel"]) for r in gluon) == want, rows
