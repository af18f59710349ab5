"""TVM backend's CUDA kernels on a GPU: prebuilt cubins (no TVM on the GPU machine) against the reference.

Build the artefacts on a machine with apache-tvm and nvcc, bring the folder, run::

    python -m attncomp build-kernels --arch sm_90 --head-dim 64 --out build/tvm-cubins
    ATTNCOMP_TVM_CUBINS=build/tvm-cubins python -m pytest -q -m gpu tests/codegen/test_tvm_gpu.py

(forward and backward kernels of every policy, causal or not; for dfss the sparse tensor-core forward
for float16 and bfloat16 inputs and the scalar one.)
"""

from __future__ import annotations

import os

import pytest
import torch

from attncomp.codegen import reference as R
from attncomp.codegen.tvm import backend as TB
from attncomp.policy import DFSS, Dense, Drop, Hash, SPION, ceil_div
from attncomp.runtime.cubin import import_folder
from attncomp.runtime.package import read_manifest
from attncomp.spec import AttentionSpec, dtype_name
from tests.utils import assert_close, fresh_seed

pytestmark = pytest.mark.gpu

CUBINS = os.environ.get("ATTNCOMP_TVM_CUBINS", "build/tvm-cubins")


@pytest.fixture(scope="module")
def artefact_cache(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not os.path.isdir(CUBINS):
        pytest.skip(f"no cubin folder {CUBINS} (build it with python -m attncomp build-kernels ... --out)")
    from attncomp.runtime.cache import DiskCache

    cache = tmp_path_factory.mktemp("tvm-cubin-cache")
    assert import_folder(CUBINS, store=DiskCache(cache)) > 0
    return cache


@pytest.fixture(autouse=True)
def _use_artefacts(artefact_cache, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(artefact_cache))


CASES = [(Dense(), False), (Dense(), True), (DFSS(2, 4), False), (DFSS(2, 4), True), (Hash(n_buckets=4), False),
         (Drop(), True), (SPION(block_size=64), False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{'causal' if c[1] else 'full'}")
def test_cubin_forward_matches_reference(case, dtype):
    pol, causal = case
    B, H, Nq, Nk, D = 2, 3, 150, 203 if not causal else 150, 64
    g = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to("cuda", dtype) for n in (Nq, Nk, Nk))
    qa = ka = bp = None
    if isinstance(pol, Hash):
        qa, ka = torch.randint(0, 3, (B, H, Nq), generator=g).cuda(), torch.randint(0, 3, (B, H, Nk), generator=g).cuda()
    elif isinstance(pol, Drop):
        qa, ka = (torch.rand(B, H, Nq, generator=g) > 0.3).cuda(), (torch.rand(B, H, Nk, generator=g) > 0.3).cuda()
    elif isinstance(pol, SPION):
        bp = (torch.rand(H, ceil_div(Nq, 64), ceil_div(Nk, 64), generator=g) > 0.5).cuda()
    spec = AttentionSpec(causal=causal, dtype=dtype_name(dtype), head_dim=D, policy=pol.resolved(torch.float16))
    out, lse = TB.TVMBackend().forward(spec, q, k, v, None, qa, ka, bp, 0.0, 0)
    torch.cuda.synchronize()
    ref, rlse = R.attention(q.double(), k.double(), v.double(), None, spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp)
    assert_close(out, ref, dtype, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))


def _inputs(B, Hq, Hk, Nq, Nk, D, dtype, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Nq, D, generator=g).to("cuda", dtype),
            torch.randn(B, Hk, Nk, D, generator=g).to("cuda", dtype),
            torch.randn(B, Hk, Nk, D, generator=g).to("cuda", dtype))


@pytest.mark.parametrize("nm,causal,dtype", [((2, 4), False, torch.float16), ((2, 4), True, torch.float16),
                                             ((2, 4), False, torch.bfloat16), ((2, 4), True, torch.bfloat16)],
                         ids=lambda x: str(x))
def test_cubin_sparse_tensor_core_dfss_matches_reference(nm, causal, dtype, monkeypatch):
    """The mma.sp kernel (dense mma for QK^T, 2:4 selection, packed P and metadata, P V on sparse
    tensor cores) against the reference and against the scalar dfss kernel on the same inputs."""
    B, H, Nq, D = 2, 3, 150, 64
    Nk = Nq if causal else 203
    q, k, v = _inputs(B, H, H, Nq, Nk, D, dtype)
    spec = AttentionSpec(causal=causal, dtype=dtype_name(dtype), head_dim=D, policy=DFSS(*nm))
    assert TB.cuda_kernel_variant(spec, q, v, None, None, 0.0).mma == "sp"
    out, lse = TB.TVMBackend().forward(spec, q, k, v, None, None, None, None, 0.0, 0)
    torch.cuda.synchronize()
    ref, rlse = R.attention(q.double(), k.double(), v.double(), None, spec=spec)
    assert_close(out, ref, dtype, "out")
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], rlse[fin].to(lse.device), torch.float32, "lse")
    monkeypatch.setenv("ATTNCOMP_TVM_DFSS_KERNEL", "scalar")
    assert TB.cuda_kernel_variant(spec, q, v, None, None, 0.0).mma == ""
    scalar, _ = TB.TVMBackend().forward(spec, q, k, v, None, None, None, None, 0.0, 0)
    assert_close(out, scalar.double(), dtype, "sp vs scalar")


