"""The Gluon Hopper forward (``attncomp/codegen/triton/hopper.py``) on an sm_90 GPU, dense and DFSS 2:4:
every configuration of ``configs.GLUON_FWD`` / ``GLUON_FWD_SHORT`` / ``GLUON_FWD_DFSS`` (and more) against the float64
reference, output and ``lse`` written into poisoned buffers, at odd lengths, GQA, causal aligned top-left and
bottom-right, float16 and bfloat16, tied logits (DFSS); the template's backward from its ``lse``; and which
calls the backend hands to it. The backward's Gluon kernels (``hopper_bwd.py``: the warp-specialised one-launch
kernel, the dK/dV pass followed by the template's or the Gluon dQ pass, or adding dQ itself) under each
configuration of ``configs.GLUON_BWD`` (and more) against the float64 reference on the same cases, and which
backward calls take them by default.

Run in a process of its own (``pytest -m gpu tests/codegen/test_hopper_gpu.py``).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from attncomp.codegen import reference as R
from attncomp.spec import AttentionSpec, dtype_name
from tests.codegen.template_cases import close, make_preds
from tests.utils import poisoned_empty

pytestmark = pytest.mark.gpu

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("TRITON_INTERPRET=1: the GPU tests need compiled kernels", allow_module_level=True)

_TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


@pytest.fixture(autouse=True)
def TB(monkeypatch):
    pytest.importorskip("triton")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is built for sm_90 (Hopper)")
    from attncomp.codegen.triton import backend

    monkeypatch.setenv("ATTNCOMP_TRITON_TUNE", "0")
    monkeypatch.delenv("ATTNCOMP_GLUON", raising=False)
    monkeypatch.setattr(backend, "_empty", poisoned_empty)
    return backend


def _configs(D, dfss=False):
    from attncomp.codegen.triton import configs

    table = configs.GLUON_FWD_DFSS if dfss else {**configs.GLUON_FWD, **{(d, c, "short"): cfg for (d, c), cfg
                                                                     in configs.GLUON_FWD_SHORT.items()}}
    own = [c for (d, *_), c in sorted(table.items(), key=str) if d == D]
    own = [c for i, c in enumerate(own) if c not in own[:i]]
    more = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, STAGES=2, V_STAGES=2),  # two warp groups per block
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=1),  # one warp group per block
            # warp-specialised: two consumers taking turns; three
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=2, WS=True, PINGPONG=True),
            dict(BLOCK_M=192, BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=2, WS=True, PINGPONG=False)]
    if D == 128:  # (three consumers spill at D=128)
        more.pop()
    return [dict(c, KERNEL="gluon") for c in own + [c for c in more if c not in own]]


def _name(c):
    ws = (" ws" if c.get("PINGPONG", True) else " wsnp") if c.get("WS") else ""
    return "%dx%dw%ds%dv%d" % (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["STAGES"], c["V_STAGES"]) + ws


def _inputs(B, Hq, Hk, Nq, Nk, D, kinds, dtype, seed=0, policy=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g).to("cuda", dtype)
    k = torch.randn(B, Hk, Nk, D, generator=g).to("cuda", dtype)
    v = torch.randn(B, Hk, Nk, D, generator=g).to("cuda", dtype)
    go = torch.randn(B, Hq, Nq, D, generator=g).to("cuda", dtype)
    fields, preds = make_preds(kinds, g, B, Nq, Nk)
    preds = preds._replace(**{f: None if getattr(preds, f) is None else getattr(preds, f).cuda()
                              for f in preds._fields})
    spec = AttentionSpec(dtype=dtype_name(dtype), **fields)
    return (spec if policy is None else spec.replace(policy=policy)), q, k, v, go, preds


# (B, Hq, Hk, Nq, Nk, D, predicates, dtype): odd lengths, one key tile, GQA, more keys than queries
CASES = [(2, 4, 2, 1000, 1000, 64, (), torch.bfloat16),
         (1, 2, 1, 130, 130, 64, ("causal",), torch.bfloat16),
         (1, 8, 2, 300, 2100, 64, ("bottom_right",), torch.float16),
         (1, 2, 2, 77, 77, 128, (), torch.bfloat16),
         (1, 4, 4, 777, 2100, 128, ("bottom_right",), torch.float16),
         (2, 2, 2, 2048, 2048, 128, ("causal",), torch.bfloat16)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-D{c[5]}-"
                         f"{'+'.join(c[6]) or 'full'}-{dtype_name(c[7])}")
def test_gluon_forward_against_reference(TB, case):
    _check_against_reference(TB, *_inputs(*case))


def _check_against_reference(TB, spec, q, k, v, go, preds):
    D, dtype = q.shape[-1], q.dtype
    ro, rl = R.attention(q.double(), k.double(), v.double(), None, spec=spec, preds=preds)
    for cfg in _configs(D, spec.policy.name == "dfss"):
        out, lse = TB.attention_forward(spec, q, k, v, preds=preds, config=cfg)
        assert TB.last_configs["fwd"]["KERNEL"] == "gluon"
        close(f"out {_name(cfg)}", out, ro, _TOL[dtype])
        err = (lse.double() - rl).abs().nan_to_num(float("inf"))
        assert err.max() < 2e-3, (f"lse {_name(cfg)}: max error {err.max().item():.3g} at "
                                  f"{[int(i) for i in torch.unravel_index(err.argmax(), err.shape)]}")
    # the template's backward from the Gluon forward's out and lse
    rq, rk, rv, _ = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec,
                                         preds=preds)
    dq, dk, dv = TB.attention_backward(spec, q, k, v, None, out, lse, go, preds=preds)[:3]
    for name, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(name, a, b, _TOL[dtype], True)


# DFSS 2:4: the same cases with lengths rounded up to a multiple of 4 (the kernel reads keys as (N/4, 4)
# groups), still not multiples of the key tile
DFSS_CASES = [(B, Hq, Hk, -(-Nq // 4) * 4, -(-Nk // 4) * 4, *rest) for B, Hq, Hk, Nq, Nk, *rest in CASES]


def _arg(fn, args: tuple, name: str):
    """The value ``fn`` gets for its parameter ``name`` from the positional ``args`` (its default where not given)."""
    bound = inspect.signature(fn).bind(*args)
    bound.apply_defaults()
    return bound.arguments[name]


#: tied logits in every group of four keys (a member copies another's key, or holds a zero key): the lower key
#: index wins a tie, and in the backward a group's members sit in two partner threads, members 0 and 1 (2 and 3)
#: apart
TIES = {"random": None, "three": ((1, 0), (2, 0), (3, None)), "pairs": ((1, 0), (3, 2)),
        "last_three": ((2, 1), (3, 1), (0, None)), "all": ((1, 0), (2, 0), (3, 0))}


def _dfss_inputs(case, ties: str):
    """:func:`_inputs` of a DFSS 2:4 case with the keys of ``TIES[ties]``: ``(r, s)``, member ``r`` of
    every group holds member ``s``'s key (``None``: a zero key)."""
    from attncomp.policy import DFSS

    spec, q, k, v, go, preds = _inputs(*case, policy=DFSS(2, 4))
    if TIES[ties]:
        k = k.clone()
        for r, src in TIES[ties]:
            k[:, :, r::4] = 0 if src is None else k[:, :, src::4]
    return spec, q, k, v, go, preds


