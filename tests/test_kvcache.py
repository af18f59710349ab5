"""KV cache layers that keep their keys' hash buckets (:mod:`attncomp.kvcache`).

After every way transformers' caches change their keys (appending a prefill and single tokens, beam search's
reordering, cropping, batch repetition and selection, reset), each layer's buckets are
:func:`attncomp.policy.lsh_side` of the keys it holds, position by position; a cache that held keys before it kept
buckets gets theirs; layers of other kinds are left as they are.
"""

from __future__ import annotations

import pytest
import torch

from attncomp.kvcache import BUCKETS_ATTR, keep_key_buckets, keeps_buckets
from attncomp.policy import Hash, lsh_side
from tests.utils import fresh_seed

transformers = pytest.importorskip("transformers")

POL = Hash(n_buckets=8, seed=3)
B, HK, D = 3, 2, 16


def _config(**kw):
    return transformers.LlamaConfig(vocab_size=32, hidden_size=HK * 2 * D, num_hidden_layers=2, num_attention_heads=HK * 2,
                                    num_key_value_heads=HK, head_dim=D, **kw)


def _check(cache, what: str) -> None:
    for i, layer in enumerate(cache.layers):
        n = int(layer.get_seq_length())
        keys = layer.keys[..., :n, :]
        want = lsh_side(keys, HK, POL.n_buckets, POL.seed)
        got = getattr(layer, BUCKETS_ATTR)[..., :n]
        assert torch.equal(got, want), f"{what}: layer {i}'s buckets are not its keys' ({n} keys)"


def _append(cache, g, n: int) -> None:
    for i in range(2):
        k = torch.randn(cache.layers[0].keys.shape[0] if cache.layers and cache.layers[0].is_initialized else B,
                        HK, n, D, generator=g)
        cache.update(k, torch.randn(k.shape, generator=g), i)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_layers_keep_the_buckets_of_their_keys(kind):
    g = torch.Generator().manual_seed(fresh_seed())
    cache = transformers.DynamicCache() if kind == "dynamic" else transformers.StaticCache(_config(), max_cache_len=12)
    kept, left = keep_key_buckets(cache, POL)
    assert left == []
    _append(cache, g, 5)  # a prefill
    assert all(keeps_buckets(layer) for layer in cache.layers) and len(cache.layers) == 2
    _check(cache, "prefill")
    for _ in range(3):
        _append(cache, g, 1)  # decoding steps
    _check(cache, "steps")
    beams = torch.tensor([2, 0, 0])
    before = [getattr(layer, BUCKETS_ATTR).clone() for layer in cache.layers]
    cache.reorder_cache(beams)
    _check(cache, "beam reorder")
    assert not torch.equal(getattr(cache.layers[0], BUCKETS_ATTR), before[0]), "the reorder moved nothing"
    if kind == "dynamic":
        cache.crop(-2)
        _check(cache, "crop")
        cache.batch_repeat_interleave(2)
        _check(cache, "batch repeat")
        cache.batch_select_indices(torch.tensor([5, 1, 2]))
        _check(cache, "batch select")
        _append(cache, g, 1)
        _check(cache, "a step after them")
    cache.reset()
    _check(cache, "reset")
    _append(cache, g, 4)
    _check(cache, "a prefill after reset")


def test_a_cache_that_held_keys_gets_their_buckets():
    """Keys appended before the cache kept buckets (an eager prefill, a cache the caller filled) get theirs when it
    starts to, and appending continues from there; a second call is a no-op, and another hash policy's buckets are
    not taken for this one's."""
    g = torch.Generator().manual_seed(fresh_seed())
    for cache in (transformers.DynamicCache(), transformers.StaticCache(_config(), max_cache_len=12)):
        _append(cache, g, 6)
        kept, _ = keep_key_buckets(cache, POL)
        assert kept == [0, 1]
        _check(cache, "held keys")
        _append(cache, g, 1)
        _check(cache, "a step after")
        assert keep_key_buckets(cache, POL) == ([0, 1], [])
        other = keep_key_buckets(cache, Hash(n_buckets=4))
        assert other[0] == [] and len(other[1]) == 2


def test_other_layers_are_left_as_they_are():
    """A window layer (it drops keys and shifts the rest) keeps no buckets: listed, not swapped."""
    cache = transformers.DynamicCache(config=_config(sliding_window=4, layer_types=["sliding_attention",
                                                                                   "full_attention"]))
    kept, left = keep_key_buckets(cache, POL)
    assert kept == [1] and [i for i, _ in left] == [0] and "Sliding" in left[0][1]
    assert not keeps_buckets(cache.layers[0]) and keeps_buckets(cache.layers[1])
    assert type(cache.layers[1]).__name__ == "DynamicLayer"  # the swapped class keeps the name users print
