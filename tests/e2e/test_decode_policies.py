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


def test_static_cache_captures_the_decode_step_once():
    """``generate(cache_implementation="static")`` on a compiled model: the per-step logits equal eager's (left
    padding included), and the decode step is captured once: a later generate that fits the cache transformers
    keeps (shorter or as long) compiles no new graph, nor does any step (no recompile per step or per position),
    and the report counts the graphs (prefill and decode). (A longer generate makes transformers allocate a longer
    cache: new shapes, one more prefill and decode graph.)"""
    torch.manual_seed(5)
    model = ZOO["llama"].build()
    fast = attncomp.compile(model, policy="dense")
    ids = torch.randint(3, 96, (2, 9))
    am = torch.ones_like(ids)
    ids[1, :3], am[1, :3] = 0, 0
    kw = dict(attention_mask=am, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    graphs = None
    with torch.no_grad():
        for n in (6, 3, 6):
            got = fast.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            ref = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **{**kw, "cache_implementation": None})
            assert torch.equal(got.sequences, ref.sequences)
            for a, b in zip(got.logits, ref.logits):
                assert rel_err(a, b) < 1e-4
            if n == 6 and graphs is None:
                graphs = attncomp.report(fast).graphs
    assert attncomp.report(fast).graphs == graphs <= 3, (graphs, attncomp.report(fast).graphs)
