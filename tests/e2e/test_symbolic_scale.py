"""Scales written from the input's sizes (``math.sqrt(x.size(-1) // heads)``, nanoGPT's
``1.0 / math.sqrt(k.size(-1))``) under dynamo capture, where every input dim starts dynamic: the scale
is a symbolic number in the graph, not a tensor, and the site is rewritten."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import attncomp
from tests.utils import fresh_seed, rel_err

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class FromInput(nn.Module):
    def __init__(self, d=64, h=4, spelling="div"):
        super().__init__()
        self.h, self.spelling = h, spelling
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        if self.spelling == "div":
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)
        else:  # nanoGPT
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))


@pytest.mark.parametrize("spelling", ["div", "nanogpt"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_scale_from_input_sizes_is_rewritten(spelling, train):
    torch.manual_seed(fresh_seed())
    model = FromInput(spelling=spelling).double().train(train)
    fast = attncomp.compile(model)
    for n in (37, 50):  # a second length: no new capture, same scale
        x = torch.randn(2, n, 64, dtype=torch.float64)
        assert rel_err(fast(x), model(x)) < 1e-10
    rep = attncomp.report(fast)
    assert rep.rewritten == 1, str(rep)
    assert "scale 0.25" in str(rep), str(rep)  # the specialised value, not a run-time expression
