"""End to end: the torch.compile route, ``torch.compile(model, backend=attncomp.backend(...))``.

Dynamo hands its graphs (parameters lifted as inputs, ``example_value`` metadata) to the same passes
as ``attncomp.compile``: the same sites must be found and rewritten and the outputs must equal eager.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import attncomp
from tests.e2e.toys import Stack as _Stack, keep_mask, tiny_bert
from tests.utils import rel_err

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class MHA(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h, self.dh = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x, keep):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(self.dh)
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        p = s.softmax(dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(B, N, C))


def Stack(n=2):
    return _Stack(MHA, n)


_keep = keep_mask


def _bert():
    return tiny_bert()


def test_toy_matches_eager_and_reports_sites():
    model = Stack().eval()
    x, keep = torch.randn(2, 9, 32), _keep(2, 9)
    be = attncomp.backend(policy="dense")
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        got = compiled(x, keep)
        want = model(x, keep)
    assert rel_err(got, want) < TOL
    assert be.contexts, "torch.compile never called the attncomp backend"
    rep = attncomp.report(be)
    direct = attncomp.report(attncomp.compile(model, example_inputs=(x, keep)))
    assert rep.rewritten == len(rep.sites) == direct.rewritten == 2, f"{rep}\n{direct}"
    assert [s.name for s in rep.sites] == [s.name for s in direct.sites]
    assert "dynamo" in rep.capture
    assert all("bool mask" in s.spec or "padding" in s.details.get("mask", "") for s in rep.sites), \
        [(s.spec, s.details.get("mask")) for s in rep.sites]


def test_toy_backward_matches_eager():
    model = Stack().train()
    x, keep = torch.randn(2, 7, 32), _keep(2, 7)
    w = torch.randn(2, 7, 32)
    compiled = torch.compile(model, backend=attncomp.backend(policy="dense"))
    (compiled(x, keep) * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (model(x, keep) * w).sum().backward()
    for n, p in model.named_parameters():
        assert rel_err(got[n], p.grad) < TOL, n


def test_policy_through_dynamo_equals_attncomp_compile():
    """The dynamo route runs the same passes: dfss gives what attncomp.compile(policy="dfss") gives."""
    model = Stack().eval()
    x, keep = torch.randn(2, 12, 32), _keep(2, 12)
    be = attncomp.backend(policy="dfss")
    with torch.no_grad():
        got = torch.compile(model, backend=be)(x, keep)
        want = attncomp.compile(model, policy="dfss", example_inputs=(x, keep))(x, keep)
        dense = model(x, keep)
    assert all(s.policy == "dfss" for s in attncomp.report(be).sites)
    assert rel_err(got, want) < TOL
    assert rel_err(got, dense) > 1e-4


def test_bert_eager_through_dynamo():
    model = _bert().eval()
    ids = torch.randint(3, 100, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 7:] = 0
    be = attncomp.backend(policy="dense")
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=am)
        want = model(input_ids=ids, attention_mask=am)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) < TOL
    assert rel_err(got.pooler_output, want.pooler_output) < TOL
    rep = attncomp.report(be)
    assert rep.rewritten == len(rep.sites) == 2, str(rep)
    assert [s.name for s in rep.sites] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]


def test_report_counts_sites_once_after_recompilation():
    """A new shape makes dynamo compile again; the report still describes a model with 2 sites."""
    model = Stack().eval()
    be = attncomp.backend(policy="dense")
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for b, n in ((2, 9), (3, 13), (1, 4)):
            x, keep = torch.randn(b, n, 32), _keep(b, n)
            assert rel_err(compiled(x, keep), model(x, keep)) < TOL
    rep = attncomp.report(be)
    assert len(rep.sites) == 2, f"{len(be.contexts)} graphs compiled, the report lists {len(rep.sites)} sites:\n{rep}"


class MemoryLookup(nn.Module):
    """softmax(q @ M^T) @ M against a learned matrix M: not attention (DESIGN.md: left alone)."""

    def __init__(self, d=32):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.memory = nn.Parameter(torch.randn(6, d))

    def forward(self, x):
        p = torch.softmax(self.q(x) @ self.memory.t() * 0.2, dim=-1)
        return p @ self.memory


def test_parameter_keys_left_alone_under_dynamo():
    """Dynamo lifts parameters to graph inputs; they must still count as constants, not as keys."""
    model = MemoryLookup().eval()
    x = torch.randn(2, 7, 32)
    be = attncomp.backend(policy="dense")
    with torch.no_grad():
        got = torch.compile(model, backend=be)(x)
        want = model(x)
    rep = attncomp.report(be)
    assert rep.rewritten == 0, str(rep)
    assert rel_err(got, want) < TOL
    direct = attncomp.report(attncomp.compile(model, example_inputs=(x,)))
    assert direct.rewritten == 0


class _Cache:
    """A cache object given to ``forward``, as generate() gives transformers' DynamicCache."""

    def __init__(self, n=3):
        self.n = n

    def size(self):
        return self.n


def _bound_size(self):
    return self.n + 1


class BindsOnCache(nn.Module):
    """RecurrentGemma's forward binds a module-level function onto the cache it is given
    (``cache.get_mask_sizes = _get_mask_sizes.__get__(cache)``) and calls it; a graph break follows, so the
    compiled code replays the store."""

    def __init__(self):
        super().__init__()
        self.attn = MHA()

    def forward(self, x, keep, cache):
        cache.size = _bound_size.__get__(cache)
        y = self.attn(x, keep) * cache.size()
        torch._dynamo.graph_break()
        return y + 1


@pytest.mark.parametrize("route", ["compile", "backend"])
def test_function_bound_onto_an_input_object(route):
    """Dynamo (torch 2.13) named ``_bound_size.__get__(cache)`` ``cache._bound_size`` and the compiled call
    failed with AttributeError; the method is rebuilt from the function and the object instead."""
    model = BindsOnCache().eval()
    x, keep = torch.randn(2, 9, 32), _keep(2, 9)
    if route == "compile":
        fast = reported = attncomp.compile(model, policy="dense")
    else:
        reported = attncomp.backend(policy="dense")
        fast = torch.compile(model, backend=reported)
    cache = _Cache()
    with torch.no_grad():
        want = model(x, keep, _Cache())
        got = fast(x, keep, cache)
    assert rel_err(got, want) < TOL
    assert cache.size.__func__ is _bound_size and cache.size.__self__ is cache and cache.size() == 4
    assert attncomp.report(reported).rewritten == 1


class _Parent(nn.Module):
    def scale(self, y):
        return y * 2


class _Child(_Parent):
    """Binds its parent's ``scale`` onto itself, which overrides it, and keeps the bound method."""

    def __init__(self):
        super().__init__()
        self.attn = MHA()

    def scale(self, y):
        return y * 3

    def forward(self, x, keep, store):
        store.scale = _Parent.scale.__get__(self)
        y = store.scale(self.attn(x, keep))
        torch._dynamo.graph_break()
        return y


def test_parent_function_bound_onto_an_overriding_object():
    """Dynamo (torch 2.13) rebuilt ``_Parent.scale.__get__(self)`` as ``self.scale``, the child's method: the
    stored method was silently another function. It is the parent's."""
    model = _Child().eval()
    x, keep = torch.randn(2, 9, 32), _keep(2, 9)
    fast = attncomp.compile(model, policy="dense")
    store = _Cache()
    with torch.no_grad():
        got, want = fast(x, keep, store), model(x, keep, _Cache())
    assert rel_err(got, want) < TOL
    assert store.scale.__func__ is _Parent.scale and store.scale.__self__ is fast   # (forward runs on fast)
