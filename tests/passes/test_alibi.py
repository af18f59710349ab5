"""alibi: a per-head slope times a position difference, left in a site's mask, becomes the spec's ALiBi
modifier after the graph's bias was checked on the example inputs.

Before: toy modules computing ALiBi as Bloom does (slopes from ``torch.pow``, times key positions counted
from each row's first valid key, which differs from ``arange`` by a per-row shift) and as
``slope * (j - i)``; compiled with attncomp.compile (dynamo, so the pass sees the real example inputs): the op carries the
slopes and no mask, equal to the module in float64 (the slopes' gradient included). Negative twin: a
slope times a squared distance keeps the mask and says why.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import pytest

import attncomp

F64 = torch.float64
B, H, N, D = 2, 4, 10, 8
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Toy(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.slopes = nn.Parameter(torch.pow(torch.tensor(0.5, dtype=F64), torch.arange(1, H + 1)))

    def forward(self, q, k, v, valid):
        nq, nk = q.size(2), k.size(2)
        if self.kind == "bloom":
            pos = (valid.cumsum(-1) - 1) * valid  # (B, Nk): counted from each row's first valid key
            bias = self.slopes[None, :, None, None] * pos[:, None, None, :].to(F64)
        else:
            rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]
            if self.kind == "squared":
                rel = rel * rel
            bias = self.slopes[:, None, None] * rel.to(F64)
        s = torch.where(valid[:, None, None, :].bool(), q @ k.transpose(-1, -2) * D ** -0.5 + bias,
                        torch.finfo(F64).min)
        return torch.softmax(s, -1) @ v


def inputs(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=F64) for _ in range(3))
    valid = torch.ones(B, n, dtype=torch.long)
    valid[1, :3] = 0  # left padding of the second row
    return q, k, v, valid


def compile_toy(kind):
    # through attncomp.compile (dynamo): the real example inputs reach the pass, and analyze_mask sees
    # the shapes of every node
    mod = Toy(kind)
    fast = attncomp.compile(mod, policy="dense", example_inputs=inputs())
    fast(*inputs())
    return mod, fast, attncomp.report(fast).sites


def test_alibi_becomes_the_modifier():
    for kind in ("bloom", "relative"):
        mod, fast, sites = compile_toy(kind)
        assert len(sites) == 1 and sites[0].rewritten
        assert sites[0].details["modifiers"].startswith("alibi (checked"), (kind, sites[0].details)
        assert "alibi" in sites[0].spec and "float mask" not in sites[0].spec
        for n in (N, 7):
            x = inputs(n, seed=n)
            torch.testing.assert_close(fast(*x), mod(*x), rtol=1e-10, atol=1e-12)
        x = list(inputs(9, seed=4))
        x[:3] = [t.requires_grad_(True) for t in x[:3]]
        go = torch.randn(B, H, 9, D, dtype=F64)
        got = torch.autograd.grad(fast(*x), x[:3] + [mod.slopes], go)
        want = torch.autograd.grad(mod(*x), x[:3] + [mod.slopes], go)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_squared_distance_keeps_the_mask():
    mod, fast, sites = compile_toy("squared")
    assert "not slope[h] * (k_pos - q_pos)" in sites[0].details["modifiers"], sites[0].details
    assert "alibi" not in sites[0].spec
    x = inputs(seed=2)
    torch.testing.assert_close(fast(*x), mod(*x))
