"""Plots as PNG files, with no plotting library: block patterns and line charts.

``pattern(fast, layer, path)`` draws the SPION block pattern of one site (every head side by side
for per-head patterns); ``curves(path, series)`` draws line charts (loss curves, timings). PNGs are
written with ``zlib`` and ``struct`` (RGB, 8 bits); text uses a built-in 5x7 pixel font.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Dict, Optional, Sequence, Union

import torch

__all__ = ["pattern", "curves", "write_png"]

# 5x7 glyphs: 7 rows of 5 bits, most significant bit on the left
_FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12), "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14), "D": (28, 18, 17, 17, 17, 18, 28), "E": (31, 16, 16, 30, 16, 16, 31),
    "F": (31, 16, 16, 30, 16, 16, 16), "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14), "J": (7, 2, 2, 2, 2, 18, 12), "K": (17, 18, 20, 24, 20, 18, 17),
    "L": (16, 16, 16, 16, 16, 16, 31), "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14), "P": (30, 17, 17, 30, 16, 16, 16), "Q": (14, 17, 17, 17, 21, 18, 13),
    "R": (30, 17, 17, 30, 20, 18, 17), "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14), "V": (17, 17, 17, 17, 17, 10, 4), "W": (17, 17, 17, 21, 21, 21, 10),
    "X": (17, 17, 10, 4, 10, 17, 17), "Y": (17, 17, 17, 10, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    " ": (0,) * 7, ".": (0, 0, 0, 0, 0, 12, 12), ",": (0, 0, 0, 0, 12, 4, 8), ":": (0, 12, 12, 0, 12, 12, 0),
    "-": (0, 0, 0, 31, 0, 0, 0), "+": (0, 4, 4, 31, 4, 4, 0), "=": (0, 0, 31, 0, 31, 0, 0),
    "(": (2, 4, 8, 8, 8, 4, 2), ")": (8, 4, 2, 2, 2, 4, 8), "/": (1, 1, 2, 4, 8, 16, 16),
    "%": (24, 25, 2, 4, 8, 19, 3), "_": (0, 0, 0, 0, 0, 0, 31), "x": (0, 17, 10, 4, 10, 17, 0),
    "[": (14, 8, 8, 8, 8, 8, 14), "]": (14, 2, 2, 2, 2, 2, 14), "'": (4, 4, 8, 0, 0, 0, 0),
}

_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189), (140, 86, 75)]


def write_png(path: str, img: torch.Tensor) -> str:
    """Write ``img`` (H, W, 3) uint8 as an RGB PNG."""
    img = img.to(torch.uint8).contiguous()
    H, W, _ = img.shape
    raw = torch.cat([torch.zeros(H, 1, dtype=torch.uint8), img.reshape(H, W * 3)], 1).numpy().tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)
    return path


def _text(img: torch.Tensor, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 1) -> int:
    """Draw ``s`` with its top-left corner at ``(x, y)``; returns the x after the text."""
    H, W, _ = img.shape
    c = torch.tensor(color, dtype=torch.uint8)
    for ch in s:
        g = _FONT.get(ch, _FONT.get(ch.upper(), _FONT[" "]))
        for r, bits in enumerate(g):
            for col in range(5):
                if bits >> (4 - col) & 1:
                    y0, x0 = y + r * scale, x + col * scale
                    if 0 <= y0 and y0 + scale <= H and 0 <= x0 and x0 + scale <= W:
                        img[y0:y0 + scale, x0:x0 + scale] = c
        x += 6 * scale
    return x


def _text_width(s: str, scale: int = 1) -> int:
    return 6 * scale * len(s)


def _grid(p: torch.Tensor, cell: int) -> torch.Tensor:
    """One head's pattern as an image: kept blocks dark blue, dropped white, grid lines grey."""
    n, m = p.shape
    img = torch.full((n * cell + 1, m * cell + 1, 3), 255, dtype=torch.uint8)
    kept = p.repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    img[:n * cell, :m * cell][kept] = torch.tensor([31, 60, 140], dtype=torch.uint8)
    if cell >= 4:
        img[::cell, :] = torch.tensor([200, 200, 200], dtype=torch.uint8)
        img[:, ::cell] = torch.tensor([200, 200, 200], dtype=torch.uint8)
    return img


