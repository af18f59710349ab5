"""Autotuning and the store of measured decisions, persisted in the disk cache.

:func:`tune` benchmarks candidate configurations once per (name, key, candidates, machine) and
remembers the fastest: the next call, in this process or any later one, returns it without
benchmarking. :func:`record`/:func:`lookup` keep arbitrary measurements under the same kind of key,
e.g. the ``select_backend`` pass storing at which sequence length the fused kernel beats the split
one, or that SDPA is faster than Triton for a shape bucket.

Every entry is keyed by the caller's ``key`` plus what makes a timing valid only on one machine:
the versions of attncomp/torch/triton and the GPU name and compute capability when CUDA is
available (both added by :func:`~attncomp.runtime.cache.cache_key`). Shapes should be bucketed with
:func:`shape_bucket` so that one measurement serves nearby sizes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .cache import DiskCache, cache_key, default_cache
from .progress import progress as _progress

log = logging.getLogger(__name__)

__all__ = ["tune", "lookup", "record", "shape_bucket", "counters", "clear_memo"]

#: this process's autotune activity (hits return a stored config without benchmarking)
counters: Dict[str, int] = {"hits": 0, "tuned": 0, "benchmarks": 0, "failures": 0, "records": 0}

_TUNE_ENTRY = "autotune.json"
_RECORD_ENTRY = "record.json"

# in-process memo: dispatch may look a decision up on every call, a disk read each time is waste
_memo: Dict[tuple, dict] = {}


def shape_bucket(n: int) -> int:
    """The power of two at or above ``n`` (1 for ``n <= 1``): sizes that share tuned configs."""
    n = int(n)
    if n < 0:
        raise ValueError(f"shape_bucket expects a non-negative size, got {n}")
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _entry_key(kind: str, name: str, key: dict, extra: Optional[dict] = None) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"autotune name must be a non-empty string, got {name!r}")
    if not isinstance(key, dict):
        raise TypeError(f"autotune key must be a dict, got {type(key).__name__}")
    parts = {"kind": kind, "name": name, "key": key}
    if extra:
        parts.update(extra)
    # cache_key adds the versions and the device (GPU name and compute capability, or "cpu")
    return cache_key(**parts)


def _memo_get(cache: DiskCache, ek: str) -> Optional[dict]:
    if not cache.enabled:
        return None
    return _memo.get((str(cache.root), ek))


def _memo_put(cache: DiskCache, ek: str, value: dict) -> None:
    if cache.enabled:
        _memo[(str(cache.root), ek)] = value


def tune(name: str, key: dict, configs: Sequence[dict], bench: Callable[[dict], float], *,
         progress: bool = True, cache: Optional[DiskCache] = None, measure: bool = True) -> dict:
    """Return the config with the lowest ``bench(config)`` time, measuring only on the first call.
    With ``measure=False`` nothing is timed: the stored best, else the first config (not stored).

    ``name`` names the tuned thing (e.g. ``"triton.attention_fwd"``); ``key`` holds what the best
    config depends on (spec digest, dtype, head dim, bucketed sequence lengths). ``bench`` returns a
    time (any unit, lower is better); a config whose ``bench`` raises or returns a non-finite or
    negative time is skipped with a warning. If every config fails, ``RuntimeError`` lists why.
    The result is persisted (see module docstring); the candidate list is part of the key, so
    changing the candidates re-tunes. A progress bar is drawn while benchmarking (``progress=False``
    or ``ATTNCOMP_PROGRESS=0`` silence it).
    """
    configs = [dict(c) for c in configs]
    # compare configs by canonical JSON: a stored best comes back with lists where tuples were
    canon = [json.dumps(c, sort_keys=True, default=str) for c in configs]
    if not configs:
        raise ValueError(f"tune({name!r}): no candidate configs")
    cache = cache or default_cache()
    ek = _entry_key("autotune", name, key, {"configs": configs})

    hit = _memo_get(cache, ek) or cache.get_json(ek, _TUNE_ENTRY)
    if isinstance(hit, dict) and isinstance(hit.get("best"), dict):
        stored = json.dumps(hit["best"], sort_keys=True, default=str)
        if stored in canon:
            counters["hits"] += 1
            _memo_put(cache, ek, hit)
            log.debug("autotune %s: cached best %s", name, hit["best"])
            return dict(configs[canon.index(stored)])

    if not measure:
        return dict(configs[0])
    timings: List[Dict[str, Any]] = []
    errors: List[str] = []
    best, best_t = None, math.inf
    t0 = time.monotonic()
    with _progress(len(configs), f"autotune {name}", enabled=None if progress else False) as bar:
        for cfg in configs:
            counters["benchmarks"] += 1
            try:
                t = float(bench(dict(cfg)))
                if not math.isfinite(t) or t < 0:
                    raise ValueError(f"bench returned {t!r}, expected a finite time >= 0")
            except Exception as e:  # any failure of one candidate only removes that candidate
                counters["failures"] += 1
                msg = f"{cfg}: {type(e).__name__}: {e}"
                errors.append(msg)
                log.warning("autotune %s: skipping config %s", name, msg)
                timings.append({"config": cfg, "time": None, "error": f"{type(e).__name__}: {e}"})
            else:
                timings.append({"config": cfg, "time": t})
                if t < best_t:
                    best, best_t = cfg, t
            bar.update(postfix=f"best {best_t:.4g}" if best is not None else None)
    if best is None:
        raise RuntimeError(f"autotune {name}: all {len(configs)} configs failed:\n  " + "\n  ".join(errors))

    counters["tuned"] += 1
    value = {"name": name, "key": key, "best": best, "time": best_t, "timings": timings,
             "seconds": round(time.monotonic() - t0, 6), "created": time.time()}
    try:
        cache.put_json(ek, _TUNE_ENTRY, value)
    except (TypeError, ValueError) as e:  # an unserialisable key/config: keep the result in memory
        log.warning("autotune %s: result not persisted: %s", name, e)
    _memo_put(cache, ek, value)
    log.info("autotune %s: best %s (%.4g) of %d configs", name, best, best_t, len(configs))
    return dict(best)


def lookup(name: str, key: dict, *, cache: Optional[DiskCache] = None) -> Optional[dict]:
    """The value stored by :func:`record` for ``(name, key)`` on this machine, or ``None``."""
    cache = cache or default_cache()
    ek = _entry_key("record", name, key)
    hit = _memo_get(cache, ek)
    if hit is None:
        stored = cache.get_json(ek, _RECORD_ENTRY)
        if not (isinstance(stored, dict) and isinstance(stored.get("value"), dict)):
            return None
        hit = stored["value"]
        _memo_put(cache, ek, hit)
    return dict(hit)


def record(name: str, key: dict, value: dict, *, cache: Optional[DiskCache] = None) -> None:
    """Store a measurement or decision (a JSON-serialisable dict) for ``(name, key)``."""
    if not isinstance(value, dict):
        raise TypeError(f"record({name!r}) stores a dict, got {type(value).__name__}")
    cache = cache or default_cache()
    ek = _entry_key("record", name, key)
    cache.put_json(ek, _RECORD_ENTRY, {"name": name, "key": key, "value": value, "created": time.time()})
    counters["records"] += 1
    _memo_put(cache, ek, dict(value))


def clear_memo() -> None:
    """Forget the in-process copies (the disk entries stay)."""
    _memo.clear()
