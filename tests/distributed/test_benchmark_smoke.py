"""``benchmarks/distributed.py --smoke`` (CPU, gloo, 2 processes) runs and writes its JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_distributed_benchmark_smoke(tmp_path):
    out = tmp_path / "distributed_cpux2.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "distributed.py"), "--smoke", "--out", str(out),
                        "--timeout", "280", "--policies", "dense"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["processes"] == 2 and doc["backend"] == "gloo"
    cp = [row for row in doc["rows"] if row["part"] == "cp"]
    assert {(row["policy"], row["causal"], row["passes"]) for row in cp} == {
        (p, c, s) for p in ("dense", "drop") for c in (True, False) for s in ("fwd", "fwd+bwd")}
    for row in cp:
        assert "error" not in row and "one_error" not in row, row
        assert row["rank_ms"] > 0 and row["one_device_ms"] > 0 and row["scaling_efficiency"] > 0
    train = [row for row in doc["rows"] if row["part"] == "train"]
    assert {(row["wrapper"], row["variant"]) for row in train} == {
        (w, v) for w in ("ddp", "fsdp2") for v in ("eager", "dense")}
    for row in train:
        assert "error" not in row and row["step_ms"] > 0, row
        if row["variant"] != "eager":
            assert row["sites_rewritten"] >= 1 and row["vs_eager"] > 0, row
    assert "context parallel" in r.stdout and "written:" in r.stdout
