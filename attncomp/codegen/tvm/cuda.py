"""CUDA kernels from the same template, built ahead of time to cubin (any machine with TVM and nvcc).

Kernels per variant (``kind``): ``fwd`` (below, or the sparse tensor-core DFSS kernel of
:mod:`.sparse` for ``mma == "sp"`` variants), ``dkdv`` and ``dq`` (:mod:`.cuda_bwd`); each has its own
cache key and launch metadata.

The CUDA schedule of the forward template: one thread block per (query tile, batch x head), one
thread per query row; each key tile (``BK`` keys) is staged in shared memory by the whole block, then
every thread scores its row against it with the same entry predicate (:func:`.kernels._allowed`),
N:M selection inside the tile, and tile schedule (:func:`.kernels._tile_range`,
:func:`.kernels._tile_visit`) as the CPU kernels, and runs the online softmax in registers.

:func:`build_cubin` generates the TVMScript, lets TVM lower it and emit CUDA C for
``{"kind": "cuda", "arch": ...}``, compiles that with ``nvcc -cubin`` (ptxas) for the arch, and
returns the cubin with its *launch metadata*: the kernel symbol, its parameters in order (each a
tensor data pointer, a shape variable read from a tensor's size, or a scalar argument), grid and block
as functions of the shapes, and the static shared memory. :func:`get_cubin` keeps both in the runtime
disk cache under the key of the source, arch, options and versions; :mod:`attncomp.runtime.cubin`
loads and launches them without TVM.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Dict, List, Optional, Tuple

from . import kernels as K
from .kernels import Variant
from .tiles import CUDA_BLOCK_K, CUDA_BLOCK_Q, cuda_variant

__all__ = ["cuda_forward_source", "build_cubin", "get_cubin", "cubin_key", "launch_meta", "nvcc_version",
           "CUDA_BLOCK_Q", "CUDA_BLOCK_K", "cuda_variant"]


def forward_source(v: Variant) -> str:
    """TVMScript of the CUDA forward kernel of ``v`` (a variant with its CUDA tile sizes): the scalar
    template below, or the sparse tensor-core DFSS kernel (:mod:`.sparse`) when ``v.mma == "sp"``."""
    if v.mma == "sp":
        from .sparse import sp_forward_source

        return sp_forward_source(v, "cuda")
    return cuda_forward_source(v)


#: CUDA kernels per variant: the forward and the two backward kernels (:mod:`.cuda_bwd`)
KINDS = ("fwd", "dkdv", "dq")
_SYMBOL = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}


def kernel_variant(v: Variant, kind: str = "fwd") -> Variant:
    """``v`` with the tile sizes of its CUDA kernel ``kind``."""
    if kind == "fwd":
        return cuda_variant(v)
    from .cuda_bwd import bwd_variant

    return bwd_variant(v, kind)


def kernel_source(v: Variant, kind: str = "fwd") -> str:
    """TVMScript of CUDA kernel ``kind`` of ``v`` (a variant with that kernel's tile sizes)."""
    if kind == "fwd":
        return forward_source(v)
    from .cuda_bwd import bwd_source

    return bwd_source(v, kind, "cuda")


def threads_per_block(v: Variant, kind: str = "fwd") -> int:
    if kind != "fwd":
        from .cuda_bwd import bwd_threads

        return bwd_threads(v, kind)
    if v.mma == "sp":
        from .sparse import SP_THREADS

        return SP_THREADS
    return v.block_q


def cuda_forward_source(v: Variant) -> str:
    BQ, BK, D, Dv, dt = v.block_q, v.block_k, v.head_dim, v.head_dim_v, v.dtype
    ninf = K._neg_inf(v)
    L = K._signature("attn_fwd", K.FWD_ARGS, v)
    L += K._qkv_buffers(v, dt, out=dt) + K._common_buffers(v)
    i1, i2, ind = "        ", "            ", "                "
    L += [f"    for qt in T.thread_binding((Nq + {BQ - 1}) // {BQ}, thread=\"blockIdx.x\"):",
          f"{i1}for bh in T.thread_binding(B * Hq, thread=\"blockIdx.y\"):",
          f"{i2}for tx in T.thread_binding({BQ}, thread=\"threadIdx.x\"):",
          f'{ind}Ks = T.alloc_buffer(({BK}, {D}), "{dt}", scope="shared")',
          f'{ind}Vs = T.alloc_buffer(({BK}, {Dv}), "{dt}", scope="shared")',
          f'{ind}Qr = T.alloc_buffer(({D},), "{dt}", scope="local")',
          f'{ind}S = T.alloc_buffer(({BK},), "{dt}", scope="local")',
          f'{ind}ACC = T.alloc_buffer(({Dv},), "{dt}", scope="local")',
          f'{ind}W = T.alloc_buffer((4,), "{dt}", scope="local")',
          f"{ind}NQT = (Nq + {BQ - 1}) // {BQ}", f"{ind}NKT = (Nk + {BK - 1}) // {BK}", f"{ind}G = Hq // Hk",
          f"{ind}b = bh // Hq", f"{ind}h = bh % Hq", f"{ind}hk = h // G",
          f"{ind}q0 = qt * {BQ}", f"{ind}qi = q0 + tx"]
    if v.dropout:
        L.append(f'{ind}seedm = T.Cast("uint32", seed)')
    if v.policy == "dfss":
        L.append(f'{ind}R = T.alloc_buffer(({BK},), "{dt}", scope="local")')
    L += [f"{ind}for d in range({D}):",
          f"{ind}    Qr[d] = Q[b, h, T.min(qi, Nq - 1), d]",
          f"{ind}W[0] = {ninf}", f"{ind}W[1] = T.{dt}(0)",
          f"{ind}for e in range({Dv}):", f"{ind}    ACC[e] = T.{dt}(0)"]
    L += K._ksum_base(v, ind) + K._query_summary(v, ind) + K._tile_range(v, ind)
    loop, ind2 = K._key_tile_loop(v, ind, BK)
    L += loop
    for buf, src, width in (("Ks", "K", D), ("Vs", "V", Dv)):
        n = BK * width
        L += [f"{ind2}for r in range({-(-n // BQ)}):",
              f"{ind2}    if r * {BQ} + tx < {n}:",
              f"{ind2}        {buf}[(r * {BQ} + tx) // {width}, (r * {BQ} + tx) % {width}] = "
              f"{src}[b, hk, T.min(k0 + (r * {BQ} + tx) // {width}, Nk - 1), (r * {BQ} + tx) % {width}]"]
    L += [f"{ind2}T.tvm_storage_sync(\"shared\")"]
    qc, kc = "T.min(qi, Nq - 1)", "T.min(k0 + j, Nk - 1)"
    conds = K._allowed(v, qc, kc)
    conds[0], conds[1] = "qi < Nq", "k0 + j < Nk"
    val = f"W[2] * T.Cast(\"{dt}\", scale)"
    if v.mask == "float":
        val += f" + MASK[b * m_sb + h * m_sh + {qc} * m_si + {kc} * m_sj]"
    if v.logit_mods:
        val = K.logit(v, "W[2]", qc, kc)
    L += [f"{ind2}for j in range({BK}):",
          f"{ind2}    W[2] = T.{dt}(0)",
          f"{ind2}    for d in range({D}):",
          f"{ind2}        W[2] = W[2] + Qr[d] * Ks[j, d]",
          f"{ind2}    S[j] = T.if_then_else({K._and(conds)}, {val}, {ninf})"]
    if v.policy == "dfss":
        n, m = v.nm_n, v.nm_m
        terms = [f"T.Cast(\"int32\", (S[g0 + {t}] > S[j]) or (S[g0 + {t}] == S[j] and g0 + {t} < j))"
                 for t in range(m)]
        L += [f"{ind2}for j in range({BK}):",
              f"{ind2}    g0 = j - j % {m}",
              f"{ind2}    R[j] = T.if_then_else({' + '.join(terms)} < {n}, S[j], {ninf})",
              f"{ind2}for j in range({BK}):",
              f"{ind2}    S[j] = R[j]"]
    L += [f"{ind2}W[2] = W[0]",
          f"{ind2}for j in range({BK}):",
          f"{ind2}    W[2] = T.max(W[2], S[j])",
          f"{ind2}W[3] = T.if_then_else(W[2] == {ninf}, T.{dt}(0), W[2])",
          f"{ind2}alpha = T.exp(W[0] - W[3])",
          f"{ind2}W[1] = W[1] * alpha",
          f"{ind2}for e in range({Dv}):",
          f"{ind2}    ACC[e] = ACC[e] * alpha",
          f"{ind2}for j in range({BK}):",
          f"{ind2}    p = T.exp(S[j] - W[3])",
          f"{ind2}    W[1] = W[1] + p"]
    pv = "p"
    if v.dropout:
        L += K._dropout_index(ind2 + "    ", "qi", "k0 + j") + K._hash_lines(ind2 + "    ", "du", "dx")
        pv = f"T.if_then_else(du >= drop_p, p, T.{dt}(0))"
    L += [f"{ind2}    pk = {pv}",
          f"{ind2}    for e in range({Dv}):",
          f"{ind2}        ACC[e] = ACC[e] + pk * Vs[j, e]",
          f"{ind2}W[0] = W[2]",
          f"{ind2}T.tvm_storage_sync(\"shared\")"]
    keep = f" * T.Cast(\"{dt}\", inv_keep)" if v.dropout else ""
    if v.sinks:
        L += [f"{ind}if qi < Nq:"] + K.sink_epilogue(v, ind + "    ", "W[0]", "W[1]", "W[2]", "LSE[b, h, qi]", keep)
        L += [f"{ind}    for e in range({Dv}):", f"{ind}        O[b, h, qi, e] = ACC[e] * W[2]"]
        return "\n".join(L) + "\n"
    L += [f"{ind}if qi < Nq:",
          f"{ind}    W[2] = T.if_then_else(W[1] > T.{dt}(0), T.{dt}(1) / W[1], T.{dt}(0)){keep}",
          f"{ind}    for e in range({Dv}):",
          f"{ind}        O[b, h, qi, e] = ACC[e] * W[2]",
          f"{ind}    LSE[b, h, qi] = T.if_then_else(W[1] > T.{dt}(0), "
          f"T.Cast(\"{dt}\", W[0] + T.log(W[1])), T.{dt}(\"-inf\"))"]
    return "\n".join(L) + "\n"


# ---------------------------------------------------------------------------------------------
# Launch metadata: what a loader without TVM needs.

_MATCH = re.compile(r"^\s*(\w+) = T\.match_buffer\((\w+), \(([^)]*)\), \"(\w+)\"\)", re.M)
_KERNEL_SIG = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\(([^)]*)\)\s*\{')
_SHARED = re.compile(r"__shared__ (?:alignas\(\d+\) )?(\w+) \w+\[(\d+)\]")
_CSIZE = {"float": 4, "double": 8, "half": 2, "nv_bfloat16": 2, "__nv_bfloat16": 2, "int": 4, "uint": 4,
          "signed char": 1, "uchar": 1, "unsigned char": 1}


def _buffers(tvmscript: str) -> Dict[str, dict]:
    """``{buffer name: {"arg": kernel argument, "shape": [...], "dtype": ...}}`` of the source."""
    out = {}
    for name, arg, shape, dtype in _MATCH.findall(tvmscript):
        out[name] = {"arg": arg, "shape": [s.strip() for s in shape.split(",") if s.strip()], "dtype": dtype}
    return out


def launch_meta(tvmscript: str, cuda_src: str, v: Variant, arch: str, kind: str = "fwd") -> dict:
    """Parameters (in the kernel's order), grid, block and shared memory of the generated kernel."""
    m = _KERNEL_SIG.search(cuda_src)
    if m is None:
        raise RuntimeError("no __global__ kernel in the CUDA source TVM generated")
    bufs = _buffers(tvmscript)
    shape_vars: Dict[str, Tuple[str, int]] = {}
    for b in bufs.values():
        for i, s in enumerate(b["shape"]):
            if re.fullmatch(r"[A-Za-z_]\w*", s) and s not in shape_vars:
                shape_vars[s] = (b["arg"], i)
    scalars = {n: k for n, k in K._extra_args(v) if k != "handle"}
    params = []
    for raw in m.group(3).split(","):
        raw = raw.strip()
        name = raw.split()[-1]
        ctype = " ".join(raw.split()[:-1]).replace("__restrict__", "").strip()
        if ctype.endswith("*"):
            buf = name[:-4] if name.endswith("_ptr") else name
            if buf not in bufs:
                raise RuntimeError(f"kernel parameter {name!r} is no buffer of the source")
            params.append({"name": name, "kind": "pointer", "arg": bufs[buf]["arg"], "ctype": ctype})
        elif name in scalars:
            params.append({"name": name, "kind": "scalar", "arg": name, "ctype": ctype})
        elif name in shape_vars:
            arg, dim = shape_vars[name]
            params.append({"name": name, "kind": "shape", "arg": arg, "dim": dim, "ctype": ctype})
        else:
            raise RuntimeError(f"kernel parameter {name!r} ({ctype}) cannot be derived")
    shared = sum(int(n) * _CSIZE.get(t, 4) for t, n in _SHARED.findall(cuda_src))
    if kind == "fwd":
        # grid.x = ceil(Nq / block_q), grid.y = B * Hq
        grid = [["cdiv", ["shape", "q", 2], v.block_q], ["mul", ["shape", "q", 0], ["shape", "q", 1]], 1]
    else:
        from .cuda_bwd import bwd_grid

        grid = bwd_grid(v, kind)
    return {
        "symbol": m.group(2),
        "arch": arch,
        "params": params,
        "grid": grid,
        "block": [threads_per_block(v, kind), 1, 1],
        "kind": kind,
        "shared_mem": shared,
        "block_k": v.block_k,
        "variant": v.to_json(),
    }


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "none"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"


def _nvcc_cubin(cuda_src: str, arch: str) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not installed: CUDA kernels cannot be built on this machine")
    with tempfile.TemporaryDirectory(prefix="attncomp-cuda-") as d:
        src, out = os.path.join(d, "kernel.cu"), os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(cuda_src)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-o", out, src]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{r.stderr[-4000:]}")
        with open(out, "rb") as f:
            return f.read()


