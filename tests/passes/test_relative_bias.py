"""relative_bias: a T5-style learned bias looked up by a bucketed relative position becomes the spec's
relative-position modifier, after the graph's own index was checked against T5's bucket function.

Before: a toy module computing T5's ``compute_bias`` (transformers' own bucket function) and adding it to
the logits; after canonicalize, match_attention, analyze_mask and relative_bias: the op carries the table
(``rel_table``) and no mask, equal to the module's attention in float64 to 1e-12 (T5 rounds its softmax
through float32; the op on float64 inputs does not), the table's gradient included. Negative
twins: an index that is not a bucket of k - q (clamped distances), and a setting the example cannot pin
down, keep the materialised bias and say why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from attncomp import ops
from attncomp.passes import analyze_mask, canonicalize, match_attention
from attncomp.passes.base import CompileContext
from attncomp.passes.capture import capture
from attncomp.passes.pipeline import run_passes
from attncomp.passes.relative_bias import relative_bias
from attncomp.spec import AttentionSpec

T5 = pytest.importorskip("transformers").models.t5.modeling_t5.T5Attention
F64 = torch.float64
B, H, D = 2, 4, 8
PASSES = [("canonicalize", canonicalize.canonicalize), ("match_attention", match_attention.match_attention),
          ("analyze_mask", analyze_mask.analyze_mask), ("relative_bias", relative_bias)]


class Toy(nn.Module):
    def __init__(self, index, n_buckets=32):
        super().__init__()
        self.table = nn.Embedding(n_buckets, H).double()
        self.index = index

    def scores(self, q, k):
        nq, nk = q.size(2), k.size(2)
        ctx = torch.arange(nq, dtype=torch.long)[:, None]
        mem = torch.arange(nk, dtype=torch.long)[None, :]
        bias = self.table(self.index(mem - ctx)).permute([2, 0, 1]).unsqueeze(0)
        return torch.matmul(q, k.transpose(3, 2)) + bias

    def forward(self, q, k, v):
        s = self.scores(q, k)
        return torch.softmax(s.float(), dim=-1).type_as(s) @ v  # T5 rounds its softmax through float32

    def exact(self, q, k, v):
        """The same attention in float64 throughout: what the op computes for float64 inputs."""
        return torch.softmax(self.scores(q, k), dim=-1) @ v


INDEX = {
    "t5_bidirectional": lambda rel: T5._relative_position_bucket(rel, bidirectional=True, num_buckets=32,
                                                                 max_distance=128),
    "t5_causal": lambda rel: T5._relative_position_bucket(rel, bidirectional=False, num_buckets=32,
                                                          max_distance=128),
}


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=F64) for _ in range(3))


def compile_toy(index, n=40):
    mod = Toy(index)
    ctx = CompileContext()
    x = inputs(n)
    gm = capture(mod, x, ctx)
    ctx.example_inputs = {p.name: t for p, t in zip([p for p in gm.graph.nodes if p.op == "placeholder"], x)}
    return mod, run_passes(gm, ctx, PASSES), ctx


def _op(gm):
    (node,) = [n for n in gm.graph.nodes if ops.is_attention_node(n)]
    return node


@pytest.mark.parametrize("name", sorted(INDEX))
def test_t5_bias_becomes_the_modifier(name):
    mod, gm, ctx = compile_toy(INDEX[name])
    node = _op(gm)
    spec = AttentionSpec.from_json(node.args[ops.ARG_INDEX["spec"]])
    assert (spec.rel_buckets, spec.rel_max_distance, spec.rel_bidirectional) == (32, 128, "bidirectional" in name)
    assert spec.mask_kind == "none" and node.args[ops.ARG_INDEX["attn_mask"]] is None
    assert "checked against the graph" in ctx.sites[0].details["modifiers"]
    assert not any(n.target is torch.nn.functional.embedding for n in gm.graph.nodes)
    for n in (40, 9):
        x = inputs(n, seed=n)
        torch.testing.assert_close(gm(*x), mod.exact(*x), rtol=1e-12, atol=1e-12)
    x = [t.requires_grad_(True) for t in inputs(23, seed=5)]
    go = torch.randn(B, H, 23, D, dtype=F64)
    got = torch.autograd.grad(gm(*x), x + [mod.table.weight], go)
    want = torch.autograd.grad(mod.exact(*x), x + [mod.table.weight], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_index_that_is_not_a_bucket_keeps_the_bias():
    mod, gm, ctx = compile_toy(lambda rel: rel.clamp(-15, 16) + 15)
    node = _op(gm)
    assert node.args[ops.ARG_INDEX["attn_mask"]] is not None
    assert ctx.sites[0].details["modifiers"].startswith("materialised bias: the index is not T5's bucket")
    x = inputs(40, seed=1)
    torch.testing.assert_close(gm(*x), mod.exact(*x), rtol=1e-12, atol=1e-12)


def test_undetermined_max_distance_keeps_the_bias():
    # at N = 6 every distance has its own exact bucket: no max distance is pinned down
    mod, gm, ctx = compile_toy(INDEX["t5_bidirectional"], n=6)
    assert _op(gm).args[ops.ARG_INDEX["attn_mask"]] is not None
    assert "max distance not determined" in ctx.sites[0].details["modifiers"]


def test_index_off_its_diagonals_keeps_the_bias():
    """An index equal to T5's bucket on the first row and column but not inside (it varies along a diagonal)
    is not a function of k - q: the bias stays."""
    def index(rel):
        b = INDEX["t5_bidirectional"](rel)
        return torch.where((rel == 0) & (torch.arange(rel.shape[0])[:, None] == rel.shape[0] // 2), b + 1, b)

    mod, gm, ctx = compile_toy(index)
    assert _op(gm).args[ops.ARG_INDEX["attn_mask"]] is not None
    assert ctx.sites[0].details["modifiers"].startswith("materialised bias: the index is not T5's bucket")
