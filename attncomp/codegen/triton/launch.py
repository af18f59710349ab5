"""A short host path for launching ``@triton.jit`` kernels that are called again and again.

``JITFunction.run`` binds every argument, specialises each one (types, integer divisibility, pointer
alignment), formats the options and looks the compiled kernel up by all of that on every call: with
the template's ~80 arguments it costs more host time than everything else in an attention call. A
:class:`FastLaunch` keeps, per *argument class* (the key below), the compiled kernel the first call
produced through ``JITFunction.run`` and launches it directly afterwards, with the same arguments in
the same order ``run`` would pass (runtime arguments, then every constexpr and default).

The key holds everything Triton's specialisation reads, or more: the type of every argument;
integers, floats, bools and ``None`` by value (but integers named ``volatile``, which change from
call to call, by the properties Triton specialises on: equal to 1, divisible by 16, 32-bit range);
tensors by dtype and 16-byte alignment; descriptors by dtype, shapes, strides, block shape and
alignment; the constexpr keyword arguments and launch options by value; and the current device.
Keying by value where Triton keys by less only adds entries. An argument of any other type, a launch
hook (profilers install them) or the interpreter take ``JITFunction.run`` as before.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Sequence

import torch

from .record import _TLS as _RECORDING

__all__ = ["FastLaunch", "fast_launch", "enabled"]

_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "num_buffers_warp_spec",
                      "num_consumer_groups", "reg_dec_producer", "reg_inc_consumer", "launch_cooperative_grid",
                      "launch_pdl", "debug"))
_ENABLED = [True]
_MAX_ENTRIES = 4096  # argument classes kept per kernel


def enabled(on: Optional[bool] = None) -> bool:
    """Whether launches take the short path (tests compare both); with ``on``, set it first."""
    if on is not None:
        _ENABLED[0] = bool(on)
    return _ENABLED[0]


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps an empty ``HookChain``; older ones None)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def _descriptor_key(d) -> tuple:
    base = d.base
    return (base.dtype, base.data_ptr() & 15 == 0, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            getattr(d, "padding", None))


def _volatile_key(v: int) -> tuple:
    """What Triton specialises an integer on: equal to 1, divisible by 16, 32-bit range."""
    return (v == 1, v & 15 == 0, -(1 << 31) <= v < (1 << 31))


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.

    ``volatile``: names of integer parameters whose values change between calls (seeds): keyed by
    their specialisation class rather than their value, so that each value does not add an entry.
    """

    def __init__(self, fn, volatile: Sequence[str] = ()):
        self.fn = fn
        self._cache: Dict[tuple, tuple] = {}
        self._layouts: Dict[tuple, Any] = {}  # argument types -> getters (see _layout)
        try:
            from triton.runtime.jit import JITFunction

            self._jit = isinstance(fn, JITFunction)
        except ImportError:  # pragma: no cover - no triton: callers never get here
            self._jit = False
        if self._jit:
            names = [p.name for p in fn.params]
            self._volatile = frozenset(i for i, n in enumerate(names) if n in volatile)
            from triton import knobs
            from triton.runtime.driver import driver

            self._runtime = knobs.runtime
            self._driver = driver
        self.hits = 0  # launches that took the short path (tests read it)
        #: ``(kernel, tail)`` of the latest launch when it was kept for the short path, else None: a
        #: caller that repeats one argument class may launch it itself (:meth:`launch_entry`)
        self.last_entry: Optional[tuple] = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.run(grid, args, kwargs)

        return launch

    # -- the two paths -------------------------------------------------------------------------
    def run(self, grid, args: tuple, kwargs: dict):
        kernel = self._run(grid, args, kwargs)
        rec = getattr(_RECORDING, "rec", None)
        if rec is not None:  # (a call recorded for replay: .record)
            rec.launches.append((self, self.last_entry, grid, args))
        return kernel

    def _run(self, grid, args: tuple, kwargs: dict):
        self.last_entry = None
        if not self.short_path_open():
            return self.fn[grid](*args, **kwargs)
        device = self._device()
        types = tuple(map(type, args))
        lay = self._layouts.get(types)
        if lay is None:
            lay = self._layouts[types] = self._layout(types)
        if lay is False:  # an argument of a type the key does not know
            return self.fn[grid](*args, **kwargs)
        plain, tens, vol, desc = lay
        key = (device, tuple(kwargs.items()), types, plain(args) if plain else (),
               tuple([a.dtype for a in tens(args)]) if tens else (),
               tuple([a.data_ptr() & 15 == 0 for a in tens(args)]) if tens else (),
               tuple([_volatile_key(args[i]) for i in vol]) if vol else (),
               tuple([_descriptor_key(args[i]) for i in desc]) if desc else ())
        ent = self._cache.get(key)
        if ent is None:
            kernel = self.fn[grid](*args, **kwargs)
            tail = self._tail(len(args), kwargs)
            if tail is not None and kernel is not None and not hasattr(kernel, "result"):
                if len(self._cache) >= _MAX_ENTRIES:  # sizes keyed by value (decoding grows N): bounded
                    self._cache.clear()
                self._cache[key] = self.last_entry = (kernel, tail)
            return kernel
        self.last_entry = ent
        self.launch_entry(ent, grid, args, device)
        return ent[0]

    def short_path_open(self) -> bool:
        """Whether launches may skip ``JITFunction.run`` now: a compiled kernel (not the interpreter),
        the short path enabled, no launch hook installed."""
        rt = self._runtime if self._jit else None
        return not (rt is None or not _ENABLED[0] or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook))

    def launch_entry(self, entry: tuple, grid, args, device=None) -> None:
        """Launch a kept ``(kernel, tail)`` entry with ``args`` of its argument class on the current
        stream of ``device`` (default: the current device)."""
        kernel, tail = entry
        if device is None:
            device = self._device()
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, self._stream(device), kernel.function, kernel.packed_metadata, None,
                   None, None, *args, *tail)
        self.hits += 1

    def _layout(self, types: tuple):
        """Getters of one argument-type pattern: ``(plain, tensors, volatile, descriptors)``, where
        ``plain`` returns the ints (but ``volatile``), floats, bools and ``None`` (keyed by value),
        ``tensors`` the tensors (keyed by dtype and alignment); False for a type the key does not know."""
        plain, tens, vol, desc = [], [], [], []
        for i, t in enumerate(types):
            if i in self._volatile and t is int:
                vol.append(i)
            elif t in (int, float, bool, type(None)):
                plain.append(i)
            elif issubclass(t, torch.Tensor):
                tens.append(i)
            elif t.__name__ == "TensorDescriptor":
                desc.append(i)
            else:
                return False

        def getter(pos):
            if not pos:
                return None
            if len(pos) == 1:
                i = pos[0]
                return lambda a: (a[i],)
            return operator.itemgetter(*pos)

        return getter(plain), getter(tens), tuple(vol), tuple(desc)

    def _device(self):
        return self._driver.active.get_current_device()

    def _stream(self, device):
        return self._driver.active.get_current_stream(device)

    def _tail(self, n_args: int, kwargs: dict) -> Optional[tuple]:
        """The values ``JITFunction.run`` passes after the ``n_args`` positional ones (constexprs and
        defaults, in parameter order), or None when the call does not have that shape (it then
        always takes ``run``)."""
        params = self.fn.params
        if n_args > len(params) or any(p.is_constexpr for p in params[:n_args]):
            return None
        tail = []
        seen = set()
        for p in params[n_args:]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
                seen.add(p.name)
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
            if not p.is_constexpr:  # a runtime argument passed by keyword: keep to run()
                return None
        if any(k not in seen and k not in _OPTIONS for k in kwargs):
            return None
        return tuple(tail)


def fast_launch(fn=None, *, volatile: Sequence[str] = ()):
    """Decorator form of :class:`FastLaunch` (above ``@triton.jit``)."""
    if fn is None:
        return lambda f: FastLaunch(f, volatile)
    return FastLaunch(fn, volatile)
