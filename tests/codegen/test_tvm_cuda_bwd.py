"""The TVM backend's CUDA backward kernels (dK/dV, dQ), checked without a GPU.

The kernels' generator (:mod:`attncomp.codegen.tvm.cuda_bwd`) writes the same statements for
``cuda`` and for ``llvm`` (threads as loops between barriers); the llvm build runs here on fresh random
inputs with poisoned gradient buffers against the reference backward in float64 (dense and dfss,
causal or not, odd sizes, GQA, masks, dropout, predicates). The CUDA build is checked to reach an
sm_90 cubin, ``build-kernels --backward`` to build it, and a machine without the cubins to get an
error that names them and the command.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("tvm")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.tvm import backend as TB  # noqa: E402
from attncomp.codegen.tvm import cuda_bwd  # noqa: E402
from attncomp.codegen.tvm.kernels import Variant  # noqa: E402
from attncomp.policy import DFSS, Dense, Hash, SPION, ceil_div  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402
from tests.utils import assert_close, draw_mask, fresh_generator, qkv  # noqa: E402


pytestmark = pytest.mark.usefixtures("tvm_poisoned")


def _check(spec, q, k, v, am=None, qa=None, ka=None, bp=None, drop=0.0, preds=None, dtype=torch.float32):
    g = fresh_generator()
    seed = int(torch.randint(0, 1000, (1,), generator=g))
    do = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g).to(q.dtype)
    qd, kd, vd = q.double(), k.double(), v.double()
    out, lse = R.attention(qd, kd, vd, am, spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, dropout_p=drop, seed=seed,
                           preds=preds)
    dq, dk, dv = TB.cuda_schedule_backward_on_cpu(spec, q, k, v, am, out.to(q.dtype), lse, do, qa, ka, bp, drop, seed,
                                                  preds)
    rq, rk, rv, _ = R.attention_backward(qd, kd, vd, am, do.double(), spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp,
                                         dropout_p=drop, seed=seed, preds=preds)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert a.dtype == q.dtype and a.shape == b.shape
        assert_close(a, b, dtype, name)


CASES = [
    # (policy, causal, Nq, Nk, Hq, Hk, D, Dv, mask, dropout)
    (Dense(), False, 77, 93, 2, 1, 32, 24, "none", 0.0),
    (Dense(), True, 70, 70, 2, 2, 16, 16, "float", 0.0),
    (DFSS(2, 4), False, 65, 40, 2, 1, 32, 32, "bool", 0.0),
    (DFSS(2, 4), True, 45, 131, 1, 1, 24, 8, "none", 0.0),
    (DFSS(1, 2), False, 33, 50, 3, 1, 16, 16, "none", 0.25),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{'causal' if c[1] else 'full'}-{c[2]}x{c[3]}-"
                         f"D{c[6]}-{c[8]}{'-drop' if c[9] else ''}")
def test_cuda_backward_schedule_matches_reference(case):
    pol, causal, Nq, Nk, Hq, Hk, D, Dv, mask, drop = case
    B = 2
    q, k, v = qkv(B, Hq, Nq, D, Hk=Hk, Nk=Nk, Dv=Dv)
    am = draw_mask(mask, fresh_generator(), B, Nq, Nk)
    spec = AttentionSpec(causal=causal, policy=pol, mask_kind=mask,
                         causal_align="bottom_right" if causal and Nk > Nq else "top_left")
    _check(spec, q, k, v, am, drop=drop)


def test_cuda_backward_schedule_float16_inputs_and_predicates():
    """Half inputs (computed in float32), segments, key validity and a window (tile summaries)."""
    g = fresh_generator()
    B, H, N, D = 2, 2, 90, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g).half() for _ in range(3))
    seg = torch.cumsum(torch.rand(B, N, generator=g) < 0.05, -1).to(torch.int32)
    preds = Predicates(q_seg=seg, k_seg=seg, k_valid=torch.rand(B, N, generator=g) > 0.1)
    spec = AttentionSpec(causal=True, window_left=40, policy=DFSS(2, 4))
    _check(spec, q, k, v, preds=preds, dtype=torch.float16)


def test_cuda_backward_schedule_other_policies():
    """The template's other keep rules go through the same kernels (hash, spion)."""
    g = fresh_generator()
    B, H, N, D = 1, 2, 70, 16
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    qa, ka = torch.randint(0, 3, (B, H, N), generator=g), torch.randint(0, 3, (B, H, N), generator=g)
    _check(AttentionSpec(policy=Hash(n_buckets=4, exclude_self=True)), q, k, v, qa=qa, ka=ka)
    bp = torch.rand(H, ceil_div(N, 32), ceil_div(N, 32), generator=g) > 0.5
    _check(AttentionSpec(policy=SPION(block_size=32)), q, k, v, bp=bp)


def test_empty_rows_get_zero_gradients():
    """Queries without an allowed key (q_valid false) have lse -inf and zero dq."""
    g = fresh_generator()
    q, k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(3))
    qv = torch.rand(1, 40, generator=g) > 0.5
    _check(AttentionSpec(policy=DFSS(2, 4)), q, k, v, preds=Predicates(q_valid=qv))


