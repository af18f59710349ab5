"""Triton backend on a CUDA GPU at realistic sizes (skipped without one).

Forward and backward against the reference backend computed in float64 on the GPU, a few mask
and GQA cases, dropout's keep pattern bit for bit, and the fused forward's memory: its peak grows
linearly with the sequence length (no ``N x N`` buffer anywhere).

Run it in its own process (``pytest -m gpu tests/codegen/test_triton_gpu.py``): the CPU module
``test_triton_kernels.py`` switches Triton to its interpreter for the whole process.
"""

from __future__ import annotations

import os

import pytest
import torch

from attncomp.codegen import reference as R
from attncomp.policy import DFSS, Dense
from attncomp.spec import AttentionSpec, dtype_name
from tests.utils import TOL, assert_close, rel_err

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    # the default configurations; tuning every candidate would only add compile time here
    monkeypatch.setenv("ATTNCOMP_TRITON_TUNE", "0")


def _backend():
    from attncomp.codegen.triton import backend

    return backend


def _inputs(B, Hq, N, D, dtype, *, Hk=None, quantized=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Hk = Hk or Hq

    def qk(*shape):
        if quantized:  # exact logits: DFSS ties and near-ties decide the same way in every precision
            return (torch.randint(-3, 4, shape, generator=g, device="cuda").float() / 2).to(dtype)
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    return qk(B, Hq, N, D), qk(B, Hk, N, D), torch.randn(B, Hk, N, D, generator=g, device="cuda").to(dtype)


def _spec(q, causal, policy, mask=None):
    mk = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return AttentionSpec(causal=causal, mask_kind=mk, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], policy=policy)


def _check(spec, q, k, v, mask=None, dropout_p=0.0, seed=0):
    TB = _backend()
    dtype = q.dtype
    out, lse = TB.attention_forward(spec, q, k, v, mask, dropout_p, seed)
    go = torch.randn_like(out)
    dq, dk, dv = TB.attention_backward(spec, q, k, v, mask, out, lse, go, dropout_p, seed)
    torch.cuda.synchronize()
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    q64, k64, v64 = q.double(), k.double(), v.double()
    ro, rl = R.attention(q64, k64, v64, m64, spec=spec, dropout_p=dropout_p, seed=seed)
    assert_close(out, ro, dtype, "out")
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert_close(lse[fin], rl[fin].float(), torch.float32, "lse")
    del ro, rl
    rq, rk, rv, _ = R.attention_backward(q64, k64, v64, m64, go.double(), spec=spec, dropout_p=dropout_p, seed=seed)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert_close(a, b, dtype, name)
        assert rel_err(a, b) < TOL[dtype][1], name


CASES = [
    # (N, D, dtype, causal, policy)
    (1024, 64, torch.bfloat16, False, Dense()),
    (2048, 64, torch.bfloat16, True, Dense()),
    (1024, 128, torch.float16, True, Dense()),
    (2048, 128, torch.bfloat16, False, Dense()),
    (1024, 64, torch.bfloat16, True, DFSS()),
    (2048, 128, torch.float16, False, DFSS()),
    (1024, 64, torch.bfloat16, False, DFSS(1, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-D{c[1]}-{dtype_name(c[2])}-"
                         f"{'causal' if c[3] else 'full'}-{c[4].name}{'' if c[4].name == 'dense' else c[4].resolved(c[2]).m}")
def test_forward_backward_realistic(case):
    N, D, dtype, causal, policy = case
    q, k, v = _inputs(2, 8, N, D, dtype, quantized=policy.name == "dfss")
    _check(_spec(q, causal, policy), q, k, v)


def test_gqa_masks_and_odd_sizes():
    dtype = torch.bfloat16
    B, Hq, Hk, N, D = 2, 8, 2, 1000, 80
    q, k, v = _inputs(B, Hq, N, D, dtype, Hk=Hk, quantized=True)
    pad = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
    pad[1, ..., 900:] = False
    _check(_spec(q, True, Dense(), pad), q, k, v, pad)
    bias = torch.randn(1, Hq, N, N, device="cuda", dtype=dtype)
    bias[..., ::7] = float("-inf")
    _check(_spec(q, False, DFSS(), bias), q, k, v, bias)


def test_dropout_keep_pattern_bit_exact():
    TB = _backend()
    B, H, N = 2, 4, 256
    q, k, _ = _inputs(B, H, N, 64, torch.float32)
    v = torch.eye(N, device="cuda").expand(B, H, N, N).contiguous()
    spec = _spec(q, False, Dense())
    out, _ = TB.attention_forward(spec, q, k, v, None, 0.25, 1234)
    expect = R.dropout_keep(1234, 0.25, (B, H, N, N), "cuda")
    assert torch.equal(out != 0, expect)


@pytest.mark.parametrize("policy", [Dense(), DFSS()], ids=["dense", "dfss"])
def test_forward_memory_linear_in_n(policy):
    """Peak memory of the fused forward (inputs, outputs, nothing N x N): ~2x for 2x the length."""
    TB = _backend()
    peaks = {}
    for N in (4096, 8192):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        q, k, v = _inputs(1, 8, N, 64, torch.bfloat16)
        spec = _spec(q, True, policy)
        TB.attention_forward(spec, q, k, v)  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out, lse = TB.attention_forward(spec, q, k, v)
        torch.cuda.synchronize()
        peaks[N] = torch.cuda.max_memory_allocated() - base
        del q, k, v, out, lse
        torch.cuda.empty_cache()
    ratio = peaks[8192] / peaks[4096]
    assert 1.8 < ratio < 2.3, f"peak memory ratio {ratio:.2f} ({peaks})"
