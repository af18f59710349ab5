"""match_attention with score modifiers (DESIGN.md §4.2, recognisers in passes/score_modifiers.py).

Before: a toy module that soft-caps its logits (Gemma2's spelling) or concatenates a learned sink column
(GPT-OSS's); after canonicalize and match_attention: one op whose spec carries the modifier, no tanh /
cat / softmax left, equal to the module in float64 at the traced length and another one, gradients of the
sinks included. Negative twins (a bias inside the tanh, a scale after it, a sink column that is kept, a
column that varies per query) stay unmatched, with the reason in the report.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from attncomp import ops
from attncomp.passes import canonicalize, match_attention
from attncomp.passes.base import CompileContext
from attncomp.passes.capture import capture
from attncomp.passes.pipeline import run_passes
from attncomp.spec import AttentionSpec

B, H, N, D = 2, 4, 11, 16
PASSES = [("canonicalize", canonicalize.canonicalize), ("match_attention", match_attention.match_attention)]
F64 = torch.float64


class Toy(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.sinks = nn.Parameter(torch.randn(H, dtype=F64))
        self.cap = 2.5

    def forward(self, q, k, v, m):
        return self.fn(self, q, k, v, m)


def _softcap(s, c):
    s = s / c
    s = torch.tanh(s)
    return s * c


def _sink_softmax(self, s):
    col = self.sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[-2], -1)
    c = torch.cat([s, col], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return torch.softmax(c, dim=-1)[..., :-1]


def _lse_sinks(self, s, v):
    """Granite-SWA's spelling: the output rescaled by sigmoid(logsumexp(s) - sink)."""
    scale = (torch.logsumexp(s, dim=-1) - self.sinks.view(1, -1, 1)).to(F64).sigmoid()
    return (torch.softmax(s, dim=-1) @ v) * scale.unsqueeze(-1).to(v.dtype)


CASES = {
    "row_max_shift_without_sink": lambda s, q, k, v, m: (lambda a: torch.softmax(a - a.max(dim=-1, keepdim=True).values, -1) @ v)(
        q @ k.transpose(2, 3) * 0.25 + m),  # MiMo-V2-Flash's layers without sinks
    "sinks_lse_scaled": lambda s, q, k, v, m: _lse_sinks(s, q @ k.transpose(2, 3) * 0.25 + m, v),
    "softcap": lambda s, q, k, v, m: torch.softmax(_softcap(q @ k.transpose(2, 3) * D ** -0.5, s.cap) + m, -1) @ v,
    "softcap_mul_first": lambda s, q, k, v, m: torch.softmax(s.cap * torch.tanh((q @ k.transpose(2, 3)) / s.cap), -1) @ v,
    "sinks": lambda s, q, k, v, m: _sink_softmax(s, q @ k.transpose(2, 3) * 0.25 + m) @ v,
    "sinks_softcap": lambda s, q, k, v, m: _sink_softmax(s, _softcap(q @ k.transpose(2, 3) * 0.25, s.cap) + m) @ v,
}

def _sink_kept(self, q, k, v):
    col = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    p = torch.softmax(torch.cat([q @ k.transpose(2, 3), col], -1), -1)
    return p[..., :-1] @ v + p[..., -1:]  # the sink's probability is read


NEGATIVE = {
    "bias_inside_tanh": (lambda s, q, k, v, m: torch.softmax(_softcap(q @ k.transpose(2, 3) + m, s.cap), -1) @ v,
                         "inside the soft-cap"),
    "scaled_after_cap": (lambda s, q, k, v, m: torch.softmax(_softcap(q @ k.transpose(2, 3), s.cap) * 0.5, -1) @ v,
                         "scaled again"),
    "tanh_not_a_cap": (lambda s, q, k, v, m: torch.softmax(torch.tanh(q @ k.transpose(2, 3) * 0.5) * 3.0, -1) @ v,
                       "tanh"),
    "lse_sink_per_query": (lambda s, q, k, v, m: (lambda a: (torch.softmax(a, -1) @ v)
                           * (torch.logsumexp(a, -1) - q[..., 0]).sigmoid().unsqueeze(-1))(q @ k.transpose(2, 3) + m),
                           "used outside"),
    "sink_kept": (lambda s, q, k, v, m: _sink_kept(s, q, k, v), "escape"),
    "column_per_query": (lambda s, q, k, v, m: torch.softmax(torch.cat([q @ k.transpose(2, 3), q[..., :1]], -1), -1)[..., :-1] @ v,
                         None),
}


def inputs(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=F64) for _ in range(3))
    m = torch.zeros(B, 1, n, n, dtype=F64)
    m[1, ..., n - 3:] = torch.finfo(F64).min  # padding of the second batch row
    return q, k, v, m


def compile_site(fn):
    ctx = CompileContext()
    mod = Toy(fn)
    gm = capture(mod, inputs(), ctx)
    return mod, run_passes(gm, ctx, PASSES), ctx


def op_nodes(gm):
    return [n for n in gm.graph.nodes if ops.is_attention_node(n)]


def _targets(gm):
    return {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op in ("call_function",
                                                                                        "call_method")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_modifier_site_is_one_op_and_exact(name):
    mod, gm, ctx = compile_site(CASES[name])
    found = op_nodes(gm)
    assert len(found) == 1, [(s.rewritten, s.reason) for s in ctx.sites]
    spec = AttentionSpec.from_json(found[0].args[ops.ARG_INDEX["spec"]])
    want = {"softcap": 2.5 if "softcap" in name else None, "sinks": "sinks" in name}
    assert (spec.softcap, spec.sinks) == (want["softcap"], want["sinks"])
    assert ctx.sites[0].details.get("modifiers", "") == spec.describe_modifiers()
    assert ("softcap" in ctx.sites[0].pattern) == ("softcap" in name)
    left = _targets(gm) & {"tanh", "softmax", "cat", "max", "logsumexp", "sigmoid"}
    assert not left, f"{name}: {left} left in the graph\n{gm.graph}"
    for n in (N, 6):
        x = inputs(n, seed=n)
        torch.testing.assert_close(gm(*x), mod(*x), rtol=1e-12, atol=1e-12)


def test_sink_gradients_equal_eager():
    mod, gm, _ = compile_site(CASES["sinks_softcap"])
    x = [t.requires_grad_(True) for t in inputs(7, seed=3)[:3]] + [inputs(7, seed=3)[3]]
    go = torch.randn(B, H, 7, D, dtype=F64)
    got = torch.autograd.grad(gm(*x), x[:3] + [mod.sinks], go)
    want = torch.autograd.grad(mod(*x), x[:3] + [mod.sinks], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_twin_is_left_alone(name):
    fn, why = NEGATIVE[name]
    mod, gm, ctx = compile_site(fn)
    assert op_nodes(gm) == []
    if why is not None:
        assert ctx.sites and not ctx.sites[0].rewritten and why in ctx.sites[0].reason, ctx.sites
    x = inputs()
    torch.testing.assert_close(gm(*x), mod(*x))
