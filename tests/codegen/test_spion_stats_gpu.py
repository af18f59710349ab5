"""SPION's statistic kernel on a CUDA GPU at realistic sizes (skipped without one).

The compiled Triton kernel against ``pool_map`` of the float64 probabilities on the GPU (fp16, bf16,
fp32; causal with key padding, odd lengths), its memory (no ``N x N`` buffer: the peak stays far below
one head's logits), and a compiled SPION training step that records through it.

Run it in its own process (``pytest -m gpu tests/codegen/test_spion_stats_gpu.py``): the CPU module
``test_spion_stats.py`` switches Triton to its interpreter for the whole process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from attncomp import spion
from attncomp.codegen import reference as R
from attncomp.spec import AttentionSpec, Predicates

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels", allow_module_level=True)


def _inputs(dtype, N, Hq=8, Hk=4, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, h, N, D, device="cuda", generator=g).to(dtype) for h in (Hq, Hk, Hk)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,F,per_head", [(64, 31, False), (32, 31, True), (128, 7, False)])
def test_kernel_against_float64(dtype, bs, F, per_head):
    N = 1000
    q, k, v = _inputs(dtype, N, seed=bs + F)
    spec = AttentionSpec(causal=True)
    k_valid = torch.ones(2, N, dtype=torch.bool, device="cuda")
    k_valid[1, 900:] = False
    preds = Predicates(k_valid=k_valid)
    lse = R.attention(q, k, v, spec=spec, preds=preds)[1]
    got = spion.block_statistic(spec, q, k, None, preds, lse, block_size=bs, filter_size=F, per_head=per_head,
                                impl="triton")
    s, allowed = R.logits(spec, q.double(), k.double(), None, preds)
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0).mean(0)
    del s, allowed
    if not per_head:
        p = p.mean(0, keepdim=True)
    want = spion.pool_map(p, bs, F)
    err = float((got - want).abs().max() / want.abs().max())
    # fp16/bf16 logits come from 16-bit q.k products accumulated in fp32, as the op's own
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err


def test_kernel_memory_has_no_n_by_n_buffer():
    N, H = 8192, 8
    q, k, v = _inputs(torch.float16, N, Hq=H, Hk=H)
    q, k = q[:1], k[:1]
    lse = torch.randn(1, H, N, device="cuda") + 8.0
    spion.block_statistic(AttentionSpec(), q, k, None, None, lse, block_size=64, filter_size=31, impl="triton")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    spion.block_statistic(AttentionSpec(), q, k, None, None, lse, block_size=64, filter_size=31, impl="triton")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # the per-tile partial sums (H x (2r+1)^2 x n x n, float64; r = 1 here) and small buffers, far from one
    # head's N x N fp32 logits (256 MiB)
    n = -(-N // 64)
    partials = H * 9 * n * n * 8
    assert peak < 3 * partials and peak < N * N * 4 // 8, f"peak {peak / 2**20:.1f} MiB for N={N}"


def test_compiled_training_records_through_the_kernel(monkeypatch):
    import attncomp
    from attncomp.codegen.triton import spion_stats

    calls = []
    real = spion_stats.spion_partials

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(spion_stats, "spion_partials", spy)

    class Attn(torch.nn.Module):
        def __init__(self, d=64, h=4):
            super().__init__()
            self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            B, N, D = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
            p = ((q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)).softmax(-1)
            return self.o((p @ v).transpose(1, 2).reshape(B, N, D))

    torch.manual_seed(0)
    model = Attn().cuda().train()
    fast = attncomp.compile(model, policy=attncomp.SPION(block_size=64, alpha=1.0, interval=100),
                            backend="triton", inductor=False)
    x = torch.randn(2, 300, 64, device="cuda")
    fast(x).sum().backward()
    (site,) = spion.state_of(fast).sites.values()
    assert calls and site.acc_count == 1 and spion._TRITON_FAILED is None
    with torch.no_grad():
        q, k, _ = model.qkv(x).view(2, 300, 3, 4, 16).permute(2, 0, 3, 1, 4)
        p = ((q.double() @ k.double().transpose(-1, -2)) / 4.0).softmax(-1).mean((0, 1))
    want = spion.pool_map(p[None], 64, 31)
    assert float((site.acc - want).abs().max() / want.abs().max()) < 1e-2   # the op may use tf32