def pattern(fast_or_pattern, layer: Union[str, int] = 0, path: Optional[str] = None, *,
            title: Optional[str] = None, size: int = 384) -> str:
    """Draw a block pattern to ``path`` (default ``spion-<layer>.png``) and return the path.

    ``fast_or_pattern``: a module compiled with the SPION policy (``layer``: site name or number, as
    in ``attncomp.spion.summary``) or a bool pattern ``(n, n)``/``(H, n, n)``. Rows are query blocks,
    columns key blocks; kept blocks are dark.
    """
    if isinstance(fast_or_pattern, torch.Tensor):
        p, name, extra = fast_or_pattern, str(layer), ""
    else:
        from . import spion

        site = spion.state_of(fast_or_pattern).lookup(layer)
        if site.pattern is None:
            raise ValueError(f"site {site.name!r} has no pattern yet (dense phase): calibrate first")
        p, name = site.pattern, site.name
        extra = f", step {site.switch_step}" if site.switch_step is not None else ""
    p = p.detach().to("cpu", torch.bool)
    if p.dim() == 2:
        p = p[None]
    if p.dim() != 3:
        raise ValueError(f"a pattern has shape (n, n) or (H, n, n), got {tuple(p.shape)}")
    H, n, m = p.shape
    cell = max(1, min(32, size // max(n, m)))
    tiles = [_grid(p[h], cell) for h in range(H)]
    th, tw = tiles[0].shape[:2]
    cols = min(H, 4)
    rows = -(-H // cols)
    pad, top = 12, 34
    W = max(cols * (tw + pad) + pad, 360)
    Himg = top + rows * (th + pad + (12 if H > 1 else 0)) + pad
    img = torch.full((Himg, W, 3), 255, dtype=torch.uint8)
    dens = float(p.float().mean())
    head = title if title is not None else f"{name}: {n}x{m} blocks, density {dens:.3f}{extra}"
    _text(img, pad, 8, head[: (W - 2 * pad) // 6])
    _text(img, pad, 20, "rows: query blocks, columns: key blocks", color=(90, 90, 90))
    for h, t in enumerate(tiles):
        r, c = divmod(h, cols)
        y = top + r * (th + pad + (12 if H > 1 else 0))
        x = pad + c * (tw + pad)
        if H > 1:
            _text(img, x, y, f"head {h}", color=(90, 90, 90))
            y += 12
        img[y:y + th, x:x + tw] = t
    if path is None:
        path = f"spion-{str(name).replace('/', '_')}.png"
    return write_png(path, img)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000 or a < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def curves(path: str, series: Dict[str, Sequence[float]], *, title: str = "", xlabel: str = "step",
           ylabel: str = "", marks: Optional[Dict[str, float]] = None, width: int = 640, height: int = 400) -> str:
    """Line chart of ``series`` (name -> values, x = 0, 1, ...) to ``path``; ``marks`` draws labelled
    vertical lines (e.g. ``{"switch": 40}``). Returns the path."""
    img = torch.full((height, width, 3), 255, dtype=torch.uint8)
    left, right, top, bottom = 64, 16, 30, 46
    pw, ph = width - left - right, height - top - bottom
    vals = [float(v) for s in series.values() for v in s if math.isfinite(float(v))]
    if not vals:
        raise ValueError("curves needs at least one finite value")
    lo, hi = min(vals), max(vals)
    if hi == lo:
        hi, lo = hi + 1.0, lo - 1.0
    span = hi - lo
    lo, hi = lo - 0.05 * span, hi + 0.05 * span
    nmax = max(len(s) for s in series.values())
    xmax = max(nmax - 1, 1)

    def X(i):
        return left + i / xmax * pw

    def Y(v):
        return top + (hi - v) / (hi - lo) * ph

    axis = torch.tensor([0, 0, 0], dtype=torch.uint8)
    grey = torch.tensor([225, 225, 225], dtype=torch.uint8)
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        y = int(round(Y(v)))
        img[y, left:left + pw] = grey
        s = _fmt(v)
        _text(img, left - 4 - _text_width(s), y - 3, s)
    for k in range(5):
        i = xmax * k / 4
        x = int(round(X(i)))
        img[top + ph:top + ph + 4, x] = axis
        s = str(int(round(i)))
        _text(img, x - _text_width(s) // 2, top + ph + 7, s)
    img[top:top + ph + 1, left] = axis
    img[top + ph, left:left + pw + 1] = axis
    for name, at in (marks or {}).items():
        x = int(round(X(float(at))))
        if left <= x <= left + pw:
            img[top:top + ph:3, x] = torch.tensor([120, 120, 120], dtype=torch.uint8)
            _text(img, min(x + 3, width - _text_width(name) - 2), top + 2, name, color=(90, 90, 90))
    for ci, (name, s) in enumerate(series.items()):
        col = torch.tensor(_COLORS[ci % len(_COLORS)], dtype=torch.uint8)
        pts = [(X(i), Y(float(v))) for i, v in enumerate(s) if math.isfinite(float(v))]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            steps = int(max(abs(x1 - x0), abs(y1 - y0))) * 2 + 1
            t = torch.linspace(0, 1, steps)
            xs = (x0 + (x1 - x0) * t).round().long().clamp(0, width - 2)
            ys = (y0 + (y1 - y0) * t).round().long().clamp(0, height - 2)
            for dx in (0, 1):
                for dy in (0, 1):
                    img[ys + dy, xs + dx] = col
        if len(pts) == 1:
            x, y = int(pts[0][0]), int(pts[0][1])
            img[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = col
        # legend, top right
        ly = top + 8 + 12 * ci
        lx = left + pw - _text_width(name) - 28
        img[ly + 2:ly + 5, lx:lx + 18] = col
        _text(img, lx + 22, ly, name)
    _text(img, left, 10, title[: (width - left) // 6])
    _text(img, left + pw // 2 - _text_width(xlabel) // 2, height - 16, xlabel)
    if ylabel:
        _text(img, 4, top - 14, ylabel)
    return write_png(path, img)
