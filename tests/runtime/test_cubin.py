"""The cubin loader up to the driver call: metadata checks, argument packing, grid arithmetic, the
artefact checksum, folders and the cache round trip (no GPU needed; the launch itself is tested by
tests/codegen/test_tvm_gpu.py on a GPU machine)."""

from __future__ import annotations

import ctypes
import hashlib
import json

import pytest
import torch

from attncomp.runtime.cache import DiskCache
from attncomp.runtime.cubin import (ArtefactError, CubinKernel, export_folder, import_folder, launch_dims,
                                    pack_arguments)


def _fake(nbytes=256, **over):
    cubin = b"\x7fELF" + bytes(range(256))[: nbytes - 4]
    meta = {
        "symbol": "attn_fwd_kernel", "arch": "sm_90", "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
        "params": [
            {"name": "K_ptr", "kind": "pointer", "arg": "k", "ctype": "float*"},
            {"name": "O_ptr", "kind": "pointer", "arg": "o", "ctype": "float*"},
            {"name": "B", "kind": "shape", "arg": "q", "dim": 0, "ctype": "int"},
            {"name": "Nk", "kind": "shape", "arg": "k", "dim": 2, "ctype": "int"},
            {"name": "scale", "kind": "scalar", "arg": "scale", "ctype": "float"},
            {"name": "seed", "kind": "scalar", "arg": "seed", "ctype": "long long"},
        ],
        "grid": [["cdiv", ["shape", "q", 2], 64], ["mul", ["shape", "q", 0], ["shape", "q", 1]], 1],
        "block": [64, 1, 1], "shared_mem": 16384,
    }
    meta.update(over)
    return cubin, meta


def _tensors():
    return {"q": torch.empty(3, 5, 130, 64), "k": torch.empty(3, 5, 77, 64), "o": torch.empty(3, 5, 130, 64)}


def test_arguments_are_packed_in_the_kernels_order():
    cubin, meta = _fake()
    k = CubinKernel(cubin, meta)
    t = _tensors()
    grid, block, shared, args = k.prepare(t, {"scale": 0.125, "seed": 2 ** 40 + 3})
    assert grid == (3, 15, 1) and block == (64, 1, 1) and shared == 16384
    assert [type(a) for a in args] == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                       ctypes.c_float, ctypes.c_int64]
    assert args[0].value == t["k"].data_ptr() and args[1].value == t["o"].data_ptr()
    assert (args[2].value, args[3].value, args[4].value, args[5].value) == (3, 77, 0.125, 2 ** 40 + 3)


def test_missing_or_bad_arguments_are_named():
    cubin, meta = _fake()
    t = _tensors()
    with pytest.raises(ArtefactError, match="needs scalar 'seed'"):
        pack_arguments(meta, t, {"scale": 1.0})
    with pytest.raises(ArtefactError, match="needs tensor 'k'"):
        pack_arguments(meta, {"q": t["q"], "o": t["o"]}, {"scale": 1.0, "seed": 0})
    with pytest.raises(ArtefactError, match="contiguous"):
        pack_arguments(meta, dict(t, k=t["k"].transpose(1, 2)), {"scale": 1.0, "seed": 0})
    with pytest.raises(ArtefactError, match="CUDA limits"):
        launch_dims(meta, {"q": torch.empty(1, 70000, 1, 1)})


