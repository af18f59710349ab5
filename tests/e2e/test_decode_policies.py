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
from tests.utils import rel_err, steps_vs_full_forward

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import ZOO  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _padded_generate(fast, cache, new: int, **extra):
    """``(gen, ids, mask)``: ``new`` greedy tokens from a batch of 2 prompts of 7 tokens, the second left-padded by 2,
    into a cache of kind ``cache`` (None: generate's default), with each step's logits."""
    ids = torch.randint(3, 96, (2, 7))
    am = torch.ones_like(ids)
    ids[1, :2], am[1, :2] = 0, 0
    kw = {} if cache is None else dict(cache_implementation=cache, disable_compile=True)
    with torch.no_grad():
        gen = fast.generate(input_ids=ids, attention_mask=am, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw, **extra)
    return gen, ids, am


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


@pytest.mark.parametrize("family,cache,mode,beams", [("llama", None, None, 1), ("gpt2", "static", None, 1),
                                                    ("llama", "static", "reduce-overhead", 1), ("gpt2", None, None, 2)],
                         ids=["llama-dynamic", "gpt2-static", "llama-static-reduce-overhead", "gpt2-beams"])
def test_hash_steps_read_the_buckets_the_cache_keeps(family, cache, mode, beams):
    """hash under ``generate()``: the cache's layers keep their keys' buckets (:mod:`attncomp.kvcache`), and each
    site's decoding steps take them (the report says so; the prefill derives them): each step's logits are the full
    forward's rows on a
    left-padded batch, and after generate every layer's buckets are the LSH buckets of the keys it holds, also
    after beam search has reordered the cache (whose per-step logits are the beams', not the rows')."""
    from attncomp.kvcache import BUCKETS_ATTR
    from attncomp.policy import lsh_side

    torch.manual_seed(7)
    model = ZOO[family].build()
    pol = attncomp.Hash(n_buckets=4)
    fast = attncomp.compile(model, policy=pol, mode=mode)
    gen, ids, am = _padded_generate(fast, cache, 5, num_beams=beams)
    # (before the full forwards below, which pass no cache and derive the buckets)
    # the decoding steps' graphs (one query) take the cache's buckets; the prefill's derive them in the op
    sites = [n for gm in fast.graphs for n in gm.graph.nodes if attncomp.ops.is_attention_node(n)]
    steps = [n for n in sites if n.args[0].meta["val"].shape[2] == 1]
    assert len(sites) == 2 * len(fast.graphs) and steps and len(steps) < len(sites)
    assert all((n.args[attncomp.ops.ARG_INDEX["k_aux"]] is not None) == (n in steps) for n in sites)
    rep = attncomp.report(fast)
    assert rep.rewritten == 2
    for site in rep.sites:
        assert "kept in the KV cache" in site.details.get("buckets", ""), site.details
    if beams == 1:
        err = steps_vs_full_forward(fast, gen, ids, am)
        assert err < 1e-4, f"cached decoding differs from the full forward ({err:.3g})"
    layers = gen.past_key_values.layers
    for i, layer in enumerate(layers):
        n = int(layer.get_seq_length())
        want = lsh_side(layer.keys[..., :n, :], layer.keys.shape[1], pol.n_buckets, pol.seed)
        assert torch.equal(getattr(layer, BUCKETS_ATTR)[..., :n], want), f"layer {i}'s buckets are not its keys'"


@pytest.mark.parametrize("padded,mode", [(True, None), (False, None), (False, "reduce-overhead")],
                         ids=["left-padded", "no-mask", "no-mask-reduce-overhead"])
def test_static_cache_captures_the_decode_step_once(padded, mode):
    """``generate(cache_implementation="static")`` on a compiled model: the per-step logits equal eager's (a
    left-padded batch, and one row called without ``attention_mask``), and the decode step is captured once: a later
    generate that fits the cache transformers keeps (shorter or as long) compiles no new graph, nor does any step
    (no recompile per step or per position), and the report counts the graphs (prefill and decode). (A longer
    generate makes transformers allocate a longer cache: new shapes, one more prefill and decode graph.) Under
    ``mode="reduce-overhead"`` the cache's storage is allocated before the compiled prefill (on a CPU too, where no
    CUDA graph runs): its position counter is then a tensor the mask reads before the first layer advances it in
    place."""
    torch.manual_seed(5)
    model = ZOO["llama"].build()
    fast = attncomp.compile(model, policy="dense", mode=mode)
    ids = torch.randint(3, 96, (2, 9))
    am = torch.ones_like(ids)
    ids[1, :3], am[1, :3] = 0, 0
    kw = dict(attention_mask=am, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    if not padded:
        ids = ids[:1]
        del kw["attention_mask"]
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


@pytest.mark.sample(1)
@pytest.mark.parametrize("family,policy,cache", [("mistral", "dfss", None), ("gemma2", "drop", None),
                                                 ("gemma2", "dfss", "static")])
def test_sliding_window_cache_decodes_the_full_forward(family, policy, cache):
    """A model with sliding-window layers (window 8) generating past its window: transformers' cache keeps only the
    window's keys there, which shifts key indices; dfss groups and drop's keep draws read them. The compiled
    module gives those layers every key (the mask still limits the window), so each step's logits are the full
    forward's rows, left padding included, and the report says so."""
    torch.manual_seed(6)
    model = ZOO[family].build()
    pol = attncomp.Drop(q_rate=0.3, k_rate=0.3, seed=5) if policy == "drop" else policy
    fast = attncomp.compile(model, policy=pol)
    gen, ids, am = _padded_generate(fast, cache, 6)
    err = steps_vs_full_forward(fast, gen, ids, am)
    assert err < 1e-4, f"cached decoding differs from the full forward ({err:.3g})"
    assert any("sliding-window layers keep every key" in n for n in attncomp.report(fast).notes)


def test_sliding_window_cache_that_dropped_keys_is_refused():
    """A cache whose sliding-window layer already dropped keys cannot give a policy that reads key positions the
    full forward's rows, nor can a static cache of window layers only whose length is unknown: a clear error
    instead of other logits. Dense keeps the window cache as it is."""
    from transformers import DynamicCache

    torch.manual_seed(7)
    model = ZOO["mistral"].build()
    ids = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # 12 tokens through a window of 8
        fast = attncomp.compile(model, policy="dfss")
        with pytest.raises(ValueError, match="dropped the keys before its window"):
            fast(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        dense = attncomp.compile(model, policy="dense")
        layers = list(cache.layers)
        dense(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        assert cache.layers == layers
        # a static cache of sliding layers only, at least a window long: no full layer gives its length
        with pytest.raises(ValueError, match="no full-attention layer"):
            fast.generate(input_ids=ids, max_new_tokens=2, cache_implementation="static", disable_compile=True)
