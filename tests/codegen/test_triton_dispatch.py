"""The op routes every policy the Triton backend supports to its kernels (interpreter on CPU)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("numpy")

import attncomp  # noqa: E402
from attncomp.codegen import get_backend  # noqa: E402
from tests.utils import assert_close, qkv  # noqa: E402


@pytest.mark.sample(2)
@pytest.mark.parametrize("policy", ["dense", "dfss", "hash", "drop"])
@pytest.mark.parametrize("causal", [False, True])
def test_functional_on_triton_matches_reference(policy, causal):
    q, k, v = qkv(1, 4, 37, 32, Hk=2, requires_grad=True)
    extra = {}
    if policy == "hash":
        extra = dict(q_buckets=torch.randint(0, 4, (1, 4, 37)), k_buckets=torch.randint(0, 4, (1, 2, 37)))
    if policy == "drop":
        extra = dict(q_keep=torch.rand(1, 4, 37) > 0.4, k_keep=torch.rand(1, 2, 37) > 0.4)
    assert get_backend("triton").supports(attncomp.AttentionSpec(policy=attncomp.get_policy(policy)), q) is None
    outs, grads = [], []
    for backend in ("triton", "reference"):
        o = attncomp.functional.attention(q, k, v, is_causal=causal, enable_gqa=True, policy=policy,
                                          backend=backend, **extra)
        g = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        outs.append(o)
        grads.append(g)
    assert_close(outs[0], outs[1], torch.float32, msg=policy)
    for a, b in zip(grads[0], grads[1]):
        assert_close(a, b, torch.float32, msg=f"{policy} grad")



@pytest.mark.parametrize("policy", ["dense", "dfss"])
def test_op_passes_predicates_to_triton(policy):
    """The op hands the structured predicates to the Triton backend (one ``preds`` argument)."""
    q, k, v = qkv(2, 4, 21, 32, Hk=2, Nk=29, requires_grad=True)
    kw = dict(is_causal=True, causal_align="bottom_right", window=(9, None), k_valid=torch.rand(2, 29) < 0.8,
              q_seg=torch.zeros(1, 21, dtype=torch.long), k_seg=(torch.arange(29) >= 3).long()[None])
    outs, grads = [], []
    for backend in ("triton", "reference"):
        o = attncomp.functional.attention(q, k, v, enable_gqa=True, policy=policy, backend=backend, **kw)
        grads.append(torch.autograd.grad(o, (q, k, v), torch.ones_like(o)))
        outs.append(o)
    assert_close(outs[0], outs[1], torch.float32, msg=policy)
    for a, b in zip(grads[0], grads[1]):
        assert_close(a, b, torch.float32, msg=f"{policy} grad")
