"""SPION's recorded statistic (``attncomp.spion.block_statistic``): the Triton kernel (through Triton's
interpreter) and the chunked PyTorch path against ``pool_map`` of the float64 softmax probabilities.

Each case draws fresh inputs of odd sizes and takes ``lse`` from the reference attention (float32, as
the op returns it); the statistic must be the filtered, pooled map of the exact probabilities
(Eq. 3-4) for every mask kind and predicate, partial last blocks, filters reaching one or two blocks
away, GQA, per-head maps and empty rows.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
triton = pytest.importorskip("triton")

from attncomp import spion  # noqa: E402
from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import spion_stats  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402

if not isinstance(spion_stats._spion_stat_kernel, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("Triton kernels already imported without TRITON_INTERPRET=1; run this module alone",
                allow_module_level=True)


def _case(name, seed):
    """``(spec, q, k, v, attn_mask, preds, block_size, filter_size, per_head)`` with fresh inputs."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, dtype):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    mask, preds = None, None
    if name == "plain-gqa-odd":
        N, Hq, Hk, D, dt, spec, bs, F, ph = 61, 4, 2, 24, torch.float64, AttentionSpec(), 16, 7, False
    elif name == "causal-per-head":
        N, Hq, Hk, D, dt, spec, bs, F, ph = 64, 3, 3, 16, torch.float32, AttentionSpec(causal=True), 16, 31, True
    elif name == "window-two-blocks":
        # h = 20 > 16: the filter reaches blocks two away
        N, Hq, Hk, D, dt, bs, F, ph = 50, 2, 1, 32, torch.float32, 16, 41, False
        spec = AttentionSpec(window_left=9, window_right=2)
    elif name == "bool-mask-empty-rows":
        N, Hq, Hk, D, dt, spec, bs, F, ph = 45, 2, 2, 16, torch.float32, AttentionSpec(), 16, 1, False
        mask = torch.rand(2, 1, N, N, generator=g) < 0.6
        mask[:, :, 3] = False                      # a row with no allowed key: zeros, lse = -inf
        mask[1, :, :, 40:] = False
    elif name == "float-mask":
        N, Hq, Hk, D, dt, spec, bs, F, ph = 40, 4, 4, 8, torch.float64, AttentionSpec(scale=0.3), 32, 15, True
        mask = rn(1, Hq, N, N, dtype=torch.float64)
        mask[torch.rand(1, Hq, N, N, generator=g) < 0.3] = float("-inf")
    elif name == "predicates":
        N, Hq, Hk, D, dt, bs, F, ph = 57, 2, 2, 16, torch.float32, 16, 31, False
        spec = AttentionSpec(causal=True, window_left=20)
        q_pos = (torch.arange(N) + 3)[None].repeat(2, 1)
        k_pos = torch.arange(N)[None]
        seg = (torch.arange(N) // 23)[None]
        k_valid = torch.ones(2, N, dtype=torch.bool)
        k_valid[1, 50:] = False
        q_valid = torch.ones(1, N, dtype=torch.bool)
        q_valid[0, [5, 33]] = False
        preds = Predicates(q_pos, k_pos, seg, seg, q_valid, k_valid)
    elif name == "bf16-causal":
        N, Hq, Hk, D, dt, spec, bs, F, ph = 48, 2, 2, 16, torch.bfloat16, AttentionSpec(causal=True), 16, 7, False
    else:
        raise AssertionError(name)
    q, k, v = rn(2, Hq, N, D, dtype=dt), rn(2, Hk, N, D, dtype=dt), rn(2, Hk, N, D, dtype=dt)
    return spec, q, k, v, mask, preds, bs, F, ph


CASES = ["plain-gqa-odd", "causal-per-head", "window-two-blocks", "bool-mask-empty-rows", "float-mask",
         "predicates", "bf16-causal"]


def _want(spec, q, k, mask, preds, bs, F, per_head):
    """pool_map of the float64 probabilities, averaged over the batch (and heads unless per_head)."""
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    s, allowed = R.logits(spec, q.double(), k.double(), m, preds)
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0).mean(0)
    if not per_head:
        p = p.mean(0, keepdim=True)
    return spion.pool_map(p, bs, F)


def _lse(spec, q, k, v, mask, preds):
    return R.attention(q, k, v, mask, spec=spec, preds=preds)[1]


#: cases whose Triton statistic another test checks against the same pool map (each interpreted
#: kernel run takes a minute): the wrong-lse twin (plain GQA) and the partials' test (window)
KERNEL_CHECKED_ELSEWHERE = {"plain-gqa-odd": "test_a_wrong_lse_is_seen",
                            "window-two-blocks": "test_kernel_writes_every_partial"}


@pytest.mark.sample(3)
@pytest.mark.parametrize("name,impl,chunk", [(n, i, c) for n in CASES
                                              for i, c in (("triton", None), ("torch", 16), ("torch", None))
                                              if not (i == "triton" and n in KERNEL_CHECKED_ELSEWHERE)])