@pytest.mark.parametrize("ties", list(TIES))
@pytest.mark.parametrize("case", DFSS_CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-D{c[5]}-"
                         f"{'+'.join(c[6]) or 'full'}-{dtype_name(c[7])}")
def test_gluon_dfss_forward_against_reference(TB, case, ties):
    """The 2:4 selection inside the Gluon kernel keeps what the reference keeps, random logits and tied ones
    (:data:`TIES`)."""
    _check_against_reference(TB, *_dfss_inputs(case, ties))


def test_dense_calls_that_take_it(TB, monkeypatch):
    """A dense call with enough keys runs the Gluon kernel by default (and gives the template's result), so
    does a DFSS 2:4 call (the warp-specialised kernel at D=128); a mask tensor, dropout, a window, DFSS 1:2,
    a head dim with no configuration, keys not a multiple of 4 (DFSS), few keys or ``ATTNCOMP_GLUON=0``
    keep the template."""
    from attncomp.codegen.triton import configs
    from attncomp.policy import get_policy

    N = configs.GLUON_MIN_KEYS
    spec, q, k, v, go, preds = _inputs(1, 4, 2, N, N, 64, ("causal",), torch.bfloat16)
    from attncomp.codegen.triton import hopper

    TB.attention_forward(spec, q, k, v, preds=preds)
    assert TB.last_configs["fwd"].get("KERNEL") == "gluon" and TB.gluon_skipped["fwd"] is None
    # the second call of the argument class takes the short launch path, with this call's tensors
    kernel = hopper.kernel_for(TB.last_configs["fwd"])
    hits = kernel.hits
    q2 = torch.randn_like(q)
    out, lse = TB.attention_forward(spec, q2, k, v, preds=preds)
    assert kernel.hits == hits + 1
    monkeypatch.setenv("ATTNCOMP_GLUON", "0")
    ref, ref_lse = TB.attention_forward(spec, q2, k, v, preds=preds)
    assert "KERNEL" not in TB.last_configs["fwd"] and TB.gluon_skipped["fwd"] == "ATTNCOMP_GLUON=0"
    close("out vs template", out, ref, _TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    monkeypatch.delenv("ATTNCOMP_GLUON")

    # DFSS 2:4 at D=128 takes it too, warp-specialised (the template's result); 1:2 and keys that are not
    # a multiple of 4 do not
    dfss = AttentionSpec(dtype="bfloat16", causal=True, policy=get_policy("dfss").resolved(torch.bfloat16))
    _, q3, k3, v3, _, _ = _inputs(1, 4, 2, N, N, 128, ("causal",), torch.bfloat16, seed=1)
    out, lse = TB.attention_forward(dfss, q3, k3, v3)
    assert TB.last_configs["fwd"].get("KERNEL") == "gluon" and TB.gluon_skipped["fwd"] is None
    assert TB.last_configs["fwd"].get("WS")
    monkeypatch.setenv("ATTNCOMP_GLUON", "0")
    ref, ref_lse = TB.attention_forward(dfss, q3, k3, v3)
    close("dfss out vs template", out, ref, _TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    monkeypatch.delenv("ATTNCOMP_GLUON")

    mask = torch.rand(N, N, device="cuda") > 0.2
    odd = torch.randn(1, 2, N + 2, 128, device="cuda", dtype=k.dtype)
    q96, k96 = (torch.randn(1, h, N, 96, device="cuda", dtype=k.dtype) for h in (4, 2))
    cases = {"mask tensor": dict(spec=AttentionSpec(dtype="bfloat16", mask_kind="bool"), attn_mask=mask),
             "dropout": dict(spec=spec, dropout_p=0.1),
             "policy 'dfss'": dict(spec=AttentionSpec(dtype="bfloat16", causal=True,
                                                      policy=get_policy("dfss", n=1, m=2))),
             "a multiple of 4": dict(spec=dfss, q=q3, k=odd, v=odd),
             "no configuration": dict(spec=spec, q=q96, k=k96, v=k96),
             "window": dict(spec=AttentionSpec(dtype="bfloat16", causal=True, window_left=128))}
    for why, kw in cases.items():
        TB.attention_forward(kw.pop("spec"), kw.pop("q", q), kw.pop("k", k), kw.pop("v", v), **kw)
        assert "KERNEL" not in TB.last_configs["fwd"], why
        assert why in TB.gluon_skipped["fwd"], (why, TB.gluon_skipped["fwd"])
    short = k[:, :, :N // 2]
    TB.attention_forward(spec, q, short, short)
    assert "KERNEL" not in TB.last_configs["fwd"] and "keys <" in TB.gluon_skipped["fwd"]
    with pytest.raises(ValueError, match="Gluon"):
        TB.attention_forward(AttentionSpec(dtype="bfloat16"), q, k, v, attn_mask=mask,
                             config=dict(configs.GLUON_FWD[(64, False)], KERNEL="gluon"))


@pytest.mark.parametrize("policy", ["dense", "dfss"])
def test_the_op_keeps_the_gluon_plan(TB, monkeypatch, policy):
    """Repeated op calls that run the Gluon kernel go from the op to its kept plan (no backend selection,
    the short launch path), each with fresh inputs laid out as a model's projections give them, NaN-poisoned
    outputs and the float64 reference (outputs held or freed, so that address sets differ and repeat: the
    plan keeps its launch arguments per address set); ``ATTNCOMP_GLUON=0`` then sends the next call to
    the template."""
    from attncomp import ops
    from attncomp.codegen.triton import configs, hopper
    from attncomp.policy import get_policy

    monkeypatch.setattr(ops, "_CALLS", {})
    n = []
    real = ops._backend_for
    monkeypatch.setattr(ops, "_backend_for", lambda *a, **kw: n.append(1) or real(*a, **kw))
    N, D = configs.GLUON_MIN_KEYS + 4, (64 if policy == "dense" else 128)
    pol = get_policy(policy).resolved(torch.bfloat16)
    spec = AttentionSpec(dtype="bfloat16", causal=True, head_dim=D, gqa_groups=2, backend="triton", policy=pol)
    sj = spec.to_json()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, (1,))))

    def call():
        q = torch.randn(1, N, 4, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, N, 2, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(2))
        out, lse = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                                sj, 0.0, 0)
        want, want_lse = R.attention(q.double(), k.double(), v.double(), None, spec=spec)
        close("out", out, want, _TOL[torch.bfloat16])
        assert (lse.double() - want_lse).abs().nan_to_num(float("inf")).max() < 2e-3
        return out

    call()
    assert TB.last_configs["fwd"].get("KERNEL") == "gluon"
    kernel = hopper.kernel_for(TB.last_configs["fwd"])  # (DFSS at D=128: the warp-specialised kernel)
    hits = kernel.hits
    outs = [call() for _ in range(3)]  # (held: each call's output at its own address)
    outs += [call() for _ in range(2)]
    del outs
    call()  # (addresses of an earlier call again, likely: its kept launch arguments)
    assert len(n) == 1, "a repeat selected a backend: the op did not keep the plan"
    plan = next(iter(ops._CALLS.values()))
    assert type(plan).__name__ == "_GluonPlan"
    assert kernel.hits == hits + 6 and TB.last_configs["fwd"].get("KERNEL") == "gluon"
    # the plan kept launch arguments per address set of q, k, v, out and lse
    assert plan.kept is None or len(plan.launches) >= 5
    monkeypatch.setenv("ATTNCOMP_GLUON", "0")
    call()
    assert len(n) == 2 and "KERNEL" not in TB.last_configs["fwd"]


