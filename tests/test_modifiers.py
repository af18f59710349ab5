"""Score modifiers (DESIGN.md §4.2): the spec's fields, the op's tensors, the functional API, and the
reference against an eager float64 statement written here, for every policy, with gradients.

``eager`` below states the semantics with plain tensor ops (no attncomp code but the policies' keep
rule, whose own tests are tests/codegen/test_reference.py): ALiBi, the T5 bucketed bias (buckets from
transformers' own ``T5Attention._relative_position_bucket`` where installed), soft-capping, the float
mask, the policy deciding on the modified logits, predicates last, a sink column in the softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

import attncomp.functional as AF
from attncomp.codegen import reference as R
from attncomp.codegen import get_backend
from attncomp.policy import get_policy
from attncomp.runtime.dispatch import select_backend
from attncomp.spec import AttentionSpec, Modifiers, Predicates, rel_bucket
from tests.utils import fresh_seed

F64 = torch.float64
POLICIES = ("dense", "dfss", "hash", "drop", "spion")


def _t5_bucket(rel, bidirectional, n, max_distance):
    T5 = pytest.importorskip("transformers").models.t5.modeling_t5.T5Attention
    return T5._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=n, max_distance=max_distance)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("n,dist", [(32, 128), (8, 16), (6, 7)])
def test_rel_bucket_is_t5s(bidirectional, n, dist):
    rel = torch.arange(-300, 301)[None] - torch.zeros(3, 1, dtype=torch.long)
    assert torch.equal(rel_bucket(rel, n, dist, bidirectional), _t5_bucket(rel, bidirectional, n, dist))


def test_mpnet_bucket_is_the_bidirectional_one():
    mp = pytest.importorskip("transformers").models.mpnet.modeling_mpnet.MPNetAttention
    enc = pytest.importorskip("transformers").models.mpnet.modeling_mpnet.MPNetEncoder
    rel = torch.arange(-300, 301)
    assert mp is not None
    assert torch.equal(rel_bucket(rel, 32, 128, True), enc.relative_position_bucket(rel, 32, 128))


def test_spec_fields_json_and_errors():
    s = AttentionSpec(softcap=30.0, alibi=True, rel_buckets=16, rel_max_distance=64, rel_bidirectional=False,
                      sinks=True)
    assert AttentionSpec.from_json(s.to_json()) == s and hash(s) == hash(AttentionSpec.from_json(s.to_json()))
    assert s.modifiers() == ("alibi", "relative bias", "softcap", "sinks")
    assert "softcap=30" in s.describe() and "relative bias(16 buckets, max distance 64, causal)" in s.describe()
    # a spec without modifiers serialises as before they existed (digests and cache keys unchanged)
    assert "softcap" not in AttentionSpec().to_json() and "sinks" not in AttentionSpec(causal=True).to_json()
    for bad in (dict(softcap=0.0), dict(softcap=-1.0), dict(softcap=float("inf")), dict(softcap=True),
                dict(rel_buckets=32), dict(rel_buckets=1, rel_max_distance=8), dict(rel_max_distance=8),
                dict(rel_buckets=32, rel_max_distance=4)):
        with pytest.raises(ValueError):
            AttentionSpec(**bad)


def _inputs(g, B=2, Hq=4, Hk=2, Nq=7, Nk=9, D=8, dtype=F64):
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hk, Nk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hk, Nk, D, generator=g, dtype=dtype)
    return q, k, v


def _policy_kw(name, g, B, Hq, Hk, Nq, Nk):
    if name == "hash":
        return dict(q_buckets=torch.randint(0, 2, (B, Hq, Nq), generator=g),
                    k_buckets=torch.randint(0, 2, (B, Hk, Nk), generator=g))
    if name == "drop":
        return dict(q_keep=torch.rand(B, Hq, Nq, generator=g) > 0.2, k_keep=torch.rand(B, Hk, Nk, generator=g) > 0.3)
    if name == "spion":
        bs = 16
        return dict(block_pattern=torch.rand(Hq, -(-Nq // bs), -(-Nk // bs), generator=g) > 0.5)
    return {}


def eager(q, k, v, *, policy, is_causal=False, attn_mask=None, softcap=None, slopes=None, table=None,
          max_distance=128, bidirectional=True, sinks=None, q_pos=None, k_pos=None, k_valid=None, **pk):
    """DESIGN.md §4.2 with plain float64 tensor ops."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Nq, D = q.shape
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    Nk = k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    qp = torch.arange(Nq)[None] if q_pos is None else q_pos
    kp = torch.arange(Nk)[None] if k_pos is None else k_pos
    rel = kp[:, None, None, :] - qp[:, None, :, None]
    if slopes is not None:
        s = s + slopes.double()[None, :, None, None] * rel
    if table is not None:
        bk = _t5_bucket(rel[:, 0], bidirectional, table.shape[0], max_distance)
        s = s + table.double()[bk].permute(0, 3, 1, 2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones(B, Hq, Nq, Nk, dtype=torch.bool)
    if attn_mask is not None:
        s = s + attn_mask.double()
        allowed = allowed & (attn_mask != float("-inf"))
    if is_causal:
        allowed = allowed & (kp[:, None, None, :] <= qp[:, None, :, None])
    if k_valid is not None:
        allowed = allowed & k_valid[:, None, None, :]
    spec = AttentionSpec(policy=get_policy(policy).resolved(torch.float64), dtype="float64")
    aux = {"hash": ("q_buckets", "k_buckets"), "drop": ("q_keep", "k_keep")}.get(policy)
    keep = R.keep_mask(spec, s, allowed, pk.get(aux[0]) if aux else None, pk.get(aux[1]) if aux else None,
                       pk.get("block_pattern"))
    cols = torch.where(keep, s, torch.tensor(float("-inf"), dtype=F64))
    if sinks is not None:
        cols = torch.cat([cols, sinks.double()[None, :, None, None].expand(B, Hq, Nq, 1)], -1)
    p = torch.softmax(cols, -1).nan_to_num(0.0)[..., :Nk]
    return p @ v


MODS = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(slopes=True),
    "rel": dict(table=True, max_distance=8),
    "rel-causal": dict(table=True, max_distance=8, bidirectional=False),
    "sinks": dict(sinks=True),
    "all": dict(softcap=2.0, slopes=True, table=True, max_distance=8, sinks=True),
}


