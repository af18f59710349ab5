"""On-disk cache of compiled kernel artefacts and tuned configurations.

Layout (as Triton's cache): ``$ATTNCOMP_CACHE_DIR/<key>/<name>``, where ``key`` is the base32 sha256
of everything that can change an artefact (kernel source, spec JSON, backend options, GPU arch and
the versions of attncomp, torch and triton; see :func:`cache_key`) and ``name`` names one file of
that entry (``kernel.cubin``, ``autotune.json``...). The default root is ``~/.cache/attncomp``;
``ATTNCOMP_DISABLE_CACHE=1`` turns every read into a miss and every write into a no-op.

Guarantees:

- *Atomic*: a file is written to a temporary name in its own folder, fsync'ed, then renamed over
  the final name with ``os.replace``; a reader sees the old content or the new one, never a mix,
  and a crash mid-write leaves the old entry (or none) behind.
- *Concurrent processes*: two writers of one entry each rename a complete file, so the last one wins
  and both are valid; :meth:`DiskCache.get_or_build` takes an ``fcntl.flock`` lock per entry so that
  processes racing on a missing entry build it once.
- *Corruption detected*: each file starts with a header holding the sha256 and length of its payload.
  A file that fails the check (truncated, garbled, foreign) is counted, dropped with a warning and
  reported as a miss, so the caller rebuilds it.

``counters`` (hits, misses, builds, corrupt, writes) lets tests and ``attncomp.report`` see what
happened in this process.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

try:  # POSIX only; elsewhere concurrent builders may duplicate work but never corrupt entries
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

log = logging.getLogger(__name__)

__all__ = ["DiskCache", "cache_key", "cache_dir", "cache_disabled", "counters", "reset_counters",
           "default_cache", "versions", "device_arch", "CACHE_FORMAT"]

#: bumped when the on-disk layout changes; part of every key so old entries are simply not found
CACHE_FORMAT = 1

#: module-level counters for this process; never reassigned (other modules hold references)
counters: Dict[str, int] = {"hits": 0, "misses": 0, "builds": 0, "corrupt": 0, "writes": 0}

_MAGIC = b"ATNCACH1"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(payload), len(payload)
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def reset_counters() -> None:
    for k in counters:
        counters[k] = 0


def cache_dir() -> Path:
    """The cache root: ``$ATTNCOMP_CACHE_DIR`` or ``~/.cache/attncomp`` (read on every call)."""
    env = os.environ.get("ATTNCOMP_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "attncomp"


def cache_disabled() -> bool:
    return os.environ.get("ATTNCOMP_DISABLE_CACHE", "").strip() not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Keys.

def _dist_version(name: str) -> str:
    # importlib.metadata reads the installed distribution's metadata: no import of triton itself
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "none"


@functools.lru_cache(maxsize=None)
def versions() -> Dict[str, str]:
    """Versions that change generated code: attncomp, torch, triton (``none`` when absent)."""
    import torch

    from .._version import __version__

    return {"attncomp": __version__, "torch": torch.__version__, "triton": _dist_version("triton")}


@functools.lru_cache(maxsize=None)
def device_arch() -> str:
    """The current accelerator, e.g. ``cuda:NVIDIA H200:sm_90``; ``cpu`` without one."""
    import torch

    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            name = torch.cuda.get_device_name()
            kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
            return f"{kind}:{name}:sm_{major}{minor}"
    except Exception as e:  # a broken driver must not break caching: key by CPU instead
        log.debug("could not query the GPU for the cache key: %s", e)
    return "cpu"


def _canonical(obj: Any) -> Any:
    """Turn a key part into canonical JSON data; refuse anything without a stable text form."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)  # repr round-trips exactly, and keeps nan/inf JSON-safe
    if isinstance(obj, bytes):
        return {"sha256": hashlib.sha256(obj).hexdigest()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if hasattr(obj, "to_json"):  # AttentionSpec, Policy
        return {"json": obj.to_json()}
    import torch

    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"cache key part of type {type(obj).__name__} has no canonical form; "
                    "pass str/int/float/bool/None/bytes, lists, dicts, or an object with to_json()")


