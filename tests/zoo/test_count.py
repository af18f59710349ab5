"""The sweep's attention counter (:mod:`tests.zoo.count`) on toy forwards: softmax(QK^T) V is counted however the
logits reach the softmax; a softmax of projected values that feeds a product (DeepSeek-V4's hyper-connection
mixers) and one that feeds none (a router) are not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.zoo.count import AttentionCounter

B, H, N, D = 2, 3, 5, 4


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


def plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + torch.zeros(1, 1, N, N), -1) @ v


def baddbmm_merged_heads(q, k, v):
    s = torch.baddbmm(torch.zeros(B * H, N, N), q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=0.5)
    return torch.matmul(F.dropout(s.view(B, H, N, N).softmax(-1), 0.0), v)


def sink_column(q, k, v):
    s = torch.einsum("bhid,bhjd->bhij", q, k)
    s = torch.cat([s, torch.zeros(B, H, N, 1)], dim=-1)
    return torch.softmax(s - s.amax(-1, keepdim=True), -1)[..., :-1] @ v


def written_into_zeros(q, k, v):   # Longformer: the diagonals of the logits copied into a new tensor
    s = q @ k.transpose(-1, -2)
    full = s.new_zeros(B, H, N, N + 2)
    full[..., 1:-1] = s
    return torch.softmax(full, -1)[..., 1:-1] @ v


def stream_mixer(q, k, v):   # DeepSeek-V4's hyper-connections: softmax of a projection, then a product
    w = torch.randn(D, H * H)
    comb = torch.softmax(F.linear(q.mean(1), w.t()).view(B, N, H, H), -1) + 1e-6
    comb = comb / comb.sum(-2, keepdim=True)
    return torch.matmul(comb.transpose(-1, -2), v.transpose(1, 2))


def router(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), -1).topk(2, -1).values


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("fn,calls", [(plain, 1), (baddbmm_merged_heads, 1), (sink_column, 1), (written_into_zeros, 1),
                                      (stream_mixer, 0), (router, 0), (sdpa, 1)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_counts_attention_only(fn, calls):
    with AttentionCounter() as c:
        fn(*_qkv())
    assert c.calls == calls


def test_attention_next_to_a_mixer():
    """One attention and one stream mixer in the same forward: one call."""
    with AttentionCounter() as c:
        q, k, v = _qkv()
        o = plain(q, k, v)
        stream_mixer(o, k, v)
    assert (c.calls, c.softmax) == (1, 1)