def _draw_mods(g, mods, Hq):
    out = dict(mods)
    if mods.get("slopes"):
        out["slopes"] = torch.rand(Hq, generator=g, dtype=F64)
    if mods.get("table"):
        out["table"] = torch.randn(10, Hq, generator=g, dtype=F64)
    if mods.get("sinks"):
        out["sinks"] = torch.randn(Hq, generator=g, dtype=F64)
    return out


def _functional_kw(m):
    kw = {}
    if "softcap" in m:
        kw["softcap"] = m["softcap"]
    if "slopes" in m:
        kw["alibi_slopes"] = m["slopes"]
    if "table" in m:
        kw.update(rel_table=m["table"], rel_max_distance=m["max_distance"],
                  rel_bidirectional=m.get("bidirectional", True))
    if "sinks" in m:
        kw["sinks"] = m["sinks"]
    return kw


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("masked", ["causal", "float mask", "padding"])
def test_functional_equals_eager(policy, mod, masked):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hk, Nq, Nk = 2, 4, 2, 7, 9
    q, k, v = _inputs(g, B, Hq, Hk, Nq, Nk)
    m = _draw_mods(g, MODS[mod], Hq)
    pk = _policy_kw(policy, g, B, Hq, Hk, Nq, Nk)
    mk = {}
    if masked == "causal":
        mk = dict(is_causal=True, q_pos=torch.arange(Nq)[None] + (Nk - Nq), k_pos=torch.arange(Nk)[None])
    elif masked == "float mask":
        mk = dict(attn_mask=torch.where(torch.rand(Nq, Nk, generator=g) > 0.2, torch.randn(Nq, Nk, generator=g,
                                                                                          dtype=F64),
                                        torch.tensor(float("-inf"), dtype=F64)))
    else:
        kv = torch.rand(B, Nk, generator=g) > 0.3
        kv[0] = False  # a batch row with no valid key: zeros, with or without a sink
        mk = dict(k_valid=kv)
    want = eager(q, k, v, policy=policy, **m, **mk, **pk)
    got = AF.attention(q, k, v, policy=policy, backend="reference", enable_gqa=True, **_functional_kw(m), **mk, **pk)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=lambda s: f"seed {seed}: {s}")
    if masked == "padding":
        assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("policy", ["dense", "dfss", "hash", "drop"])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "rel", "sinks", "all"])
def test_gradcheck(policy, mod):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hk, Nq, Nk = 1, 2, 1, 3, 5
    q, k, v = _inputs(g, B, Hq, Hk, Nq, Nk, D=4)
    m = _draw_mods(g, MODS[mod], Hq)
    pk = _policy_kw(policy, g, B, Hq, Hk, Nq, Nk)
    kw = _functional_kw(m)
    names = [n for n in ("alibi_slopes", "rel_table", "sinks") if n in kw]
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + [kw[n].requires_grad_(True) for n in names]

    def f(q, k, v, *mt):
        return AF.attention(q, k, v, policy=policy, backend="reference", enable_gqa=True, is_causal=True,
                            **{**kw, **dict(zip(names, mt))}, **pk)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7), f"seed {seed}"


