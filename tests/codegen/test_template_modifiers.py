"""The kernel template with the score modifiers (DESIGN §4.2), under Triton's interpreter.

ALiBi, the relative-position bias, soft-capping and attention sinks, alone and combined, with every
policy (dense, dfss, hash, drop, spion) and the §4.1 predicates (causal top-left and bottom-right, a
window on position vectors, position vectors that no window reads, segments, padding), GQA, odd lengths,
float32/float16/bfloat16 and a float mask: forward ``out`` and ``lse``, backward dq/dk/dv and the gradients
of the slopes, the table and the sinks, against the reference run in float64, with every buffer the
backend allocates poisoned (NaN) before the kernels write it. Then one call through the op with
``backend="triton"``, gradients of q and of the learnable table and sinks included.
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
from attncomp.codegen.triton import schedule as S  # noqa: E402
from attncomp.spec import AttentionSpec, Modifiers, Predicates, dtype_name  # noqa: E402
from tests.codegen.template_cases import close, make_mask, make_policy, make_preds, make_qkv  # noqa: E402
from tests.utils import TOL, fresh_seed, poisoned_empty  # noqa: E402

BACKEND = TB.TritonBackend()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    monkeypatch.setattr(S, "_empty", poisoned_empty)


def make_mods(names, g, Hq):
    """``(spec fields, Modifiers)`` for the named modifiers (``alibi``, ``rel``, ``rel1`` (the table of
    a unidirectional bias), ``softcap``, ``sinks``), with random slopes, tables, caps and sinks."""
    fields, slopes, table, sinks = {}, None, None, None
    if "alibi" in names:
        fields["alibi"] = True
        slopes = torch.rand(Hq, generator=g) * 0.6 - 0.1  # (a negative slope too, now and then)
    for nm, bidir, nb in (("rel", True, 8), ("rel1", False, 6)):
        if nm in names:  # max distances below the lengths: the clamped (last) buckets are reached
            md = int(torch.randint(nb // 2 + 3, 20, (1,), generator=g))
            fields.update(rel_buckets=nb, rel_max_distance=md, rel_bidirectional=bidir)
            table = torch.randn(nb, Hq, generator=g)
    if "softcap" in names:
        fields["softcap"] = float(torch.empty(()).uniform_(3.0, 8.0, generator=g))
    if "sinks" in names:
        fields["sinks"] = True
        sinks = torch.randn(Hq, generator=g)
    return fields, Modifiers(slopes, table, sinks)


def _preds(kinds, g, B, Nq, Nk):
    """:func:`make_preds`, plus ``pos``: position vectors without a window (only the modifiers read them)."""
    fields, preds = make_preds([k for k in kinds if k != "pos"], g, B, Nq, Nk)
    if "pos" in kinds:
        qp = torch.arange(Nq)[None] * 2 + torch.randint(0, 5, (B, 1), generator=g)
        kp = torch.arange(Nk)[None] * 2 + torch.randint(0, 5, (B, 1), generator=g)
        preds = preds._replace(q_pos=qp, k_pos=kp)
    return fields, preds


# (policy, predicates, residual mask, modifiers, B, Hq, Hk, Nq, Nk, D, dtype)
CASES = [
    ("dense", ("causal",), "none", ("alibi",), 1, 2, 1, 37, 37, 32, torch.float32),
    ("dense", ("bottom_right", "k_valid"), "bool", ("rel",), 2, 2, 2, 21, 45, 64, torch.float16),
    ("dense", ("window",), "float", ("alibi", "softcap"), 1, 2, 1, 40, 40, 32, torch.float32),
    ("dense", ("segments", "q_valid"), "none", ("rel1", "sinks"), 1, 2, 1, 33, 33, 32, torch.bfloat16),
    ("dense", ("pos",), "none", ("alibi", "rel"), 2, 2, 1, 29, 35, 32, torch.float32),
    ("dense", (), "none", ("sinks",), 1, 4, 2, 19, 50, 32, torch.float16),
    ("dfss", ("bottom_right",), "none", ("softcap",), 1, 2, 1, 23, 40, 32, torch.float32),
    ("dfss", ("segments", "k_valid"), "none", ("alibi", "rel", "softcap", "sinks"), 1, 4, 2, 37, 37, 32,
     torch.float16),
    ("hash", ("causal", "k_valid"), "none", ("alibi", "rel"), 2, 2, 1, 40, 40, 32, torch.float32),
    ("hash", ("window", "q_valid"), "none", ("softcap", "sinks"), 1, 2, 1, 37, 29, 64, torch.float16),
    ("hash", ("pos",), "none", ("rel1",), 1, 2, 1, 30, 30, 32, torch.float32),
    ("drop", ("segments", "causal"), "none", ("rel", "sinks"), 1, 2, 1, 45, 45, 32, torch.float32),
    ("drop", ("bottom_right",), "none", ("alibi", "softcap"), 1, 4, 2, 19, 37, 32, torch.bfloat16),
    ("spion", ("causal",), "none", ("alibi", "rel", "softcap", "sinks"), 1, 2, 1, 45, 45, 32, torch.float32),
    ("spion", ("window", "k_valid"), "none", ("alibi",), 1, 2, 2, 37, 37, 64, torch.float16),
]


def _ids(c):
    return "-".join([c[0], "+".join(c[1]) or "nopred", c[2], "+".join(c[3]), f"H{c[5]}/{c[6]}", f"N{c[7]}x{c[8]}",
                     dtype_name(c[10])])


def _f64(mods):
    return Modifiers(*(None if t is None else t.double() for t in mods))


def draw_case(policy, kinds, mask_kind, names, B, Hq, Hk, Nq, Nk, D, dtype):
    """``(g, spec, q, k, v, mask, preds, mods, q_aux, k_aux, block_pattern)`` of a case, drawn from a fresh seed."""
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv(policy, g, B, Hq, Hk, Nq, Nk, D, dtype)
    fields, preds = _preds(kinds, g, B, Nq, Nk)
    mfields, mods = make_mods(names, g, Hq)
    mask = make_mask(mask_kind, g, B, Hq, Nq, Nk)
    pol, qa, ka, bp = make_policy(policy, g, B, Hq, Hk, Nq, Nk)
    spec = AttentionSpec(mask_kind=mask_kind, dtype=dtype_name(dtype), policy=pol, **fields, **mfields)
    return g, spec, q, k, v, mask, preds, mods, qa, ka, bp


def run_case(policy, kinds, mask_kind, names, B, Hq, Hk, Nq, Nk, D, dtype, *, dropout_p=0.0):
    g, spec, q, k, v, mask, preds, mods, qa, ka, bp = draw_case(policy, kinds, mask_kind, names, B, Hq, Hk, Nq, Nk, D,
                                                                dtype)
    seed = fresh_seed()
    tol = TOL[dtype]
    out, lse = BACKEND.forward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, preds=preds, mods=mods)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    args = dict(spec=spec, q_aux=qa, k_aux=ka, block_pattern=bp, dropout_p=dropout_p, seed=seed, preds=preds)
    ro, rl = R.attention(q.double(), k.double(), v.double(), m64, mods=_f64(mods), **args)
    close("out", out, ro, tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "rows without a kept key differ"
    fin = torch.isfinite(rl)
    close("lse", lse[fin], rl[fin], TOL[torch.float32])
    go = torch.randn(out.shape, generator=g).to(dtype)
    got = BACKEND.backward(spec, q, k, v, mask, qa, ka, bp, dropout_p, seed, out, lse, go, preds=preds, mods=mods)
    ref = R.attention_backward_mods(q.double(), k.double(), v.double(), m64, go.double(), mods=_f64(mods), **args)
    assert len(got) == 5 and got[3] is None
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], ref[:3]):
        close(name, a, b, tol, grad=True)
    for name, a, b, t in zip(("dslopes", "dtable", "dsinks"), got[4], ref[4], mods):
        assert (a is None) == (t is None), name
        if t is not None:
            assert a.shape == t.shape and a.dtype == t.dtype, name
            close(name, a, b, tol, grad=True)
    return spec, out, lse


@pytest.mark.sample(4)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_modifiers_x_policies_match_reference(case):
    run_case(*case)


def test_modifiers_with_dropout():
    run_case("dense", ("causal",), "none", ("alibi", "sinks"), 1, 2, 1, 33, 33, 32, torch.float32, dropout_p=0.2)


def test_sink_rows_without_keys():
    """A query with no allowed key outputs zeros and has ``lse = sink[h]`` (not ``-inf``)."""
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv("dense", g, 1, 2, 1, 20, 20, 32, torch.float32)
    _, mods = make_mods(("sinks",), g, 2)
    q_valid = torch.ones(1, 20, dtype=torch.bool)
    q_valid[0, 3] = False
    spec = AttentionSpec(sinks=True)
    out, lse = BACKEND.forward(spec, q, k, v, None, None, None, None, 0.0, 0, preds=Predicates(q_valid=q_valid),
                               mods=mods)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    torch.testing.assert_close(lse[0, :, 3], mods.sinks)


def test_sites_without_modifiers_launch_the_kernel_they_had():
    """No modifier: no modifier meta-parameter and only None (Triton constants) in the modifier arguments."""
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = make_qkv("dense", g, 1, 2, 1, 20, 20, 32, torch.float32)
    site = TB.Site(AttentionSpec(causal=True), q, k, v, None, 0.0, 0)
    assert not set(site.meta(16, 16)) & {"ALIBI", "REL", "SOFTCAP", "SINKS", "MPOS"}
    assert site.mod_args() == (None,) * 7
    assert BACKEND.supports(AttentionSpec(softcap=5.0, alibi=True, sinks=True), q) is None


def test_missing_modifier_tensors_raise():
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="alibi_slopes"):
        BACKEND.forward(AttentionSpec(alibi=True), q, q, q, None, None, None, None, 0.0, 0, mods=Modifiers())


def test_through_the_op():
    """``attncomp.functional.attention`` with ``backend="triton"``: out and the gradients of q, the
    learnable table and sinks equal the reference's (float64)."""
    from attncomp.functional import attention

    g = torch.Generator().manual_seed(fresh_seed())
    B, H, N, D = 1, 2, 27, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    table = torch.randn(8, H, generator=g)
    sinks = torch.randn(H, generator=g)
    kw = dict(is_causal=True, policy="dense", softcap=6.0, rel_max_distance=12)

    def run(backend, dt):
        x = [t.detach().to(dt).clone().requires_grad_() for t in (q, k, v, table, sinks)]
        out = attention(x[0], x[1], x[2], rel_table=x[3], sinks=x[4], backend=backend, **kw)
        (out * torch.linspace(-1, 1, D, dtype=dt)).sum().backward()
        return out.detach(), [t.grad for t in x]

    TB.last_configs.clear()
    out, grads = run("triton", torch.float32)
    assert {"fwd", "bwd"} <= set(TB.last_configs), "the op did not run the Triton kernels"
    ro, rgrads = run("reference", torch.float64)
    close("out", out, ro, TOL[torch.float32])
    for name, a, b in zip(("dq", "dk", "dv", "dtable", "dsinks"), grads, rgrads):
        close(name, a, b, TOL[torch.float32], grad=True)
