"""A tiny progress bar on stderr for long work (autotuning, building many kernels).

Why not tqdm: the runtime must not grow dependencies for a single line of output. The bar is shown
when stderr is a terminal, or anywhere when ``ATTNCOMP_PROGRESS=1`` (logs of CI jobs, tests);
``ATTNCOMP_PROGRESS=0`` silences it everywhere. Usage::

    with progress(len(configs), "autotune attention") as p:
        for cfg in configs:
            ...
            p.update()
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["progress", "progress_enabled"]

_WIDTH = 24


def progress_enabled(stream: Optional[TextIO] = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default stderr) under the current environment."""
    env = os.environ.get("ATTNCOMP_PROGRESS", "").strip()
    if env == "1":
        return True
    if env == "0":
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or tty-less stream objects
        return False


class progress:
    """Context manager drawing ``desc: done/total [####----] pct elapsed`` on one line.

    ``enabled=None`` follows :func:`progress_enabled`; ``False`` never draws (the caller asked for
    silence); ``True`` draws if the environment allows it, so ``ATTNCOMP_PROGRESS=0`` always wins.
    Redraws are throttled to ``min_interval`` seconds so a fast loop does not flood a log file.
    """

    def __init__(self, total: int, desc: str = "", *, enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None, min_interval: float = 0.1):
        self.total = max(0, int(total))
        self.desc = desc
        self.stream = stream
        self.n = 0
        self.postfix = ""
        self.min_interval = float(min_interval)
        self._enabled = enabled
        self._active = False
        self._tty = False
        self._t0 = 0.0
        self._last = 0.0

    # -- context manager --------------------------------------------------------------------
    def __enter__(self) -> "progress":
        stream = self.stream if self.stream is not None else sys.stderr
        self.stream = stream
        self._active = self._enabled is not False and progress_enabled(stream)
        try:
            self._tty = bool(stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False
        self._t0 = time.monotonic()
        self._last = float("-inf")
        self._draw(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public -----------------------------------------------------------------------------
    def update(self, n: int = 1, postfix: Optional[str] = None) -> None:
        """Advance by ``n`` steps; ``postfix`` (e.g. the best time so far) is shown after the bar."""
        self.n = min(self.total, self.n + int(n)) if self.total else self.n + int(n)
        if postfix is not None:
            self.postfix = postfix
        self._draw(force=self.n >= self.total)

    def close(self) -> None:
        if self._active:
            self._draw(force=True)
            self._write("\n")
            self._active = False

    # -- drawing ----------------------------------------------------------------------------
    def render(self) -> str:
        """The current line, without carriage return (exposed for tests and logging)."""
        elapsed = time.monotonic() - self._t0 if self._t0 else 0.0
        if self.total:
            frac = self.n / self.total
            filled = int(round(frac * _WIDTH))
            bar = "#" * filled + "-" * (_WIDTH - filled)
            body = f"{self.n}/{self.total} [{bar}] {frac * 100:3.0f}%"
        else:
            body = f"{self.n}"
        head = f"{self.desc}: " if self.desc else ""
        tail = f" {self.postfix}" if self.postfix else ""
        return f"{head}{body} {elapsed:.1f}s{tail}"

    def _draw(self, force: bool = False) -> None:
        if not self._active:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        # \r redraws one line in place; on a terminal, clear what a longer previous line left
        self._write("\r" + self.render() + ("\x1b[K" if self._tty else ""))

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):
            # a closed or broken stream must never break the work the bar reports on
            self._active = False