def test_gradients_equal_eager_autograd():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(g)
    m = _draw_mods(g, MODS["all"], 4)
    leaves = [t.requires_grad_(True) for t in (q, k, v, m["slopes"], m["table"], m["sinks"])]
    go = torch.randn(2, 4, 7, 8, generator=g, dtype=F64)
    want = torch.autograd.grad(eager(q, k, v, policy="dense", is_causal=True, **m), leaves, go)
    got = torch.autograd.grad(AF.attention(q, k, v, policy="dense", enable_gqa=True, is_causal=True,
                                           **_functional_kw(m)), leaves, go)
    for a, b, nm in zip(got, want, ("q", "k", "v", "slopes", "table", "sinks")):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda s: f"seed {seed}, d{nm}: {s}")


def test_sink_row_without_keys_and_lse():
    q, k, v = _inputs(torch.Generator().manual_seed(0), B=1, Hq=2, Hk=2, Nq=3, Nk=4)
    sinks = torch.tensor([0.5, -1.0], dtype=F64)
    spec = AttentionSpec(sinks=True, dtype="float64")
    preds = Predicates(k_valid=torch.zeros(1, 4, dtype=torch.bool))
    out, lse = R.attention(q, k, v, spec=spec, preds=preds, mods=Modifiers(sinks=sinks))
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.dtype == F64 and torch.equal(lse, sinks[None, :, None].expand(1, 2, 3))  # float64 in: float64 lse
    out, lse = R.attention(q, k, v, spec=spec, mods=Modifiers(sinks=sinks))
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    want = torch.logsumexp(torch.cat([s, sinks[None, :, None, None].expand(1, 2, 3, 1)], -1), -1)
    torch.testing.assert_close(lse, want, atol=1e-13, rtol=1e-13)


def test_op_checks_modifier_tensors():
    q, k, v = _inputs(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        AF.attention(q, k, v, policy="dense", enable_gqa=True, sinks=torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="rel_table must be a float tensor of shape"):
        AF.attention(q, k, v, policy="dense", enable_gqa=True, rel_table=torch.zeros(4, dtype=F64))
    with pytest.raises(ValueError, match="alibi_slopes must be a float tensor"):
        AF.attention(q, k, v, policy="dense", enable_gqa=True, alibi_slopes=torch.zeros(4, dtype=torch.long))
    spec = AttentionSpec(softcap=5.0, sinks=True).to_json()
    with pytest.raises(ValueError, match="the spec has attention sinks but no sinks was given"):
        torch.ops.attncomp.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, None, None,
                                     None, None, None, None, None, None, None, spec, 0.0, 0)


def test_backends_decline_modifiers_and_dispatch_runs_the_reference():
    q = torch.randn(1, 2, 4, 8)
    spec = AttentionSpec(softcap=5.0)
    for name in ("sdpa", "tvm", "triton"):
        try:
            be = get_backend(name)
        except ImportError:
            continue
        reason = be.supports(spec, q)
        if name in ("triton", "tvm"):  # their kernels apply every modifier (Triton lacks a GPU here)
            assert "softcap" in be.modifiers and (reason is None or "softcap" not in reason), reason
        else:
            assert reason is not None and "softcap" in reason, (name, reason)
    assert select_backend(spec, q, q, q).name == "reference"
    assert select_backend(AttentionSpec(), q, q, q).name == "sdpa"
    with pytest.raises(RuntimeError, match="score modifier softcap not applied by the SDPA backend"):
        select_backend(spec.replace(backend="sdpa"), q, q, q)


def test_fake_and_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(4))
            self.table = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, q, k, v):
            return AF.attention(q, k, v, policy="dense", is_causal=True, softcap=3.0, sinks=self.sinks,
                                rel_table=self.table, rel_max_distance=16)

    m = M()
    x = [torch.randn(2, 4, 6, 8) for _ in range(3)]
    ep = torch.export.export(m, tuple(x))
    torch.testing.assert_close(ep.module()(*x), m(*x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    fm = FakeTensorMode()
    fx_ = [fm.from_tensor(t) for t in x]
    fs = fm.from_tensor(torch.randn(4))
    with fm:
        out = AF.attention(*fx_, policy="dense", sinks=fs)
    assert out.shape == (2, 4, 6, 8)
