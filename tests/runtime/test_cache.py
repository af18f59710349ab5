"""The disk cache: keys, atomic writes, concurrent processes, corruption detection."""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os

import pytest

from attncomp.runtime import cache as C
from tests.runtime import _workers

@pytest.fixture
def cache(tmp_path):
    C.reset_counters()
    return C.DiskCache(tmp_path / "cache")


# ---------------------------------------------------------------------------------------------
# keys

def test_key_is_base32_sha256_and_deterministic():
    k = C.cache_key(source="kernel src", spec='{"causal":true}', options={"num_warps": 4, "stages": 2})
    assert len(k) == 52 and k.isalnum() and k == k.upper()
    assert k == C.cache_key(options={"stages": 2, "num_warps": 4}, spec='{"causal":true}', source="kernel src")


@pytest.mark.parametrize("change", [
    dict(source="kernel src!"), dict(spec='{"causal":false}'), dict(options={"num_warps": 8}),
])
def test_key_changes_with_every_part(change):
    base = dict(source="kernel src", spec='{"causal":true}', options={"num_warps": 4})
    assert C.cache_key(**base) != C.cache_key(**{**base, **change})


def test_key_includes_arch_and_versions(monkeypatch):
    assert set(C.versions()) == {"attncomp", "torch", "triton"}
    k = C.cache_key(source="s")
    assert C.cache_key(source="s", arch="sm_90") != C.cache_key(source="s", arch="sm_80")
    monkeypatch.setattr(C, "device_arch", lambda: "cuda:Imaginary GPU:sm_990")
    assert C.cache_key(source="s") != k
    monkeypatch.undo()
    monkeypatch.setattr(C, "versions", lambda: {"attncomp": "0.1.0", "torch": "2.99.0", "triton": "none"})
    assert C.cache_key(source="s") != k


def test_key_accepts_specs_and_refuses_opaque_objects():
    from attncomp import AttentionSpec

    s = AttentionSpec(causal=True)
    assert C.cache_key(spec=s) == C.cache_key(spec=AttentionSpec(causal=True)) != C.cache_key(spec=AttentionSpec())
    with pytest.raises(TypeError, match="canonical form"):
        C.cache_key(spec=object())


def test_default_root_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNCOMP_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert C.cache_dir() == tmp_path / ".cache" / "attncomp"
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path / "x"))
    assert C.cache_dir() == tmp_path / "x"
    assert C.default_cache().root == tmp_path / "x"


# ---------------------------------------------------------------------------------------------
# basic behaviour

def test_put_get_and_counters(cache):
    key = C.cache_key(source="a")
    assert cache.get(key, "kernel.bin") is None
    cache.put(key, "kernel.bin", b"\x00cubin\xff")
    assert cache.get(key, "kernel.bin") == b"\x00cubin\xff"
    cache.put_json(key, "meta.json", {"num_warps": 4, "shared": 1024})
    assert cache.get_json(key, "meta.json") == {"num_warps": 4, "shared": 1024}
    assert C.counters == {"hits": 2, "misses": 1, "builds": 0, "corrupt": 0, "writes": 2}
    # stored under <root>/<key>/<name>, nothing else left behind
    assert sorted(p.name for p in (cache.root / key).iterdir()) == ["kernel.bin", "meta.json"]


def test_get_or_build_builds_once(cache):
    key = C.cache_key(source="b")
    calls = []

    def build():
        calls.append(1)
        return b"artefact"

    assert cache.get_or_build(key, "k.bin", build) == b"artefact"
    assert cache.get_or_build(key, "k.bin", build) == b"artefact"
    assert len(calls) == 1
    assert C.counters["builds"] == 1 and C.counters["hits"] == 1
    with pytest.raises(TypeError, match="not bytes"):
        cache.get_or_build(key, "other.bin", lambda: "a str")


def test_get_file_gives_plain_payload(cache):
    key = C.cache_key(source="so")
    assert cache.get_file(key, "lib.so") is None
    cache.put(key, "lib.so", b"\x7fELF...")
    p = cache.get_file(key, "lib.so")
    assert p.read_bytes() == b"\x7fELF..."
    p.write_bytes(b"stale")  # a damaged copy is replaced by the verified payload
    assert cache.get_file(key, "lib.so").read_bytes() == b"\x7fELF..."


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x.lock", "x.tmp", "a" * 200])
def test_invalid_names_refused(cache, name):
    with pytest.raises(ValueError, match="invalid cache entry name"):
        cache.put(C.cache_key(source="n"), name, b"")


def test_invalid_key_refused(cache):
    with pytest.raises(ValueError, match="invalid cache key"):
        cache.get("../../etc", "x")


