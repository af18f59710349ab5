"""canonicalize: each spelling becomes the canonical call_function, with the same values."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from attncomp.passes import canonicalize as C
from attncomp.passes.base import CompileContext, PassResult


class Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.sm = nn.Softmax(dim=-1)
        self.dp = nn.Dropout(0.25)

    def forward(self, a, b):
        return self.fn(self, a, b)


SPELLINGS = {
    "matmul": [lambda s, a, b: a @ b, lambda s, a, b: torch.bmm(a, b), lambda s, a, b: a.matmul(b),
               lambda s, a, b: torch.einsum("bij,bjk->bik", a, b)],
    "transpose": [lambda s, a, b: a.mT, lambda s, a, b: a.transpose(-1, -2), lambda s, a, b: torch.swapaxes(a, 1, 2)],
    "mul": [lambda s, a, b: a * 0.5, lambda s, a, b: a / 2.0, lambda s, a, b: a.div(2.0), lambda s, a, b: a.mul(0.5)],
    "add": [lambda s, a, b: a + b, lambda s, a, b: a.add(b), lambda s, a, b: torch.add(a, b)],
    "where": [lambda s, a, b: a.masked_fill(b > 0, float("-inf")), lambda s, a, b: torch.masked_fill(a, b > 0, -1e9)],
    "softmax": [lambda s, a, b: a.softmax(-1), lambda s, a, b: F.softmax(a, dim=-1), lambda s, a, b: s.sm(a),
                lambda s, a, b: torch.nn.functional.softmax(a, -1, dtype=torch.float64)],
    "cast": [lambda s, a, b: a.float(), lambda s, a, b: a.double()],
    "dropout": [lambda s, a, b: F.dropout(a, 0.25, False), lambda s, a, b: torch.dropout(a, 0.25, False)],
}
TARGET = {"matmul": C.MATMUL, "transpose": C.TRANSPOSE, "mul": C.MUL, "add": C.ADD, "where": C.WHERE,
          "softmax": C.SOFTMAX, "dropout": C.DROPOUT}


@pytest.mark.parametrize("kind,idx", [(k, i) for k, fns in SPELLINGS.items() for i in range(len(fns))])
def test_spelling_becomes_canonical(kind, idx):
    fn = SPELLINGS[kind][idx]
    mod = Wrap(fn).eval()
    gm = fx.symbolic_trace(mod)
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    expected = mod(a, b)
    res = C.canonicalize(gm, CompileContext())
    res.graph_module.recompile()
    nodes = [n for n in res.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if kind == "cast":
        assert any(C.is_cast(n) for n in nodes)
    else:
        assert any(n.op == "call_function" and n.target is TARGET[kind] for n in nodes), res.graph_module.graph
        assert not any(n.op in ("call_method", "call_module") for n in nodes if n.target not in ("size",)), \
            res.graph_module.graph
    torch.testing.assert_close(res.graph_module(a, b), expected)


def test_inplace_masked_fill_is_functionalised():
    def fn(s, a, b):
        a = a * 1.0
        a.masked_fill_(b > 0, float("-inf"))
        return a.softmax(-1)

    mod = Wrap(fn)
    gm = fx.symbolic_trace(mod)
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    b[..., 0] = -1.0
    res = C.canonicalize(gm, CompileContext()).graph_module
    res.recompile()
    assert not any(n.op == "call_method" and n.target.endswith("_") for n in res.graph.nodes)
    sm = next(n for n in res.graph.nodes if n.target is C.SOFTMAX)
    assert sm.args[0].target is C.WHERE  # the softmax reads the filled value, not the pre-fill one
    torch.testing.assert_close(res(a, b), mod(a, b))


def _view_read_after(s, a, b):
    a = a * 1.0
    flat = a.view(a.shape[0], -1)  # another view of the same memory, read after the write
    a.masked_fill_(b > 0, 0.0)
    return a.softmax(-1), flat.sum(-1)


def _input_written(s, a, b):
    a.mul_(2.0)  # the caller sees its tensor doubled
    return a.softmax(-1)


@pytest.mark.parametrize("fn", [_view_read_after, _input_written])
def test_inplace_write_seen_elsewhere_stays_in_place(fn):
    """An in-place write whose effect another view of the memory (or the caller) reads stays in
    place: made out of place, those readers would miss it."""
    mod = Wrap(fn)
    gm = fx.symbolic_trace(mod)
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    res = C.canonicalize(gm, CompileContext()).graph_module
    res.recompile()
    assert any(n.op == "call_method" and n.target.endswith("_") for n in res.graph.nodes), res.graph
    a1, a2 = a.clone(), a.clone()
    got, want = res(a1, b), mod(a2, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(a1, a2)


def test_dead_code_elimination_keeps_inplace_writes():
    """The pipeline removes what rewrites left dead, but not in-place writes whose results are unused
    (an MoE router's ``group_mask.scatter_(...)``, ``ids.clamp_(max=...)``, a write through a view): their
    effect is in the tensor they write."""
    from attncomp.passes.pipeline import run_passes

    class Router(nn.Module):
        def forward(self, x, idx):
            mask = torch.zeros_like(x)
            mask.scatter_(1, idx, 1.0)
            ids = idx * 3
            ids.clamp_(max=3)
            out = x.clone()
            out.select(1, 0).fill_(0.0)
            return out * mask.gather(1, ids).sum(-1, keepdim=True)

    mod = Router()
    x, idx = torch.randn(3, 4), torch.tensor([[0], [2], [3]])
    gm = fx.symbolic_trace(mod)
    names = {n.name for n in gm.graph.nodes}
    done = run_passes(gm, CompileContext(), [("modified", lambda g, c: PassResult(g, True))])
    assert names == {n.name for n in done.graph.nodes}, "an in-place write was removed as dead code"
    torch.testing.assert_close(done(x, idx), mod(x, idx))


@pytest.mark.parametrize("spelling", ["method", "function"])
def test_baddbmm_becomes_bias_plus_scaled_matmul(spelling):
    """``alibi.baddbmm(q, k, beta=, alpha=)`` (Bloom's logits, a method call in dynamo graphs) and
    ``torch.baddbmm``: ``input*beta + alpha*(b1 @ b2)`` spelled with the canonical ops."""
    if spelling == "method":
        fn = (lambda s, a, b: b[:, :1].baddbmm(a, a.transpose(1, 2), beta=0.5, alpha=0.25))
    else:
        fn = (lambda s, a, b: torch.baddbmm(b[:, :1], a, a.transpose(1, 2), beta=0.5, alpha=0.25))
    mod = Wrap(fn)
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    res = C.canonicalize(fx.symbolic_trace(mod), CompileContext()).graph_module
    res.recompile()
    targets = [n.target for n in res.graph.nodes if n.op != "placeholder"]
    assert C.MATMUL in targets and C.ADD in targets and "baddbmm" not in targets and torch.baddbmm not in targets
    torch.testing.assert_close(res(a, b), mod(a, b))


def test_dropout_module_stays_a_module_call():
    mod = Wrap(lambda s, a, b: s.dp(a)).eval()
    gm = C.canonicalize(fx.symbolic_trace(mod), CompileContext()).graph_module
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert node.meta["attncomp_module_dropout"] == 0.25
    a = torch.randn(3, 4)
    torch.testing.assert_close(gm(a, a), a)  # eval mode: identity


def test_non_matmul_einsum_is_kept():
    gm = fx.symbolic_trace(Wrap(lambda s, a, b: torch.einsum("bij,bij->bi", a, b)))
    res = C.canonicalize(gm, CompileContext()).graph_module
    assert any(n.target is torch.einsum for n in res.graph.nodes if n.op == "call_function")
    assert not any(n.target is C.MATMUL for n in res.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("eq,shapes", [
    ("ibnd,jbnd->bnij", ((5, 2, 3, 4), (6, 2, 3, 4))),    # XLNet's logits: sequence-first operands
    ("bnij,jbnd->ibnd", ((2, 3, 5, 6), (6, 2, 3, 4))),    # XLNet's product with v, sequence-first output
    ("ijbs,ibns->bnij", ((5, 6, 2, 2), (5, 2, 3, 2))),    # XLNet's segment term: batch letters i, b
    ("blhd,bshd->blhs", ((2, 5, 3, 4), (2, 6, 3, 4))),    # Longformer's chunks
])
def test_permuted_einsum_becomes_matmul(eq, shapes):
    """A batched matrix product written with the dims in another order is one matmul of permuted operands,
    permuted back; equal values (float64); no einsum left."""
    gm = fx.symbolic_trace(Wrap(lambda s, a, b: torch.einsum(eq, a, b)))
    res = C.canonicalize(gm, CompileContext()).graph_module
    res.recompile()
    targets = [n.target for n in res.graph.nodes if n.op == "call_function"]
    assert targets.count(C.MATMUL) == 1 and torch.einsum not in targets
    a, b = (torch.randn(*sh, dtype=torch.float64) for sh in shapes)
    torch.testing.assert_close(res(a, b), torch.einsum(eq, a, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eq", ["ibnd,hnd->ibh", "bij,bjk->bijk", "bii,bij->bij", "bij,bj->bi"])
def test_einsum_that_is_no_batched_product_is_kept(eq):
    """Two contracted letters, an output that keeps the contracted letter, a repeated letter, a vector operand."""
    assert C._einsum_permuted(eq) is None and C._einsum_to_matmul(eq) is None


def test_aten_graph_from_export_is_canonicalised():
    mod = Wrap(lambda s, a, b: F.softmax(a @ b.transpose(-1, -2) / 4.0, dim=-1) @ b).eval()
    a, b = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    gm = torch.export.export(mod, (a, b), strict=False).module()
    res = C.canonicalize(gm, CompileContext()).graph_module
    res.recompile()
    targets = {n.target for n in res.graph.nodes if n.op == "call_function"}
    assert {C.MATMUL, C.TRANSPOSE, C.MUL, C.SOFTMAX} <= targets
    assert torch.ops.aten.matmul.default not in targets
    torch.testing.assert_close(res(a, b), mod(a, b))
