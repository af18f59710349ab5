"""The quality run's smoke mode (examples/train_quality.py --smoke through benchmarks/quality.py):
every policy compiles and trains on CPU, and the results file has the documented schema."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("dense", "dfss", "hash", "drop", "spion")


def test_smoke_run_writes_results(tmp_path):
    out = tmp_path / "quality.json"
    # a process of its own: the run resets dynamo and sets the thread count
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "quality.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for key, typ in (("device", str), ("model", str), ("context", int), ("command", str), ("commit", str),
                     ("torch", str), ("rows", list), ("versions", dict), ("benchmark", str)):
        assert isinstance(res[key], typ), key
    assert res["benchmark"] == "quality" and res["torch"] == res["versions"]["torch"]
    assert res["command"] == f"python -m attncomp bench quality --smoke --out {out}"
    assert res["device"] == "cpu" and res["context"] == 128
    assert "2 layers" in res["model"] and "hidden 64" in res["model"]
    for row in res["rows"]:
        assert set(row) == {"policy", "step", "wall_s", "val_bpb"}
    for pol in POLICIES:
        rows = [r for r in res["rows"] if r["policy"] == pol]
        assert len(rows) >= 2, pol
        assert all(math.isfinite(r["val_bpb"]) for r in rows), pol
        walls = [r["wall_s"] for r in rows]
        assert all(a < b for a, b in zip(walls, walls[1:])), (pol, walls)
        assert rows[0]["step"] == 0 and rows[-1]["step"] == 5, pol
    dense = [r for r in res["rows"] if r["policy"] == "dense"]
    assert dense[-1]["val_bpb"] < dense[0]["val_bpb"]
    assert "time to dense final" in proc.stdout  # the final table
    # the automatic switch ran within the smoke's steps, so the block-sparse path trained too
    assert res["runs"]["spion"]["spion_switch_after_step"], res["runs"]["spion"]


def test_resume_refuses_another_model(tmp_path):
    """--resume does not mix a results file of another model into this run's (it stops before training)."""
    import torch

    from benchmarks import quality

    out = tmp_path / "quality_cpu.json"
    out.write_text(json.dumps({"model": "another", "context": 128, "rows": [], "runs": {}}))
    threads = torch.get_num_threads()
    try:
        assert quality.main(["--smoke", "--resume", "--out", str(out)]) == 2
    finally:
        torch.set_num_threads(threads)  # the smoke run sets one thread
    assert json.loads(out.read_text())["model"] == "another"