def test_disabled_cache_is_bypassed(cache, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_DISABLE_CACHE", "1")
    key = C.cache_key(source="d")
    cache.put(key, "x.bin", b"1")
    assert not cache.root.exists()
    assert cache.get(key, "x.bin") is None
    n = []
    for _ in range(2):
        cache.get_or_build(key, "x.bin", lambda: n.append(1) or b"1")
    assert len(n) == 2 and C.counters["builds"] == 2


def test_unwritable_root_does_not_fail(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    c = C.DiskCache(blocker / "cache")  # a folder under a regular file cannot exist
    with caplog.at_level(logging.WARNING, logger="attncomp.runtime.cache"):
        assert c.get_or_build(C.cache_key(source="w"), "x.bin", lambda: b"v") == b"v"
    assert "could not write" in caplog.text


# ---------------------------------------------------------------------------------------------
# corruption

@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "foreign_header"])
def test_corrupt_entry_detected_dropped_and_rebuilt(cache, damage, caplog):
    key = C.cache_key(source="c")
    cache.put(key, "k.bin", b"payload-" * 1000)
    path = cache.path(key, "k.bin")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":
        raw[len(raw) // 2] ^= 0x40
    elif damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    elif damage == "empty":
        raw = bytearray()
    else:  # a file written by something else: valid-looking bytes without our header
        raw = bytearray(b"payload-" * 1000)
    path.write_bytes(bytes(raw))

    with caplog.at_level(logging.WARNING, logger="attncomp.runtime.cache"):
        assert cache.get(key, "k.bin") is None
    assert C.counters["corrupt"] == 1
    assert "corrupt entry" in caplog.text and "rebuilt" in caplog.text
    assert not path.exists()  # dropped

    builds = []
    out = cache.get_or_build(key, "k.bin", lambda: builds.append(1) or b"payload-" * 1000)
    assert out == b"payload-" * 1000 and builds == [1]
    assert cache.get(key, "k.bin") == b"payload-" * 1000


def test_corrupt_entry_found_inside_get_or_build(cache):
    # the corrupt file is first seen by get_or_build, which then rebuilds under its own lock
    key = C.cache_key(source="c2")
    cache.put(key, "k.bin", b"good")
    path = cache.path(key, "k.bin")
    path.write_bytes(path.read_bytes()[:-1])
    assert cache.get_or_build(key, "k.bin", lambda: b"good") == b"good"
    assert C.counters["corrupt"] == 1 and C.counters["builds"] == 1


def test_json_entry_that_is_not_json_is_dropped(cache):
    key = C.cache_key(source="j")
    cache.put(key, "cfg.json", b"\xff not json")
    assert cache.get_json(key, "cfg.json") is None
    assert C.counters["corrupt"] == 1 and not cache.path(key, "cfg.json").exists()


# ---------------------------------------------------------------------------------------------
# atomicity: a crash mid-write leaves the old entry (or none), never a partial one

def test_failed_rename_keeps_old_entry(cache, monkeypatch):
    key = C.cache_key(source="r")
    cache.put(key, "k.bin", b"old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(C.os, "replace", boom)
    cache.put(key, "k.bin", b"new" * 100)  # logged, not raised: a cache write never fails a compile
    monkeypatch.undo()
    assert cache.get(key, "k.bin") == b"old"
    assert sorted(p.name for p in (cache.root / key).iterdir()) == ["k.bin"]  # temp file removed


def _crash_while_putting(cache, key, data, when):
    """Fork a child that dies (``os._exit``) partway through ``cache.put``; return its exit code.

    A fork shares this process's imports, so the crash costs milliseconds rather than a fresh
    interpreter; the child only touches files before dying.
    """
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            if when == "mid_write":
                real_fdopen = os.fdopen

                class Dying(io.RawIOBase):
                    def __init__(self, f):
                        self.f = f

                    def write(self, b):
                        self.f.write(bytes(b)[: len(b) // 2])
                        self.f.flush()
                        os._exit(9)  # the process dies with half the bytes on disk

                os.fdopen = lambda fd, mode="r", *a, **k: Dying(real_fdopen(fd, mode, *a, **k))
            else:
                os.fsync = lambda fd: os._exit(9)  # every byte written, killed before the rename
            cache.put(key, "k.bin", data)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("when", ["mid_write", "before_rename"])
def test_process_crash_mid_write(cache, when):
    key = C.cache_key(source="crash")
    cache.put(key, "k.bin", b"old entry")
    assert _crash_while_putting(cache, key, b"new entry " * 100000, when) == 9
    files = sorted(p.name for p in (cache.root / key).iterdir())
    assert "k.bin" in files and any(f.endswith(".tmp") for f in files)  # the crash left a temp file
    assert cache.get(key, "k.bin") == b"old entry"
    assert C.counters["corrupt"] == 0
    cache.put(key, "k.bin", b"new entry")
    assert cache.get(key, "k.bin") == b"new entry"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_crash_without_old_entry_leaves_none(cache):
    key = C.cache_key(source="crash2")
    (cache.root / key).mkdir(parents=True)
    assert _crash_while_putting(cache, key, b"x" * 100000, "mid_write") == 9
    assert cache.get(key, "k.bin") is None and C.counters["corrupt"] == 0


# ---------------------------------------------------------------------------------------------
# concurrent processes

def test_two_processes_hammering_one_key(cache):
    key = C.cache_key(source="hammer")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_workers.hammer, args=(str(cache.root), key, w, 1.0, barrier, results))
             for w in range(2)]
    for p in procs:
        p.start()
    out = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for r in out:
        assert r["bad"] == 0 and r["corrupt"] == 0, r
        assert r["writes"] > 5, r
        assert r["built"] == b"built once"
    # the last write wins and is a complete, valid entry
    final = cache.get(key, "blob.bin")
    assert final is not None and _workers.valid(final)
    # both processes raced on the missing entry; the lock let exactly one build it
    assert (cache.root / "builds.log").read_text().split() in (["0"], ["1"])
    assert C.counters["corrupt"] == 0