def test_tampered_or_malformed_artefacts_are_refused():
    cubin, meta = _fake()
    bad = bytearray(cubin)
    bad[100] ^= 1
    with pytest.raises(ArtefactError, match="checksum"):
        CubinKernel(bytes(bad), meta)
    with pytest.raises(ArtefactError, match="not a cubin"):
        CubinKernel(b"#!/bin/sh\n" + cubin, dict(meta, cubin_sha256=hashlib.sha256(b"#!/bin/sh\n" + cubin).hexdigest()))
    for change, msg in [({"symbol": "x; rm -rf"}, "bad kernel symbol"), ({"block": [0, 1, 1]}, "bad block"),
                        ({"shared_mem": 10 ** 9}, "shared memory"),
                        ({"params": [{"name": "a", "kind": "pointer", "arg": "q", "ctype": "int"}]}, "not a pointer"),
                        ({"params": [{"name": "a", "kind": "scalar", "arg": "s", "ctype": "char*"}]}, "C type")]:
        with pytest.raises(ArtefactError, match=msg):
            CubinKernel(cubin, dict(meta, **change))
    with pytest.raises(ArtefactError, match="lacks 'grid'"):
        CubinKernel(cubin, {k: v for k, v in meta.items() if k != "grid"})
    with pytest.raises(ArtefactError, match="not JSON"):
        CubinKernel(cubin, b"\x80not json")


def test_folder_and_cache_round_trip(tmp_path):
    cubin, meta = _fake()
    src = DiskCache(tmp_path / "a")
    key = "A" * 52
    src.put(key, "kernel.cubin", cubin)
    src.put_json(key, "launch.json", meta)
    assert export_folder(tmp_path / "f", [key], store=src) == 1
    dst = DiskCache(tmp_path / "b")
    assert import_folder(tmp_path / "f", store=dst) == 1
    k = CubinKernel(dst.get(key, "kernel.cubin"), dst.get_json(key, "launch.json"))
    assert k.meta == meta
    # a tampered cubin in a folder is refused before it reaches the cache
    (tmp_path / "f" / key / "kernel.cubin").write_bytes(cubin[:-1] + b"\x00")
    dst2 = DiskCache(tmp_path / "c")
    with pytest.raises(ArtefactError, match="checksum"):
        import_folder(tmp_path / "f", store=dst2)
    assert dst2.get(key, "kernel.cubin") is None
    with pytest.raises(ArtefactError, match="no artefact"):
        export_folder(tmp_path / "g", ["B" * 52], store=src)


def test_real_cubin_metadata_packs(tmp_path, monkeypatch):
    """A cubin the TVM backend built (TVM + nvcc): its metadata packs the arguments of a real call."""
    pytest.importorskip("tvm")
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from attncomp.codegen.tvm import backend as TB
    from attncomp.codegen.tvm import cuda
    from attncomp.policy import DFSS
    from attncomp.spec import AttentionSpec

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(causal=True, mask_kind="float", policy=DFSS(2, 4))
    q, k, v = torch.randn(2, 4, 70, 64), torch.randn(2, 2, 90, 64), torch.randn(2, 2, 90, 64)
    mask = torch.randn(1, 1, 70, 90)
    var = cuda.cuda_variant(TB.make_variant(spec, q, v, mask, None, 0.0))
    cubin, meta = cuda.get_cubin(var, "sm_90")
    kern = CubinKernel(cubin, meta)
    assert json.loads(DiskCache(tmp_path).get(cuda.cubin_key(var, "sm_90"), "launch.json")) == meta
    extra = TB._extra_values(var, spec, q, k, mask, None, None, None, None, 0.0, 0, torch.float32)
    tensors = {"q": q, "k": k, "v": v, "o": torch.empty(2, 4, 70, 64), "lse": torch.empty(2, 4, 70)}
    tensors.update({n: t for n, t in extra.items() if isinstance(t, torch.Tensor)})
    scalars = {n: x for n, x in extra.items() if not isinstance(x, torch.Tensor)}
    grid, block, shared, args = kern.prepare(tensors, scalars)
    assert grid == (-(-70 // var.block_q), 8, 1) and block == (var.block_q, 1, 1) and shared > 0
    assert len(args) == len(meta["params"])
    names = {p["name"]: a for p, a in zip(meta["params"], args)}
    assert names["MASK_ptr"].value == tensors["mask"].data_ptr() and names["Nk"].value == 90
    assert names["m_si"].value == 90 and names["m_sb"].value == 0
