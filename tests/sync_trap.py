"""A trap for device->host synchronisation in attncomp's host code (DESIGN.md §6, issue 17).

``with sync_trap():`` fails a test when attncomp code (a frame whose file lies in the ``attncomp``
package) does anything that needs tensor *data* on the host, on any device, CPU included:

* aten ops that read data or give data-dependent shapes: ``_local_scalar_dense`` (``.item()``,
  ``bool(t)``, ``int(t)``), ``nonzero``, ``unique*``, ``masked_select``, ``index`` / ``index_put``
  with bool indices, ``repeat_interleave`` with tensor repeats, ``_assert_async`` is allowed (it runs
  on the device);
* the tensor methods ``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__int__``,
  ``__float__``, ``__index__``.

Test code itself may use them freely (only attncomp frames are checked). ``allow`` names functions
(``"module_suffix:function"`` or just ``"function"``) whose calls are known not to touch device
memory, e.g. a seed drawn from torch's CPU generator. On a GPU, the same test body can run under
``torch.cuda.set_sync_debug_mode("error")`` instead (tests/codegen GPU tests).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attncomp

__all__ = ["sync_trap", "SyncError", "SyncTrap"]

_PKG = os.path.dirname(os.path.abspath(attncomp.__file__)) + os.sep

aten = torch.ops.aten

_BANNED = {
    aten._local_scalar_dense, aten.nonzero, aten.nonzero_static, aten.masked_select, aten.unique_consecutive,
    aten.unique_dim, aten._unique, aten._unique2, aten.unique_dim_consecutive, aten.argwhere,
}
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class SyncError(AssertionError):
    """attncomp host code read tensor data on the host."""


def _attncomp_frame(allow: Iterable[str]):
    """The innermost attncomp frame on the stack (``file:line function``), or None if none, or if an
    allowed function is on the stack."""
    f = sys._getframe(2)
    hit = None
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG):
            name = f.f_code.co_name
            mod = fn[len(_PKG):]
            for a in allow:
                m, _, func = a.rpartition(":")
                if func == name and (not m or mod.endswith(m)):
                    return None
            if hit is None:
                hit = f"attncomp/{mod}:{f.f_lineno} in {name}"
        f = f.f_back
    return hit


def _has_bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    if isinstance(idx, (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx)
    return False


class SyncTrap(TorchDispatchMode):
    """The dispatch-mode half of :func:`sync_trap` (records every violation in ``self.errors``)."""

    def __init__(self, allow: Iterable[str] = ()):
        super().__init__()
        self.allow = tuple(allow)
        self.errors: List[str] = []
        self.seen_ops: set = set()

    def _fail(self, what: str) -> None:
        where = _attncomp_frame(self.allow)
        if where is not None:
            msg = f"{what} from {where}"
            self.errors.append(msg)
            raise SyncError(f"host sync in attncomp code: {msg}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        self.seen_ops.add(str(packet))
        if packet in _BANNED or str(packet).startswith("aten.unique"):
            self._fail(str(func))
        elif packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) and _has_bool_index(args):
            self._fail(f"{func} with a bool index")
        elif packet is aten.repeat_interleave and args and isinstance(args[0], torch.Tensor) and \
                not args[0].is_floating_point() and len(args) == 1:
            self._fail(f"{func} with tensor repeats")
        if func.namespace == "attncomp":
            impl = _python_kernel(func, args)
            if impl is not None:
                # a custom op's kernel would run below this mode: run its Python body under the trap
                with self:
                    return impl(*args, **kwargs)
        return func(*args, **kwargs)


def _python_kernel(func, args):
    """The Python function behind a ``torch.library.custom_op`` for the inputs' device, or None."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:
        return None
    opdef = _maybe_get_opdef(func)
    if opdef is None:
        return None
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    return opdef._backend_fns.get(dev) or opdef._init_fn


@contextlib.contextmanager
def sync_trap(allow: Iterable[str] = ()):
    """Fail on host reads of tensor data from attncomp code inside the block (see module docstring).
    Yields the :class:`SyncTrap` (``.seen_ops`` lists the ops that ran)."""
    mode = SyncTrap(allow)
    saved = {m: getattr(torch.Tensor, m) for m in _METHODS}

    def wrap(name, orig):
        def method(self, *a, **kw):
            mode._fail(f"Tensor.{name}()")
            return orig(self, *a, **kw)
        method.__name__ = name
        return method

    for m, orig in saved.items():
        setattr(torch.Tensor, m, wrap(m, orig))
    try:
        with mode:
            yield mode
    finally:
        for m, orig in saved.items():
            setattr(torch.Tensor, m, orig)
