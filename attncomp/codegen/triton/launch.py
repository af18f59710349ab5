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
import threading
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["FastLaunch", "fast_launch", "enabled", "direct_launcher", "kept_launcher", "launcher"]

_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "num_buffers_warp_spec",
                      "num_consumer_groups", "reg_dec_producer", "reg_inc_consumer", "launch_cooperative_grid",
                      "launch_pdl", "debug"))
_ENABLED = [True]
# this thread's recording (``.rec``), set by :func:`.record.record`: each launch made under it is logged
# for replay (the recording module builds on this one, so the state lives here)
_RECORDING = threading.local()
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
        launcher(kernel)(grid[0], g1, g2, self._stream(device), (*args, *tail))
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


# -- Triton's compiled launcher, called directly ---------------------------------------------------
# ``CompiledKernel.run`` is Triton's ``CudaLauncher``: a Python ``__call__`` that allocates the
# kernel's scratch buffers (none for the kernels here), then, for a kernel with host tensor
# descriptors, a Python loop that encodes each descriptor (``make_tensordesc_arg``: the driver's
# ``cuTensorMapEncodeTiled``) and expands the arguments, and last the compiled C ``launch``. A kept
# launch calls that C ``launch`` itself, with the same arguments in the same order, and keeps the
# encoded descriptors by what the encoding reads (the base address, shape, strides and padding; the
# rest is the kernel's), so that a repeat with tensors at the same addresses (a model's steady
# state) encodes nothing. Anything else (another driver, scratch, launcher or argument layout) takes
# ``CompiledKernel.run`` as before.

_BASE_FORMAT = "iiiKKppOOOOOO"  # the C launch's leading arguments this passes (checked against the driver's)
_DIRECT: Dict[int, tuple] = {}  # id(compiled kernel) -> (kernel, direct launcher or None)
_MAX_MAPS = 64  # encoded descriptors kept per descriptor argument of a kernel
_DIRECT_ON = [True]


def direct(on: Optional[bool] = None) -> bool:
    """Whether kept launches call Triton's C launcher directly (benchmarks compare both; launch plans
    made before a change keep the launcher they were made with); with ``on``, set it first."""
    if on is not None:
        _DIRECT_ON[0] = bool(on)
    return _DIRECT_ON[0]


def _nvidia_driver():
    try:
        from triton.backends.nvidia import driver as nv
    except ImportError:  # pragma: no cover - no NVIDIA backend
        return None
    return nv


def direct_launcher(kernel):
    """``go(g0, g1, g2, stream, args)``: launches the compiled ``kernel`` (a Triton ``CompiledKernel``)
    with ``args`` (every argument of its signature, constexprs included, as ``kernel.run`` takes them
    after the hooks) through its compiled C launcher directly; None where the launcher is not one this
    knows (the caller then calls ``kernel.run``)."""
    if not _DIRECT_ON[0]:
        return None
    hit = _DIRECT.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    go = _make_direct(kernel)
    _DIRECT[id(kernel)] = (kernel, go)
    return go


def launcher(kernel):
    """``go(g0, g1, g2, stream, args)`` launching the compiled ``kernel``: Triton's C launcher directly
    where it can (:func:`direct_launcher`), else ``kernel.run`` without launch hooks."""
    go = direct_launcher(kernel)
    if go is not None:
        return go
    run, function, meta = kernel.run, kernel.function, kernel.packed_metadata

    def go(g0, g1, g2, stream, args):
        run(g0, g1, g2, stream, function, meta, None, None, None, *args)

    return go


def _make_direct(kernel):
    nv = _nvidia_driver()
    run = kernel.run
    if nv is None or type(run) is not getattr(nv, "CudaLauncher", None) or \
            getattr(nv, "_BASE_ARGS_FORMAT", None) != _BASE_FORMAT:
        return None
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None  # (scratch is allocated per launch by CudaLauncher.__call__)
        head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                None, None, None)
        c_launch = run.launch
    except AttributeError:
        return None
    # wrap_handle_tensordesc's ``inner`` (a kernel with host descriptors): the C launch, the
    # descriptors' places and metadata are its cells
    code, cells = getattr(c_launch, "__code__", None), getattr(c_launch, "__closure__", None)
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None and cells else {}
    if "tensordesc_indices" not in free:
        def go(g0, g1, g2, stream, args):
            c_launch(g0, g1, g2, stream, *head, *args)

        go.expand, go.expanded = tuple, go
        return go
    c_launch, places, metas = free.get("launcher"), free.get("tensordesc_indices"), free.get("tensordesc_meta")
    if not callable(c_launch) or not places or metas is None:
        return None
    places = sorted(places)
    if len(metas) != len(places):
        return None
    descs = tuple(zip(places, metas, [{} for _ in places]))

    def go(g0, g1, g2, stream, args):
        c_launch(g0, g1, g2, stream, *head, *_expand(args, descs, nv))

    def expanded(g0, g1, g2, stream, args):
        c_launch(g0, g1, g2, stream, *head, *args)

    go.expand, go.expanded = (lambda args: tuple(_expand(args, descs, nv))), expanded
    return go


def kept_launcher(kernel):
    """``(expand, go)`` for a caller that launches the compiled ``kernel`` again and again with the
    same arguments: ``expand(args)`` gives what Triton's C launcher gets for ``args`` (every argument
    of the signature, as :func:`direct_launcher`'s ``go`` takes them; host descriptors encoded,
    tensors as their addresses), for the caller to keep; ``go(g0, g1, g2, stream, expanded)``
    launches it. None where the direct launch is not open (:func:`direct_launcher`)."""
    go = direct_launcher(kernel)
    if go is None:
        return None
    expand = go.expand

    def addresses(args):
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expand(args))

    return addresses, go.expanded


def _expand(args: tuple, descs: tuple, nv) -> list:
    """The arguments with each host tensor descriptor replaced by what Triton's launcher passes for
    it (``make_tensordesc_arg``), encoded once per base address, shape, strides and padding."""
    out, last = [], 0
    for i, meta, maps in descs:
        out.extend(args[last:i])
        d = args[i]
        if meta is None:  # passed as base pointer, shapes and strides (no encoding to keep)
            out.extend(nv.make_tensordesc_arg(d, meta))
        else:
            key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
            arg = maps.get(key)
            if arg is None:
                if len(maps) >= _MAX_MAPS:
                    maps.clear()
                arg = maps[key] = nv.make_tensordesc_arg(d, meta)
            out.extend(arg)
        last = i + 1
    out.extend(args[last:])
    return out


def fast_launch(fn=None, *, volatile: Sequence[str] = ()):
    """Decorator form of :class:`FastLaunch` (above ``@triton.jit``)."""
    if fn is None:
        return lambda f: FastLaunch(f, volatile)
    return FastLaunch(fn, volatile)
