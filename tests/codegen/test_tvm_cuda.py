"""The TVM backend's CUDA kernels build to cubin here (TVM + nvcc/ptxas, no GPU) for every policy,
sm_90 and sm_80, predicates and dropout included; the CLI builds sets of them; a GPU machine without
an artefact gets an error that names the build command."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("tvm")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc", allow_module_level=True)

from attncomp.cli import main  # noqa: E402
from attncomp.codegen.tvm import backend as TB  # noqa: E402
from attncomp.codegen.tvm import cuda  # noqa: E402
from attncomp.codegen.tvm.kernels import Variant  # noqa: E402
from attncomp.runtime.cache import DiskCache  # noqa: E402
from attncomp.runtime.cubin import CubinKernel, import_folder  # noqa: E402

BUILDS = [
    ("dense", Variant(head_dim=64, head_dim_v=64), "sm_90"),
    ("dense-causal-sm80", Variant(head_dim=128, head_dim_v=128, causal=True), "sm_80"),
    ("dfss", Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, mask="float"), "sm_90"),
    ("dfss-sp-sm80", Variant(head_dim=128, head_dim_v=128, policy="dfss", nm_n=1, nm_m=2, causal=True, mma="sp",
                             operand_dtype="bfloat16"), "sm_80"),
    ("hash", Variant(head_dim=64, head_dim_v=64, policy="hash", exclude_self=True, causal=True), "sm_90"),
    ("drop", Variant(head_dim=32, head_dim_v=32, policy="drop", mask="bool", dropout=True), "sm_90"),
    ("spion", Variant(head_dim=64, head_dim_v=64, policy="spion", block_size=32, block_q=32, block_k=32), "sm_90"),
    ("predicates", Variant(head_dim=64, head_dim_v=64, causal=True, window_left=100, q_pos=True, k_pos=True,
                           seg=True, q_valid=True, k_valid=True), "sm_90"),
]


@pytest.mark.parametrize("name,variant,arch", BUILDS, ids=[b[0] for b in BUILDS])
def test_cuda_kernel_builds_to_cubin(name, variant, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    cubin, meta = cuda.get_cubin(variant, arch)
    assert cubin[:4] == b"\x7fELF" and meta["arch"] == arch and meta["symbol"] == "attn_fwd_kernel"
    kern = CubinKernel(cubin, meta)  # metadata well formed, checksum matches
    kinds = {p["name"]: p["kind"] for p in kern.meta["params"]}
    assert kinds["Q_ptr"] == "pointer" and kinds["Nq"] == "shape" and kinds["scale"] == "scalar"
    if variant.seg:
        assert {"QSEG_ptr", "KSEG_ptr", "KSUM_ptr", "QPOS_ptr", "KPOS_ptr"} <= set(kinds)
    if variant.dropout:
        assert {"seed", "drop_p", "inv_keep"} <= set(kinds)
    # a second request is a cache hit with identical bytes
    again = cuda.get_cubin(variant, arch, build=False)
    assert again is not None and again[0] == cubin


def test_cli_builds_a_set_into_a_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["build-kernels", "--arch", "sm_90", "--policy", "dense", "--head-dim", "32", "--causal",
               "--out", str(tmp_path / "cubins")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "3 kernels copied" in out  # the forward and, by default, the two backward kernels
    assert import_folder(tmp_path / "cubins", store=DiskCache(tmp_path / "other")) == 3
    assert main(["build-kernels", "--policy", "nope"]) == 2
    assert main(["build-kernels", "--policy", "dense", "--head-dim", "32", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6  # causal or not, forward + two backward
    assert main(["build-kernels", "--policy", "dense", "--head-dim", "32", "--no-backward", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_missing_artefact_error_names_the_command(monkeypatch, tmp_path):
    """What a GPU machine without the artefact (and without TVM) sees, short of the GPU itself."""
    from attncomp.policy import DFSS
    from attncomp.spec import AttentionSpec

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(causal=True, policy=DFSS(2, 4))
    q = torch.empty(1, 2, 8, 64)
    var = cuda.cuda_variant(TB.make_variant(spec, q, q, None, None, 0.0))
    assert cuda.get_cubin(var, "sm_90", build=False) is None
    cmd = TB.build_command(var, "sm_90")
    assert cmd == ("python -m attncomp build-kernels --arch sm_90 --policy dfss --head-dim 64 --nm 2:4 "
                   "--dfss-kernel scalar --causal")
    # the command builds exactly the missing artefact
    assert main(cmd.split()[3:]) == 0
    assert cuda.get_cubin(var, "sm_90", build=False) is not None
