"""Parity matrix: the same specs through the reference, Triton (interpreter) and TVM (llvm) backends.

All three must run every spec of the matrix and agree with the float64 reference (and so with each
other), forward and backward. Shapes are tiny: Triton's interpreter runs each tile op through numpy.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("tvm")
triton = pytest.importorskip("triton")

from attncomp.codegen import get_backend  # noqa: E402
from attncomp.codegen import reference as R  # noqa: E402
import attncomp.codegen.triton.backend  # noqa: E402,F401
from attncomp.policy import DFSS, Dense, Drop, Hash, SPION, ceil_div  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates, dtype_name  # noqa: E402
from tests.utils import assert_close, fresh_generator  # noqa: E402



def _compiled_kernels() -> bool:
    """Whether some Triton kernel of the backend was created in compiled (not interpreter) mode."""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for nm, mod in list(sys.modules.items()):
        if nm.startswith("attncomp.codegen.triton") and mod is not None:
            for obj in vars(mod).values():
                if isinstance(obj, JITFunction) and not isinstance(obj, InterpretedFunction):
                    return True
    return False


if _compiled_kernels():
    pytest.skip("Triton kernels already imported without TRITON_INTERPRET=1; run this module alone",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _shared_kernels(tvm_cache_dir, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tvm_cache_dir))


# (name, policy, spec keywords, mask kind, predicates kind)
MATRIX = [
    ("dense", Dense(), {}, "none", None),
    ("dense-causal-boolmask", Dense(), {"causal": True}, "bool", None),
    ("dense-floatmask", Dense(), {}, "float", None),
    ("dfss-2:4", DFSS(2, 4), {}, "none", None),
    ("dfss-1:2-causal", DFSS(1, 2), {"causal": True}, "none", None),
    ("hash", Hash(n_buckets=4), {}, "none", None),
    ("drop-causal", Drop(), {"causal": True}, "none", None),
    ("spion", SPION(block_size=16), {}, "none", None),
    ("window", Dense(), {"window_left": 9, "window_right": 3}, "none", None),
    ("padding-segments", Dense(), {}, "none", "segpad"),
]


def _inputs(policy, mask_kind, preds_kind, g):
    B, Hq, Hk, Nq, Nk, D = 1, 2, 1, 21, 35, 32
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hk, Nk, D, generator=g)
    v = torch.randn(B, Hk, Nk, D, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(Nq, Nk, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(B, 1, Nq, Nk, generator=g)
        mask[torch.rand(B, 1, Nq, Nk, generator=g) < 0.2] = float("-inf")
    qa = ka = bp = None
    if isinstance(policy, Hash):
        qa, ka = torch.randint(0, 3, (B, Hq, Nq), generator=g), torch.randint(0, 3, (B, Hk, Nk), generator=g)
    elif isinstance(policy, Drop):
        qa, ka = torch.rand(B, Hq, Nq, generator=g) > 0.3, torch.rand(B, Hk, Nk, generator=g) > 0.3
    elif isinstance(policy, SPION):
        bs = policy.block_size
        bp = torch.rand(Hq, ceil_div(Nq, bs), ceil_div(Nk, bs), generator=g) > 0.5
    preds = None
    if preds_kind == "segpad":
        preds = Predicates(q_seg=torch.sort(torch.randint(0, 3, (B, Nq), generator=g)).values,
                           k_seg=torch.sort(torch.randint(0, 3, (B, Nk), generator=g)).values,
                           k_valid=torch.rand(B, Nk, generator=g) > 0.2)
    return q, k, v, mask, (qa, ka, bp), preds


def _supports(be, spec, q, preds):
    try:
        return be.supports(spec, q, preds=preds)
    except TypeError:  # a backend without predicate support yet
        return None if preds is None else "no predicate support"


@pytest.mark.sample(2)
@pytest.mark.parametrize("row", MATRIX, ids=[r[0] for r in MATRIX])
def test_parity(row):
    name, policy, kw, mask_kind, preds_kind = row
    g = fresh_generator()
    q, k, v, mask, (qa, ka, bp), preds = _inputs(policy, mask_kind, preds_kind, g)
    mk = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    spec = AttentionSpec(mask_kind=mk, dtype=dtype_name(q.dtype), head_dim=q.shape[-1],
                         gqa_groups=q.shape[1] // k.shape[1], policy=policy.resolved(q.dtype), **kw)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref, ref_lse = R.attention(q.double(), k.double(), v.double(), m64, spec=spec, q_aux=qa, k_aux=ka,
                               block_pattern=bp, preds=preds)
    go = torch.randn(ref.shape, generator=g)
    rgrads = R.attention_backward(q.double(), k.double(), v.double(), m64, go.double(), spec=spec, q_aux=qa,
                                  k_aux=ka, block_pattern=bp, preds=preds)[:3]
    ran = {}
    for bname in ("reference", "triton", "tvm"):
        be = get_backend(bname)
        why = _supports(be, spec, q, preds)
        assert why is None, f"{bname} declined {name}: {why}"
        pk = {} if preds is None else {"preds": preds}
        out, lse = be.forward(spec, q, k, v, mask, qa, ka, bp, 0.0, 0, **pk)
        assert_close(out, ref, torch.float32, f"{bname} out")
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{bname}: rows with lse = -inf differ"
        grads = be.backward(spec, q, k, v, mask, qa, ka, bp, 0.0, 0, out, lse, go, **pk)[:3]
        for nm, a, b in zip(("dq", "dk", "dv"), grads, rgrads):
            assert_close(a, b, torch.float32, f"{bname} {nm}")
        ran[bname] = out
    assert sorted(ran) == ["reference", "triton", "tvm"], f"{name}: only {sorted(ran)} ran"
    for bname, out in ran.items():  # pairwise agreement (through the reference, made explicit)
        torch.testing.assert_close(out, ran["tvm"], atol=4e-3, rtol=4e-3, msg=f"{bname} vs tvm")
