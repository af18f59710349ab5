"""analyze_mask: masks computed in the graph become §4.1 predicates; data-dependent masks stay dense.

Each case is a small module that builds a mask from index vectors, position ids, padding vectors or
data, and attends with it (SDPA with a boolean mask, or matmul-softmax with an additive float mask).
It is captured through torch.fx, torch.export and dynamo, run through canonicalize, match_attention
and analyze_mask, and compared in float64 with the eager module on fresh random inputs, at the query
rows that have at least one allowed key (a row with none outputs zeros in attncomp, NaN or a uniform
average in eager: DESIGN §4). The report must name the predicates (or say why the mask stays).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attncomp import ops
from attncomp.passes import analyze_mask, canonicalize, match_attention
from attncomp.passes.base import CompileContext
from attncomp.passes.capture import capture
from attncomp.passes.node_info import spec_of
from attncomp.passes.pipeline import run_passes

PASSES = [("canonicalize", canonicalize.canonicalize), ("match_attention", match_attention.match_attention),
          ("analyze_mask", analyze_mask.analyze_mask)]
B, H, D = 2, 2, 8
NEG = torch.finfo(torch.float64).min


def _has_predicate_args() -> bool:
    names = [a.name for a in torch.ops.attncomp.attention.default._schema.arguments]
    return "k_valid" in names


pytestmark = pytest.mark.skipif(not _has_predicate_args(), reason="attncomp::attention has no predicate arguments")


def _ij(q, k, offset=0):
    nq, nk = q.shape[2], k.shape[2]
    i = torch.arange(nq) + offset
    j = torch.arange(nk)
    return i[:, None], j[None, :]


def _causal(q, k):
    i, j = _ij(q, k)
    return (j <= i)[None, None]


def _causal_br(q, k):
    i, j = _ij(q, k, k.shape[2] - q.shape[2])
    return (j <= i)[None, None]


def _window(q, k, left=3):
    i, j = _ij(q, k)
    return ((j <= i) & (j > i - (left + 1)))[None, None]


def _two_sided(q, k):
    i, j = _ij(q, k)
    return ((j >= i - 2) & (j <= i + 1))[None, None]


def _segments(pid):
    return torch.cumsum((pid == 0).to(torch.int64), -1)


def _packed(q, k, pid):
    seg = _segments(pid)
    return (seg[:, None, :, None] == seg[:, None, None, :]) & _causal(q, k)


def _padding(am):
    return am.bool()[:, None, None, :]


def _hf_padding_causal(q, k, am):
    """As Hugging Face's sdpa_mask builds it: index vectors broadcast over (b, h, i, j), the padding
    vector read by advanced indexing, the result expanded."""
    b = torch.arange(q.shape[0])[:, None, None, None]
    qi = torch.arange(q.shape[2])[None, None, :, None]
    kv = torch.arange(k.shape[2])[None, None, None, :]
    m = torch.ones((), dtype=torch.bool) & (kv <= qi)
    m = m & am.to(torch.bool)[b, kv]
    return m.expand(q.shape[0], -1, q.shape[2], k.shape[2])


def _sdpa(mask_fn):
    def f(q, k, v, am, pid, cp, r):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(q, k, am, pid, cp, r))
    return f


def _eager(mask_fn):
    def f(q, k, v, am, pid, cp, r):
        s = q @ k.transpose(-1, -2) * D ** -0.5 + mask_fn(q, k, am, pid, cp, r)
        return torch.softmax(s, -1) @ v
    return f


#: name -> (mask builder, attention form, words the report must contain, Nq < Nk?)
CASES = {
    "causal": (lambda q, k, am, pid, cp, r: _causal(q, k), "sdpa", ["causal"], False),
    "causal_bottom_right": (lambda q, k, am, pid, cp, r: _causal_br(q, k), "sdpa", ["causal (bottom-right)"], True),
    "window": (lambda q, k, am, pid, cp, r: _window(q, k), "sdpa", ["window(3, 0)"], False),
    "two_sided_window": (lambda q, k, am, pid, cp, r: _two_sided(q, k), "sdpa", ["window(2, 1)"], False),
    "abs_window": (lambda q, k, am, pid, cp, r: (lambda i, j: (torch.abs(i - j) <= 2)[None, None] & _padding(am))(*_ij(q, k)),
                   "sdpa", ["window(2, 2)", "padding"], False),
    "decode_cache_position": (lambda q, k, am, pid, cp, r: (torch.arange(k.shape[2])[None, :] <= cp[:, None])[None, None],
                              "sdpa", ["causal (positions)"], True),
    "packed_documents": (lambda q, k, am, pid, cp, r: _packed(q, k, pid), "sdpa", ["causal", "documents"], False),
    "padding_keys": (lambda q, k, am, pid, cp, r: _padding(am).expand(-1, -1, q.shape[2], -1), "sdpa",
                     ["padding"], False),
    "padding_causal_hf": (lambda q, k, am, pid, cp, r: _hf_padding_causal(q, k, am), "sdpa",
                          ["causal", "padding"], False),
    "all_combined": (lambda q, k, am, pid, cp, r: _window(q, k, 4) & _packed(q, k, pid) & _padding(am), "sdpa",
                     ["window(4, 0)", "documents", "padding"], False),
    "float_where": (lambda q, k, am, pid, cp, r: torch.where(_causal(q, k) & _padding(am), torch.tensor(0.0, dtype=q.dtype), NEG), "eager",
                    ["causal", "padding"], False),
    "float_sum_of_masks": (lambda q, k, am, pid, cp, r: (1.0 - _padding(am).to(q.dtype)) * NEG
                           + torch.zeros_like(r).masked_fill(~_window(q, k), NEG),
                           "eager", ["window(3, 0)", "padding"], False),
    # causal masks built in forward from triu/tril of ones (nanoGPT-style user code)
    "triu_ones_in_forward": (lambda q, k, am, pid, cp, r: ~torch.triu(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool), 1),
                             "sdpa", ["causal"], False),
    "tril_float_eq_zero": (lambda q, k, am, pid, cp, r: torch.zeros(q.shape[2], k.shape[2], dtype=q.dtype).masked_fill(
        torch.tril(torch.ones(q.shape[2], k.shape[2])) == 0, NEG), "eager", ["causal"], False),
    "tril_and_triu_band": (lambda q, k, am, pid, cp, r: torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
                           & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(-3) & _padding(am),
                           "sdpa", ["window(3, 0)", "padding"], False),
    "float_mask_to_sdpa": (lambda q, k, am, pid, cp, r: torch.where(_packed(q, k, pid), 0.0, float("-inf")), "sdpa",
                           ["causal", "documents"], False),
}

#: negative twins: the same forms built from data, or reading heads -> (builder, form, words, Nq < Nk?)
NEGATIVE = {
    "causal_and_random": (lambda q, k, am, pid, cp, r: _causal(q, k) & (r > 0.3), "sdpa",
                          ["causal", "materialised mask", "both queries and keys"], False),
    "random_only": (lambda q, k, am, pid, cp, r: r > 0.3, "sdpa", ["materialised mask"], False),
    "query_data": (lambda q, k, am, pid, cp, r: _window(q, k) & (q.sum(-1, keepdim=True) > 0), "sdpa",
                   ["window(3, 0)", "materialised mask", "heads"], False),
    "segments_of_data": (lambda q, k, am, pid, cp, r: (torch.cumsum((r > 0.5).long(), 2)
                                                      == torch.cumsum((r > 0.5).long(), 3)) | _causal(q, k),
                         "sdpa", ["materialised mask"], False),
    "per_head_padding": (lambda q, k, am, pid, cp, r: _causal(q, k) & (k.sum(-1) > 0)[:, :, None, :], "sdpa",
                         ["causal", "materialised mask", "heads"], False),
    "float_bias": (lambda q, k, am, pid, cp, r: torch.where(_causal(q, k), torch.tensor(0.0, dtype=q.dtype), NEG) + r, "eager",
                   ["causal", "additive bias"], False),
    "bias_where_allowed": (lambda q, k, am, pid, cp, r: torch.where(_padding(am) & _causal(q, k), r, NEG), "eager",
                           ["causal", "padding", "additive bias"], False),
    "abs_at_least": (lambda q, k, am, pid, cp, r: (lambda i, j: (torch.abs(i - j) >= 2)[None, None] | _causal(q, k))(*_ij(q, k)),
                     "sdpa", ["materialised mask"], False),
    "float_not_a_mask": (lambda q, k, am, pid, cp, r: torch.where(_causal(q, k), torch.tensor(0.0, dtype=q.dtype), -1.0), "eager",
                         ["materialised mask"], False),
}


class Toy(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, am, pid, cp, r):
        return self.fn(q, k, v, am, pid, cp, r)


def inputs(nq, nk, seed, left_pad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, nk, D, generator=g, dtype=torch.float64)
    am = torch.ones(B, nk, dtype=torch.int64)
    if left_pad:
        am[1, :2] = 0
    else:
        am[1, nk - 2:] = 0
    pid = torch.cat([torch.arange(3), torch.arange(nk - 3)]).repeat(B, 1)
    pid[1] = torch.cat([torch.arange(nk - 2), torch.arange(2)])
    cp = torch.arange(nk - nq, nk)
    r = torch.rand(B, 1, nq, nk, generator=g, dtype=torch.float64)
    return q, k, v, am, pid[:, :nk], cp, r


def _allowed_rows(mask, q):
    m = mask if mask.dtype == torch.bool else mask > -1e4
    return m.expand(q.shape[0], q.shape[1], q.shape[2], m.shape[-1]).any(-1)


def _check(case, run, nq, nk, seed, left_pad=False):
    build, form, _, _ = case
    x = inputs(nq, nk, seed, left_pad)
    exp = Toy((_sdpa if form == "sdpa" else _eager)(build))(*x)
    got = run(*x)
    rows = _allowed_rows(build(*x[:2], *x[3:]), x[0])
    assert rows.any()
    torch.testing.assert_close(got[rows], exp[rows], rtol=1e-9, atol=1e-10)
    assert not torch.isnan(got).any()


def _sizes(case):
    return (5, 9) if case[3] else (7, 7)


def _compile(case, route):
    build, form, _, _ = case
    model = Toy((_sdpa if form == "sdpa" else _eager)(build))
    nq, nk = _sizes(case)
    ex = inputs(nq, nk, 0)
    ctx = CompileContext()
    if route == "dynamo":
        holder = {}

        def be(gm, example):
            holder["gm"] = run_passes(gm, ctx, PASSES)
            return holder["gm"]

        torch._dynamo.reset()
        fn = torch.compile(model, backend=be, dynamic=False)
        fn(*ex)
        return fn, holder["gm"], ctx
    gm = capture(model, ex, ctx, route=route)
    gm = run_passes(gm, ctx, PASSES)
    return gm, gm, ctx


def _site(gm, ctx):
    sites = [n for n in gm.graph.nodes if ops.is_attention_node(n)]
    assert len(sites) == 1, gm.graph
    assert len(ctx.sites) == 1 and ctx.sites[0].rewritten, [(s.rewritten, s.reason) for s in ctx.sites]
    return sites[0], ctx.sites[0].details.get("mask", "")


ARG = analyze_mask._op_args()


def _mask_arg(node):
    return node.args[ARG["attn_mask"]]


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_predicates_found_and_exact(name, route):
    case = CASES[name]
    run, gm, ctx = _compile(case, route)
    node, words = _site(gm, ctx)
    for w in case[2]:
        assert w in words, (name, words)
    assert "materialised" not in words, words
    assert _mask_arg(node) is None, f"{name}: a dense mask is still passed\n{gm.graph}"
    # no N x N boolean or float mask is computed any more
    for n in gm.graph.nodes:
        shp = n.meta.get("val", n.meta.get("tensor_meta"))
        shp = getattr(shp, "shape", None)
        if shp is not None and len(shp) == 4 and n.op == "call_function" and not ops.is_attention_node(n):
            assert not (shp[-1] > 1 and shp[-2] > 1 and shp[-1] == _sizes(case)[1] and shp[-2] == _sizes(case)[0]
                        and n.meta.get("val", n.meta.get("tensor_meta")).dtype == torch.bool), n.format_node()
    nq, nk = _sizes(case)
    _check(case, run, nq, nk, seed=1)
    _check(case, run, nq, nk, seed=2, left_pad=True)


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_twin_stays_materialised(name, route):
    case = NEGATIVE[name]
    run, gm, ctx = _compile(case, route)
    node, words = _site(gm, ctx)
    for w in case[2]:
        assert w in words, (name, words)
    assert _mask_arg(node) is not None
    nq, nk = _sizes(case)
    _check(case, run, nq, nk, seed=3)


@pytest.mark.parametrize("name", ["padding_causal_hf", "decode_cache_position", "all_combined", "float_where",
                                  "causal_and_random", "triu_ones_in_forward", "tril_float_eq_zero"])
def test_dynamo_graphs(name):
    case = CASES.get(name) or NEGATIVE[name]
    run, gm, ctx = _compile(case, "dynamo")
    node, words = _site(gm, ctx)
    for w in case[2]:
        assert w in words, (name, words)
    nq, nk = _sizes(case)
    _check(case, run, nq, nk, seed=4)


def test_predicates_are_vectors_of_the_graph():
    """The packed + padded + causal mask: q_seg/k_seg/k_valid are (B, N) tensors, the spec is causal."""
    gm, _, ctx = _compile(CASES["all_combined"], "fx")
    node, _ = _site(gm, ctx)
    spec = spec_of(node)
    assert spec.causal and spec.window_left == 4 and spec.mask_kind == "none"
    x = inputs(7, 7, 5)
    interp = torch.fx.Interpreter(gm)
    vals = {}
    orig = interp.run_node

    def run_node(n):
        out = orig(n)
        vals[n] = out
        return out

    interp.run_node = run_node
    interp.run(*x)
    idx = ARG
    for nm in ("q_seg", "k_seg", "k_valid"):
        arg = node.args[idx[nm]]
        assert arg is not None, nm
        assert tuple(vals[arg].shape) == (B, 7), (nm, vals[arg].shape)
    torch.testing.assert_close(vals[node.args[idx["k_seg"]]], _segments(x[4]))
    assert torch.equal(vals[node.args[idx["k_valid"]]], x[3].bool())
    assert node.args[idx["q_pos"]] is None and node.args[idx["k_pos"]] is None  # default top-left positions


# ---------------------------------------------------------------------------------------------
# Hugging Face models as shipped (tiny configs, default attention implementation, use_cache default)

def _hf(family, impl=None, **over):
    T = pytest.importorskip("transformers")
    kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=97)
    cfgs = {
        "llama": lambda: T.LlamaConfig(num_key_value_heads=2, **kw),
        "mistral": lambda: T.MistralConfig(num_key_value_heads=2, sliding_window=4, **kw),
        "gemma2": lambda: T.Gemma2Config(num_key_value_heads=2, sliding_window=4, head_dim=8, **kw),
        "qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **kw),
        "bert": lambda: T.BertConfig(**kw),
        "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, bos_token_id=0, eos_token_id=0),
        "t5": lambda: T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=97),
        "modernbert": lambda: T.ModernBertConfig(local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
                                                 bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **kw),
    }
    models = {"llama": T.LlamaModel, "mistral": T.MistralModel, "gemma2": T.Gemma2Model, "qwen2": T.Qwen2Model,
              "bert": T.BertModel, "gpt2": T.GPT2Model, "modernbert": T.ModernBertModel,
              "t5": T.T5EncoderModel}
    cfg = cfgs[family]()
    for k_, v_ in over.items():
        setattr(cfg, k_, v_)
    if impl:
        cfg._attn_implementation = impl
    torch.manual_seed(0)
    return models[family](cfg).eval()


#: family, attention implementation, padding side, words every site's report must contain
HF = [
    ("llama", None, "right", ["causal", "padding"]),
    ("llama", "eager", "left", ["causal", "padding"]),
    ("mistral", None, "left", ["window(3, 0)", "padding"]),
    ("gemma2", None, "right", ["padding"]),
    ("qwen2", None, "right", ["causal", "padding"]),
    ("bert", None, "right", ["padding"]),
    ("bert", "eager", "left", ["padding"]),
    ("gpt2", None, "right", ["causal", "padding"]),
    ("modernbert", None, "right", ["padding"]),
    ("t5", None, "left", ["padding", "additive bias"]),   # relative-position bias stays a float input
]


def _run_hf(model, kwargs):
    ctx = CompileContext()

    def be(gm, example):
        return run_passes(gm, ctx, PASSES)

    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=be, dynamic=False)(**kwargs)
    finally:
        torch._dynamo.reset()
    return out, ctx


@pytest.mark.sample(2)
@pytest.mark.parametrize("family,impl,side,words", HF, ids=[f"{f}-{i or 'sdpa'}-{s}" for f, i, s, _ in HF])
def test_hf_models_masks_become_predicates(family, impl, side, words):
    model = _hf(family, impl)
    g = torch.Generator().manual_seed(1)
    n = 9
    ids = torch.randint(1, 97, (2, n), generator=g)
    am = torch.ones(2, n, dtype=torch.int64)
    if side == "right":
        am[1, n - 3:] = 0
    else:
        am[1, :3] = 0
    got, ctx = _run_hf(model, dict(input_ids=ids, attention_mask=am))
    exp = model(input_ids=ids, attention_mask=am)
    sites = [s for s in ctx.sites]
    assert len(sites) == 2 and all(s.rewritten for s in sites), [(s.name, s.reason) for s in sites]
    for s in sites:
        mask = s.details.get("mask", "")
        assert "materialised" not in mask, (s.name, mask)
        for w in words:
            if w == "window(3, 0)" or family != "gemma2":
                assert w in mask, (s.name, mask)
    masks = [s.details["mask"] for s in sites]
    if family == "gemma2":   # local and global layers alternate
        assert any("window(3, 0)" in m for m in masks) and any(m.startswith("causal") for m in masks), masks
    if family == "modernbert":   # global, then a local layer: abs(q_idx - kv_idx) <= half window
        assert masks[0] == "padding" and masks[1].startswith("window(2, 2)"), masks
    valid = am.bool()   # padded query rows differ from eager by design (DESIGN §4)
    torch.testing.assert_close(got.last_hidden_state[valid], exp.last_hidden_state[valid], rtol=1e-4, atol=1e-5)


def test_hf_packed_documents():
    """position_ids that restart (no attention_mask, no cache): Hugging Face's packed-sequence mask."""
    model = _hf("qwen2", use_cache=False)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    pid = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    got, ctx = _run_hf(model, dict(input_ids=ids, position_ids=pid))
    exp = model(input_ids=ids, position_ids=pid)
    for s in ctx.sites:
        assert s.rewritten and "causal" in s.details["mask"] and "documents" in s.details["mask"], s.details
        assert "materialised" not in s.details["mask"]
    torch.testing.assert_close(got.last_hidden_state, exp.last_hidden_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_hf_own_positions_are_one_document(family):
    """Called without an attention mask and without a cache (training), transformers derives packed-sequence ids
    from the model's own positions (an arange): one document per row whatever the length, so no documents
    predicate (its tiles and tests would cost time for nothing); explicit positions that restart keep it
    (``test_hf_packed_documents``)."""
    model = _hf(family, use_cache=False)
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    got, ctx = _run_hf(model, dict(input_ids=ids, use_cache=False))
    exp = model(input_ids=ids, use_cache=False)
    assert len(ctx.sites) == 2
    for s in ctx.sites:
        mask = s.details["mask"]
        assert s.rewritten and mask.startswith("causal") and "documents" not in mask.replace("one document", ""), mask
        assert "one document per row" in mask and "materialised" not in mask, mask
    torch.testing.assert_close(got.last_hidden_state, exp.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_one_document_needs_the_whole_pattern():
    """The packed-sequence ids count as one document only for positions that count up by one from the model's
    arange: a step of 2, positions from an input, another prepend or a diff along another axis keep the ids."""
    def ids(make_pos, prepend=lambda p: p[:, :1] - 1, axis0=False):
        def f(x):
            p = make_pos(x)
            d = torch.diff(p, prepend=prepend(p), dim=0) if axis0 else torch.diff(p, prepend=prepend(p), dim=-1)
            return (d != 1).cumsum(-1) + x.shape[0] * 0
        gms = []
        torch.compile(f, backend=lambda gm, ex: gms.append(gm) or gm.forward, dynamic=True)(torch.zeros(2, 7))
        out = [n for n in gms[0].graph.nodes if n.op == "output"][0]
        node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        while node.op != "call_method" or node.target != "cumsum":
            node = node.args[0]
        return analyze_mask._one_document(node)

    own = (lambda x: (torch.arange(x.shape[1]) + 3).unsqueeze(0).expand(x.shape[0], -1))
    assert ids(own)
    assert not ids(lambda x: torch.arange(0, 2 * x.shape[1], 2).unsqueeze(0).expand(x.shape[0], -1))
    assert not ids(lambda x: x.long())
    assert not ids(own, prepend=lambda p: p[:, :1])
    assert not ids(lambda x: torch.arange(x.shape[0]).unsqueeze(1).expand(-1, x.shape[1]), prepend=lambda p: p[:1] - 1,
                   axis0=True)


@pytest.mark.parametrize("data", [False, True], ids=["index", "data"])
def test_vmap_built_masks(data):
    """Hugging Face builds custom masks with torch.vmap (dynamo keeps the batching calls in the graph):
    sliding window + padding become predicates; a mask function that reads an (B, Nq, Nk) tensor (the
    negative twin) stays materialised. Both graphs run and equal eager."""
    MU = pytest.importorskip("transformers.masking_utils")

    class M(nn.Module):
        def forward(self, q, k, v, am, r):
            mf = MU.and_masks(MU.sliding_window_causal_mask_function(3), MU.padding_mask_function(am.bool()))
            if data:
                rb = r[:, 0] > 0.2
                mf = MU.and_masks(mf, lambda b, h, i, j: rb[b, i, j])
            m = MU.sdpa_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2], mask_function=mf,
                             allow_is_causal_skip=False, use_vmap=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    x = inputs(7, 7, 6)
    q, k, v, am, r = x[0], x[1], x[2], x[3], x[6]
    ctx = CompileContext()
    torch._dynamo.reset()
    out = torch.compile(M(), backend=lambda gm, ex: run_passes(gm, ctx, PASSES))(q, k, v, am, r)
    torch._dynamo.reset()
    assert len(ctx.sites) == 1 and ctx.sites[0].rewritten
    mask = ctx.sites[0].details["mask"]
    assert "window(2, 0)" in mask and "padding" in mask, mask
    assert ("materialised mask" in mask) == data, mask
    exp = M()(q, k, v, am, r)
    rows = ~torch.isnan(exp).any(-1)
    torch.testing.assert_close(out[rows], exp[rows])


class _CounterAdvancedAfterMask(nn.Module):
    """A cache's position counter read into the mask, then advanced in place before the attention, as a transformers
    static cache does (the model builds its mask from ``cumulative_length``; layer 0's update runs
    ``cumulative_length.add_`` before the layer's attention)."""

    def forward(self, q, k, v, counter):
        q_pos = torch.arange(q.shape[-2]) + counter
        mask = torch.arange(k.shape[-2])[None, None, None, :] <= q_pos[None, None, :, None]
        counter.add_(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("start", [0, 3])
def test_positions_are_read_where_the_mask_read_them(start):
    """The predicate vectors read the counter's value before the in-place advance, as the mask did: read at the
    attention they would let every query see the cache's empty slots (a static cache's prefill: 0.33 off)."""
    g = torch.Generator().manual_seed(start)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, generator=g) for n in (5, 11, 11))
    ctx = CompileContext()
    torch._dynamo.reset()
    fast = torch.compile(_CounterAdvancedAfterMask(), backend=lambda gm, ex: run_passes(gm, ctx, PASSES))
    c_got, c_want = torch.tensor([start]), torch.tensor([start])
    got = fast(q, k, v, c_got)
    torch._dynamo.reset()
    want = _CounterAdvancedAfterMask()(q, k, v, c_want)
    assert len(ctx.sites) == 1 and ctx.sites[0].rewritten
    assert "materialised" not in ctx.sites[0].details["mask"], ctx.sites[0].details
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert int(c_got) == int(c_want) == start + 5