def _bwd_configs():
    """Gluon backward configurations: the dK/dV pass (queries per step, ring slots; blocks of 64 keys) followed by
    the template's or the Gluon dQ pass, or adding dQ in the pass, and the warp-specialised kernel: the
    default's, and more."""
    from attncomp.codegen.triton import configs

    own = list(configs.GLUON_BWD.values())
    more = [dict(KERNEL="gluon", BLOCK_M=bm, BLOCK_N=64, STAGES=st, num_warps=4, num_stages=2, DQ=[64, 64, 4, 2])
            for bm, st in ((32, 3), (64, 3))]
    # dQ added in the pass (TMA reductions)
    more += [dict(KERNEL="gluon", BLOCK_M=64, BLOCK_N=64, STAGES=st, num_warps=4, num_stages=2, DQ=[64, 64, 4, 2],
                  DQ_ATOMIC=2) for st in (2, 3)]
    # the dQ pass in Gluon too ([queries, keys, ring slots])
    more += [dict(KERNEL="gluon", BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4, num_stages=2, DQ_GLUON=dq)
             for dq in ([64, 64, 2], [64, 128, 2])]
    # the warp-specialised one-launch kernel (ring slots; the two passes above where it cannot run)
    more += [dict(KERNEL="gluon", BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4, num_stages=2, DQ_GLUON=[64, 64, 2],
                  WS=st) for st in (2, 3)]
    return [c for i, c in enumerate(own + more) if c not in (own + more)[:i]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-D{c[5]}-"
                         f"{'+'.join(c[6]) or 'full'}-{dtype_name(c[7])}")
