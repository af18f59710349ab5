"""Autotuning store: best config, persistence across processes, failures, records, progress."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attncomp.runtime import autotune as A
from attncomp.runtime import cache as C
from attncomp.runtime.progress import progress, progress_enabled

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [{"BLOCK_M": 64, "num_warps": 4}, {"BLOCK_M": 128, "num_warps": 8}, {"BLOCK_M": 32, "num_warps": 2}]
TIMES = {64: 2.0, 128: 1.0, 32: 3.0}


@pytest.fixture(autouse=True)
def _fresh():
    C.reset_counters()
    A.clear_memo()
    for k in A.counters:
        A.counters[k] = 0


class Bench:
    def __init__(self, times=TIMES, fail=()):
        self.times, self.fail, self.calls = times, fail, []

    def __call__(self, cfg):
        self.calls.append(cfg["BLOCK_M"])
        if cfg["BLOCK_M"] in self.fail:
            raise RuntimeError(f"out of shared memory for BLOCK_M={cfg['BLOCK_M']}")
        return self.times[cfg["BLOCK_M"]]


KEY = {"spec": "abc123", "dtype": "float16", "D": 64, "N": A.shape_bucket(1000)}


def test_tune_picks_fastest_then_hits(tmp_path):
    b = Bench()
    assert A.tune("attn_fwd", KEY, CONFIGS, b, progress=False) == CONFIGS[1]
    assert b.calls == [64, 128, 32]
    assert A.tune("attn_fwd", KEY, CONFIGS, b, progress=False) == CONFIGS[1]
    assert b.calls == [64, 128, 32]  # no benchmarking on the second call
    assert A.counters["hits"] == 1 and A.counters["tuned"] == 1
    # the disk, not only the in-process memo, holds the decision
    A.clear_memo()
    assert A.tune("attn_fwd", KEY, CONFIGS, b, progress=False) == CONFIGS[1]
    assert b.calls == [64, 128, 32] and C.counters["hits"] >= 1


def test_tune_keeps_tuple_values():
    cfgs = [{"tile": (64, 32)}, {"tile": (128, 64)}]
    bench = lambda c: c["tile"][0]  # noqa: E731
    assert A.tune("tuples", KEY, cfgs, bench, progress=False) == {"tile": (64, 32)}
    A.clear_memo()
    assert A.tune("tuples", KEY, cfgs, lambda c: 1 / 0, progress=False) == {"tile": (64, 32)}


@pytest.mark.parametrize("change", ["name", "key", "configs"])
def test_tune_retunes_when_anything_changes(change):
    A.tune("attn_fwd", KEY, CONFIGS, Bench(), progress=False)
    b = Bench()
    name, key, cfgs = "attn_fwd", dict(KEY), list(CONFIGS)
    if change == "name":
        name = "attn_bwd"
    elif change == "key":
        key["N"] = A.shape_bucket(5000)
    else:
        cfgs = cfgs + [{"BLOCK_M": 16, "num_warps": 1}]
        b.times = {**TIMES, 16: 0.5}
    A.tune(name, key, cfgs, b, progress=False)
    assert len(b.calls) == len(cfgs)


def test_tune_keyed_by_device_and_versions(monkeypatch):
    A.tune("attn_fwd", KEY, CONFIGS, Bench(), progress=False)
    A.clear_memo()
    monkeypatch.setattr(C, "device_arch", lambda: "cuda:Imaginary GPU:sm_990")
    b = Bench()
    A.tune("attn_fwd", KEY, CONFIGS, b, progress=False)
    assert len(b.calls) == 3
    A.clear_memo()
    monkeypatch.setattr(C, "versions", lambda: {"attncomp": "0.0.0", "torch": "9.9.9", "triton": "9.9.9"})
    b = Bench()
    A.tune("attn_fwd", KEY, CONFIGS, b, progress=False)
    assert len(b.calls) == 3


def test_failing_configs_are_skipped(caplog):
    b = Bench(fail=(128,))
    with caplog.at_level(logging.WARNING, logger="attncomp.runtime.autotune"):
        assert A.tune("attn_fwd", KEY, CONFIGS, b, progress=False) == CONFIGS[0]
    assert "out of shared memory for BLOCK_M=128" in caplog.text
    assert A.counters["failures"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_non_finite_times_are_failures(bad):
    times = {**TIMES, 128: bad}
    assert A.tune("attn_fwd", KEY, CONFIGS, Bench(times), progress=False) == CONFIGS[0]


def test_all_failing_raises_with_every_error():
    with pytest.raises(RuntimeError) as ei:
        A.tune("attn_fwd", KEY, CONFIGS, Bench(fail=(32, 64, 128)), progress=False)
    msg = str(ei.value)
    assert "all 3 configs failed" in msg
    for m in (32, 64, 128):
        assert f"BLOCK_M={m}" in msg
    with pytest.raises(ValueError, match="no candidate"):
        A.tune("attn_fwd", KEY, [], Bench())


def test_tune_without_cache_always_benchmarks(monkeypatch):
    monkeypatch.setenv("ATTNCOMP_DISABLE_CACHE", "1")
    b = Bench()
    A.tune("attn_fwd", KEY, CONFIGS, b, progress=False)
    A.tune("attn_fwd", KEY, CONFIGS, b, progress=False)
    assert len(b.calls) == 6
    root = Path(os.environ["ATTNCOMP_CACHE_DIR"])
    assert not root.exists() or not any(root.iterdir())


def test_corrupt_tune_entry_is_retuned():
    A.tune("attn_fwd", KEY, CONFIGS, Bench(), progress=False)
    A.clear_memo()
    root = C.cache_dir()
    (entry,) = list(root.glob("*/autotune.json"))
    entry.write_bytes(entry.read_bytes()[:-3])
    b = Bench()
    assert A.tune("attn_fwd", KEY, CONFIGS, b, progress=False) == CONFIGS[1]
    assert len(b.calls) == 3 and C.counters["corrupt"] == 1


def test_tune_survives_process_restart():
    b = Bench()
    best = A.tune("attn_fwd", KEY, CONFIGS, b, progress=False)
    code = textwrap.dedent(f"""
        import json, sys
        from attncomp.runtime import autotune as A
        def bench(cfg):
            raise AssertionError("benchmarked again in a new process")
        print(json.dumps(A.tune("attn_fwd", {KEY!r}, {CONFIGS!r}, bench)))
        print(json.dumps(A.lookup("threshold", {{"D": 64}})))
    """)
    A.record("threshold", {"D": 64}, {"fused_min_n": 512})
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    lines = r.stdout.strip().splitlines()
    assert json.loads(lines[0]) == best
    assert json.loads(lines[1]) == {"fused_min_n": 512}


def test_record_and_lookup():
    assert A.lookup("sdpa_vs_triton", {"bucket": 1024}) is None
    A.record("sdpa_vs_triton", {"bucket": 1024}, {"winner": "sdpa", "ms": {"sdpa": 0.8, "triton": 1.1}})
    assert A.lookup("sdpa_vs_triton", {"bucket": 1024}) == {"winner": "sdpa", "ms": {"sdpa": 0.8, "triton": 1.1}}
    A.clear_memo()
    assert A.lookup("sdpa_vs_triton", {"bucket": 1024})["winner"] == "sdpa"
    assert A.lookup("sdpa_vs_triton", {"bucket": 2048}) is None
    # a returned value is a copy: changing it does not change the store
    A.lookup("sdpa_vs_triton", {"bucket": 1024})["winner"] = "x"
    assert A.lookup("sdpa_vs_triton", {"bucket": 1024})["winner"] == "sdpa"
    with pytest.raises(TypeError):
        A.record("x", {}, [1, 2])


def test_shape_bucket():
    assert [A.shape_bucket(n) for n in (0, 1, 2, 3, 64, 65, 1000, 4096)] == [1, 1, 2, 4, 64, 128, 1024, 4096]
    with pytest.raises(ValueError):
        A.shape_bucket(-1)


# ---------------------------------------------------------------------------------------------
# progress

def test_tune_shows_progress_when_forced(monkeypatch, capsys):
    monkeypatch.setenv("ATTNCOMP_PROGRESS", "1")
    A.tune("attn_fwd", KEY, CONFIGS, Bench(), progress=True)
    err = capsys.readouterr().err
    assert "autotune attn_fwd: 3/3 [" in err and "100%" in err and "best 1" in err
    assert err.endswith("\n")
    # a hit benchmarks nothing and draws nothing
    A.tune("attn_fwd", KEY, CONFIGS, Bench(), progress=True)
    assert capsys.readouterr().err == ""


def test_tune_progress_silent(monkeypatch, capsys):
    monkeypatch.setenv("ATTNCOMP_PROGRESS", "1")
    A.tune("a", KEY, CONFIGS, Bench(), progress=False)
    monkeypatch.delenv("ATTNCOMP_PROGRESS")
    A.tune("b", KEY, CONFIGS, Bench(), progress=True)  # stderr is captured, not a terminal
    assert capsys.readouterr().err == ""


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_rendering(monkeypatch):
    monkeypatch.delenv("ATTNCOMP_PROGRESS", raising=False)
    s = FakeTTY()
    assert progress_enabled(s) and not progress_enabled(io.StringIO())
    with progress(4, "build kernels", stream=s, min_interval=0) as p:
        p.update()
        p.update(2, postfix="fwd")
        assert p.render().startswith("build kernels: 3/4 [" + "#" * 18 + "-" * 6 + "]  75%")
        p.update()
    out = s.getvalue()
    assert out.count("\r") == 5 and "\x1b[K" in out and out.endswith("\n")
    assert "4/4" in out and "fwd" in out
    monkeypatch.setenv("ATTNCOMP_PROGRESS", "0")
    s = FakeTTY()
    with progress(2, "x", stream=s) as p:
        p.update()
    assert s.getvalue() == ""


def test_progress_throttles_and_survives_broken_stream(monkeypatch):
    monkeypatch.setenv("ATTNCOMP_PROGRESS", "1")
    s = io.StringIO()
    with progress(1000, "many", stream=s, min_interval=60) as p:
        for _ in range(1000):
            p.update()
    # first draw, the forced final draw at 1000/1000, and the one at close
    assert s.getvalue().count("\r") == 3 and "\x1b[K" not in s.getvalue()

    class Broken(io.StringIO):
        def write(self, _):
            raise OSError("EPIPE")

    with progress(2, "x", stream=Broken()) as p:
        p.update()
        p.update()
