"""The split-KV decode kernels (:mod:`attncomp.codegen.triton.decode`) under Triton's interpreter.

Decoding steps (1 to 16 queries, fewer than the keys) of every policy they run (dense, dfss, drop with its keep
masks given or drawn in the kernel, spion; hash with its buckets given, as a KV cache keeps them: derived
buckets decode through the template's sorted layout) with the §4.1 predicates (causal bottom-right, a window
on position vectors, segments, padding), residual masks, score modifiers, GQA groups packed into one tile of
rows, odd key counts and split counts from one to one per key tile: ``out`` and ``lse`` against the float64
reference, every buffer poisoned (NaN) before the kernels write it. Then: the template's backward from the
decode forward's ``lse``, and the route (``attention_forward`` takes the decode kernels for such calls only).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import decode as DEC  # noqa: E402
from attncomp.ops import materialize_aux  # noqa: E402
from attncomp.policy import Drop, Hash  # noqa: E402
from attncomp.spec import AttentionSpec, dtype_name  # noqa: E402
from tests.codegen.template_cases import close, given_buckets_case, make_preds, make_qkv  # noqa: E402
from tests.codegen.test_template_modifiers import _f64, draw_case  # noqa: E402
from tests.utils import TOL, fresh_seed, poisoned_empty  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    monkeypatch.setattr(DEC, "_empty", poisoned_empty)


def _launches(monkeypatch):
    """Count the decode kernels' and the template's forward launches."""
    seen = {"decode": 0}
    real = DEC.decode_forward

    def counted(*a, **kw):
        seen["decode"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(DEC, "decode_forward", counted)
    return seen


# (policy, predicates, residual mask, modifiers, B, Hq, Hk, Nq, Nk, D, dtype, n_split)
CASES = [
    ("dense", ("bottom_right",), "none", (), 2, 4, 1, 1, 77, 32, torch.float32, None),
    ("dense", ("bottom_right", "k_valid"), "bool", (), 2, 8, 2, 3, 70, 64, torch.float16, 3),
    ("dense", (), "float", (), 1, 2, 2, 16, 45, 32, torch.bfloat16, 1),
    ("dense", ("window", "segments"), "none", (), 2, 4, 2, 5, 61, 48, torch.float32, 64),
    ("dense", ("bottom_right", "q_valid"), "none", ("alibi", "softcap", "sinks"), 1, 4, 1, 2, 50, 32,
     torch.float32, 2),
    ("dense", ("bottom_right",), "none", ("rel1",), 1, 2, 1, 1, 41, 32, torch.float16, None),
    ("dfss", ("bottom_right", "k_valid"), "none", (), 2, 4, 2, 1, 83, 32, torch.float32, 2),
    ("dfss", ("segments",), "float", ("softcap",), 1, 2, 1, 4, 66, 64, torch.bfloat16, None),
    ("drop", ("bottom_right",), "none", ("sinks",), 2, 4, 1, 2, 58, 32, torch.float32, 2),
    ("drop", ("segments", "q_valid"), "none", (), 1, 2, 2, 9, 47, 32, torch.bfloat16, None),
    ("spion", ("bottom_right",), "none", (), 1, 2, 1, 3, 70, 32, torch.float32, 2),
    ("spion", ("window",), "float", ("rel",), 2, 4, 2, 1, 49, 64, torch.float16, None),
]


def _ids(c):
    return "-".join([c[0], "+".join(c[1]) or "nopred", c[2], "+".join(c[3]) or "nomod", f"H{c[5]}/{c[6]}",
                     f"N{c[7]}x{c[8]}", dtype_name(c[10]), f"s{c[11]}"])


def _decode(spec, q, k, v, mask, preds, mods, qa, ka, bp, seed, n_split):
    site = TB.Site(spec, q, k, v, mask, 0.0, seed, preds, block_pattern=bp, mods=mods, unsorted=True)
    out = TB._out_empty(q, site.Dv)
    lse = TB._empty((site.B, site.Hq, site.Nq), torch.float32, q.device)
    DEC.decode_forward(site, spec, q, k, v, out, lse, qa, ka, seed, n_split=n_split)
    return out, lse


def _check(out, lse, ro, rl, dtype):
    close("out", out, ro, TOL[dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "rows without a kept key differ"
    fin = torch.isfinite(rl)
    close("lse", lse[fin], rl[fin], TOL[torch.float32])


@pytest.mark.sample(7)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decode_matches_reference(case):
    *drawn, n_split = case
    policy, dtype = case[0], case[10]
    _, spec, q, k, v, mask, preds, mods, qa, ka, bp = draw_case(*drawn)
    assert DEC.eligible(spec, q, k, 0.0)
    out, lse = _decode(spec, q, k, v, mask, preds, mods, qa, ka, bp, 0, n_split)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp,
                         preds=preds, mods=_f64(mods))
    _check(out, lse, ro, rl, dtype)


@pytest.mark.parametrize("given", [False, True], ids=["drawn", "given"])
def test_drawn_keep_bits(given):
    """drop's keep bits drawn in the kernel equal the op's draws by position (queries at the last positions), over
    several splits, and the keys a step drops are not read: their K and V rows are NaN here (a read would put NaN
    in the output through ``0 * NaN``), with the keep masks drawn in the kernel or given. A hash spec is refused
    (its steps run the template)."""
    g = torch.Generator().manual_seed(fresh_seed())
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 3, 67, 32
    q, k, v = make_qkv("drop", g, B, Hq, Hk, Nq, Nk, D, torch.float32)
    spec = AttentionSpec(causal=True, causal_align="bottom_right", dtype="float32", policy=Drop(q_rate=0.3, k_rate=0.4))
    seed = fresh_seed()
    qa, ka = materialize_aux(spec, q, k, seed=seed)
    assert 0 < int(ka.sum()) < ka.numel()
    ro, rl = R.attention(q.double(), k.double(), v.double(), None, spec=spec, q_aux=qa, k_aux=ka)
    dropped = ~ka[..., None].expand_as(k)
    k, v = k.masked_fill(dropped, float("nan")), v.masked_fill(dropped, float("nan"))
    aux = (qa, ka) if given else (None, None)
    out, lse = _decode(spec, q, k, v, None, None, None, *aux, None, seed, 3)
    _check(out, lse, ro, rl, torch.float32)
    with pytest.raises(ValueError, match="sorted layout"):
        _decode(spec.replace(policy=Hash()), q, k, v, None, None, None, None, None, None, seed, 3)


@pytest.mark.parametrize("nq,exclude_self,preds", [(1, False, ("bottom_right",)), (3, True, ("bottom_right", "k_valid")),
                                                   (2, False, ("window",))], ids=["one-query", "exclude-self", "window"])
def test_given_buckets_read_only_their_keys(nq, exclude_self, preds):
    """hash with its buckets given (a KV cache's, :mod:`attncomp.kvcache`): the decode kernels keep a key where its
    bucket is the query row's, as the reference does, and read the K and V rows of only the keys in the bucket of
    some query row of their KV head's group: the others are NaN here (a read would put NaN in the output through
    ``0 * NaN``). LSH buckets of the vectors, 4 buckets, GQA groups of 2, several splits."""
    g = torch.Generator().manual_seed(fresh_seed())
    spec, q, k, v, pr, qa, ka, ro, rl = given_buckets_case(g, 2, 4, 2, nq, 71, 32, torch.float32, preds,
                                                           exclude_self=exclude_self)
    out, lse = _decode(spec, q, k, v, None, pr, None, qa, ka, None, 0, 3)
    _check(out, lse, ro, rl, torch.float32)
    with pytest.raises(ValueError, match="both"):
        _decode(spec, q, k, v, None, pr, None, None, ka, None, 0, 3)


def test_split_counts_agree():
    """Every split count gives the same result (the log-sum-exp merge), empty runs included."""
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv("dense", g, 1, 2, 1, 2, 70, 32, torch.float32)
    fields, preds = make_preds(("bottom_right", "k_valid"), g, 1, 2, 70)
    spec = AttentionSpec(dtype="float32", **fields)
    outs = [_decode(spec, q, k, v, None, preds, None, None, None, None, 0, s) for s in (1, 2, 5)]
    for o, l in outs[1:]:
        close("out", o, outs[0][0], (1e-5, 1e-5))
        close("lse", l, outs[0][1], (1e-5, 1e-5))


def test_route_and_backward(monkeypatch):
    """``attention_forward`` takes the decode kernels for a decoding step (and not for a prefill or a call
    with dropout); the template's backward from their ``lse`` gives the reference's gradients."""
    seen = _launches(monkeypatch)
    g = torch.Generator().manual_seed(fresh_seed())
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 2, 37, 32
    q, k, v = make_qkv("dense", g, B, Hq, Hk, Nq, Nk, D, torch.float32)
    fields, preds = make_preds(("bottom_right", "k_valid"), g, B, Nq, Nk)
    spec = AttentionSpec(dtype="float32", **fields)
    be = TB.TritonBackend()
    out, lse = be.forward(spec, q, k, v, None, None, None, None, 0.0, 0, preds=preds)
    assert seen["decode"] == 1
    ro, rl = R.attention(q.double(), k.double(), v.double(), None, spec=spec, preds=preds)
    _check(out, lse, ro, rl, torch.float32)
    go = torch.randn(out.shape, generator=g)
    got = be.backward(spec, q, k, v, None, None, None, None, 0.0, 0, out, lse, go, preds=preds)
    ref = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec, preds=preds)
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        close(name, a, b, TOL[torch.float32], grad=True)
    qq, kk, vv = make_qkv("dense", g, B, Hq, Hk, Nk, Nk, D, torch.float32)  # a prefill: the template
    be.forward(AttentionSpec(dtype="float32", causal=True), qq, kk, vv, None, None, None, None, 0.0, 0)
    be.forward(spec, q, k, v, None, None, None, None, 0.1, 0, preds=preds)  # dropout: the template
    assert seen["decode"] == 1


def test_not_eligible():
    q = torch.zeros(1, 8, 17, 16)
    k = torch.zeros(1, 2, 40, 16)
    spec = AttentionSpec()
    assert not DEC.eligible(spec, q, k, 0.0)  # 17 queries
    assert not DEC.eligible(spec, q[:, :, :16], k[:, :1], 0.0)  # 8 x 16 rows per group
    assert DEC.eligible(spec, q[:, :, :16], k, 0.0)  # 4 x 16
    assert not DEC.eligible(spec, q[:, :, :4], k[:, :, :4], 0.0)  # as many keys as queries
    assert not DEC.eligible(spec, q[:, :, :1], k, 0.5)
    assert not DEC.eligible(AttentionSpec(policy=Hash()), q[:, :, :1], k, 0.0)  # buckets derived: the template
    assert DEC.eligible(AttentionSpec(policy=Hash()), q[:, :, :1], k, 0.0, torch.zeros(1, 2, 40, dtype=torch.int32))
