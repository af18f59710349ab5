"""CUDA graphs of a launch plan's kernel launches, made and launched through the CUDA driver.

A recorded plan (:class:`.record.Replay`) launches the same compiled kernels with the same arguments
each call, but for the addresses of the call's tensors, its workspace and its outputs. In a model's
steady state those addresses repeat (the caching allocator hands the freed blocks back), so a run of
launches whose arguments are all fixed by them can be captured once into a CUDA graph and launched
afterwards with one ``cuGraphLaunch`` instead of one launch per kernel (on an H100 host, a hash call
of six launches, before the range spans of :mod:`.template`, went from 67-126 us to 34-72 us per op
call: ``benchmarks/README.md``).

:func:`capture` records the launches on a stream of its own (in the driver's relaxed capture mode,
which leaves other threads' calls alone); nothing runs while it records, so the caller launches the
graph afterwards. Graphs serve only the calls of the default stream, outside any capture of the
caller's (Inductor's ``mode="reduce-overhead"``, ``torch.cuda.graph``: their launches are captured
as they are), with no dispatch mode tracing (:func:`..reference.cacheable`), and not where
``ATTNCOMP_CUDA_GRAPHS=0`` is set (:func:`usable`). The driver is reached with
:mod:`ctypes` (``libcuda``), as Triton's own launcher reaches it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional, Sequence, Tuple

from ...runtime import env

__all__ = ["Graph", "capture", "enabled", "usable"]

_ENV = "ATTNCOMP_CUDA_GRAPHS"
_ON = [True]
_CU_STREAM_NON_BLOCKING = 1
_CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED

_DRIVER: list = []  # [driver or None], loaded on first use
_SIDE: dict = {}  # device index -> the raw handle of the stream graphs are captured on
_CAPTURING = threading.Lock()  # one capture at a time (the side stream is shared by the threads)


class _Driver:
    """The few driver entry points used here, typed."""

    def __init__(self, lib):
        vp, ip = ctypes.c_void_p, ctypes.c_int

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), ip
            return f

        self.stream_create = fn("cuStreamCreate", ctypes.POINTER(vp), ctypes.c_uint)
        self.begin = fn("cuStreamBeginCapture_v2", vp, ip)
        self.end = fn("cuStreamEndCapture", vp, ctypes.POINTER(vp))
        self.nodes = fn("cuGraphGetNodes", vp, vp, ctypes.POINTER(ctypes.c_size_t))
        self.instantiate = fn("cuGraphInstantiateWithFlags", ctypes.POINTER(vp), vp, ctypes.c_ulonglong)
        self.launch = fn("cuGraphLaunch", vp, vp)
        self.graph_destroy = fn("cuGraphDestroy", vp)
        self.exec_destroy = fn("cuGraphExecDestroy", vp)


def _driver() -> Optional[_Driver]:
    if not _DRIVER:
        try:
            _DRIVER.append(_Driver(ctypes.CDLL("libcuda.so.1")))
        except (OSError, AttributeError):  # no CUDA driver (or one without these entry points)
            _DRIVER.append(None)
    return _DRIVER[0]


def enabled(on: Optional[bool] = None) -> bool:
    """Whether plans may launch their runs as CUDA graphs (``ATTNCOMP_CUDA_GRAPHS=0`` turns it off;
    benchmarks compare both); with ``on``, set it first."""
    if on is not None:
        _ON[0] = bool(on)
    return _ON[0] and (env.raw(_ENV) is None or env.flag(_ENV, True))


def usable(device) -> bool:
    """Whether calls on ``device`` (a ``torch.device``) may make and launch graphs: a CUDA device, a
    driver, and graphs :func:`enabled`. Callers also check that the call may be kept at all
    (:func:`..reference.cacheable`: the default stream, no capture of the caller's, no tracing)."""
    return device.type == "cuda" and enabled() and _driver() is not None


class Graph:
    """An instantiated graph (``CUgraphExec``) of ``size`` kernel launches."""

    __slots__ = ("handle", "size", "_drv")

    def __init__(self, handle: int, size: int, drv: _Driver):
        self.handle, self.size, self._drv = handle, size, drv

    def launch(self, stream: int) -> None:
        """Launch the graph on the raw stream ``stream`` (ordered after the work queued there)."""
        rc = self._drv.launch(self.handle, stream)
        if rc:
            raise RuntimeError(f"cuGraphLaunch failed (CUDA driver error {rc})")

    def __del__(self):
        # (an executable graph still running is freed when it completes)
        try:
            if self.handle:
                self._drv.exec_destroy(self.handle)
        except Exception:  # pragma: no cover - the driver is gone at interpreter exit
            pass
        self.handle = None


def _side_stream(drv: _Driver, device: int) -> int:
    s = _SIDE.get(device)
    if s is None:
        h = ctypes.c_void_p()
        rc = drv.stream_create(ctypes.byref(h), _CU_STREAM_NON_BLOCKING)
        if rc:
            raise RuntimeError(f"cuStreamCreate failed (CUDA driver error {rc})")
        s = _SIDE[device] = h.value
    return s


def capture(calls: Sequence[tuple], device: int) -> Tuple[Optional[Graph], str]:
    """``(graph, "")`` of the launches ``calls`` (``(go, g0, g1, g2, args)`` each: ``go(g0, g1, g2,
    stream, args)`` launches one kernel, as :func:`.launch.launcher` gives), captured on a stream of
    device ``device`` (the current one), or ``(None, why)``. Nothing is launched for real."""
    drv = _driver()
    if drv is None:
        return None, "no CUDA driver"
    with _CAPTURING:
        return _capture(drv, calls, device)


def _capture(drv: _Driver, calls: Sequence[tuple], device: int) -> Tuple[Optional[Graph], str]:
    try:
        s = _side_stream(drv, device)
    except RuntimeError as e:
        return None, str(e)
    rc = drv.begin(s, _CAPTURE_RELAXED)
    if rc:
        return None, f"cuStreamBeginCapture failed (CUDA driver error {rc})"
    failed = None
    try:
        for go, g0, g1, g2, args in calls:
            go(g0, g1, g2, s, args)
    except Exception as e:  # (the capture is ended below either way)
        failed = f"a launch failed while captured: {e}"
    g = ctypes.c_void_p()
    rc = drv.end(s, ctypes.byref(g))
    try:
        if failed or rc or not g.value:
            return None, failed or f"cuStreamEndCapture failed (CUDA driver error {rc})"
        n = ctypes.c_size_t(0)
        rc = drv.nodes(g, None, ctypes.byref(n))
        if rc or n.value != len(calls):
            return None, f"the capture holds {n.value} nodes for {len(calls)} launches"
        ex = ctypes.c_void_p()
        rc = drv.instantiate(ctypes.byref(ex), g, 0)
        if rc or not ex.value:
            return None, f"cuGraphInstantiateWithFlags failed (CUDA driver error {rc})"
        return Graph(ex.value, len(calls), drv), ""
    finally:
        if g.value:
            drv.graph_destroy(g)
