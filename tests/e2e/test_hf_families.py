"""Hugging Face families as users build them (default configs: KV caches on, default attention
implementation), compiled with ``attncomp.compile`` and its default capture (dynamo).

For every family: each attention site is rewritten, outputs (caches included) equal eager in float32 at
two batch sizes and lengths with no new graph for the second, and for causal LMs ``generate()`` returns
eager's tokens and per-step logits (greedy on left-padded batches; sampled with a fixed seed for
:data:`SAMPLED`). Llama and BERT also train: gradients equal eager's (T5 trains in test_hf_modifiers.py).
"""

from __future__ import annotations

import pytest
import torch

import attncomp
from tests.utils import rel_err, sample, tensors

transformers = pytest.importorskip("transformers")

from tests.e2e.hf_zoo import ZOO, text  # noqa: E402

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def assert_outputs_match(got, want, what):
    g, w = tensors(got), tensors(want)
    assert len(g) == len(w) and len(w) > 0, f"{what}: {len(g)} output tensors, eager gives {len(w)}"
    for i, (a, b) in enumerate(zip(g, w)):
        assert a.shape == b.shape, f"{what}: output {i} has shape {tuple(a.shape)}, eager {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{what}: output {i} has NaN/inf"
        err = rel_err(a, b)
        assert err < TOL, f"{what}: output {i} differs from eager: relative error {err:.3g}"


def graphs(fast):
    return attncomp.report(fast).graphs


#: families whose every check here another test makes on the same model (modifiers, outputs at both
#: shapes, no new graph, generate()): not compiled twice in one suite
CHECKED_ELSEWHERE = {"t5": "test_hf_modifiers.py: relative bias, outputs, graphs, training",
                     "bloom": "test_hf_modifiers.py: ALiBi, outputs, graphs, generate()"}

#: the families whose generate() is also checked sampling (the draws' order is the model's, not the
#: family's: one decoder-only family of each attention layout)
SAMPLED = ("llama", "gpt2")


#: what ``make test`` runs of each list (``make test-full``, ``make zoo``: every family, and the registry sweep):
#: one family per way of writing attention: Conv1D projections and a causal buffer (gpt2), GQA with rotary
#: positions (llama), sliding windows (gemma2), an encoder with padding (bert), local and global layers
#: (modernbert), encoder-decoder cross-attention (bart), a causal text tower beside a vision tower (clip);
#: Whisper's and ViT's encoders are compiled by test_models.py, multi-query (falcon) by make test-full
SAMPLE = ("gpt2", "llama", "gemma2", "bert", "modernbert", "bart", "clip")
SAMPLE_GENERATE = ("gpt2", "llama", "gemma2")


def _cases(names, keep=SAMPLE):
    names = sample([n for n in names if n not in CHECKED_ELSEWHERE], keep)
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=ZOO[n].gap)] if ZOO[n].gap else [])
            for n in names]


@pytest.mark.parametrize("name", _cases(ZOO))
def test_family_compiles_and_matches_eager(name):
    fam = ZOO[name]
    torch.manual_seed(0)
    model = fam.build()
    fast = attncomp.compile(model, policy="dense")
    assert isinstance(fast, type(model)) and fast.config is model.config
    assert [id(p) for p in fast.parameters()] == [id(p) for p in model.parameters()]
    counts = []
    for b, n in ((2, 12), (3, 17)):
        x = fam.inputs(b, n)
        with torch.no_grad():
            assert_outputs_match(fast(**x), model(**x), f"{name} at ({b}, {n})")
        counts.append(graphs(fast))
    rep = attncomp.report(fast)
    bad = [(s.name, s.reason) for s in rep.sites if not s.rewritten]
    assert not bad, f"{name}: sites not rewritten: {bad}\n{rep}"
    assert len(rep.sites) == fam.sites, f"{name}: {len(rep.sites)} sites, expected {fam.sites}\n{rep}"
    assert "dynamo" in rep.capture
    # causal, window, packed and padding masks become predicates; only a real bias stays an input
    materialised = [(s.name, s.details.get("mask")) for s in rep.sites
                    if str(s.details.get("mask", "")).startswith("materialised")]
    assert not materialised, f"{name}: masks left materialised: {materialised}"
    assert counts[1] == counts[0], f"{name}: a new batch size and length compiled new graphs ({counts})\n{rep}"