def cache_key(*, arch: Optional[str] = None, **parts: Any) -> str:
    """Hash the parts of an artefact's identity into a cache folder name.

    Pass what determines the artefact, e.g. ``cache_key(source=src, spec=spec.to_json(),
    options={"num_warps": 4}, backend="triton")``. The versions of attncomp/torch/triton and the
    cache format are always added; ``arch`` defaults to :func:`device_arch` (pass the target arch
    explicitly when building for another machine, e.g. ``arch="sm_90"``). Returns the base32 form
    of the sha256 (52 characters, as Triton's cache).
    """
    data = {
        "parts": _canonical(parts),
        "arch": device_arch() if arch is None else str(arch),
        "versions": versions(),
        "format": CACHE_FORMAT,
    }
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode().rstrip("=")


# ---------------------------------------------------------------------------------------------
# Entry encoding.

def _encode(data: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, hashlib.sha256(data).digest(), len(data)) + data


def _decode(raw: bytes) -> Optional[bytes]:
    """The payload of a stored file, or ``None`` if the file fails its header check."""
    if len(raw) < _HEADER.size:
        return None
    magic, digest, n = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:]
    if magic != _MAGIC or n != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def _fsync_dir(path: Path) -> None:
    # makes the rename itself durable; not all platforms/filesystems allow opening a folder
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the complete new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


#: temp files older than this were left by a crashed writer (a live write takes far less)
STALE_TEMP_SECONDS = 3600.0


def _prune_stale_temps(folder: Path) -> None:
    now = time.time()
    try:
        for p in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > STALE_TEMP_SECONDS:
                    p.unlink()
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# The cache.

