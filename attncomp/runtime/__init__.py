"""Runtime: backend dispatch, the on-disk kernel cache and autotune store, and the AOT package format."""

import importlib as _importlib

#: reached as attributes (``attncomp.runtime.cubin.import_folder``) after ``import attncomp``, imported
#: on first use
_MODULES = ("autotune", "cache", "choice_tables", "cubin", "dispatch", "env", "package", "progress")


def __getattr__(name):
    if name in _MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_MODULES))
