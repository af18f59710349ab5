"""The one-launch backward (``DQ_ATOMIC``): dQ added with float32 atomics in the dK/dV pass, under Triton's
interpreter.

Forced ``DQ_ATOMIC`` configurations against the reference run in float64: dense causal with GQA, padding
(``k_valid``/``q_valid``), 2:4 DFSS (queries-by-keys tiles), ``hash`` (a sorted layout: the atomics scatter
to permuted rows), SPION (a block pattern's tile lists), dropout, lengths that are not a multiple of the
tile and a head dim that is not a power of two, with every buffer the backend allocates poisoned (NaN) so
that a row left unwritten fails; each with per-element atomics and with one TMA bulk reduction per tile
(``DQ_ATOMIC=2``; the interpreter's emulation of it in ``common``). The dQ launch must be skipped. Under
PyTorch's deterministic mode the candidates hold no ``DQ_ATOMIC`` configuration and a forced one runs the
two launches, with the same result.
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
from attncomp.codegen.triton import configs  # noqa: E402
from attncomp.codegen.triton.template import MODE_DKDV, MODE_DQ, MODE_FWD  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402
from tests.codegen.template_cases import close, make_policy, make_preds, make_qkv  # noqa: E402
from tests.utils import TOL, fresh_seed, poisoned_empty  # noqa: E402

ATOMIC = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "DQ_ATOMIC": 1}


class _Launches:
    """Stands in for the backend's ``_attention_kernel``: records ``(MODE, DQ_ATOMIC)`` of every launch
    (``DQ_ATOMIC`` as launched: 0, 1, or 2 with a TMA descriptor as the ``DQ`` argument)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            mode = int(kw.get("DQ_ATOMIC", 0))
            assert (mode == 2) == (type(args[7]).__name__ == "TensorDescriptor"), "DQ_ATOMIC=2 takes a descriptor"
            self.seen.append((kw["MODE"], mode))
            return launch(*args, **kw)

        return run

    def backward(self):
        return [s for s in self.seen if s[0] != MODE_FWD]


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    rec = _Launches(TB._attention_kernel)
    monkeypatch.setattr(TB, "_attention_kernel", rec)
    return rec


def _case(policy, kinds, B, Hq, Hk, N, D, dtype, g):
    q, k, v = make_qkv(policy, g, B, Hq, Hk, N, N, D, dtype)
    fields, preds = make_preds(kinds, g, B, N, N)
    pol, qa, ka, bp = make_policy(policy, g, B, Hq, Hk, N, N)
    spec = AttentionSpec(policy=pol, **fields)
    return (q, k, v), spec, dict(preds=preds, q_aux=qa, k_aux=ka, block_pattern=bp)


def _check(policy, kinds, B, Hq, Hk, N, D, dtype, dropout_p, cfg, launches):
    """Forward and backward with ``cfg`` against the reference; returns the backward's launches."""
    g = torch.Generator().manual_seed(fresh_seed())
    (q, k, v), spec, kw = _case(policy, kinds, B, Hq, Hk, N, D, dtype, g)
    seed = fresh_seed()
    out, lse = TB.attention_forward(spec, q, k, v, None, dropout_p, seed, config=cfg, **kw)
    go = torch.randn(out.shape, generator=g).to(dtype)
    launches.seen.clear()
    got = TB.attention_backward(spec, q, k, v, None, out, lse, go, dropout_p, seed, config=cfg, **kw)
    seen = launches.backward()
    ref = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec, dropout_p=dropout_p,
                               seed=seed, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref[:3]):
        close(name, a, b, TOL[dtype], grad=True)
    return seen


@pytest.mark.sample(3)
@pytest.mark.parametrize("policy,kinds,B,Hq,Hk,N,D,dtype,dropout_p,extra", [
    ("dense", ("causal",), 2, 4, 2, 45, 40, torch.float32, 0.0, {}),
    ("dense", ("k_valid", "q_valid"), 2, 2, 1, 37, 32, torch.float16, 0.0, {}),
    ("dfss", (), 1, 2, 1, 45, 32, torch.float32, 0.0, {"NATURAL": 1}),
    ("hash", ("causal",), 2, 4, 2, 40, 32, torch.float32, 0.0, {}),
    ("dense", ("causal",), 1, 2, 1, 45, 32, torch.float32, 0.2, {}),
    ("spion", ("causal",), 2, 2, 1, 45, 32, torch.float32, 0.0, {}),
], ids=["dense-causal-gqa-D40", "padding-fp16", "dfss24-natural", "hash-causal-gqa", "dropout-causal",
        "spion-causal-gqa"])
@pytest.mark.parametrize("atomic", [1, 2], ids=["elements", "tma-reduce"])
def test_dq_atomic_matches_the_reference(launches, policy, kinds, B, Hq, Hk, N, D, dtype, dropout_p, extra, atomic):
    """Both forms: per-element atomics, and one TMA bulk reduction per tile (``DQ_ATOMIC=2``), which a
    sorted layout (``hash``: query rows permuted) declines for the element atomics."""
    seen = _check(policy, kinds, B, Hq, Hk, N, D, dtype, dropout_p, dict(ATOMIC, DQ_ATOMIC=atomic, **extra),
                  launches)
    want = 1 if policy == "hash" else atomic
    assert seen == [(MODE_DKDV, want)], f"expected one dK/dV launch with DQ_ATOMIC={want}, got {seen}"


def test_deterministic_mode_drops_atomic_dq(launches, monkeypatch):
    """Deterministic algorithms: no ``DQ_ATOMIC`` candidate, and a forced one runs the dQ launch."""

    def cands(d):
        with monkeypatch.context() as m:  # the GPU lists (the interpreter has one small candidate)
            m.setenv("TRITON_INTERPRET", "0")
            return configs.bwd_candidates(d, d, torch.bfloat16, 1)

    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    for d in (64, 128):
        assert any(c.get("DQ_ATOMIC") for c in cands(d)), "the dense tiers time DQ_ATOMIC candidates"
    try:
        torch.use_deterministic_algorithms(True)
        for d in (64, 128):
            assert cands(d) and not any(c.get("DQ_ATOMIC") for c in cands(d))
        seen = _check("dense", ("causal",), 1, 4, 2, 45, 40, torch.float32, 0.0, ATOMIC, launches)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert seen == [(MODE_DKDV, 0), (MODE_DQ, 0)], seen
    assert torch.are_deterministic_algorithms_enabled() == was