def test_gluon_dkdv_pass_against_reference(TB, case):
    """The Gluon backward kernels (``hopper_bwd``, :func:`_bwd_configs`) give the float64
    reference's gradients (poisoned outputs, odd lengths, grouped heads, both causal alignments, more keys
    than queries), from the forward's ``out`` and ``lse``."""
    spec, q, k, v, go, preds = _inputs(*case)
    out, lse = TB.attention_forward(spec, q, k, v, preds=preds)
    want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec, preds=preds)[:3]
    for cfg in _bwd_configs():
        got = TB.attention_backward(spec, q, k, v, None, out, lse, go, preds=preds, config=cfg)[:3]
        assert TB.last_configs["bwd"].get("KERNEL") == "gluon"
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            close(f"{name} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}s{cfg['STAGES']} fused {cfg.get('DQ_ATOMIC', 0)} "
                  f"dq {cfg.get('DQ_GLUON')} ws {cfg.get('WS')}", a, b, _TOL[q.dtype], True)


@pytest.mark.parametrize("ties", list(TIES))
@pytest.mark.parametrize("case", DFSS_CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-D{c[5]}-"
                         f"{'+'.join(c[6]) or 'full'}-{dtype_name(c[7])}")
def test_gluon_dfss_backward_against_reference(TB, case, ties):
    """The warp-specialised backward of DFSS 2:4 (key rows read in the selection's order, logits swapped between
    partner threads) gives the float64 reference's gradients under each DFSS configuration (two and three ring
    slots; poisoned outputs, odd lengths, grouped heads, both causal alignments, more keys than queries), random
    logits and tied ones (:data:`TIES`: ties within a thread's two members and between partner threads)."""
    from attncomp.codegen.triton import configs

    spec, q, k, v, go, preds = _dfss_inputs(case, ties)
    out, lse = TB.attention_forward(spec, q, k, v, preds=preds)
    want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec, preds=preds)[:3]
    D = q.shape[-1]
    for cfg in [dict(configs.GLUON_BWD[(D, "causal" in case[6] or "bottom_right" in case[6])])] + [
            dict(KERNEL="gluon", BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4, num_stages=2, WS=3)]:
        got = TB.attention_backward(spec, q, k, v, None, out, lse, go, preds=preds, config=cfg)[:3]
        assert TB.last_configs["bwd"].get("WS") == cfg["WS"]
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            close(f"{name} ws {cfg['WS']}", a, b, _TOL[q.dtype], True)


