"""A fixed sample of the registry sweep, run by the test suite: each family through the sweep's own
check (:func:`tests.zoo.check.check`: eager vs ``attncomp.compile(model, policy="dense")`` at two shapes
with padding, every eager attention call rewritten, ``generate()`` tokens and logits for causal LMs).

The sample spreads over the four registries and the kinds of attention (grouped-query and multi-query,
sliding windows, encoders with padding, cross-attention, relative-position biases, vision) and mostly
leaves out the families that ``tests/e2e/test_hf_families.py`` checks already. Families that do not pass
today are strict xfails carrying the sweep's measured reason: a fix flips them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.utils import sample  # noqa: E402
from tests.zoo.check import check  # noqa: E402

#: (registry, model_type, what it covers)
SAMPLE = [
    ("causal-lm", "gpt_bigcode", "multi-query attention (one KV head)"),
    ("causal-lm", "gemma3_text", "GQA, sliding-window and global layers"),
    ("causal-lm", "starcoder2", "GQA, sliding window"),
    ("causal-lm", "cohere2", "interleaved sliding-window and global layers"),
    ("causal-lm", "deepseek_v3", "multi-head latent attention (q/k head dim differs from v's)"),
    ("causal-lm", "gpt_oss", "attention sinks, sliding window"),
    ("causal-lm", "gpt_neo", "eager attention, local layers"),
    ("causal-lm", "olmo2", "q/k norms"),
    ("causal-lm", "deepseek_v4", "attention sinks next to hyper-connection mixers (a softmax that is not attention)"),
    ("causal-lm", "gpt_neox_japanese", "baddbmm logits on merged heads, viewed to 4-D, 4-D values"),
    ("causal-lm", "recurrent_gemma", "a function bound onto the generate() cache inside forward"),
    ("causal-lm", "xlnet", "sequence-first einsums, a relative-position term, a subtracted mask"),
    ("masked-lm", "albert", "one layer shared by every depth"),
    ("masked-lm", "deberta-v2", "disentangled relative-position attention (eager)"),
    ("masked-lm", "xlm-roberta", "encoder with padding"),
    ("masked-lm", "eurobert", "GQA encoder with rotary positions"),
    ("masked-lm", "squeezebert", "attention over convolution projections (eager)"),
    ("masked-lm", "funnel", "relative attention with a subtracted mask, pooled queries"),
    ("masked-lm", "flaubert", "padding mask applied with masked_fill on the scores (eager)"),
    ("seq2seq", "marian", "encoder-decoder, cross-attention"),
    ("seq2seq", "t5gemma", "GQA encoder-decoder, cross-attention"),
    ("seq2seq", "prophetnet", "n-gram (5-D) decoder self-attention"),
    ("image", "dinov2", "vision encoder"),
    ("image", "segformer", "keys from a spatially reduced sequence"),
    ("image", "data2vec-vision", "relative-position bias"),
    ("image", "siglip", "vision encoder of a CLIP-like model"),
    ("image", "perceiver", "cross-attention from learned latents"),
    ("image", "imagegpt", "causal attention over pixel tokens"),
]

#: "registry/model_type" -> the status and reason the sweep measured (tests/zoo/RESULTS.md)
FAILING: dict = {}


#: what ``make test`` runs of the sample (``make zoo`` and ``make test-full``: all of it, the families that fail
#: today too, whose fix flips their xfail): the quick ones, 13 of the 28 (each under 12 s in the sweep, but the
#: first two), covering every registry and the shapes fixed most recently
IN_MAKE_TEST = ("causal-lm/gpt_bigcode", "masked-lm/deberta-v2", "image/imagegpt", "causal-lm/olmo2",
                "causal-lm/gpt_neox_japanese", "causal-lm/recurrent_gemma", "masked-lm/xlm-roberta",
                "masked-lm/flaubert", "seq2seq/marian", "seq2seq/prophetnet", "image/data2vec-vision", "image/siglip",
                "image/perceiver")


def _params():
    out = []
    keep = sample([f"{reg}/{mt}" for reg, mt, _ in SAMPLE], IN_MAKE_TEST)
    for reg, mt, what in SAMPLE:
        if f"{reg}/{mt}" not in keep:
            continue
        key = f"{reg}/{mt}"
        marks = [pytest.mark.xfail(strict=True, reason=FAILING[key])] if key in FAILING else []
        out.append(pytest.param(reg, mt, id=key, marks=marks))
    return out


@pytest.mark.parametrize("registry,model_type", _params())
def test_family(registry, model_type, fresh_dynamo):
    torch.manual_seed(0)
    res = check(registry, model_type)
    assert res["status"] == "pass", f"{registry}/{model_type}: {res['status']}: {res['reason']}"


@pytest.mark.sample(1)
@pytest.mark.parametrize("model_type", ["gpt_oss", "cohere2"])
def test_decode_steps_of_a_window_family(model_type, fresh_dynamo):
    """The sweep's ``--decode`` check on families with sliding-window layers (and GPT-OSS's sinks): under dfss and
    drop each generate step's logits are the compiled model's full-forward rows (``make zoo-decode`` runs every
    causal LM)."""
    torch.manual_seed(0)
    res = check("causal-lm", model_type, decode=("dfss", "drop"))
    assert res["status"] == "pass", f"{model_type}: {res['status']}: {res['reason']}"
    assert res["details"]["decode_dfss_err"] < 1e-4 and res["details"]["decode_drop_err"] < 1e-4


def test_hash_steps_take_the_cache_buckets_through_an_upcast(fresh_dynamo):
    """The sweep's ``--decode hash`` check on GPT-J, which upcasts the cache's keys to float32 before attending: every
    decoding step's site still takes the buckets the cache keeps (an upcast keeps the keys' buckets), and each step's
    logits are the full forward's rows."""
    torch.manual_seed(0)
    res = check("causal-lm", "gptj", decode=("hash",))
    assert res["status"] == "pass", f"gptj: {res['status']}: {res['reason']}"
    took, steps = map(int, res["details"]["decode_hash_cached"].split("/"))
    assert steps > 0 and took == steps, res["details"]["decode_hash_cached"]
    assert res["details"]["decode_hash_err"] < 1e-4


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_decode_into_an_initialised_static_cache(model_type, fresh_dynamo):
    """The sweep's ``--decode static`` check: the dense compiled model generates into a static cache a forward already
    initialised (a left-padded batch, and a row without ``attention_mask``, whose mask is built from the cache's
    position counter) with eager's step logits."""
    torch.manual_seed(0)
    res = check("causal-lm", model_type, decode=("static",))
    assert res["status"] == "pass", f"{model_type}: {res['status']}: {res['reason']}"
    assert res["details"]["static"].startswith("static cache: steps within"), res["details"]["static"]
