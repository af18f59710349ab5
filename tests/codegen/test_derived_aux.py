"""Hash buckets left out of ``attncomp::attention`` (compiled graphs leave them out): every backend
derives the policy's LSH buckets itself, in the forward and again in the backward, and computes
bit for bit what it computes when handed ``attncomp.policy.lsh_buckets``'s buckets.

Backends: the reference, TVM (when installed) and Triton under the interpreter (which derives the
buckets inside its counting sort). Shapes cover GQA (Hq != Hk), decoding (Nq < Nk, bottom-right
causal) and more queries than keys; inputs are fresh per test.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from attncomp.policy import Drop, Hash, lsh_buckets  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402
from tests.utils import fresh_seed  # noqa: E402

SHAPES = [  # B, Hq, Hk, Nq, Nk, D
    (2, 4, 2, 11, 11, 16),
    (2, 4, 2, 3, 13, 16),    # decoding: the last 3 positions against 13 cached keys
    (1, 2, 1, 19, 7, 8),
]


def _backend_ok(name):
    if name == "tvm":
        pytest.importorskip("tvm")
    if name == "triton":
        pytest.importorskip("triton")
        pytest.importorskip("numpy")


@pytest.fixture
def _tvm_cache(request, tvm_cache_dir, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tvm_cache_dir))


def _run(spec, q, k, v, q_aux, k_aux, g, before_backward=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = torch.ops.attncomp.attention(q, k, v, None, q_aux, k_aux, None, None, None, None, None, None, None,
                                            spec.to_json(), 0.0, 0)
    if before_backward is not None:
        before_backward()
    out.backward(g)
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.sample(2)
@pytest.mark.usefixtures("_tvm_cache")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", ["reference", "tvm", "triton"])
def test_op_derives_buckets_like_given_ones(backend, shape, monkeypatch):
    _backend_ok(backend)
    fused = []
    if backend == "triton":  # Triton derives them in its counting sort (once: the backward reuses them)
        from attncomp.codegen.triton import backend as TB

        real = TB.derive_layout
        monkeypatch.setattr(TB, "derive_layout", lambda *a, **kw: fused.append(1) or real(*a, **kw))
        TB._LAYOUT_CACHE.clear()
    B, Hq, Hk, Nq, Nk, D = shape
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((Hq, Nq), (Hk, Nk), (Hk, Nk)))
    g = torch.randn(B, Hq, Nq, D, generator=gen)
    pol = Hash(n_buckets=4, seed=seed % 1000)
    spec = AttentionSpec(policy=pol, causal=True, causal_align="bottom_right", backend=backend)
    qb, kb = lsh_buckets(q, k, pol.n_buckets, pol.seed)
    derived = _run(spec, q, k, v, None, None, g)
    assert len(fused) == (1 if backend == "triton" else 0)
    given = _run(spec, q, k, v, qb, kb, g)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), derived, given):
        assert torch.equal(a, b), f"{backend}: {name} with derived buckets differs from given ones"
    if backend == "triton":  # a backward that finds nothing remembered derives the same buckets again
        again = _run(spec, q, k, v, None, None, g, before_backward=TB._LAYOUT_CACHE.clear)
        assert len(fused) == 3
        for name, a, b in zip(("dq", "dk", "dv"), again[2:], given[2:]):
            assert torch.equal(a, b), f"re-derived in the backward: {name} differs"
    # the buckets matter: other buckets give another result (so equality above is not vacuous)
    other = _run(spec, q, k, v, (qb + 1) % pol.n_buckets, kb, g)
    assert not torch.equal(other[0], given[0])


def test_op_asks_for_both_bucket_tensors():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    spec = AttentionSpec(policy=Hash(n_buckets=4), backend="reference")
    qb = torch.zeros(1, 2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="both"):
        torch.ops.attncomp.attention(q, k, v, None, qb, None, None, None, None, None, None, None, None,
                                     spec.to_json(), 0.0, 0)


def test_triton_counting_sort_only_for_buckets_attncomp_derived(monkeypatch):
    """Buckets from ``attncomp.ops.materialize_aux`` lie in ``[0, n_buckets)``: the Triton backend sorts
    them by counting; a caller's ids (any range), a copy, or derived buckets written to since take
    ``torch.sort``. Every path computes the same attention."""
    _backend_ok("triton")
    from attncomp import ops
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import layout as L

    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 19, 24, 8  # (more queries than a decoding step: the sorted template)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((Hq, Nq), (Hk, Nk), (Hk, Nk)))
    pol = Hash(n_buckets=6, seed=seed % 1000)
    spec = AttentionSpec(policy=pol, backend="triton")
    paths = []
    for nm in ("counting_layout", "sorted_layout"):
        real = getattr(L, nm)
        monkeypatch.setattr(L, nm, lambda *a, _r=real, _n=nm, **kw: paths.append(_n) or _r(*a, **kw))
    monkeypatch.setattr(TB, "counting_layout", L.counting_layout)

    def run(qb, kb):
        paths.clear()
        TB._LAYOUT_CACHE.clear()
        out = torch.ops.attncomp.attention(q, k, v, None, qb, kb, None, None, None, None, None, None, None,
                                           spec.to_json(), 0.0, 0)[0]
        return out, list(paths)

    qb, kb = ops.materialize_aux(spec, q, k)
    assert ops.bucket_range(qb) == ops.bucket_range(kb) == 6
    fast, p = run(qb, kb)
    assert p == ["counting_layout"]
    user, p = run(qb.clone(), kb.clone())
    assert p == ["sorted_layout"] and torch.equal(user, fast)
    # a caller's ids outside [0, n_buckets): same partition, shifted ids, still sorted correctly
    shifted, p = run(qb.long() * 1000 - 7, kb.long() * 1000 - 7)
    assert p == ["sorted_layout"] and torch.equal(shifted, fast)
    kb.mul_(1000)                                            # written to since: its range is not known
    assert ops.bucket_range(kb) is None
    _, p = run(qb, kb)
    assert p == ["sorted_layout"]


@pytest.mark.parametrize("policy", [Hash(n_buckets=4, seed=3), Drop(q_rate=0.3, k_rate=0.3, seed=5)],
                         ids=["hash", "drop"])
def test_exported_model_derives_policy_tensors_after_load(tmp_path, policy):
    """``attncomp.export`` + ``attncomp.load`` of a compiled hash or drop model (eval mode): the
    package's graph holds no bucket derivation or keep draw (the op derives them), and the loaded
    module computes what the compiled one does (GQA, causal, other batch and length)."""
    import attncomp
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            B, N, _ = x.shape
            q = self.q(x).view(B, N, 4, 4).transpose(1, 2)
            k, v = self.kv(x).view(B, N, 2, 2, 4).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch.manual_seed(fresh_seed())
    model = M().eval()
    x = torch.randn(2, 10, 16)
    fast = attncomp.compile(model, policy=policy, example_inputs=(x,))
    path = attncomp.export(fast, str(tmp_path / "m.acpkg"))
    loaded = attncomp.load(path)
    x2 = torch.randn(3, 13, 16)                               # other batch and length: dynamic dims
    with torch.no_grad():
        want, got = fast(x2), loaded(x2)
        assert not torch.allclose(want, model(x2))           # the policy changed the result
    assert torch.equal(got, want)
    targets = {str(n.target) for n in loaded.program.graph.nodes}
    assert "attncomp.attention.default" in targets and not [t for t in targets if "policy_aux" in t], targets
