"""Functions run in spawned worker processes by the runtime tests (importable by module path)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from pathlib import Path

_CACHE_PY = Path(__file__).resolve().parents[2] / "attncomp" / "runtime" / "cache.py"


def _cache_module():
    """``attncomp/runtime/cache.py`` loaded on its own.

    Importing it through the package would import torch (``attncomp/__init__``), seconds per
    spawned process; the module itself needs only the standard library unless keys are computed.
    """
    spec = importlib.util.spec_from_file_location("_attncomp_cache_standalone", _CACHE_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def payload(writer: int, i: int) -> bytes:
    """A deterministic payload whose validity a reader can check; sizes vary up to ~1 MiB."""
    size = 1 + (hashlib.sha256(f"{writer}:{i}".encode()).digest()[0] * 4099) % (1 << 20)
    head = f"{writer}:{i}:{size}:".encode()
    return head + bytes([(writer * 31 + i) % 251]) * size


def valid(data: bytes) -> bool:
    try:
        writer, i, size, _ = data.split(b":", 3)
        return data == payload(int(writer), int(i))
    except ValueError:
        return False


def hammer(root: str, key: str, writer: int, seconds: float, barrier, results) -> None:
    """Write and read one entry as fast as possible; report what was seen."""
    C = _cache_module()
    c = C.DiskCache(root)
    bad = 0
    reads = writes = 0
    barrier.wait()
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        c.put(key, "blob.bin", payload(writer, i))
        writes += 1
        data = c.get(key, "blob.bin")
        reads += 1
        if data is None or not valid(data):
            bad += 1
        i += 1
    # now race on a missing entry: exactly one process may build it
    barrier.wait()
    log = os.path.join(root, "builds.log")

    def build() -> bytes:
        with open(log, "a") as f:
            f.write(f"{writer}\n")
        time.sleep(0.3)
        return b"built once"

    got = c.get_or_build(key, "built.bin", build)
    results.put({"writer": writer, "bad": bad, "reads": reads, "writes": writes, "built": got,
                 "corrupt": C.counters["corrupt"]})
