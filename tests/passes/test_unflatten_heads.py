"""unflatten_heads: attention on merged (B*H, N, D) tensors, viewed as (B, H, Nq, Nk) on the way (XGLM's
and Bloom's eager attention), becomes one 4-D site whose masks broadcast as the model's do."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import attncomp
from attncomp.passes import counters

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

B, H, N, D = 2, 4, 7, 8


class Merged(nn.Module):
    """q/k/v as (B*H, N, D); ``style`` says how the logits meet the (B, 1, N, N) mask."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.slopes = torch.linspace(0.1, 0.9, H)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D).transpose(1, 2).reshape(b * H, n, D) for t in self.qkv(x).chunk(3, -1))
        if self.style == "xglm":   # view to 4-D for the mask, clamp at finfo.min, view back, softmax in 3-D
            s = torch.bmm(q * D ** -0.5, k.transpose(1, 2))
            s = s.view(b, H, n, n) + mask
            s = torch.max(s, torch.full((), torch.finfo(s.dtype).min, dtype=s.dtype))
            p = torch.softmax(s.view(b * H, n, n), dim=-1)
            p = p.view(b, H, n, n).view(b * H, n, n)
        else:                      # bloom: a (B*H, 1, N) bias through baddbmm, softmax in 4-D, view back
            bias = (self.slopes[:, None] * torch.arange(n)[None, :]).repeat(b, 1)[:, None, :].to(x.dtype)
            s = bias.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
            s = s.view(b, H, n, n) + mask
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype).view(b * H, n, n)
        o = torch.bmm(p, v)
        return o.view(b, H, n, D).transpose(1, 2).reshape(b, n, H * D)


class MergedLogits(Merged):
    """GPT-NeoX-Japanese: logits from ``baddbmm`` on zeros over (B*H, N, D) q and k, viewed as (B, H, N, N) for
    the mask and the softmax, multiplied with v as the model keeps it, (B, H, N, D)."""

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = q.reshape(b * H, n, D), k.reshape(b * H, n, D)
        zeros = torch.zeros(b * H, n, n, dtype=q.dtype, device=q.device)
        s = torch.baddbmm(zeros, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
        s = s.view(b, H, n, n)
        p = torch.softmax(s if mask is None else s + mask, dim=-1)
        return torch.matmul(p, v).transpose(1, 2).reshape(b, n, H * D)


class Escapes(Merged):
    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D).transpose(1, 2).reshape(b * H, n, D) for t in self.qkv(x).chunk(3, -1))
        s = torch.bmm(q, k.transpose(1, 2)).view(b, H, n, n) + mask
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p.view(b * H, n, n), v), p   # weights returned: not a site


def _mask(b, n):
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, : n // 2] = False   # left padding
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & keep[:, None, None, :]
    return torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min), keep


@pytest.mark.parametrize("style", ["xglm", "bloom"])
def test_merged_heads_become_one_4d_site(style):
    counters.clear()
    model = Merged(style)
    fast = attncomp.compile(model, policy="dense")
    for b, n in ((B, N), (3, 10)):
        x = torch.randn(b, n, H * D)
        mask, keep = _mask(b, n)
        rows = keep.clone()   # query rows that attend to a key: all but row 1's padding
        with torch.no_grad():
            got, want = fast(x, mask), model(x, mask)
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    rep = attncomp.report(fast)
    assert rep.rewritten == len(rep.sites) == 1, str(rep)
    assert counters["unflatten_heads"]["sites"] >= 1
    assert "3-D" not in rep.sites[0].pattern, rep.sites[0].pattern   # the op sees the heads


def test_merged_heads_train_like_eager():
    torch.manual_seed(0)
    model = Merged("xglm").train()   # (bloom's softmax runs in float32 by the model's own cast)
    fast = attncomp.compile(model, policy="dense")
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    model.double()
    mask = torch.zeros(B, 1, N, N, dtype=torch.float64).masked_fill(~torch.tril(torch.ones(N, N, dtype=torch.bool)),
                                                                    float("-inf"))
    grads = []
    for run in (model, fast):
        model.zero_grad()
        run(x, mask).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert attncomp.report(fast).rewritten == 1


def test_probabilities_returned_are_left_alone():
    model = Escapes("xglm")
    fast = attncomp.compile(model, policy="dense")
    x = torch.randn(B, N, H * D)
    mask, _ = _mask(B, N)
    with torch.no_grad():
        got, want = fast(x, mask), model(x, mask)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    rep = attncomp.report(fast)
    assert rep.rewritten == 0 and "escape" in rep.sites[0].reason, str(rep)


def test_merged_logits_with_4d_values():
    """The probabilities meet a 4-D v: the site is one 4-D op (no flatten back), the zeros of ``baddbmm`` are
    no bias, values equal eager in float64 at two shapes."""
    counters.clear()
    model = MergedLogits("neox-japanese").double()
    fast = attncomp.compile(model, policy="dense")
    for b, n in ((B, N), (3, 10)):
        x = torch.randn(b, n, H * D, dtype=torch.float64)
        mask, keep = _mask(b, n)
        mask = mask.double()
        with torch.no_grad():
            got, want = fast(x, mask), model(x, mask)
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-12)
    rep = attncomp.report(fast)
    assert rep.rewritten == len(rep.sites) == 1, str(rep)
    assert counters["unflatten_heads"]["sites"] >= 1
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    fast = attncomp.compile(model, policy="dense")
    with torch.no_grad():
        torch.testing.assert_close(fast(x, None), model(x, None), rtol=1e-10, atol=1e-12)
    site = attncomp.report(fast).sites[0]
    assert site.rewritten and "mask" not in site.spec, site   # the zeros are no bias


class RegroupedHeads(Merged):
    """Logits split as (B, H, N, N) for the mask, probabilities regrouped as (2B, H/2, N, N) for a v of that shape:
    the same values, but the op's heads (H, from the first split) are not the product's."""

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, H, D).transpose(1, 2).reshape(b * H, n, D) for t in self.qkv(x).chunk(3, -1))
        p = torch.softmax(torch.bmm(q, k.transpose(1, 2)).view(b, H, n, n) + mask, dim=-1)
        o = torch.matmul(p.view(b * H, n, n).view(b * 2, H // 2, n, n), v.view(b * 2, H // 2, n, D))
        return o.reshape(b, H, n, D).transpose(1, 2).reshape(b, n, H * D)


def test_heads_regrouped_between_the_products_are_left_alone():
    model = RegroupedHeads("regrouped").double()
    fast = attncomp.compile(model, policy="dense")
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    mask = _mask(B, N)[0].double()
    with torch.no_grad():
        torch.testing.assert_close(fast(x, mask), model(x, mask))
    rep = attncomp.report(fast)
    assert rep.rewritten == 0 and "different head counts" in rep.sites[0].reason, str(rep)