class DiskCache:
    """A folder of verified, atomically written entries; see the module docstring.

    ``root=None`` follows ``$ATTNCOMP_CACHE_DIR`` at every call, so one instance serves a process
    whose environment changes (tests). ``lock_timeout`` bounds how long :meth:`get_or_build` waits
    for another process building the same entry before building it too.
    """

    def __init__(self, root: Optional[os.PathLike] = None, *, lock_timeout: Optional[float] = None):
        self._root = None if root is None else Path(root)
        if lock_timeout is None:
            lock_timeout = float(os.environ.get("ATTNCOMP_CACHE_LOCK_TIMEOUT", "600"))
        self.lock_timeout = lock_timeout

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache_dir()

    @property
    def enabled(self) -> bool:
        return not cache_disabled()

    def path(self, key: str, name: str) -> Path:
        """Where the entry ``name`` of ``key`` lives (whether or not it exists)."""
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"invalid cache key {key!r}: use cache_key(...) to make one")
        if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith((".lock", ".tmp")):
            raise ValueError(f"invalid cache entry name {name!r}: letters, digits, '_', '-', '.' "
                             "(not starting with '.', not ending in .lock/.tmp)")
        return self.root / key / name

    # -- bytes ------------------------------------------------------------------------------
    def get(self, key: str, name: str) -> Optional[bytes]:
        """The stored bytes, or ``None`` (missing, disabled, or corrupt: then dropped and counted)."""
        path = self.path(key, name)
        if not self.enabled:
            counters["misses"] += 1
            return None
        data = self._read(path)
        if data is None:
            counters["misses"] += 1
            return None
        counters["hits"] += 1
        return data

    def put(self, key: str, name: str, data: bytes) -> None:
        """Store ``data`` atomically (a no-op when the cache is disabled)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"cache entries are bytes, got {type(data).__name__}")
        path = self.path(key, name)
        if not self.enabled:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, _encode(bytes(data)))
        except OSError as e:
            # a read-only or full disk costs a rebuild next time, never a failed compile
            log.warning("attncomp cache: could not write %s: %s", path, e)
            return
        counters["writes"] += 1
        _prune_stale_temps(path.parent)

    def get_or_build(self, key: str, name: str, build: Callable[[], bytes]) -> bytes:
        """The stored bytes, or ``build()``'s result, stored; concurrent processes build once."""
        data = self.get(key, name)
        if data is not None:
            return data
        if not self.enabled:
            counters["builds"] += 1
            return build()
        path = self.path(key, name)
        with self._lock(path):
            # another process may have built it while this one waited for the lock
            data = self._read(path)
            if data is not None:
                counters["hits"] += 1
                return data
            counters["builds"] += 1
            data = build()
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"build() for cache entry {name!r} returned {type(data).__name__}, not bytes")
            data = bytes(data)
            self.put(key, name, data)
            return data

    # -- JSON -------------------------------------------------------------------------------
    def get_json(self, key: str, name: str) -> Optional[Any]:
        data = self.get(key, name)
        if data is None:
            return None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            # checksum fine but not JSON: a writer stored something else under this name
            counters["hits"] -= 1
            counters["misses"] += 1
            self._drop_corrupt(self.path(key, name), "not valid JSON")
            return None

    def put_json(self, key: str, name: str, value: Any) -> None:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        self.put(key, name, text.encode("utf-8"))

    # -- files for loaders that need a path (TVM modules, shared libraries) ------------------
    def get_file(self, key: str, name: str) -> Optional[Path]:
        """A plain file holding the verified payload of an entry (for ``dlopen``-style loaders).

        The entry itself carries a header, so loaders that take a path get a sibling copy under
        ``<key>/files/``; it is rewritten whenever it no longer matches the verified payload.
        """
        data = self.get(key, name)
        if data is None:
            return None
        target = self.path(key, name).parent / "files" / name
        try:
            if target.is_file() and target.stat().st_size == len(data) and target.read_bytes() == data:
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target, data)
        except OSError as e:
            log.warning("attncomp cache: could not write %s: %s", target, e)
            return None
        return target

    # -- maintenance ------------------------------------------------------------------------
    def delete(self, key: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key, name))

    def clear(self) -> None:
        """Remove every entry under the root (lock files included)."""
        import shutil

        root = self.root
        if root.is_dir():
            for child in root.iterdir():
                if child.is_dir() and _KEY_RE.match(child.name):
                    shutil.rmtree(child, ignore_errors=True)

    # -- internals --------------------------------------------------------------------------
    def _read(self, path: Path) -> Optional[bytes]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.EISDIR):
                return None
            log.warning("attncomp cache: could not read %s: %s", path, e)
            return None
        data = _decode(raw)
        if data is None:
            self._drop_corrupt(path, f"checksum or header mismatch ({len(raw)} bytes)", raw)
        return data

    def _drop_corrupt(self, path: Path, why: str, seen: Optional[bytes] = None) -> None:
        counters["corrupt"] += 1
        log.warning("attncomp cache: corrupt entry %s (%s); dropping it, it will be rebuilt", path, why)
        # take the entry's lock so a writer that just renamed a good file over the bad one is not
        # undone: only unlink if the file still holds what was found corrupt
        with self._lock(path, timeout=5.0):
            try:
                now = path.read_bytes()
            except OSError:
                return
            if seen is not None and now != seen:
                return
            with contextlib.suppress(OSError):
                os.unlink(path)

    @contextlib.contextmanager
    def _lock(self, path: Path, timeout: Optional[float] = None) -> Iterator[None]:
        """An exclusive inter-process lock on ``<path>.lock`` (best effort without fcntl)."""
        timeout = self.lock_timeout if timeout is None else timeout
        lock_path = path.with_name(path.name + ".lock")
        held = _held_locks()
        if fcntl is None or lock_path in held:
            # re-entry (dropping a corrupt file while building it) must not wait on itself
            yield
            return
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.debug("attncomp cache: no lock for %s: %s", path, e)
            yield
            return
        locked = False
        try:
            deadline = time.monotonic() + timeout
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("attncomp cache: waited %.0fs for %s; going on without the lock",
                                    timeout, lock_path)
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                except OSError as e:  # filesystems without flock support
                    log.debug("attncomp cache: flock failed on %s: %s", lock_path, e)
                    break
            held.add(lock_path)
            yield
        finally:
            held.discard(lock_path)
            if locked:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


_tls = threading.local()


def _held_locks() -> set:
    if not hasattr(_tls, "held"):
        _tls.held = set()
    return _tls.held


_default: Optional[DiskCache] = None


def default_cache() -> DiskCache:
    """The process-wide cache under ``$ATTNCOMP_CACHE_DIR`` (resolved at every access)."""
    global _default
    if _default is None:
        _default = DiskCache()
    return _default
