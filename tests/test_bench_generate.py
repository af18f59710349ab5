"""``benchmarks/generate.py`` (``python -m attncomp bench generate``) in smoke mode on the CPU.

Paths: eager (the reference), ``attncomp-dense`` and ``attncomp-hash``; ``hf-static`` (transformers compiles
its decode step with Inductor: this test took 29 s with it, 20-22 s without, in CI runs on the 2-core machine)
is transformers' own code, and ``drop`` and ``dfss`` run the same code as ``hash``: left to the GPU runs. The attncomp paths
compile without Inductor here (``ATTNCOMP_INDUCTOR=0`` from tests/conftest.py).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.generate import FIELDS, main, write  # noqa: E402

PATHS = ["eager", "attncomp-dense", "attncomp-hash"]


def test_generate_smoke_writes_schema(tmp_path, fresh_dynamo, capsys):
    assert main(["--smoke", "--paths", ",".join(PATHS), "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["generate_cpu_smoke.json"]
    doc = json.loads(files[0].read_text())
    for key in ("device", "torch", "transformers", "command", "commit", "rows", "versions", "benchmark"):
        assert key in doc, key
    assert doc["benchmark"] == "generate" and set(doc["versions"]) == {"torch", "triton", "transformers"}
    assert doc["torch"] == doc["versions"]["torch"] and "previous" not in doc
    assert doc["device"] == "cpu" and doc["command"].startswith("python -m attncomp bench generate --smoke")
    rows = doc["rows"]
    assert [r["path"] for r in rows] == PATHS
    for r in rows:
        assert set(FIELDS) <= set(r), f"{r['path']}: missing {set(FIELDS) - set(r)}"
        assert (r["B"], r["prompt"], r["new_tokens"]) == (2, 16, 4)
        assert r["kv_bandwidth_frac"] is None
    by = {r["path"]: r for r in rows}
    for path in ("eager", "attncomp-dense", "attncomp-hash"):
        r = by[path]
        assert r["error"] is None, f"{path}: {r['error']}"
        assert r["first_call_s"] > 0 and r["tokens_per_s"] > 0 and r["step_ms"] is not None, r
    dense = by["attncomp-dense"]
    assert dense["logits_match"] is True and dense["tokens_equal"] == 1.0, dense
    assert by["eager"]["tokens_equal"] == 1.0 and by["eager"]["logits_match"] is None
    # a sparse policy computes another function: no logits verdict, tokens compared
    assert by["attncomp-hash"]["logits_match"] is None and 0.0 <= by["attncomp-hash"]["tokens_equal"] <= 1.0
    table = capsys.readouterr().out
    assert "| attncomp-dense |" in table and "x eager" in table


def _row(B, path, tps):
    return {"B": B, "prompt": 16, "new_tokens": 4, "path": path, "tokens_per_s": tps}


def test_merge_keeps_rows_not_measured_again(tmp_path, monkeypatch):
    """--merge: the rows of the file as it was before the run that the run does not measure again stay, ahead of
    the run's; the file is written after every path, each time from that first state; a copy goes under $OUT."""
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    path = str(tmp_path / "generate_cpu.json")
    before = {"command": "python -m attncomp bench generate --B 1", "commit": "abc", "date": "d", "versions": {},
              "rows": [_row(1, "eager", 1.0), _row(2, "eager", 2.0)]}
    doc = {"benchmark": "generate", "device": "cpu", "command": "python -m attncomp bench generate --B 2",
           "rows": [_row(2, "eager", 3.0)]}
    write(doc, path, before)
    doc["rows"].append(_row(2, "attncomp-dense", 4.0))
    written = write(doc, path, before)
    assert written == [path, str(out / "generate_cpu.json")]
    for p in written:
        got = json.loads(open(p).read())
        assert [(r["B"], r["path"], r["tokens_per_s"]) for r in got["rows"]] == \
            [(1, "eager", 1.0), (2, "eager", 3.0), (2, "attncomp-dense", 4.0)]
        assert got["previous"][0]["command"] == before["command"] and got["previous"][0]["rows"] == 1
    # without --merge the file holds this run's rows only
    write(doc, path, None)
    assert [r["tokens_per_s"] for r in json.loads(open(path).read())["rows"]] == [3.0, 4.0]
