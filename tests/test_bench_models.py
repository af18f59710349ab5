"""``benchmarks/models.py``'s ways of calling a model (``--inputs``): what each gives the compiled sites."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import attncomp  # noqa: E402
from benchmarks import models as M  # noqa: E402


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_inputs_reach_the_sites_as_documented(model, fresh_dynamo):
    import transformers

    M.T = transformers
    c = next(c for c in M.configs("cpu", smoke=True) if c["model"] == model and c["mode"] == "infer")
    words = {}
    for kind in M.INPUTS:
        x = M.inputs(dict(c, inputs=kind), "cpu")
        assert ("attention_mask" in x) == (kind == "mask") and ("position_ids" in x) == (kind == "packed")
        if kind == "packed":  # 8 documents per row, positions restarting at each
            assert int((x["position_ids"] == 0).sum(1).min()) == M.DOCUMENTS
        torch.manual_seed(0)
        m = M.build(c).eval()
        fast = attncomp.compile(m, policy="dense", inductor=False)
        with torch.no_grad():
            torch.testing.assert_close(fast(**x).last_hidden_state, m(**x).last_hidden_state, rtol=1e-4, atol=1e-5)
        words[kind] = {s.details.get("mask", "") for s in attncomp.report(fast).sites}
        torch._dynamo.reset()
    assert all("causal" in w and "documents" not in w for w in words["mask"]), words
    assert all("one document per row" in w for w in words["no-mask"]), words
    assert all("documents" in w and "one document" not in w for w in words["packed"]), words