class _BiasWhereAllowed(nn.Module):
    def forward(self, q, k, v, allow, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~allow, float("-inf")))


def test_a_call_that_allows_nothing_compiles():
    """The derivation's check on a first call whose mask allows no entry at all (GPT-Neo's local layers against a
    static cache): no bias value to compare, the compile goes on (it raised on an empty ``amax``); a later call
    that allows some entries equals eager on every row that has one."""
    import attncomp

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, generator=g) for n in (6, 9, 9))
    bias = torch.randn(B, 1, 6, 9, dtype=torch.float64, generator=g)
    fast = attncomp.compile(_BiasWhereAllowed(), policy="dense")
    with torch.no_grad():
        out = fast(q, k, v, torch.zeros(B, 1, 6, 9, dtype=torch.bool), bias)
        words = attncomp.report(fast).sites[0].details["mask"]
        assert "additive bias" in words and not out.isnan().any(), words
        allow = torch.rand(B, 1, 6, 9, generator=g) < 0.5
        got, want = fast(q, k, v, allow, bias), _BiasWhereAllowed()(q, k, v, allow, bias)
    rows = allow.any(-1).expand(B, H, 6)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family,words", [("llama", ["causal (bottom-right)", "padding"]),
                                          ("mistral", ["window(3, 0) bottom-right", "padding"])])