def test_statistic_is_pool_map_of_the_probabilities(name, impl, chunk):
    seed = 10 * CASES.index(name) + (impl == "torch") + (chunk is not None)
    spec, q, k, v, mask, preds, bs, F, ph = _case(name, seed=seed)
    lse = _lse(spec, q, k, v, mask, preds)
    got = spion.block_statistic(spec, q, k, mask, preds, lse, block_size=bs, filter_size=F, per_head=ph,
                                impl=impl, chunk=chunk)
    want = _want(spec, q, k, mask, preds, bs, F, ph)
    n = -(-q.shape[2] // bs)
    assert got.shape == (q.shape[1] if ph else 1, n, n) and got.dtype == torch.float64
    assert want.abs().max() > 0
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-5, f"{name} {impl}: relative error {err:.2e}"


def test_a_wrong_lse_is_seen():
    # negative twin: the statistic is built from the given lse (a shifted lse scales the map)
    spec, q, k, v, mask, preds, bs, F, ph = _case("plain-gqa-odd", seed=5)
    lse = _lse(spec, q, k, v, mask, preds)
    want = _want(spec, q, k, mask, preds, bs, F, ph)
    for impl in ("triton", "torch"):
        got = spion.block_statistic(spec, q, k, mask, preds, lse - math.log(2.0), block_size=bs, filter_size=F,
                                    per_head=ph, impl=impl)
        assert torch.allclose(got, 2 * want, rtol=1e-5, atol=0)


def test_kernel_writes_every_partial():
    spec, q, k, v, mask, preds, bs, F, ph = _case("window-two-blocks", seed=11)
    lse = _lse(spec, q, k, v, mask, preds)
    n, r = -(-q.shape[2] // bs), -(-(F // 2) // bs)
    out = torch.full((q.shape[0], q.shape[1], (2 * r + 1) ** 2, n, n), float("nan"))
    res = spion_stats.spion_partials(q, k, lse, scale=1 / math.sqrt(q.shape[-1]), block_size=bs, filter_size=F,
                                     left=9, right=2, q_pos=torch.arange(q.shape[2])[None],
                                     k_pos=torch.arange(q.shape[2])[None], out=out)
    assert res is out and torch.isfinite(out).all()
    # the partials of the blocks inside the map add up to the statistic
    S = spion._shift_add(out.sum((0, 1), dtype=torch.float64)[None], r)
    rows = torch.tensor([16.0, 16.0, 16.0, 2.0], dtype=torch.float64)
    stat = S / (rows[:, None] * rows[None, :] * q.shape[0] * q.shape[1])
    assert torch.allclose(stat, _want(spec, q, k, mask, preds, bs, F, ph), rtol=2e-5, atol=1e-9)


def test_patterns_from_the_statistic_equal_generate_pattern():
    # a structured map (a shifted band and an anti-diagonal in the logits): the patterns made from the
    # recorded statistic are those generate_pattern makes from the dense probabilities
    g = torch.Generator().manual_seed(3)
    N, D = 96, 16
    pos = torch.arange(N, dtype=torch.float64)
    base = torch.randn(N, D, generator=g, dtype=torch.float64)
    partner = torch.where(pos < N // 2, pos + N // 2, N - 1 - pos).long()
    q = (base * 3)[None, None].repeat(2, 2, 1, 1) + 0.3 * torch.randn(2, 2, N, D, generator=g, dtype=torch.float64)
    k = (base[partner.argsort()] * 3)[None, None].repeat(2, 2, 1, 1)
    spec = AttentionSpec()
    v = torch.randn(2, 2, N, D, generator=g, dtype=torch.float64)
    lse = _lse(spec, q, k, v, None, None)
    s, _ = R.logits(spec, q, k)
    dense = torch.softmax(s, -1).mean((0, 1))
    # the statistic each impl computes is checked against pool_map above; here what the patterns make of
    # it (the kernel once, for the filter that reaches the neighbouring blocks)
    for variant, F in (("spion", 31), ("spion-f", 1)):
        for impl in (("triton", "torch") if F > 1 else ("torch",)):
            stat = spion.block_statistic(spec, q, k, None, None, lse, block_size=16, filter_size=F, impl=impl)
            got = spion.pattern_from_pool(stat, threshold=0.8, variant=variant)
            want = spion.generate_pattern(dense, 16, filter_size=31, threshold=0.8, variant=variant)
            assert torch.equal(got[0], want), (variant, impl)
            assert not want.all() and (want & ~torch.eye(6, dtype=torch.bool)).any()


def test_torch_path_holds_one_chunk_of_logits(monkeypatch):
    spec, q, k, v, mask, preds, bs, F, ph = _case("predicates", seed=2)
    lse = _lse(spec, q, k, v, mask, preds)
    seen = []
    real = R.logits

    def spy(spec_, q_, k_, *a, **kw):
        seen.append((q_.shape[2], k_.shape[2]))
        return real(spec_, q_, k_, *a, **kw)

    monkeypatch.setattr(R, "logits", spy)
    got = spion.block_statistic(spec, q, k, mask, preds, lse, block_size=bs, filter_size=F, per_head=ph,
                                impl="torch", chunk=20)
    monkeypatch.setattr(R, "logits", real)
    # 57 query rows in chunks of 32 (20 rounded up to whole blocks): never the N x N logits at once
    assert seen == [(32, 57), (25, 57)]
    assert torch.allclose(got, _want(spec, q, k, mask, preds, bs, F, ph), rtol=2e-5, atol=1e-9)