BWD_CASES = [(Dense(), False), (Dense(), True), (DFSS(2, 4), False), (DFSS(2, 4), True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0].name}-{'causal' if c[1] else 'full'}")
def test_cubin_backward_matches_reference(case, dtype):
    """dQ, dK, dV from the backward cubins (GQA, odd sizes) against the reference backward in float64."""
    pol, causal = case
    B, Hq, Hk, Nq, D = 2, 4, 2, 150, 64
    Nk = Nq if causal else 203
    q, k, v = _inputs(B, Hq, Hk, Nq, Nk, D, dtype, seed=4321)
    do = torch.randn(B, Hq, Nq, D, generator=torch.Generator().manual_seed(7)).to("cuda", dtype)
    spec = AttentionSpec(causal=causal, dtype=dtype_name(dtype), head_dim=D, policy=pol.resolved(torch.float16))
    be = TB.TVMBackend()
    out, lse = be.forward(spec, q, k, v, None, None, None, None, 0.0, 0)
    dq, dk, dv, dmask = be.backward(spec, q, k, v, None, None, None, None, 0.0, 0, out, lse, do)
    torch.cuda.synchronize()
    assert dmask is None
    rq, rk, rv, _ = R.attention_backward(q.double(), k.double(), v.double(), None, do.double(), spec=spec)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert a.dtype == dtype and a.device.type == "cuda"
        assert_close(a, b, dtype, name)


def test_autograd_through_the_cuda_kernels():
    """attncomp.functional.attention on CUDA tensors with the TVM backend trains: forward and backward
    cubins, gradients against the reference's autograd."""
    import attncomp

    q, k, v = _inputs(1, 4, 2, 97, 120, 64, torch.float16, seed=99)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attncomp.functional.attention(q, k, v, is_causal=True, enable_gqa=True, policy="dfss", backend="tvm")
    go = torch.randn_like(out)
    out.backward(go)
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    spec = AttentionSpec(causal=True, dtype="float16", head_dim=64, policy=DFSS(2, 4))
    ref, _ = R.attention(q2, k2, v2, None, spec=spec)
    ref.backward(go.double())
    assert_close(out, ref, torch.float16, "out")
    for a, b, nm in ((q.grad, q2.grad, "dq"), (k.grad, k2.grad, "dk"), (v.grad, v2.grad, "dv")):
        assert_close(a, b, torch.float16, nm)


_LOAD_AND_RUN = r"""
import sys
sys.modules["tvm"] = None  # TVM cannot be imported: the package's kernels must be enough
import torch, attncomp
data = torch.load(sys.argv[2])
m = attncomp.load(sys.argv[1])
out = m(data["x"].cuda()).cpu().double()
err = ((out - data["want"].double()).norm() / data["want"].double().norm()).item()
print("ERR", err)
"""


def test_exported_package_with_tvm_kernels_runs_without_tvm(tmp_path, artefact_cache):
    """A model compiled on the TVM backend exports with its cubins; a fresh process with an empty kernel
    cache and no TVM loads the package and runs it."""
    import math
    import subprocess
    import sys

    import attncomp

    class Attn(torch.nn.Module):
        def __init__(self, d=256, h=4):
            super().__init__()
            self.h, self.dh = h, d // h
            self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
            p = ((q @ k.transpose(-2, -1)) / math.sqrt(self.dh)).softmax(-1)
            return self.o((p @ v).transpose(1, 2).reshape(B, N, C))

    torch.manual_seed(fresh_seed())
    model = Attn().cuda().half().eval()
    x = torch.randn(2, 150, 256, device="cuda", dtype=torch.float16)
    for policy in ("dense", "dfss"):
        fast = attncomp.compile(model, policy=policy, backend="tvm", example_inputs=(x,), capture="export")
        assert attncomp.report(fast).rewritten == 1
        path = attncomp.export(fast, str(tmp_path / f"{policy}.acpkg"))
        names = read_manifest(path)["entries"]
        assert any(n.startswith("kernels/") for n in names), "the package carries no kernel"
        x2 = torch.randn(3, 97, 256, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            want = fast(x2)
        torch.save({"x": x2.cpu(), "want": want.cpu()}, tmp_path / "data.pt")
        env = dict(os.environ, ATTNCOMP_CACHE_DIR=str(tmp_path / f"empty-cache-{policy}"))
        r = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, path, str(tmp_path / "data.pt")], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        err = float(r.stdout.split("ERR")[-1])
        assert err < 1e-3, f"{policy}: the loaded package differs from the compiled model ({err})"
