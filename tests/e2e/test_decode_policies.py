"""Sparse policies while decoding with a KV cache (README, "Decoding").

Each decoding step computes the last rows of what a full forward over the whole sequence computes
under the same policy: dfss selects N:M among the cached keys (groups from key 0, as in the full
sequence), hash compares the buckets of the cached keys, drop decides per absolute position (a key is
kept or dropped the same way at every step, and a query at position p as in the full sequence).
"""

from __future__ import annotations

import pytest
import torch

import attncomp
from tests.utils import rel_err

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import ZOO  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.sample(2)
@pytest.mark.parametrize("policy", ["dfss", "hash", attncomp.Drop(q_rate=0.3, k_rate=0.3, seed=5)],
                         ids=["dfss", "hash", "drop"])
def test_decode_steps_equal_full_forward(policy):
    torch.manual_seed(4)
    model = ZOO["llama"].build()
    fast = attncomp.compile(model, policy=policy)
    ids = torch.randint(3, 96, (2, 7))
    with torch.no_grad():
        gen = fast.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
        seq = gen.sequences
        for t, step_logits in enumerate(gen.logits):
            n = ids.shape[1] + t
            full = fast(input_ids=seq[:, :n], use_cache=False).logits[:, -1]
            err = rel_err(step_logits, full)
            assert err < 1e-4, f"step {t}: cached decoding differs from the full forward ({err:.3g})"
        dense = model(input_ids=seq[:, :-1], use_cache=False).logits[:, -1]
    rep = attncomp.report(fast)
    assert rep.rewritten == 2 and all(s.policy == attncomp.get_policy(policy).name for s in rep.sites), str(rep)
    assert rel_err(full, dense) > 1e-3, "the policy changed nothing: the test would not see a wrong alignment"