CAUSAL = [n for n, f in ZOO.items() if f.causal_lm]


@pytest.mark.parametrize("name", _cases(CAUSAL, SAMPLE_GENERATE))
def test_generate_equals_eager(name):
    fam = ZOO[name]
    torch.manual_seed(1)
    model = fam.build()
    fast = attncomp.compile(model, policy="dense")
    x = text(3, 9, side="left")
    with torch.no_grad():
        # per-step logits as well as tokens: on a left-padded row the greedy tokens can agree while the
        # logits are wrong (positions not derived from the mask when generate() misreads the signature)
        opts = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        want = model.generate(**x, **opts)
        got = fast.generate(**x, **opts)
        assert torch.equal(got.sequences, want.sequences), \
            f"{name}: greedy tokens differ\n{got.sequences}\n{want.sequences}"
        for step, (a, b) in enumerate(zip(got.logits, want.logits)):
            for row in range(a.shape[0]):
                err = rel_err(a[row], b[row])
                assert err < TOL, f"{name}: step {step}, row {row}: logits differ from eager by {err:.3g}"
        if name in SAMPLED:
            torch.manual_seed(7)
            want = model.generate(**x, max_new_tokens=4, do_sample=True, top_k=0)
            torch.manual_seed(7)
            got = fast.generate(**x, max_new_tokens=4, do_sample=True, top_k=0)
            assert torch.equal(got, want), f"{name}: sampled tokens differ\n{got}\n{want}"
    rep = attncomp.report(fast)
    assert rep.rewritten == fam.sites == len(rep.sites), str(rep)
    assert rep.graphs <= 8, f"{name}: {rep.graphs} graphs for generate\n{rep}"


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "dropout_rate"):  # rates read at call time
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    for k in ("attention_dropout", "attention_probs_dropout_prob", "dropout_rate", "hidden_dropout_prob"):
        if hasattr(model.config, k):
            setattr(model.config, k, 0.0)
    return model


# T5 trains in tests/e2e/test_hf_modifiers.py (every gradient, its relative-bias tables' included)
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_training_gradients_equal_eager(name):
    fam = ZOO[name]
    torch.manual_seed(2)
    model = _no_dropout(fam.build()).train()
    fast = attncomp.compile(model, policy="dense")
    assert_gradients_match(model, fast, fam.inputs(2, 11), name)
    assert attncomp.report(fast).rewritten == fam.sites


def assert_gradients_match(model, fast, x, what, needed=lambda names: True):
    """One backward of a random projection of the first output through ``model`` and ``fast``: the same
    parameters get gradients (``needed(names)`` holds of them), each equal to eager's within 1e-4 of the
    largest gradient's norm (a key bias's gradient is zero up to rounding)."""
    grads, proj = [], None
    for run in (model, fast):
        model.zero_grad(set_to_none=True)
        out = tensors(run(**x))[0]
        proj = torch.randn_like(out) if proj is None else proj
        (out * proj).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and needed(want), f"{what}: parameters with gradients {sorted(want)}"
    scale = max(g.norm() for g in want.values())
    for n in want:
        err = float((got[n] - want[n]).norm() / scale)
        assert err < 1e-4, f"{what}: gradient of {n} differs: {err:.3g} of the largest gradient's norm"


def test_export_causal_lm_and_load():
    """``attncomp.export`` of a causal LM: ``use_cache=False`` in the example inputs (torch.export cannot
    output a DynamicCache; without it the error says so); the package runs new shapes."""
    import os
    import tempfile

    fam = ZOO["llama"]
    torch.manual_seed(5)
    model = fam.build()
    fast = attncomp.compile(model, policy="dense")
    x = dict(fam.inputs(2, 10), use_cache=False)
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(attncomp.CaptureError, match="use_cache=False"):
            attncomp.export(fast, os.path.join(tmp, "bad.acpkg"), example_inputs=fam.inputs(2, 10))
        path = attncomp.export(fast, os.path.join(tmp, "llama.acpkg"), example_inputs=x)
        again = attncomp.load(path)
    with torch.no_grad():
        for b, n in ((2, 10), (3, 13)):
            y = dict(fam.inputs(b, n), use_cache=False)
            got, want = again(**y), model(**y)
            assert rel_err(tensors(got)[0], want.logits) < TOL