def build_cubin(v: Variant, arch: str = "sm_90", kind: str = "fwd") -> Tuple[bytes, dict, str]:
    """``(cubin, launch metadata, CUDA source)`` of CUDA kernel ``kind`` (fwd | dkdv | dq) of ``v``
    for ``arch``."""
    import tvm
    import tvm.script
    from tvm.script import tirx as T

    v = kernel_variant(v, kind)
    script = kernel_source(v, kind)
    func = tvm.script.from_source(script, extra_vars={"T": T})
    # no host-side common subexpressions: every kernel parameter must be a buffer, a shape or an
    # argument, so that a loader without TVM can compute it
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        lib = tvm.compile(tvm.IRModule({_SYMBOL[kind]: func}), target={"kind": "cuda", "arch": arch})
    dev = lib.mod.imports[0]
    cuda_src = dev.inspect_source()
    cubin = _nvcc_cubin(cuda_src, arch)
    meta = launch_meta(script, cuda_src, v, arch, kind)
    meta["cubin_sha256"] = hashlib.sha256(cubin).hexdigest()
    return cubin, meta, cuda_src


def cubin_key(v: Variant, arch: str, kind: str = "fwd") -> str:
    """Cache key of the cubin of kernel ``kind`` of ``v`` for ``arch`` (computable without TVM: the
    loader uses it)."""
    import base64

    from ..._version import __version__
    from ...runtime.cache import CACHE_FORMAT

    v = kernel_variant(v, kind)
    # the GPU machine that loads the artefact runs another torch (and no TVM): the key holds only what
    # changes the cubin or how it is launched, never the loading machine's library versions
    ident = {"backend": "tvm-cuda", "kind": kind, "source": kernel_source(v, kind), "arch": str(arch),
             "kernel_version": K.KERNEL_VERSION, "attncomp": __version__, "format": CACHE_FORMAT}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()
    return base64.b32encode(digest).decode().rstrip("=")


def get_cubin(v: Variant, arch: str, build: bool = True, kind: str = "fwd") -> Optional[Tuple[bytes, dict]]:
    """The cached ``(cubin, metadata)`` of kernel ``kind`` of ``v`` for ``arch``; built and stored when
    missing and ``build`` (needs TVM and nvcc), else ``None``."""
    from ...runtime.cache import default_cache

    store = default_cache()
    key = cubin_key(v, arch, kind)
    cubin, meta = store.get(key, "kernel.cubin"), store.get_json(key, "launch.json")
    if cubin is not None and meta is not None:
        return cubin, meta
    if not build:
        return None
    cubin, meta, _ = build_cubin(v, arch, kind)
    store.put(key, "kernel.cubin", cubin)
    store.put_json(key, "launch.json", meta)
    return cubin, meta


def artefact_names(v: Variant, arch: str, kind: str = "fwd") -> List[str]:
    """``<cache key>/<file>`` names of the artefacts of ``v`` (what a package carries)."""
    key = cubin_key(v, arch, kind)
    return [f"{key}/kernel.cubin", f"{key}/launch.json"]


def dumps(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, indent=1)