def test_dfss_backward_runs_the_warp_specialised_kernel_by_default(TB, monkeypatch):
    """By default the backward of a DFSS 2:4 site of ``configs.GLUON_BWD_DFSS`` (D=128, causal or not) with enough
    keys runs the warp-specialised kernel, and the template's backward while PyTorch's deterministic algorithms are
    on; both give the reference's gradients. D=64 DFSS sites keep the template's backward."""
    from attncomp.codegen.triton import configs, hopper_bwd
    from attncomp.policy import DFSS

    N = configs.GLUON_MIN_KEYS + 68
    for D, kinds in ((64, ()), (64, ("causal",))):
        spec, q, k, v, go, preds = _inputs(1, 2, 1, N, N, D, kinds, torch.bfloat16, seed=3, policy=DFSS(2, 4))
        out, lse = TB.attention_forward(spec, q, k, v)
        TB.attention_backward(spec, q, k, v, None, out, lse, go)
        assert "KERNEL" not in TB.last_configs["bwd"] and "no configuration" in TB.gluon_skipped["bwd"], (D, kinds)
    spec, q, k, v, go, preds = _inputs(1, 4, 2, N, N, 128, ("causal",), torch.bfloat16, seed=9, policy=DFSS(2, 4))
    out, lse = TB.attention_forward(spec, q, k, v)
    want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec)[:3]
    ran, real = [], hopper_bwd.backward_ws
    monkeypatch.setattr(hopper_bwd, "backward_ws", lambda *a: (ran.append(_arg(real, a, "nm24")), real(*a))[1])
    for deterministic in (False, True):
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        ran.clear()
        try:
            got = TB.attention_backward(spec, q, k, v, None, out, lse, go)
        finally:
            torch.use_deterministic_algorithms(was)
        if deterministic:
            assert ran == [] and "KERNEL" not in TB.last_configs["bwd"]
            assert "deterministic" in TB.gluon_skipped["bwd"]
        else:
            assert ran == [True] and TB.gluon_skipped["bwd"] is None  # (nm24)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            close(f"{name} deterministic={deterministic}", a, b, _TOL[q.dtype], True)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_backward_runs_the_warp_specialised_kernel_by_default(TB, monkeypatch, causal, D):
    """By default the backward of a dense site at head dim 64 or 128 with enough keys, causal or not, runs the
    warp-specialised Gluon kernel (one launch, ``WS`` ring slots) and no second pass, and gives the float64
    reference's gradients (grouped heads, an odd length, poisoned outputs)."""
    from attncomp.codegen.triton import configs, hopper_bwd

    N = configs.GLUON_MIN_KEYS + 67
    spec, q, k, v, go, preds = _inputs(1, 4, 2, N, N, D, ("causal",) if causal else (), torch.bfloat16, seed=7)
    out, lse = TB.attention_forward(spec, q, k, v)
    ran, real_ws, real_dq = [], hopper_bwd.backward_ws, hopper_bwd.dq_pass
    monkeypatch.setattr(hopper_bwd, "backward_ws",
                        lambda *a: (ran.append(("ws", _arg(real_ws, a, "stages"))), real_ws(*a))[1])
    monkeypatch.setattr(hopper_bwd, "dq_pass", lambda *a: (ran.append(("dq", a[-1])), real_dq(*a))[1])
    got = TB.attention_backward(spec, q, k, v, None, out, lse, go)
    assert TB.last_configs["bwd"].get("KERNEL") == "gluon" and TB.gluon_skipped["bwd"] is None
    assert ran == [("ws", TB.last_configs["bwd"]["WS"])]
    want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec)[:3]
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(name, a, b, _TOL[q.dtype], True)


