"""Recorded launch plans: a call served again by replaying the kernel launches it made.

Some calls of the Triton backend do nothing on the host but allocate buffers, take views of tensors
and launch kernels through :class:`.launch.FastLaunch`: the sorted layouts of ``hash`` and ``drop``
(derived from q and k on the device), their tile summaries and lists (with padding), and the forward. Built piece by
piece, such a call pays for a ``Site``, a dozen allocations and a launch key per kernel. Under
:func:`record`, a call logs every launch (the kept compiled kernel, the grid, the arguments) and every
allocation; a dispatch mode watches the torch ops it runs, and any op that is neither an allocation
nor a view (a computation that replaying the launches would not repeat) spoils the recording.
:class:`Replay` then serves later calls of the same key: one workspace allocation carved into the
recorded buffers, the outputs allocated as recorded, and the same launches through
``FastLaunch.launch_entry``, with the call's tensors and seed put in their places.

Each argument of a recorded launch is replayed, by what it was:

* a tensor of the call (q, k, v, a mask, padding vectors; matched by address) -> the call's tensor;
* a buffer allocated during the call -> its place in the workspace, or the call's own output;
* a tensor registered with :func:`constant` (a cached rotation) -> the same tensor (the plan holds it);
* a scalar -> the same value; the seed parameters named by the caller -> the call's seed word;
* a TMA descriptor (``TensorDescriptor``) of one of the above -> a descriptor of the same shape, strides,
  block and padding at the replay's address of that tensor (encoded by the launcher per address);
* anything else (a tensor that existed before the call) -> no plan.

On a GPU, consecutive launches with no seed word among their arguments form a run that is launched
as one CUDA graph per set of addresses once that set comes back (:class:`_Run`, :mod:`.cugraph`).

Scalars are replayed as recorded, so a plan's key must hold everything the recorded call's scalars
depend on (the backend keys plans by spec, tensor signature and state, as its other plans).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import _RECORDING as _TLS, launcher

__all__ = ["Recording", "record", "active", "constant", "descriptor", "Replay", "workspace_view"]

_CONSTANTS: Dict[int, weakref.ref] = {}
_ALIGN = 256  # workspace offsets (bytes): every buffer keeps the alignment class it was recorded with

_aten = torch.ops.aten
_ALLOCATIONS = frozenset((_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                          _aten.new_empty.default, _aten.new_empty_strided.default))


class Recording:
    """What one call launched and allocated; ``why`` says why no plan can be made from it."""

    def __init__(self):
        #: ``(fast_launch, entry, grid, args)`` per launch, in order
        self.launches: List[tuple] = []
        self.allocations: List[torch.Tensor] = []
        self.why: Optional[str] = None

    def spoil(self, why: str) -> None:
        if self.why is None:
            self.why = why


def active() -> Optional[Recording]:
    """The recording of this thread's current call, or None."""
    return getattr(_TLS, "rec", None)


class _Watch(TorchDispatchMode):
    """Logs allocations; any other op that is not a view spoils the recording."""

    #: :func:`attncomp.codegen.reference.tracing` does not count this mode: tensors made under it are
    #: real, and the caches may keep them
    records_launches = True

    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.rec.allocations.append(out)
        elif not func.is_view:
            self.rec.spoil(f"{func} runs on the host path")
        return out


@contextlib.contextmanager
def record():
    """Record the launches and allocations of the calls made inside (this thread)."""
    rec = Recording()
    prev = active()
    _TLS.rec = rec
    try:
        with _Watch(rec):
            yield rec
    finally:
        _TLS.rec = prev


