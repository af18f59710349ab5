"""SPION end to end on a Hugging Face encoder: the default compile (dynamo, Inductor around the op),
dense phase equal to eager, calibration to per-layer patterns, sparse training step, report, and an
exported package that keeps the patterns without the live state."""

from __future__ import annotations

import pytest
import torch

import attncomp
from attncomp import spion
from tests.utils import rel_err

T = pytest.importorskip("transformers")

VOCAB = 100


def _bert():
    torch.manual_seed(0)
    return T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                                    attn_implementation="eager", hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0))


def _inputs(b, n, g):
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1:, n - 5:] = 0       # right padding: a key-padding predicate at the sites
    return dict(input_ids=torch.randint(3, VOCAB, (b, n), generator=g), attention_mask=mask)


def test_bert_training_switches_under_the_default_pipeline():
    # dynamo capture, Inductor around the op: the dense phase trains, records, and switches (Alg. 2)
    g = torch.Generator().manual_seed(3)
    model = _bert().train()
    fast = attncomp.compile(model, policy=attncomp.SPION(block_size=16, threshold=0.7, alpha=10.0, interval=1),
                            backend="reference")
    x = _inputs(2, 48, g)
    for step in range(4):
        model.zero_grad()
        out = fast(**x).last_hidden_state
        if step == 0:
            assert rel_err(out, model(**x).last_hidden_state) < 1e-4   # dense phase: the model's attention
        out.square().mean().backward()
        qw = model.encoder.layer[0].attention.self.query.weight.grad
        assert qw is not None and torch.isfinite(qw).all() and qw.abs().sum() > 0
    rep = attncomp.report(fast)
    assert len(rep.sites) == 2 and all(s.rewritten and s.policy == "spion" for s in rep.sites), str(rep)
    pats = spion.patterns(fast)
    assert len(pats) == 2 and all(p is not None and p.shape == (1, 3, 3) for p in pats.values())
    assert str(rep).count("switched at training step 3") == 2
    # the last step ran sparse: its output differs from dense attention's
    with torch.no_grad():
        assert rel_err(fast(**x).last_hidden_state, model(**x).last_hidden_state) > 1e-4


def test_bert_calibrate_and_set_patterns():
    g = torch.Generator().manual_seed(1)
    model = _bert().eval()
    fast = attncomp.compile(model, policy=attncomp.SPION(block_size=16, threshold=0.7), backend="reference",
                            inductor=False)
    x = _inputs(2, 48, g)
    with torch.no_grad():
        want = model(**x).last_hidden_state
        got = fast(**x).last_hidden_state
    assert rel_err(got, want) < 1e-4                     # dense phase: the model's own attention
    pats = spion.calibrate(fast, [_inputs(2, 48, g) for _ in range(2)])
    assert len(pats) == 2
    for name, p in pats.items():
        assert p.shape == (1, 3, 3) and p[0].diagonal().all(), name
    assert "calibrate, 2 batch(es)" in str(attncomp.report(fast))
    # all-True patterns are dense again (negative twin of the sparse run below)
    spion.set_patterns(fast, {n: torch.ones(3, 3, dtype=torch.bool) for n in pats})
    with torch.no_grad():
        assert rel_err(fast(**x).last_hidden_state, want) < 1e-4
    spion.set_patterns(fast, {n: torch.eye(3, dtype=torch.bool) for n in pats})  # diagonal blocks only
    with torch.no_grad():
        out = fast(**x).last_hidden_state
    assert torch.isfinite(out).all() and rel_err(out, want) > 1e-3
    # a longer input: the patterns are extended along their band
    with torch.no_grad():
        out = fast(**_inputs(2, 60, g)).last_hidden_state
    assert torch.isfinite(out).all()


def test_export_keeps_patterns(tmp_path):
    g = torch.Generator().manual_seed(2)
    model = _bert().eval()
    x = _inputs(2, 48, g)
    fast = attncomp.compile(model, policy=attncomp.SPION(block_size=16, threshold=0.7), backend="reference",
                            capture="export", example_inputs=x)
    spion.calibrate(fast, [x])
    pats = {n: torch.eye(3, dtype=torch.bool) | torch.rand(3, 3, generator=g).lt(0.4)
            for n in spion.patterns(fast)}
    spion.set_patterns(fast, pats)
    with torch.no_grad():
        want = fast(**x).last_hidden_state
        dense = model(**x).last_hidden_state
    path = attncomp.export(fast, str(tmp_path / "bert-spion.acpkg"), example_inputs=x)
    st = spion.state_of(fast)
    # the package alone (no live state in this process) runs the exported patterns
    spion._STATES.pop(st.uid)
    try:
        loaded = attncomp.load(path)
        with torch.no_grad():
            got = loaded(**x).last_hidden_state
    finally:
        spion._STATES[st.uid] = st
    assert rel_err(got, want) < 1e-5 and rel_err(got, dense) > 1e-3