@pytest.mark.parametrize("kind", ["DQ_ATOMIC", "WS"])
def test_gluon_one_launch_backwards_keep_to_deterministic_algorithms(TB, monkeypatch, kind):
    """A configuration that adds dQ by TMA reductions (whose order varies: ``DQ_ATOMIC`` in the dK/dV pass, or the
    warp-specialised kernel ``WS``) runs two passes instead while PyTorch's deterministic algorithms are on
    (the dK/dV pass without dQ, then a dQ pass), and gives the reference's gradients either way."""
    from attncomp.codegen.triton import hopper_bwd

    spec, q, k, v, go, preds = _inputs(1, 4, 2, 700, 700, 64, ("causal",), torch.bfloat16, seed=5)
    out, lse = TB.attention_forward(spec, q, k, v)
    want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec)[:3]
    cfg = next(c for c in _bwd_configs() if c.get(kind))
    ran, real_dkdv, real_ws = [], hopper_bwd.dkdv, hopper_bwd.backward_ws
    monkeypatch.setattr(hopper_bwd, "dkdv", lambda *a: (ran.append("dkdv+dq" if len(a) > 12 and a[12] is not None
                                                                   else "dkdv"), real_dkdv(*a))[1])
    monkeypatch.setattr(hopper_bwd, "backward_ws", lambda *a: (ran.append("ws"), real_ws(*a))[1])
    one = {"DQ_ATOMIC": "dkdv+dq", "WS": "ws"}[kind]
    for deterministic in (False, True):
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        ran.clear()
        try:
            got = TB.attention_backward(spec, q, k, v, None, out, lse, go, config=cfg)
        finally:
            torch.use_deterministic_algorithms(was)
        assert ran == (["dkdv"] if deterministic else [one])
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            close(f"{name} deterministic={deterministic}", a, b, _TOL[q.dtype], True)


