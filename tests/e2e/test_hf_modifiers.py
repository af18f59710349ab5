"""Hugging Face families whose attention modifies the logits (DESIGN.md §4.2), compiled with
``attncomp.compile`` (dynamo): Gemma2 with eager attention (tanh soft-capping) and GPT-OSS (attention
sinks); Bloom (ALiBi); T5 and MPNet (a learned relative-position bias, looked up by T5's buckets). Every site is rewritten with its modifier in the spec (no tanh or sink column left to the
graph), outputs equal eager at two batch sizes and lengths, ``generate()`` equals eager's tokens and
per-step logits on a left-padded batch, and GPT-OSS, T5 and MPNet train: gradients (the sinks' and the
bias tables' included) equal eager's.
"""

from __future__ import annotations

import pytest
import torch

import attncomp
from tests.utils import rel_err

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import _GQA, H, VOCAB, seq2seq, text  # noqa: E402
from tests.e2e.test_hf_families import (TOL, _no_dropout, assert_gradients_match,  # noqa: E402
                                        assert_outputs_match)

T = transformers
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FAMILIES = {
    "gemma2_eager": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**_GQA, head_dim=16, sliding_window=8,
                                                                attn_implementation="eager")).eval(),
                     "softcap=50"),
    "gpt_oss": (lambda: T.GptOssForCausalLM(T.GptOssConfig(**_GQA, head_dim=16, sliding_window=8,
                                                           num_local_experts=4, num_experts_per_tok=2)).eval(),
                "sinks"),
}


REL = "relative bias(32 buckets, max distance 128, {}) (checked against the graph's bias index)"
ENCODERS = {
    # T5: encoder self-attention bidirectional, decoder self-attention causal, cross-attention without a bias
    "t5": (lambda: T.T5Model(T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB,
                                        decoder_start_token_id=0)).eval(), seq2seq,
           [REL.format("bidirectional")] * 2 + [REL.format("causal"), None] * 2),
    "mpnet": (lambda: T.MPNetModel(T.MPNetConfig(**H, max_position_embeddings=128, pad_token_id=1)).eval(), text,
              [REL.format("bidirectional")] * 2),
}


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", list(ENCODERS))  # (make test: T5, the first)
def test_relative_bias_family_matches_eager_and_trains(name):
    build, inputs, modifiers = ENCODERS[name]
    torch.manual_seed(0)
    model = build()
    fast = attncomp.compile(model, policy="dense")
    counts = []
    for b, n in ((2, 12), (3, 17)):
        x = inputs(b, n)
        with torch.no_grad():
            assert_outputs_match(fast(**x), model(**x), f"{name} at ({b}, {n})")
        counts.append(attncomp.report(fast).graphs)
    rep = attncomp.report(fast)
    assert [s.details.get("modifiers") for s in rep.sites] == modifiers, str(rep)
    assert all(s.rewritten for s in rep.sites)
    assert counts[1] == counts[0], f"{name}: a new batch size and length compiled new graphs ({counts})"
    _no_dropout(model).train()
    assert_gradients_match(model, fast, inputs(2, 11), name,
                           lambda names: any("relative_attention_bias" in n for n in names))


def test_bloom_alibi_is_the_modifier():
    """Bloom's ALiBi (slopes from torch.pow times positions counted from each row's first valid key, added
    with baddbmm on (B*H, Nq, Nk) logits) becomes the spec's modifier; outputs and generate() equal eager."""
    from tests.e2e.hf_zoo import ZOO

    fam = ZOO["bloom"]
    torch.manual_seed(0)
    model = fam.build()
    fast = attncomp.compile(model, policy="dense")
    counts = []
    for b, n in ((2, 12), (3, 17)):
        x = fam.inputs(b, n)
        with torch.no_grad():
            assert_outputs_match(fast(**x), model(**x), f"bloom at ({b}, {n})")
        counts.append(attncomp.report(fast).graphs)
    rep = attncomp.report(fast)
    assert [s.details.get("modifiers") for s in rep.sites] == [
        "alibi (checked against the graph's bias on the example inputs)"] * 2, str(rep)
    assert counts[1] == counts[0], f"bloom: a new batch size and length compiled new graphs ({counts})"
    x = text(3, 9, side="left")
    opts = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = model.generate(**x, **opts), fast.generate(**x, **opts)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_modifier_family_matches_eager(name):
    build, modifier = FAMILIES[name]
    torch.manual_seed(0)
    model = build()
    fast = attncomp.compile(model, policy="dense")
    for b, n in ((2, 12), (3, 17)):
        x = text(b, n)
        with torch.no_grad():
            assert_outputs_match(fast(**x), model(**x), f"{name} at ({b}, {n})")
    rep = attncomp.report(fast)
    assert len(rep.sites) == 2 and all(s.rewritten for s in rep.sites), str(rep)
    assert all(s.details.get("modifiers") == modifier for s in rep.sites), str(rep)
    assert f"modifiers: {modifier}" in str(rep)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_modifier_family_generate_equals_eager(name):
    build, _ = FAMILIES[name]
    torch.manual_seed(1)
    model = build()
    fast = attncomp.compile(model, policy="dense")
    x = text(3, 9, side="left")
    opts = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**x, **opts)
        got = fast.generate(**x, **opts)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        for row in range(a.shape[0]):
            assert rel_err(a[row], b[row]) < TOL, f"{name}: step {step}, row {row}"


def test_gpt_oss_training_gradients_equal_eager():
    build, _ = FAMILIES["gpt_oss"]
    torch.manual_seed(2)
    model = build().train()
    fast = attncomp.compile(model, policy="dense")
    assert_gradients_match(model, fast, text(2, 11), "gpt_oss", lambda names: any(n.endswith("sinks") for n in names))
    assert attncomp.report(fast).rewritten == 2