def constant(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as a tensor that recorded launches may read as it is (a cache's: it stays the
    same tensor with the same contents for the calls a plan serves). Returns ``t``."""
    i = id(t)
    _CONSTANTS[i] = weakref.ref(t, lambda _: _CONSTANTS.pop(i, None))
    return t


def _is_constant(t: torch.Tensor) -> bool:
    r = _CONSTANTS.get(id(t))
    return r is not None and r() is t


def _alloc(shape, stride, dtype, device) -> torch.Tensor:
    """A replay's workspace and outputs come from here (tests swap it for a poisoning one: nothing
    may read what the replayed kernels did not write)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _storage_base(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Replay:
    """The launches of a recording, replayable for other tensors of the same signature.

    ``inputs``: name -> tensor of the call (or None), matched by address; ``outputs``: name -> tensor
    allocated during the call that each replay allocates afresh (the call's results); ``seeds``:
    ``{fast_launch: {parameter: name}}``, integer parameters replayed with the call's value of that
    name (seed words); ``nulls``: ``{fast_launch: parameter names}`` of pointers the launches do not
    read (replayed as null pointers, which the launcher passes as they are). Raises ``ValueError``
    (with the reason) where the recording cannot be replayed. A replay launches the kept compiled
    kernels directly (``FastLaunch.hits`` does not count them)."""

    def __init__(self, rec: Recording, inputs: Dict[str, Optional[torch.Tensor]],
                 outputs: Dict[str, torch.Tensor], seeds: Dict[object, Dict[str, str]],
                 nulls: Optional[Dict[object, Iterable[str]]] = None):
        nulls = nulls or {}
        if rec.why is not None:
            raise ValueError(rec.why)
        if not rec.launches:
            raise ValueError("nothing was launched")
        addresses = {t.data_ptr(): name for name, t in inputs.items() if t is not None}
        out_of = {_storage_base(t): name for name, t in outputs.items()}
        # each allocation: its storage, and where a replay finds it (an output, or a workspace offset)
        self.outputs: List[Tuple[str, tuple, tuple, torch.dtype]] = []
        place: Dict[int, Tuple[str, int]] = {}
        size = 0
        for t in rec.allocations:
            base = _storage_base(t)
            name = out_of.get(base)
            if name is not None:
                place[base] = (name, base)
                self.outputs.append((name, tuple(t.shape), tuple(t.stride()), t.dtype))
            elif base not in place:
                place[base] = ("ws", base - size)  # an address in the buffer minus this = its offset
                size += -(-max(t.untyped_storage().nbytes(), 1) // _ALIGN) * _ALIGN
        if len(self.outputs) != len(outputs):
            raise ValueError("an output was not allocated by the call")
        self.ws_bytes = size
        self._place = place
        self.device = rec.allocations[0].device if rec.allocations else None
        self.kept: list = []  # constant tensors the launches read
        self.launches = []
        seeded = []
        kernels = {}
        for fl, entry, grid, args in rec.launches:
            if entry is None:
                raise ValueError(f"a launch of {getattr(fl.fn, '__name__', fl.fn)} took no short path")
            names = [p.name for p in fl.fn.params]
            seed_at = {names.index(p): n for p, n in seeds.get(fl, {}).items()}
            null_at = {names.index(n) for n in nulls.get(fl, ())}
            template, slots, descs = list(args), [], []
            for i, a in enumerate(args):
                if i in seed_at:
                    slots.append((i, seed_at[i], 0))
                    template[i] = None
                elif i in null_at:  # a pointer the kernel does not read here: null
                    template[i] = None
                elif isinstance(a, torch.Tensor):
                    slots.append(self._slot(i, a, addresses, place))
                    template[i] = None
                elif isinstance(a, TensorDescriptor):
                    if not isinstance(a.base, torch.Tensor):
                        raise ValueError("a launch reads a TMA descriptor of no tensor")
                    _, name, off = self._slot(i, a.base, addresses, place)
                    descs.append((i, name, off, (list(a.shape), list(a.strides), list(a.block_shape), a.padding)))
                    template[i] = None
            kernel, tail = entry
            g = tuple(grid) + (1, 1)
            # what FastLaunch.launch_entry passes, with the arguments' tail (constexprs) appended
            self.launches.append((launcher(kernel), g[0], g[1], g[2], template + list(tail), tuple(slots),
                                  tuple(descs)))
            seeded.append(bool(seed_at))
            kernels[id(fl)] = fl
        self.kernels = tuple(kernels.values())
        self.steps = _steps(self.launches, seeded)

    def _slot(self, i: int, a: torch.Tensor, addresses: dict, place: dict) -> tuple:
        p = a.data_ptr()
        name = addresses.get(p)
        if name is not None:
            return (i, name, 0)
        where = place.get(_storage_base(a))
        if where is not None:
            kind, base = where
            return (i, kind, p - base)
        if _is_constant(a):
            self.kept.append(a)
            return (i, "const", p)
        raise ValueError("a launch reads a tensor that is neither the call's, nor made by it, nor a constant")

    def open(self) -> bool:
        """Whether every kernel of the plan can take the short launch path now."""
        for fl in self.kernels:
            if not fl.short_path_open():
                return False
        return True

    def run(self, values: Dict[str, int], device=None, graphs: bool = False) -> Tuple[Optional[torch.Tensor], dict]:
        """Replay for the call's tensors and seeds (``values``: name -> address or seed word) on the
        current stream of ``device`` (default: the current device): ``(workspace, outputs)``. With
        ``graphs`` (the caller checked :func:`.cugraph.usable` and that the call may be kept) the runs
        of :attr:`steps` launch as CUDA graphs where their addresses were seen before (:class:`_Run`)."""
        ws = _alloc((self.ws_bytes,), (1,), torch.uint8, self.device) if self.ws_bytes else None
        outs = {}
        base = dict(values, const=0, ws=0 if ws is None else ws.data_ptr())
        for name, shape, stride, dtype in self.outputs:
            t = outs[name] = _alloc(shape, stride, dtype, self.device)
            base[name] = t.data_ptr()
        fl = self.kernels[0]
        dev = fl._device() if device is None else device
        stream = fl._stream(dev)
        if not graphs:
            for go, g0, g1, g2, args in _calls(self.launches, base):
                go(g0, g1, g2, stream, args)
            return ws, outs
        for step in self.steps:
            if type(step) is _Run:
                step.launch(base, stream, dev)
            else:
                go, g0, g1, g2, args = _calls((step,), base)[0]
                go(g0, g1, g2, stream, args)
        return ws, outs

    def buffer(self, t: torch.Tensor) -> Optional[tuple]:
        """``(offset, shape, stride, dtype)`` of the recorded workspace buffer ``t`` in a replay's
        workspace (see :func:`workspace_view`), or None where ``t`` is not one."""
        kind, base = self._place.get(_storage_base(t), (None, 0))
        if kind != "ws":
            return None
        return t.data_ptr() - base, tuple(t.shape), tuple(t.stride()), t.dtype


def _calls(launches, base: Dict[str, int]) -> List[tuple]:
    """``(go, g0, g1, g2, args)`` of each recorded launch, its slots filled from ``base``."""
    calls = []
    for go, g0, g1, g2, template, slots, descs in launches:
        args = template.copy()
        for i, name, off in slots:
            args[i] = base[name] + off
        for i, name, off, layout in descs:
            args[i] = _descriptor_at(base[name] + off, *layout)
        calls.append((go, g0, g1, g2, args))
    return calls


class _Address:
    """A device address where a descriptor's base tensor was: what Triton's launcher reads of it."""

    __slots__ = ("p",)

    def __init__(self, p: int):
        self.p = p

    def data_ptr(self) -> int:
        return self.p


def descriptor(base, shape: list, strides: list, block: list, padding: str = "zero") -> TensorDescriptor:
    """A TMA descriptor built without the constructor's checks (which cost more host time than a launch):
    the caller has checked what they assert. ``base``: a tensor, or an :class:`_Address`."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = base, shape, strides, block, padding
    return d


def _descriptor_at(p: int, shape: list, strides: list, block: list, padding: str) -> TensorDescriptor:
    """A TMA descriptor of the recorded layout at address ``p`` (the recorded one passed the checks)."""
    return descriptor(_Address(p), shape, strides, block, padding)


def _capturable(go) -> bool:
    """Whether a CUDA graph may capture the launches of ``go``: Triton's C launcher called directly
    (:func:`.launch.direct_launcher`), which allocates nothing per launch (``CompiledKernel.run``
    may allocate scratch memory, which a graph would keep the address of after it is freed)."""
    return getattr(go, "expand", None) is not None


def _steps(launches: list, seeded: List[bool]) -> list:
    """The launches in order, each run of two or more that a graph may capture (no seed word among
    their arguments, each one :func:`_capturable`) gathered into a :class:`_Run`."""
    steps, run = [], []
    for ln, sd in zip(launches, seeded):
        if not sd and _capturable(ln[0]):
            run.append(ln)
            continue
        steps.extend([_Run(run)] if len(run) > 1 else run)
        run = []
        steps.append(ln)
    steps.extend([_Run(run)] if len(run) > 1 else run)
    return steps


class _Run:
    """Consecutive launches of a replay whose arguments are fixed by the addresses they name (the
    call's tensors, the workspace, the outputs): launched as one CUDA graph per set of addresses.
    A set is captured the second time it is seen (a call whose addresses never come back pays no
    capture); at most ``_MAX_GRAPHS`` graphs are kept, the least recently used one is dropped. The
    run launches kernel by kernel from then on (``why`` says why) if the driver refuses a capture,
    or if ``_MAX_GRAPHS`` captures have served fewer launches than that (more address sets in turn
    than graphs kept: each capture would be dropped before its set came back)."""

    __slots__ = ("launches", "names", "graphs", "seen", "why", "captures", "hits")

    def __init__(self, launches: list):
        self.launches = launches
        self.names = tuple(sorted({sl[1] for ln in launches for sl in ln[5] + ln[6]} - {"const"}))
        self.graphs: "OrderedDict[tuple, object]" = OrderedDict()
        self.seen: Dict[tuple, bool] = {}
        self.why: Optional[str] = None
        self.captures = self.hits = 0

    def launch(self, base: Dict[str, int], stream: int, device: int) -> None:
        key = tuple([base[n] for n in self.names])
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            self.hits += 1
            g.launch(stream)
            return
        calls = _calls(self.launches, base)
        if self.why is None and key in self.seen and self.captures >= _MAX_GRAPHS and self.hits < self.captures:
            self.why = f"more than {_MAX_GRAPHS} sets of addresses in turn"
        if self.why is None and key in self.seen:
            from . import cugraph

            g, why = cugraph.capture(calls, device)
            if g is None:
                self.why = why
            else:
                self.captures += 1
                self.graphs[key] = g
                if len(self.graphs) > _MAX_GRAPHS:
                    self.graphs.popitem(last=False)
                g.launch(stream)
                return
        elif len(self.seen) >= _MAX_SEEN:
            self.seen.clear()
        self.seen[key] = True
        for go, g0, g1, g2, args in calls:
            go(g0, g1, g2, stream, args)


_MAX_GRAPHS = 64  # graphs (address sets) kept per run
_MAX_SEEN = 256  # address sets remembered per run until a second sighting


def workspace_view(ws: torch.Tensor, offset: int, shape: Iterable[int], stride: Iterable[int],
                   dtype: torch.dtype) -> torch.Tensor:
    """A typed, strided view of the workspace bytes from ``offset``."""
    return ws.view(dtype).as_strided(tuple(shape), tuple(stride), offset // dtype.itemsize)
