"""Recorded launch plans: a call served again by replaying the kernel launches it made.

Some calls of the Triton backend do nothing on the host but allocate buffers, take views of tensors
and launch kernels through :class:`.launch.FastLaunch`: the sorted layouts of ``hash`` and ``drop``
(derived from q and k on the device), their tile summaries and lists, and the forward. Built piece by
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
* anything else (a tensor that existed before the call, a TMA descriptor) -> no plan.

Scalars are replayed as recorded, so a plan's key must hold everything the recorded call's scalars
depend on (the backend keys plans by spec, tensor signature and state, as its other plans).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Recording", "record", "active", "constant", "Replay", "workspace_view"]

_TLS = threading.local()
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
        from .launch import launcher  # (launch imports this module)

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
        kernels = {}
        for fl, entry, grid, args in rec.launches:
            if entry is None:
                raise ValueError(f"a launch of {getattr(fl.fn, '__name__', fl.fn)} took no short path")
            names = [p.name for p in fl.fn.params]
            seed_at = {names.index(p): n for p, n in seeds.get(fl, {}).items()}
            null_at = {names.index(n) for n in nulls.get(fl, ())}
            template, slots = list(args), []
            for i, a in enumerate(args):
                if i in seed_at:
                    slots.append((i, seed_at[i], 0))
                    template[i] = None
                elif i in null_at:  # a pointer the kernel does not read here: null
                    template[i] = None
                elif isinstance(a, torch.Tensor):
                    slots.append(self._slot(i, a, addresses, place))
                    template[i] = None
                elif type(a).__name__ == "TensorDescriptor":
                    raise ValueError("a launch reads a TMA descriptor")
            kernel, tail = entry
            g = tuple(grid) + (1, 1)
            # what FastLaunch.launch_entry passes, with the arguments' tail (constexprs) appended
            self.launches.append((launcher(kernel), g[0], g[1], g[2], template + list(tail), tuple(slots)))
            kernels[id(fl)] = fl
        self.kernels = tuple(kernels.values())

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

    def run(self, values: Dict[str, int], device=None) -> Tuple[Optional[torch.Tensor], dict]:
        """Replay for the call's tensors and seeds (``values``: name -> address or seed word) on the
        current stream of ``device`` (default: the current device): ``(workspace, outputs)``."""
        ws = _alloc((self.ws_bytes,), (1,), torch.uint8, self.device) if self.ws_bytes else None
        outs = {}
        base = dict(values, const=0, ws=0 if ws is None else ws.data_ptr())
        for name, shape, stride, dtype in self.outputs:
            t = outs[name] = _alloc(shape, stride, dtype, self.device)
            base[name] = t.data_ptr()
        fl = self.kernels[0]
        stream = fl._stream(fl._device() if device is None else device)
        for go, g0, g1, g2, template, slots in self.launches:
            args = template.copy()
            for i, name, off in slots:
                args[i] = base[name] + off
            go(g0, g1, g2, stream, args)
        return ws, outs

    def buffer(self, t: torch.Tensor) -> Optional[tuple]:
        """``(offset, shape, stride, dtype)`` of the recorded workspace buffer ``t`` in a replay's
        workspace (see :func:`workspace_view`), or None where ``t`` is not one."""
        kind, base = self._place.get(_storage_base(t), (None, 0))
        if kind != "ws":
            return None
        return t.data_ptr() - base, tuple(t.shape), tuple(t.stride()), t.dtype


def workspace_view(ws: torch.Tensor, offset: int, shape: Iterable[int], stride: Iterable[int],
                   dtype: torch.dtype) -> torch.Tensor:
    """A typed, strided view of the workspace bytes from ``offset``."""
    return ws.view(dtype).as_strided(tuple(shape), tuple(stride), offset // dtype.itemsize)