def test_hf_kv_cache_offsets(family, words):
    """Queries at the end of a cached sequence (3 new tokens after 6 cached, left padding): the causal
    and window bounds are bottom-right, the padding covers cached keys too; outputs equal eager."""
    import copy

    model = _hf(family)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.int64)
    am[1, :2] = 0
    with torch.no_grad():
        cache = model(input_ids=ids[:, :6], attention_mask=am[:, :6], use_cache=True).past_key_values
    c1, c2 = copy.deepcopy(cache), copy.deepcopy(cache)
    got, ctx = _run_hf(model, dict(input_ids=ids[:, 6:], attention_mask=am, past_key_values=c1, use_cache=True))
    exp = model(input_ids=ids[:, 6:], attention_mask=am, past_key_values=c2, use_cache=True)
    assert len(ctx.sites) == 2
    for s in ctx.sites:
        for w in words:
            assert w in s.details["mask"], s.details
        assert "materialised" not in s.details["mask"]
    torch.testing.assert_close(got.last_hidden_state, exp.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_hf_export_graph():
    """torch.export's aten graph of a Hugging Face model (use_cache=False, as export requires)."""
    model = _hf("mistral", use_cache=False)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    am = torch.ones(2, 9, dtype=torch.int64)
    am[0, 7:] = 0
    ctx = CompileContext()
    gm = capture(model, dict(input_ids=ids, attention_mask=am), ctx, route="export")
    gm = run_passes(gm, ctx, PASSES)
    assert len(ctx.sites) == 2
    for s in ctx.sites:
        assert s.rewritten and "window(3, 0)" in s.details["mask"] and "padding" in s.details["mask"], s.details
        assert "materialised" not in s.details["mask"]
    got = gm(input_ids=ids, attention_mask=am)
    exp = model(input_ids=ids, attention_mask=am)
    got = got["last_hidden_state"] if isinstance(got, dict) else got.last_hidden_state if hasattr(got, "last_hidden_state") else got[0]
    torch.testing.assert_close(got[am.bool()], exp.last_hidden_state[am.bool()], rtol=1e-4, atol=1e-5)


def test_sites_without_a_computed_mask_are_reported():
    """is_causal (no mask tensor): the report still names what the site allows."""
    ctx = CompileContext()
    model = Toy(lambda q, k, v, am, pid, cp, r: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    gm = run_passes(capture(model, inputs(7, 7, 0), ctx, route="fx"), ctx, PASSES)
    assert ctx.sites[0].details["mask"] == "causal"
    model = Toy(lambda q, k, v, am, pid, cp, r: F.scaled_dot_product_attention(q, k, v))
    ctx = CompileContext()
    gm = run_passes(capture(model, inputs(7, 7, 0), ctx, route="fx"), ctx, PASSES)
    assert ctx.sites[0].details["mask"] == "none"
    del gm


class _WindowAttention(nn.Module):
    """Sliding-window attention over a padded batch, the mask built in the model (as Mistral's)."""

    def __init__(self, window=3):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, am):
        i, j = _ij(q, k)
        allowed = ((j <= i) & (j > i - self.window))[None, None] & _padding(am)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("wrong", ["window", "padding"])
def test_a_wrong_derivation_keeps_the_mask(monkeypatch, wrong):
    """DESIGN §7: predicates derived from the graph are checked, at compile time, against the mask the
    graph computes on the call's inputs; a derivation that disagrees (here made wrong on purpose: the
    window one key shorter, or the padding vector dropped) leaves the mask materialised, with the
    reason in the report, and the outputs stay eager's."""
    import attncomp

    real = analyze_mask._classify

    def off(ev, v):
        res = real(ev, v)
        if wrong == "window" and res.positions is not None:
            kt, qt, syms, left, right = res.positions
            res.positions = (kt, qt, syms, left - 1, right)
        if wrong == "padding":
            res.k_valid = []
        return res

    monkeypatch.setattr(analyze_mask, "_classify", off)
    model = _WindowAttention()
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    fast = attncomp.compile(model, policy="dense")
    with torch.no_grad():
        got, want = fast(q, k, v, am), model(q, k, v, am)
    words = attncomp.report(fast).sites[0].details["mask"]
    assert words.startswith("materialised mask: the derived predicates") and "disagree" in words, words
    torch.testing.assert_close(got[:, :, :6], want[:, :, :6])
    torch.testing.assert_close(got[0], want[0])

    monkeypatch.setattr(analyze_mask, "_classify", real)  # the true derivation passes the same check
    torch._dynamo.reset()
    fast = attncomp.compile(model, policy="dense")
    with torch.no_grad():
        torch.testing.assert_close(fast(q, k, v, am)[0], want[0])
    assert attncomp.report(fast).sites[0].details["mask"] == "window(2, 0), padding"
