"""sparsify: a float mask that stays materialised keeps its masked entries out of a sparse policy's keep rule.

Models fill masked logits with ``finfo(dtype).min`` (or a fraction of it: CodeGen's is a quarter) rather than
``-inf``. As an additive bias those entries are allowed (DESIGN §4) and dense attention weighs them 0, but under
``hash`` a query whose bucket holds none of its allowed keys would keep only them and attend to the tokens the
model masked: the future ones here. The pass turns entries at or below -1e4 into ``-inf`` for sparse policies
only. Checked through ``attncomp.compile`` against the float64 reference with the masked entries excluded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attncomp
from attncomp.codegen import reference as R
from attncomp.ops import materialize_aux
from attncomp.policy import Hash
from attncomp.spec import AttentionSpec
from tests.utils import fresh_seed

B, H, N, D = 2, 2, 24, 8


class MaskedBias(nn.Module):
    """Attention with the caller's additive mask (values unknown at compile time: it stays materialised)."""

    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + mask, dim=-1) @ v


@pytest.mark.parametrize("policy", [Hash(n_buckets=8), "dense"], ids=["hash", "dense"])
def test_masked_entries_stay_masked_under_a_sparse_policy(policy):
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    bias = 0.1 * torch.randn(N, N, generator=g)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    # a small bias where allowed, a quarter of float32's lowest value where masked (CodeGen's fill)
    fill = torch.finfo(torch.float32).min / 4
    fast = attncomp.compile(MaskedBias(), policy=policy)
    with torch.no_grad():
        out = fast(q, k, v, torch.where(causal, bias, fill))
    site = attncomp.report(fast).sites[0]
    assert site.rewritten and "materialised" in site.details["mask"], site.details["mask"]
    spec = AttentionSpec(mask_kind="float", scale=D ** -0.5, dtype="float32", head_dim=D,
                         policy=attncomp.get_policy(policy).resolved(torch.float32))
    excluded = torch.where(causal, bias, float("-inf")).double()
    aux = dict(zip(("q_aux", "k_aux"), materialize_aux(spec, q, k))) if policy != "dense" else {}
    want, _ = R.attention(q.double(), k.double(), v.double(), excluded, spec=spec, **aux)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    if policy == "dense":
        assert "made -inf" not in site.details["mask"]
        return
    assert "made -inf" in site.details["mask"]
    # the case the pass exists for: with the masked entries allowed, some query keeps only future keys
    leaked, _ = R.attention(q.double(), k.double(), v.double(), torch.where(causal, bias, fill).double(), spec=spec,
                            **aux)
    assert (leaked - want).abs().amax() > 1e-2, "no query had only masked keys in its bucket: the test sees nothing"
