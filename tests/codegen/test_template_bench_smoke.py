"""``python -m attncomp bench kernels --smoke --table structured`` (CPU, Triton's interpreter) runs end to end
and writes every predicate and SPION row with finite timings and ratios."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_structured_benchmark_smoke(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TMPDIR=str(tmp_path), TRITON_INTERPRET="1")
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, "-m", "attncomp", "bench", "kernels", "--smoke", "--table", "structured"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.load(open(tmp_path / "kernels_smoke.json"))
    assert doc["benchmark"] == "kernels" and doc["command"].startswith("python -m attncomp bench kernels --smoke")
    assert set(doc["versions"]) == {"torch", "triton", "transformers"} and doc["device"] == "cpu"
    rows = doc["rows"]
    preds = {(x["policy"], x["predicate"]) for x in rows if x["table"] == "predicates"}
    assert preds == {(p, k) for p in ("dense", "dfss", "hash", "drop")
                     for k in ("causal_bottom_right", "window_4096", "docs_8", "right_pad_25")}
    assert {x["predicate"] for x in rows if x["table"] == "spion"} == {"banded", "flood"}
    for x in rows:
        assert x["attncomp_ms"] > 0 and 0 < x["achieved_over_ideal"] < 100