def test_tile_sizes():
    v = Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, mma="sp", operand_dtype="float16")
    dk = cuda_bwd.bwd_variant(v, "dkdv")
    assert (dk.block_q, dk.block_k, dk.mma) == (32, 64, "")
    assert cuda_bwd.bwd_variant(Variant(head_dim=256, head_dim_v=256), "dkdv").block_q == 16
    assert cuda_bwd.bwd_variant(Variant(head_dim=64, head_dim_v=64, policy="spion", block_size=16, block_q=16,
                                        block_k=16), "dkdv").block_k == 16
    with pytest.raises(ValueError):
        cuda_bwd.bwd_source(dk, "dv")


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("kind", ["dkdv", "dq"])
def test_backward_kernels_build_to_sm90_cubins(kind, tmp_path, monkeypatch):
    from attncomp.codegen.tvm import cuda
    from attncomp.runtime.cubin import CubinKernel

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    v = Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, causal=True, mask="float")
    cubin, meta = cuda.get_cubin(v, "sm_90", kind=kind)
    kern = CubinKernel(cubin, meta)
    assert meta["symbol"] == f"attn_bwd_{kind}_kernel" and meta["kind"] == kind
    names = {p["name"]: p["kind"] for p in kern.meta["params"]}
    assert {"Q_ptr", "K_ptr", "V_ptr", "DO_ptr", "LSE_ptr", "DELTA_ptr", "MASK_ptr"} <= set(names)
    assert ({"DK__ptr", "DV__ptr"} if kind == "dkdv" else {"DQ__ptr"}) <= set(names)
    # the grid follows the keys (dK/dV) or the queries (dQ)
    q, k = torch.empty(2, 4, 100, 64), torch.empty(2, 2, 130, 64)
    grid, block, _ = __import__("attncomp.runtime.cubin", fromlist=["launch_dims"]).launch_dims(meta, {"q": q, "k": k})
    assert grid == ((3, 4, 1) if kind == "dkdv" else (2, 8, 1)) and block == (64, 1, 1)
    assert cuda.get_cubin(v, "sm_90", build=False, kind=kind)[0] == cubin


@needs_nvcc
def test_missing_backward_cubins_error_names_them_and_the_command(tmp_path, monkeypatch):
    from attncomp.cli import main
    from attncomp.codegen.tvm import cuda

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(TB._build, "tvm_available", lambda: False)  # a GPU machine without TVM
    spec = AttentionSpec(causal=True, policy=DFSS(2, 4))
    q = torch.empty(1, 2, 8, 64)
    var = TB.make_variant(spec, q, q, None, None, 0.0)
    with pytest.raises(RuntimeError) as e:
        TB._cuda_kernels(spec, var, ("dkdv", "dq"), "sm_90")
    msg = str(e.value)
    assert "backward dK/dV, backward dQ" in msg
    cmd = msg.split("\n")[1].strip().replace(" --out <folder>", "")
    assert cmd == ("python -m attncomp build-kernels --arch sm_90 --policy dfss --head-dim 64 --nm 2:4 "
                   "--dfss-kernel scalar --causal --backward")
    assert main(cmd.split()[3:]) == 0
    for kind in ("fwd", "dkdv", "dq"):
        assert cuda.get_cubin(var, "sm_90", build=False, kind=kind) is not None
    assert set(TB._cuda_kernels(spec, var, ("dkdv", "dq"), "sm_90")) == {"dkdv", "dq"}


@needs_nvcc
@pytest.mark.parametrize("policy,dtype", [(DFSS(2, 4), torch.float16), (DFSS(2, 4), torch.float32),
                                          (Dense(), torch.bfloat16)], ids=["dfss-sp", "dfss-scalar", "dense"])
def test_cuda_host_paths_fill_every_kernel_parameter(policy, dtype, tmp_path, monkeypatch):
    """What a GPU run does up to the driver call, here: the backend's forward and backward on the CUDA
    path (kernel choice, cubins, argument dictionaries) with the launch replaced by the loader's
    argument packing and grid arithmetic, which raise on any parameter the host does not provide."""
    from attncomp.runtime.cubin import CubinKernel

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    launched = []

    def launch(self, tensors, scalars, stream=None):
        grid, block, _, args = self.prepare(tensors, scalars)
        launched.append((self.meta["symbol"], grid, block, len(args)))

    monkeypatch.setattr(CubinKernel, "launch", launch)
    g = fresh_generator()
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 70, 90, 64
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, Nq), (Hk, Nk), (Hk, Nk)))
    seg = torch.cumsum(torch.rand(B, Nk, generator=g) < 0.05, -1).to(torch.int32)
    preds = Predicates(q_seg=seg[:, :Nq], k_seg=seg, k_valid=torch.rand(B, Nk, generator=g) > 0.1)
    am = torch.rand(B, 1, Nq, Nk, generator=g) > 0.2
    spec = AttentionSpec(causal=True, causal_align="bottom_right", policy=policy, mask_kind="bool")
    out, lse = TB.cuda_forward(spec, q, k, v, am, preds=preds)
    do = torch.randn(out.shape, generator=g).to(dtype)
    TB.cuda_backward(spec, q, k, v, am, out.nan_to_num(0.0), lse.nan_to_num(0.0), do, preds=preds)
    sp = policy.name == "dfss" and dtype == torch.float16
    assert [s for s, *_ in launched] == ["attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    assert launched[0][1:3] == (((Nq + 63) // 64, B * Hq, 1), ((128 if sp else 64), 1, 1))
    assert launched[1][1] == ((Nk + 63) // 64, B * Hk, 1)
    assert launched[2][1] == ((Nq + 63) // 64, B * Hq, 1)
