"""The TVM backend's score modifiers (DESIGN.md §4.2: ALiBi, relative-position bias, soft-cap, attention
sinks) against the reference in float64, forward and backward.

The llvm kernels run here on fresh random inputs with poisoned output buffers: each modifier alone and
all four together, every policy TVM runs, predicates (causal, a window on given positions, positions
that only the modifiers read, key validity), GQA, odd lengths, a float and a bool mask, fp32 and one
fp16 case; ``out``/``lse``, ``dq``/``dk``/``dv`` and the gradients of the slopes, the table and the
sinks. The CUDA kernels' schedules built for the CPU (the sparse tensor-core DFSS forward, the backward
kernels) are checked the same way, and the CUDA kernels with modifiers are built to cubin where nvcc is.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("tvm")

from attncomp import functional as AF  # noqa: E402
from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.tvm import backend as TB  # noqa: E402
from attncomp.codegen.tvm import cuda  # noqa: E402
from attncomp.codegen.tvm.kernels import Variant  # noqa: E402
from attncomp.policy import DFSS, Dense, Drop, Hash, SPION  # noqa: E402
from attncomp.spec import AttentionSpec, Modifiers, Predicates, dtype_name  # noqa: E402
from tests.codegen.test_tvm import policy_tensors  # noqa: E402
from tests.utils import TOL, assert_close, fresh_generator  # noqa: E402

BACKEND = TB.TVMBackend()
pytestmark = pytest.mark.usefixtures("tvm_poisoned")

ALL = dict(alibi=True, rel=True, softcap=6.0, sinks=True)


def _inputs(g, B, Hq, Hk, Nq, Nk, D, dtype):
    return (torch.randn(B, Hq, Nq, D, generator=g).to(dtype), torch.randn(B, Hk, Nk, D, generator=g).to(dtype),
            torch.randn(B, Hk, Nk, D, generator=g).to(dtype))


def _mods(g, Hq, *, alibi=False, rel=False, sinks=False, slope=0.3, **_):
    """Fresh modifier tensors: small ALiBi slopes (so that soft-capped logits stay off the cap, where float32
    and float64 would break near-ties of a selection differently), a 12-bucket table, sinks."""
    return Modifiers(torch.rand(Hq, generator=g) * slope if alibi else None,
                     torch.randn(12, Hq, generator=g) if rel else None,
                     torch.randn(Hq, generator=g) if sinks else None)


def _spec(q, k, policy, mods_kw, mask=None, **kw):
    mk = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    extra = {}
    if mods_kw.get("rel"):
        extra.update(rel_buckets=12, rel_max_distance=20, rel_bidirectional=mods_kw.get("bidirectional", True))
    return AttentionSpec(policy=policy.resolved(q.dtype), mask_kind=mk, dtype=dtype_name(q.dtype), head_dim=q.shape[-1],
                         gqa_groups=q.shape[1] // k.shape[1], alibi=bool(mods_kw.get("alibi")),
                         softcap=mods_kw.get("softcap"), sinks=bool(mods_kw.get("sinks")), **extra, **kw)


def _preds(g, kind, B, Nq, Nk):
    if kind == "window":  # given positions (gaps, repeats), a window on them
        return dict(window_left=9), Predicates(q_pos=torch.randint(0, 60, (B, Nq), generator=g).sort(-1).values,
                                               k_pos=torch.randint(0, 60, (1, Nk), generator=g).sort(-1).values)
    if kind == "positions":  # positions that no window reads: only the modifiers do
        return {}, Predicates(q_pos=torch.randint(0, 80, (B, Nq), generator=g), k_pos=None)
    if kind == "k_valid":
        kv = torch.rand(B, Nk, generator=g) > 0.3
        kv[:, 0] = True
        return {}, Predicates(k_valid=kv)
    if kind == "bottom_right":
        return dict(causal=True, causal_align="bottom_right"), None
    if kind == "causal":
        return dict(causal=True), None
    return {}, None


def _check(policy, B, Hq, Hk, Nq, Nk, D, mods_kw, preds="none", mask=None, dtype=torch.float32):
    g = fresh_generator()
    q, k, v = _inputs(g, B, Hq, Hk, Nq, Nk, D, dtype)
    kw, pr = _preds(g, preds, B, Nq, Nk)
    am = None
    if mask == "float":
        am = torch.where(torch.rand(Nq, Nk, generator=g) > 0.2, torch.randn(Nq, Nk, generator=g),
                         torch.tensor(float("-inf"))).to(dtype)
    elif mask == "bool":  # a row with no allowed key: output 0, lse = sink (or -inf)
        am = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
        am[:, :, 2] = False
    spec = _spec(q, k, policy, mods_kw, am, **kw)
    mods = _mods(g, Hq, **mods_kw)
    qa, ka, bp = policy_tensors(policy, q, k)
    m64 = Modifiers(*(None if t is None else t.double() for t in mods))
    am64 = am if am is None or am.dtype == torch.bool else am.double()
    qd, kd, vd = q.double(), k.double(), v.double()

    out, lse = BACKEND.forward(spec, q, k, v, am, qa, ka, bp, 0.0, 0, preds=pr, mods=mods)
    rout, rlse = R.attention(qd, kd, vd, am64, spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, preds=pr, mods=m64)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, rout, dtype, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse)), "rows with lse = -inf differ"
    fin = torch.isfinite(rlse)
    assert_close(lse[fin], rlse[fin].float(), torch.float32, "lse")

    go = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv, dm, dmods = BACKEND.backward(spec, q, k, v, am, qa, ka, bp, 0.0, 0, out, lse, go, preds=pr, mods=mods)
    assert dm is None
    rq, rk, rv, _, rmods = R.attention_backward_mods(qd, kd, vd, am64, go.double(), spec=spec, mods=m64, q_aux=qa,
                                                     k_aux=ka, block_pattern=bp, preds=pr)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert_close(a, b, dtype, name)
    _close_mods(dmods, rmods, mods)
    return spec, (q, k, v, am, qa, ka, bp, pr, mods), (rout, rlse, go, rq, rk, rv, rmods)


def _close_mods(got, exp, mods):
    for name, a, b, t in zip(("dslopes", "dtable", "dsinks"), got, exp, mods):
        if t is None:
            assert a is None, name
            continue
        assert a.shape == t.shape and a.dtype == t.dtype, name
        # sums over every logit: relative to the largest entry
        atol, rtol = TOL[torch.float32]
        assert_close(a, b, torch.float32, name) if b.abs().max() < 1 else \
            torch.testing.assert_close(a.double(), b.double(), atol=atol * float(b.abs().max()), rtol=rtol)


# ---------------------------------------------------------------------------------------------
# The llvm kernels

CASES = [
    # (id, policy, B, Hq, Hk, Nq, Nk, D, modifiers, predicates, mask, dtype)
    ("dense-all-causal-gqa-float", Dense(), 1, 4, 2, 37, 45, 32, ALL, "causal", "float", torch.float32),
    ("dense-alibi-window", Dense(), 2, 2, 1, 29, 53, 32, dict(alibi=True, slope=1.0), "window", None, torch.float32),
    ("dense-rel-positions", Dense(), 2, 2, 2, 33, 40, 32, dict(rel=True, bidirectional=False), "positions", None,
     torch.float32),
    ("dense-softcap-kvalid-fp16", Dense(), 1, 2, 1, 41, 70, 32, dict(softcap=2.0), "k_valid", None, torch.float16),
    ("dense-sinks-bool", Dense(), 1, 2, 2, 23, 31, 32, dict(sinks=True), "none", "bool", torch.float32),
    ("dfss-all-bottom-right", DFSS(2, 4), 1, 2, 1, 30, 66, 32, dict(ALL, slope=0.05, softcap=20.0), "bottom_right",
     None, torch.float32),
    ("hash-all-kvalid", Hash(n_buckets=4), 1, 4, 2, 35, 47, 32, ALL, "k_valid", None, torch.float32),
    ("drop-all-window", Drop(), 2, 2, 1, 27, 39, 32, ALL, "window", None, torch.float32),
    ("spion-all-causal", SPION(block_size=16), 1, 2, 2, 45, 61, 32, ALL, "causal", None, torch.float32),
]


@pytest.mark.sample(3)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_modifiers_forward_backward(case):
    _check(*case[1:])


def test_empty_and_sink_only_rows():
    """No key at all: zeros, ``lse = sink``; gradients zero (the sinks' too: delta = 0)."""
    g = fresh_generator()
    q, k, v = _inputs(g, 1, 2, 2, 5, 0, 32, torch.float32)
    spec = _spec(q, k, Dense(), dict(sinks=True, softcap=3.0))
    mods = _mods(g, 2, sinks=True)
    out, lse = BACKEND.forward(spec, q, k, v, None, None, None, None, 0.0, 0, mods=mods)
    assert torch.all(out == 0) and torch.equal(lse, mods.sinks.reshape(1, 2, 1).expand(1, 2, 5))
    res = BACKEND.backward(spec, q, k, v, None, None, None, None, 0.0, 0, out, lse, torch.ones_like(out), mods=mods)
    assert torch.all(res[0] == 0) and torch.all(res[4].sinks == 0)


def test_through_the_op():
    """The op passes the modifier tensors to the backend and their gradients back (autograd)."""
    g = fresh_generator()
    q, k, v = (t.requires_grad_() for t in _inputs(g, 1, 4, 2, 37, 45, 32, torch.float32))
    mods = [t.requires_grad_() for t in _mods(g, 4, **ALL)]

    def run(backend, args):
        q_, k_, v_, sl, tab, sk = args
        am = torch.zeros(37, 45)  # float mask, as the first case (same kernels)
        return AF.attention(q_, k_, v_, am, policy="dense", backend=backend, is_causal=True, enable_gqa=True,
                            softcap=6.0, alibi_slopes=sl, rel_table=tab, rel_max_distance=20, sinks=sk)

    args = [q, k, v, *mods]
    got = run("tvm", args)
    grads = torch.autograd.grad(got.square().sum(), args)
    args64 = [t.detach().double().requires_grad_() for t in args]
    ref = run("reference", args64)
    rgrads = torch.autograd.grad(ref.square().sum(), args64)
    assert_close(got, ref, torch.float32, "out")
    for name, a, b in zip(("dq", "dk", "dv", "dslopes", "dtable", "dsinks"), grads, rgrads):
        atol, rtol = TOL[torch.float32]
        torch.testing.assert_close(a.double(), b, atol=atol * max(1.0, float(b.abs().max())), rtol=rtol, msg=name)


def test_variant_without_modifiers_is_unchanged():
    """A site without modifiers builds the variant (arguments, JSON, source) it built before they existed."""
    v = Variant(head_dim=64, head_dim_v=64, causal=True)
    assert not any(f in v.to_json() for f in ("alibi", "rel", "softcap", "sinks"))
    w = Variant(head_dim=64, head_dim_v=64, causal=True, alibi=True, sinks=True)
    assert w.to_json()["alibi"] and w.digest() != v.digest()
    from attncomp.codegen.tvm.kernels import arg_names

    assert arg_names("dkdv", v)[-2:] == ("scale", "qoff")
    assert arg_names("dkdv", w)[-1] == "sinks" and "dslopes" in arg_names("dkdv", w)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels' schedules built for the CPU, and their cubins


def test_cuda_backward_schedule_with_modifiers():
    g = fresh_generator()
    q, k, v = _inputs(g, 1, 4, 2, 37, 45, 32, torch.float32)
    am = torch.where(torch.rand(37, 45, generator=g) > 0.2, torch.randn(37, 45, generator=g),
                     torch.tensor(float("-inf")))
    spec = _spec(q, k, Dense(), ALL, am, causal=True)
    mods = _mods(g, 4, **ALL)
    m64 = Modifiers(*(t.double() for t in mods))
    qd, kd, vd = q.double(), k.double(), v.double()
    out, lse = R.attention(qd, kd, vd, am.double(), spec=spec, mods=m64)
    go = torch.randn(out.shape, generator=g)
    dq, dk, dv, dmods = TB.cuda_schedule_backward_on_cpu(spec, q, k, v, am, out.float(), lse, go, mods=mods)
    rq, rk, rv, _, rmods = R.attention_backward_mods(qd, kd, vd, am.double(), go.double(), spec=spec, mods=m64)
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert_close(a, b, torch.float32, name)
    _close_mods(dmods, rmods, mods)


def test_sparse_tensor_core_forward_with_modifiers():
    g = fresh_generator()
    q, k, v = _inputs(g, 1, 2, 1, 40, 70, 32, torch.float16)
    mods_kw = dict(ALL, slope=0.05, softcap=20.0)
    spec = _spec(q, k, DFSS(2, 4), mods_kw)
    mods = _mods(g, 2, **mods_kw)
    out, lse = TB.sparse_emulated_forward(spec, q, k, v, mods=mods)
    rout, rlse = R.attention(q.double(), k.double(), v.double(), None, spec=spec,
                             mods=Modifiers(*(t.double() for t in mods)))
    assert_close(out, rout, torch.float16, "out")
    assert_close(lse, rlse.float(), torch.float32, "lse")


MOD_BUILDS = [
    ("fwd", Variant(head_dim=64, head_dim_v=64, causal=True, mask="float", q_pos=True, k_pos=True, alibi=True,
                    rel=True, softcap=True, sinks=True)),
    ("dkdv", Variant(head_dim=64, head_dim_v=64, causal=True, mask="float", alibi=True, rel=True, softcap=True,
                     sinks=True)),
    ("dq", Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, softcap=True, sinks=True)),
    ("fwd", Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, mma="sp", operand_dtype="float16",
                    alibi=True, rel=True, softcap=True, sinks=True)),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kind,variant", MOD_BUILDS, ids=["fwd", "dkdv", "dq-dfss", "fwd-sp"])
def test_cuda_kernels_with_modifiers_build_to_cubin(kind, variant, tmp_path, monkeypatch):
    from attncomp.runtime.cubin import CubinKernel

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    cubin, meta = cuda.get_cubin(variant, "sm_90", kind=kind)
    assert cubin[:4] == b"\x7fELF"
    params = {p["name"]: p for p in CubinKernel(cubin, meta).meta["params"]}
    if variant.alibi:
        assert params["SLOPES_ptr"]["arg"] == "slopes"
        if kind == "dkdv":
            assert params["DSL_ptr"]["arg"] == "dslopes"
    if variant.rel:
        assert params["LUT_ptr"]["arg"] == "lut" and params["rel_md"]["kind"] == "scalar"
        if kind == "dkdv":
            assert params["DLUT_ptr"]["arg"] == "dlut"
    assert params["softcap"]["kind"] == "scalar"
    if kind == "fwd":
        assert params["SINKS_ptr"]["arg"] == "sinks"
