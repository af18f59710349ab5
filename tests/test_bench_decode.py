"""``benchmarks/decode.py`` (``python -m attncomp bench decode``) in smoke mode: Triton's interpreter on the CPU, in a
process of its own (the smoke mode sets ``TRITON_INTERPRET=1``), every policy's decode step checked against the
reference (float32), the results document's schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_smoke(tmp_path):
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "-m", "attncomp", "bench", "decode", "--smoke", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode" and doc["device"] == "cpu" and doc["smoke"] is True
    rows = doc["rows"]
    policies = ("dense", "hash", "hash-cache", "drop", "dfss")
    assert {(x["B"], x["policy"]) for x in rows} == {(b, p) for b in (1, 2) for p in policies}
    for x in rows:
        assert x["table"] == "decode" and x.get("error") is None, x
        assert x["max_err"] < 1e-4, x
        assert x["ms"] is None and x["kv_bandwidth_frac"] is None  # nothing timed on the CPU
    assert "| B | Nk | policy |" in r.stdout
