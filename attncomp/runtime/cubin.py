"""Load and launch prebuilt CUDA kernels (cubin + launch metadata) without TVM.

The TVM backend builds its CUDA kernels ahead of time on any machine with TVM and nvcc
(``python -m attncomp build-kernels``); the artefacts live in the runtime disk cache (and travel inside
exported packages or a folder). A GPU machine runs them through NVIDIA's ``cuda.bindings`` driver API,
an optional dependency like TVM itself, on torch's current stream (no device synchronisation, so
calls can be captured in CUDA graphs).

Metadata (``launch.json``, written by :func:`attncomp.codegen.tvm.cuda.launch_meta`)::

    {"symbol": "attn_fwd_kernel", "arch": "sm_90", "cubin_sha256": "...",
     "params": [{"name": "K_ptr", "kind": "pointer", "arg": "k", "ctype": "float*"},
                {"name": "Nq", "kind": "shape", "arg": "q", "dim": 2, "ctype": "int"},
                {"name": "scale", "kind": "scalar", "arg": "scale", "ctype": "float"}, ...],
     "grid": [["cdiv", ["shape", "q", 2], 64], ["mul", ["shape", "q", 0], ["shape", "q", 1]], 1],
     "block": [64, 1, 1], "shared_mem": 16384}

Everything up to the driver call (metadata checks, argument packing, grid arithmetic, the cubin's
checksum) is plain Python and tested on CPU machines; :meth:`CubinKernel.launch` is the one place
that needs a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["CubinKernel", "ArtefactError", "pack_arguments", "launch_dims", "import_folder", "export_folder",
           "cuda_bindings_available", "artefacts_for_specs"]

_CTYPES = {
    "int": ctypes.c_int32, "int32_t": ctypes.c_int32, "unsigned int": ctypes.c_uint32, "uint": ctypes.c_uint32,
    "long long": ctypes.c_int64, "int64_t": ctypes.c_int64, "unsigned long long": ctypes.c_uint64,
    "float": ctypes.c_float, "double": ctypes.c_double,
}
_POINTER = re.compile(r"^[A-Za-z_][\w ]*\*$")
_ELF = b"\x7fELF"


class ArtefactError(RuntimeError):
    """A kernel artefact that cannot be used: missing, tampered, malformed or for another GPU."""


def cuda_bindings_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


def _check_meta(meta: Any) -> dict:
    if not isinstance(meta, dict):
        raise ArtefactError("launch metadata is not a JSON object")
    for key in ("symbol", "params", "grid", "block", "shared_mem", "cubin_sha256"):
        if key not in meta:
            raise ArtefactError(f"launch metadata lacks {key!r}")
    if not re.fullmatch(r"[A-Za-z_]\w{0,255}", str(meta["symbol"])):
        raise ArtefactError(f"bad kernel symbol {meta['symbol']!r}")
    if not isinstance(meta["params"], list):
        raise ArtefactError("launch metadata 'params' is not a list")
    for p in meta["params"]:
        if not isinstance(p, dict) or p.get("kind") not in ("pointer", "shape", "scalar"):
            raise ArtefactError(f"bad kernel parameter record {p!r}")
        ct = str(p.get("ctype", ""))
        if p["kind"] == "pointer" and not _POINTER.match(ct):
            raise ArtefactError(f"parameter {p.get('name')!r}: {ct!r} is not a pointer type")
        if p["kind"] != "pointer" and ct not in _CTYPES:
            raise ArtefactError(f"parameter {p.get('name')!r}: unsupported C type {ct!r}")
    if not (isinstance(meta["block"], list) and len(meta["block"]) == 3
            and all(isinstance(b, int) and b > 0 for b in meta["block"])):
        raise ArtefactError(f"bad block {meta['block']!r}")
    if not (isinstance(meta["grid"], list) and len(meta["grid"]) == 3):
        raise ArtefactError(f"bad grid {meta['grid']!r}")
    if not isinstance(meta["shared_mem"], int) or not 0 <= meta["shared_mem"] <= 228 * 1024:
        raise ArtefactError(f"bad shared memory size {meta['shared_mem']!r}")
    return meta


def _eval_dim(expr: Any, tensors: Mapping[str, Any]) -> int:
    """A grid dimension: an int, ``["shape", arg, dim]``, ``["mul", a, b]`` or ``["cdiv", a, b]``."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        return expr
    if isinstance(expr, list) and expr and expr[0] == "shape" and len(expr) == 3:
        t = tensors.get(expr[1])
        if t is None:
            raise ArtefactError(f"grid needs tensor {expr[1]!r}, not given")
        return int(t.shape[int(expr[2])])
    if isinstance(expr, list) and len(expr) == 3 and expr[0] in ("mul", "cdiv"):
        a, b = _eval_dim(expr[1], tensors), _eval_dim(expr[2], tensors)
        return a * b if expr[0] == "mul" else -(-a // b)
    raise ArtefactError(f"bad grid expression {expr!r}")


def launch_dims(meta: dict, tensors: Mapping[str, Any]) -> Tuple[Tuple[int, int, int], Tuple[int, int, int], int]:
    """``(grid, block, shared memory bytes)`` of a launch on these tensors."""
    grid = tuple(_eval_dim(g, tensors) for g in meta["grid"])
    if any(g <= 0 or g >= 2 ** 31 for g in grid) or grid[1] > 65535 or grid[2] > 65535:
        raise ArtefactError(f"grid {grid} is out of the CUDA limits")
    return grid, tuple(meta["block"]), int(meta["shared_mem"])  # type: ignore[return-value]


def pack_arguments(meta: dict, tensors: Mapping[str, Any], scalars: Mapping[str, Union[int, float]]) -> List[Any]:
    """The kernel's arguments as ctypes values, in the order of ``meta["params"]``.

    Pointers are the tensors' ``data_ptr()`` (each tensor must be contiguous); shapes are read from
    the tensors; scalars come from ``scalars``. Raises :class:`ArtefactError` naming what is missing.
    """
    out: List[Any] = []
    for p in meta["params"]:
        kind, arg, name = p["kind"], p["arg"], p.get("name")
        if kind == "pointer":
            t = tensors.get(arg)
            if t is None:
                raise ArtefactError(f"kernel parameter {name!r} needs tensor {arg!r}, not given")
            if not t.is_contiguous():
                raise ArtefactError(f"tensor {arg!r} must be contiguous for the kernel")
            out.append(ctypes.c_void_p(int(t.data_ptr())))
        elif kind == "shape":
            t = tensors.get(arg)
            if t is None:
                raise ArtefactError(f"kernel parameter {name!r} needs the shape of {arg!r}, not given")
            out.append(_CTYPES[p["ctype"]](int(t.shape[int(p["dim"])])))
        else:
            if arg not in scalars:
                raise ArtefactError(f"kernel parameter {name!r} needs scalar {arg!r}, not given")
            out.append(_CTYPES[p["ctype"]](scalars[arg]))
    return out


def _param_array(args: Sequence[Any]):
    """``void*[]`` pointing at each argument (the ``kernelParams`` of ``cuLaunchKernel``)."""
    arr = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    return arr


class CubinKernel:
    """One cubin and its launch metadata; verified at construction, loaded on first launch per device."""

    def __init__(self, cubin: bytes, meta: Union[dict, str, bytes]):
        if isinstance(meta, (str, bytes)):
            try:
                meta = json.loads(meta)
            except ValueError as e:
                raise ArtefactError(f"launch metadata is not JSON: {e}") from None
        self.meta = _check_meta(meta)
        if not isinstance(cubin, (bytes, bytearray)) or not bytes(cubin[:4]) == _ELF:
            raise ArtefactError("the kernel artefact is not a cubin (ELF)")
        if hashlib.sha256(bytes(cubin)).hexdigest() != self.meta["cubin_sha256"]:
            raise ArtefactError("the cubin does not match the checksum in its launch metadata (tampered or "
                                "mixed-up artefact); rebuild it with `python -m attncomp build-kernels`")
        self.cubin = bytes(cubin)
        self._functions: Dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def arch(self) -> str:
        return str(self.meta.get("arch", "?"))

    def prepare(self, tensors: Mapping[str, Any], scalars: Mapping[str, Union[int, float]]):
        """``(grid, block, shared, args)``: everything the launch needs, computed on the host."""
        grid, block, shared = launch_dims(self.meta, tensors)
        return grid, block, shared, pack_arguments(self.meta, tensors, scalars)

    def _function(self, device_index: int):
        from cuda.bindings import driver

        with self._lock:
            fn = self._functions.get(device_index)
            if fn is None:
                err, mod = driver.cuModuleLoadData(self.cubin)
                _check(err, "cuModuleLoadData", self.arch)
                err, fn = driver.cuModuleGetFunction(mod, self.meta["symbol"].encode())
                _check(err, "cuModuleGetFunction", self.arch)
                shared = int(self.meta["shared_mem"])
                if shared > 48 * 1024:
                    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    _check(driver.cuFuncSetAttribute(fn, attr, shared)[0], "cuFuncSetAttribute", self.arch)
                self._functions[device_index] = (mod, fn)
            return self._functions[device_index][1]

    def launch(self, tensors: Mapping[str, Any], scalars: Mapping[str, Union[int, float]], stream: Optional[int] = None):
        """Launch on torch's current stream of the tensors' device (or the given stream handle)."""
        import torch
        from cuda.bindings import driver

        grid, block, shared, args = self.prepare(tensors, scalars)
        dev = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
        with torch.cuda.device(dev):
            torch.cuda.init()
            fn = self._function(dev.index or 0)
            s = torch.cuda.current_stream(dev).cuda_stream if stream is None else stream
            params = _param_array(args)
            # static shared memory is part of the cubin: only the dynamic part is passed
            err = driver.cuLaunchKernel(fn, *grid, *block, 0, s, ctypes.addressof(params), 0)[0]
            _check(err, "cuLaunchKernel", self.arch)


def _check(err, what: str, arch: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise ArtefactError(f"{what} failed ({err}); the kernel was built for {arch}")


# ---------------------------------------------------------------------------------------------
# Folders of artefacts (what a GPU machine receives when it cannot receive a package)

_KEY = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
_NAMES = ("kernel.cubin", "launch.json")


def export_folder(folder: Union[str, os.PathLike], keys: Sequence[str], store=None) -> int:
    """Copy the artefacts of ``keys`` from the cache into ``folder/<key>/``; returns how many."""
    from .cache import atomic_write, default_cache

    store = store or default_cache()
    n = 0
    for key in keys:
        for name in _NAMES:
            data = store.get(key, name)
            if data is None:
                raise ArtefactError(f"no artefact {key}/{name} in the cache")
            p = Path(folder) / key / name
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, data)
        n += 1
    return n


def import_folder(folder: Union[str, os.PathLike], store=None) -> int:
    """Put every verified ``<key>/kernel.cubin`` + ``launch.json`` of ``folder`` into the cache."""
    from .cache import default_cache

    store = store or default_cache()
    n = 0
    for d in sorted(Path(folder).iterdir()):
        if not (d.is_dir() and _KEY.match(d.name)):
            continue
        cubin, meta = (d / "kernel.cubin"), (d / "launch.json")
        if not (cubin.is_file() and meta.is_file()):
            continue
        CubinKernel(cubin.read_bytes(), meta.read_bytes())  # refuses tampered or malformed artefacts
        store.put(d.name, "kernel.cubin", cubin.read_bytes())
        store.put(d.name, "launch.json", meta.read_bytes())
        n += 1
    return n


def _spec_matches(variant: dict, spec) -> bool:
    pol = "dense" if spec.policy.name == "et" else spec.policy.name
    return (variant.get("policy") == pol and bool(variant.get("causal")) == bool(spec.causal)
            and variant.get("mask") == spec.mask_kind
            and (spec.head_dim is None or variant.get("head_dim") == spec.head_dim)
            and variant.get("window_left") == getattr(spec, "window_left", None)
            and variant.get("window_right") == getattr(spec, "window_right", None))


def artefacts_for_specs(specs, store=None) -> Dict[str, bytes]:
    """``{"<key>/<file>": bytes}`` of every cached forward cubin whose kernel variant serves one of
    ``specs`` (what a package of those sites carries to a GPU machine: loaded packages run inference,
    so backward kernels stay behind)."""
    from .cache import default_cache

    store = store or default_cache()
    root = Path(store.root)
    out: Dict[str, bytes] = {}
    if not specs or not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not (d.is_dir() and _KEY.match(d.name) and (d / "launch.json").exists()):
            continue
        meta = store.get_json(d.name, "launch.json")
        cubin = store.get(d.name, "kernel.cubin")
        if not isinstance(meta, dict) or cubin is None or not isinstance(meta.get("variant"), dict):
            continue
        if meta.get("kind", "fwd") != "fwd":
            continue
        if any(_spec_matches(meta["variant"], sp) for sp in specs):
            out[f"{d.name}/kernel.cubin"] = cubin
            out[f"{d.name}/launch.json"] = json.dumps(meta, sort_keys=True).encode()
    return out
