"""Environment variables read on the per-call host path.

``os.environ.get`` encodes the name and decodes the value on every call (about a microsecond each):
:func:`raw` reads the raw mapping that ``os.environ`` updates, where the platform has one, with the
encoded name kept. Values come back as ``os.environ`` stores them (bytes on POSIX); :func:`get`
decodes, for callers that compare with ``str``.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["raw", "get", "flag", "allow_measuring", "measuring_allowed"]

_DATA = getattr(os.environ, "_data", None)
_KEYS: dict = {}


def raw(name: str):
    """The raw stored value of ``name`` (None when unset); compare values only with each other."""
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        try:
            key = _KEYS[name] = os.environ.encodekey(name)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            return os.environ.get(name)
    return _DATA.get(key)


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """``os.environ.get(name, default)`` through :func:`raw`."""
    v = raw(name)
    if v is None:
        return default
    return v.decode(errors="surrogateescape") if isinstance(v, bytes) else v


def flag(name: str, default: bool) -> bool:
    """A switch: ``default`` when unset or empty, else off for ``0``/``false``/``no``/``off``."""
    v = get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


_MEASURING = [False]


def allow_measuring() -> None:
    """Let this process time kernels from now on (tuned Triton configurations, SDPA against Triton): set
    by a compile with ``mode="max-autotune"``; every other call runs the shipped defaults and tables."""
    _MEASURING[0] = True


def measuring_allowed() -> bool:
    """Whether a call may time kernels now: ``ATTNCOMP_AUTOTUNE=1`` always, ``ATTNCOMP_AUTOTUNE=0`` never,
    unset: only once a compile with ``mode="max-autotune"`` ran in this process (:func:`allow_measuring`).
    No first call of a default compile or of the functional API measures (DESIGN.md §6)."""
    if not raw("ATTNCOMP_AUTOTUNE"):  # (raw: this is read on the op's per-call path, through plan keys)
        return _MEASURING[0]
    return flag("ATTNCOMP_AUTOTUNE", False)
