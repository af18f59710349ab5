"""Compile the generated TIR kernels with apache-tvm and keep the results in the runtime's disk cache.

CPU (``llvm``) kernels become shared libraries (``kernel.so``) stored under the cache key of their
source text, the target, the TVM version and the usual attncomp/torch versions; a second process (or a
test worker) loads the library instead of compiling again. Within a process, loaded functions are
memoised per key. ``tvm`` is imported only here and only when a kernel is first built.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import tempfile
import threading
from typing import Any, Callable, Dict, Tuple

from ...runtime import cache as _cache
from . import kernels

log = logging.getLogger(__name__)

__all__ = ["tvm_available", "tvm_version", "llvm_target", "get_kernel", "kernel_source", "counters"]

#: per-process counters: compiled kernels and in-memory / disk hits (tests read them)
counters: Dict[str, int] = {"compiled": 0, "memory_hits": 0, "disk_hits": 0}

_loaded: Dict[str, Callable] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def tvm_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("tvm") is not None
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def tvm_version() -> str:
    try:
        from importlib.metadata import version

        return version("apache-tvm")
    except Exception:
        import tvm

        return str(tvm.__version__)


@functools.lru_cache(maxsize=None)
def llvm_target() -> Dict[str, str]:
    """The host CPU as a TVM ``llvm`` target (JSON-dict form). ``ATTNCOMP_TVM_MCPU`` overrides the CPU
    name (e.g. ``generic`` for artefacts meant for other machines)."""
    mcpu = os.environ.get("ATTNCOMP_TVM_MCPU")
    if not mcpu:
        from tvm.target import codegen

        mcpu = str(codegen.llvm_get_system_cpu())
    arch = platform.machine() or "x86_64"
    triple = f"{arch}-linux-gnu" if platform.system() == "Linux" else str(__import__("tvm").target.codegen
                                                                           .llvm_get_system_triple())
    return {"kind": "llvm", "mtriple": triple, "mcpu": mcpu}


def _sp_emulated(variant: kernels.Variant) -> str:
    from .sparse import sp_forward_source

    return sp_forward_source(variant, "llvm")


def _cuda_bwd_on_cpu(kind: str):
    def source(variant: kernels.Variant) -> str:
        from .cuda_bwd import bwd_source

        return bwd_source(variant, kind, "llvm")
    return source


# fwd_sp_emu: the sparse tensor-core DFSS forward built for the CPU with emulated warp instructions;
# dkdv_cuda / dq_cuda: the CUDA backward kernels' schedule built for the CPU
_SOURCES = {"fwd": kernels.forward_source, "dkdv": kernels.dkdv_source, "dq": kernels.dq_source,
            "fwd_sp_emu": _sp_emulated, "dkdv_cuda": _cuda_bwd_on_cpu("dkdv"), "dq_cuda": _cuda_bwd_on_cpu("dq")}
_SYMBOLS = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq", "fwd_sp_emu": "attn_fwd",
            "dkdv_cuda": "attn_bwd_dkdv", "dq_cuda": "attn_bwd_dq"}


def kernel_source(kind: str, variant: kernels.Variant) -> str:
    return _SOURCES[kind](variant)


def _parse(source: str):
    import tvm.script
    from tvm.script import tirx as T

    return tvm.script.from_source(source, extra_vars={"T": T})


def compile_llvm(kind: str, variant: kernels.Variant, path: str) -> None:
    """Compile one kernel for the host CPU into the shared library ``path``."""
    import tvm

    func = _parse(kernel_source(kind, variant))
    lib = tvm.compile(tvm.IRModule({_SYMBOLS[kind]: func}), target=llvm_target())
    lib.export_library(path)
    counters["compiled"] += 1


def _key(kind: str, variant: kernels.Variant) -> str:
    return _cache.cache_key(backend="tvm", kind=kind, source=kernel_source(kind, variant),
                            target=llvm_target(), tvm=tvm_version(), arch="cpu")


def get_kernel(kind: str, variant: kernels.Variant) -> Callable:
    """The packed function of a compiled kernel (``kind``: fwd | dkdv | dq), built once per process
    and stored in the disk cache."""
    memo = (kind, variant)
    fn = _loaded.get(memo)  # type: ignore[arg-type]
    if fn is not None:
        counters["memory_hits"] += 1
        return fn
    with _lock:
        fn = _loaded.get(memo)  # type: ignore[arg-type]
        if fn is None:
            fn = _load(kind, variant)
            _loaded[memo] = fn  # type: ignore[index]
    return fn


def _threads() -> None:
    """TVM's CPU thread pool takes as many threads as torch's intra-op pool (TVM's own count is the
    physical cores it detects, which on small or containerised machines can be 1). The pool is built
    on the first parallel launch; ``TVM_NUM_THREADS`` set by the user wins."""
    if "TVM_NUM_THREADS" not in os.environ:
        import torch

        os.environ["TVM_NUM_THREADS"] = str(max(1, torch.get_num_threads()))


def _load(kind: str, variant: kernels.Variant) -> Callable:
    _threads()
    import tvm

    store = _cache.default_cache()
    key = _key(kind, variant)
    name = "kernel.so"
    if store.enabled:
        built = []

        def build() -> bytes:
            built.append(True)
            with tempfile.TemporaryDirectory(prefix="attncomp-tvm-") as d:
                p = os.path.join(d, name)
                compile_llvm(kind, variant, p)
                with open(p, "rb") as f:
                    return f.read()

        store.get_or_build(key, name, build)
        if not built:
            counters["disk_hits"] += 1
        path = store.get_file(key, name)
        if path is not None:
            return tvm.runtime.load_module(str(path))[_SYMBOLS[kind]]
        log.warning("attncomp: TVM kernel cache entry unusable; compiling in a temporary folder")
    d = tempfile.mkdtemp(prefix="attncomp-tvm-")
    p = os.path.join(d, name)
    compile_llvm(kind, variant, p)
    return tvm.runtime.load_module(p)[_SYMBOLS[kind]]


def clear_memory() -> None:
    """Forget loaded kernels (tests use it to exercise the disk cache)."""
    with _lock:
        _loaded.clear()


def describe() -> Tuple[Any, ...]:
    return (tvm_version(), llvm_target())