def test_gluon_dkdv_pass_refuses_what_it_cannot_run(TB):
    """A configuration that asks for the Gluon dK/dV pass on a call it cannot run (a mask tensor, DFSS)
    raises instead of running something else."""
    from attncomp.policy import get_policy

    spec, q, k, v, go, preds = _inputs(1, 2, 2, 256, 256, 64, (), torch.bfloat16)
    out, lse = TB.attention_forward(spec, q, k, v)
    mask = torch.rand(256, 256, device="cuda") > 0.2
    with pytest.raises(ValueError, match="Gluon backward"):
        TB.attention_backward(AttentionSpec(dtype="bfloat16", mask_kind="bool"), q, k, v, mask, out, lse, go,
                              config=_bwd_configs()[0])
    dfss = AttentionSpec(dtype="bfloat16", policy=get_policy("dfss").resolved(torch.bfloat16))
    two_passes = next(c for c in _bwd_configs() if not c.get("WS"))
    with pytest.raises(ValueError, match="DFSS without the warp-specialised kernel"):
        TB.attention_backward(dfss, q, k, v, None, out, lse, go, config=two_passes)
    # (DFSS's one launch adds dQ in a varying order)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.raises(ValueError, match="deterministic"):
            TB.attention_backward(dfss, q, k, v, None, out, lse, go, config=_bwd_configs()[0])
    finally:
        torch.use_deterministic_algorithms(was)


def test_causal_dense_backward_takes_the_gluon_dkdv_pass(TB, monkeypatch):
    """By default the backward of a causal dense site with enough keys runs the Gluon dK/dV pass
    (``configs.GLUON_BWD``) and gives the template's gradients; a head dim without a configuration (dense or DFSS), few
    keys or ``ATTNCOMP_GLUON=0`` keep the template's dK/dV pass."""
    from attncomp.codegen.triton import configs
    from attncomp.policy import get_policy

    N = configs.GLUON_MIN_KEYS + 3
    spec, q, k, v, go, preds = _inputs(1, 4, 2, N, N, 128, ("causal",), torch.bfloat16, seed=2)
    out, lse = TB.attention_forward(spec, q, k, v)
    got = TB.attention_backward(spec, q, k, v, None, out, lse, go)
    assert TB.last_configs["bwd"].get("KERNEL") == "gluon" and TB.gluon_skipped["bwd"] is None
    monkeypatch.setenv("ATTNCOMP_GLUON", "0")
    want = TB.attention_backward(spec, q, k, v, None, out, lse, go)
    assert "KERNEL" not in TB.last_configs["bwd"] and TB.gluon_skipped["bwd"] == "ATTNCOMP_GLUON=0"
    monkeypatch.delenv("ATTNCOMP_GLUON")
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(f"{name} vs template", a, b, _TOL[torch.bfloat16], True)

    dfss = spec.replace(policy=get_policy("dfss").resolved(torch.bfloat16))
    short, whole_groups = k[:, :, :N // 2], k[:, :, :N // 4 * 4]  # (DFSS: a multiple of 4 keys)
    monkeypatch.delitem(configs.GLUON_BWD, (128, True))
    monkeypatch.delitem(configs.GLUON_BWD_DFSS, (128, True))
    for why, sp, kk in (("no configuration", spec, k), ("no configuration", dfss, whole_groups),
                        ("keys <", spec, short)):
        o, l = TB.attention_forward(sp, q, kk, kk)
        TB.attention_backward(sp, q, kk, kk, None, o, l, go)
        assert "KERNEL" not in TB.last_configs["bwd"], why
        assert why in TB.gluon_skipped["bwd"], (why, TB.gluon_skipped["bwd"])
