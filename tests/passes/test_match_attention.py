"""match_attention: every spelling of an attention site becomes one op; negative twins stay unchanged.

Each case is a few-line module whose forward takes q, k, v (B, H, N, D) and optional masks. The pass
runs on the fx capture (canonicalize then match) and the result is compared with the eager module in
float64 on fresh random inputs.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attncomp import ops
from attncomp.passes import canonicalize, match_attention
from attncomp.passes.base import CompileContext
from attncomp.passes.capture import capture
from attncomp.passes.pipeline import run_passes
from attncomp.spec import AttentionSpec

B, H, N, D = 2, 4, 11, 16
PASSES = [("canonicalize", canonicalize.canonicalize), ("match_attention", match_attention.match_attention)]


class Site(nn.Module):
    def __init__(self, fn, n_max=32):
        super().__init__()
        self.fn = fn
        self.sm = nn.Softmax(dim=-1)
        self.drop = nn.Dropout(0.0)
        self.register_buffer("tril", torch.tril(torch.ones(n_max, n_max)).view(1, 1, n_max, n_max))
        self.register_buffer("tril_bool", torch.tril(torch.ones(n_max, n_max, dtype=torch.bool)))
        self.w = nn.Parameter(torch.randn(D, N, dtype=torch.float64))
        self.head_scale = nn.Parameter(torch.rand(H, 1, 1, dtype=torch.float64) + 0.5)

    def forward(self, q, k, v, m=None):
        return self.fn(self, q, k, v, m)


def sd(x):
    return x.size(-1) ** 0.5


CASES = {
    # QK^T spellings
    "matmul_transpose": lambda s, q, k, v, m: torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D), -1) @ v,
    "at_mT": lambda s, q, k, v, m: (q @ k.mT * D ** -0.5).softmax(-1) @ v,
    "permute": lambda s, q, k, v, m: F.softmax(q @ k.permute(0, 1, 3, 2) * 0.3, dim=-1) @ v,
    "pretransposed": lambda s, q, k, v, m: torch.softmax(q @ k * 0.25, dim=-1) @ v,  # k given as (B,H,D,N)
    "bmm": lambda s, q, k, v, m: torch.bmm(torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) / sd(q), -1), v.flatten(0, 1)).view(q.shape),
    "einsum": lambda s, q, k, v, m: torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k).mul(0.2).softmax(-1), v),
    # scales
    "scale_div_sqrt_expr": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) / sd(k), -1) @ v,
    "scale_on_q": lambda s, q, k, v, m: torch.softmax((q * D ** -0.5) @ k.transpose(-1, -2), -1) @ v,
    "scale_on_k": lambda s, q, k, v, m: torch.softmax(q @ (k / 3.0).transpose(-1, -2), -1) @ v,
    "scale_on_both": lambda s, q, k, v, m: torch.softmax((q * q.size(-1) ** -0.25) @ (k * k.size(-1) ** -0.25).transpose(-1, -2), -1) @ v,
    "no_scale": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2), -1) @ v,
    # masks
    "additive_float": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) * 0.25 + m, -1) @ v,
    "finfo_min_padding": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) * 0.25 + (1.0 - m) * torch.finfo(torch.float64).min, -1) @ v,
    "masked_fill_bool": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~m, float("-inf")), -1) @ v,
    "where_bool": lambda s, q, k, v, m: torch.softmax(torch.where(m, q @ k.transpose(-1, -2), torch.tensor(-1e9, dtype=q.dtype)), -1) @ v,
    "causal_buffer": lambda s, q, k, v, m: s.drop(s.sm((q @ k.transpose(-2, -1)).masked_fill(s.tril[:, :, :q.size(2), :q.size(2)] == 0, float("-inf")))) @ v,
    "padding_expand_as_logits": lambda s, q, k, v, m: (lambda a: torch.softmax(a.masked_fill((m == 0).view(q.size(0), 1, 1, -1).expand_as(a), torch.finfo(a.dtype).min), -1) @ v)(q @ k.transpose(-1, -2) / sd(q)),  # XLM
    "multiplicative_buffer_mask": lambda s, q, k, v, m: (lambda w, b: torch.softmax(w * b + -1e4 * (1 - b), -1) @ v)(q @ k.transpose(-1, -2) * 0.25, s.tril[:, :, :q.size(2), :q.size(2)]),  # OpenAI-GPT
    "zeroed_again_after_softmax": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(m == False, float("-inf")), -1).masked_fill(m == False, 0.0) @ v,  # noqa: E712 (CPM-Ant)
    "bias_inside_the_scale": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2) + m) * 0.5, -1) @ v,
    "mask_inside_the_scale": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~m, float("-inf")) / 4.0, -1) @ v,
    "per_head_logit_scale": lambda s, q, k, v, m: torch.softmax(F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) * s.head_scale.exp() + m, -1) @ v,  # Swin-V2
    "five_d_streams": lambda s, q, k, v, m: torch.softmax(torch.einsum("bnhtc,bnhsc->bnhts", q, k) * 0.25 + m, -1) @ v,  # ProphetNet
    "relative_bias_no_scale": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)) + m.float().to(q.dtype), -1, dtype=torch.float32).to(q.dtype) @ v,
    "zeros_added": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) * 0.25 + torch.zeros(q.size(0), q.size(1), q.size(2), k.size(2), dtype=q.dtype), -1) @ v,  # GPT-NeoX-Japanese's baddbmm on zeros
    "xlnet_sequence_first": lambda s, q, k, v, m: (lambda qi, ki, vi: torch.einsum("bnij,jbnd->ibnd", F.softmax((torch.einsum("ibnd,jbnd->bnij", qi, ki) + m) * 0.25 - 1e30 * (1 - s.tril[:, :, :q.size(2), :q.size(2)]), dim=3), vi))(*(t.permute(2, 0, 1, 3) for t in (q, k, v))),  # XLNet: (N, B, H, D) tensors, a bias, a mask subtracted
    "softmax_upcast_to": lambda s, q, k, v, m: F.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1, dtype=torch.float32).type_as(q) @ v,
    "dropout_eval": lambda s, q, k, v, m: F.dropout(torch.softmax(q @ k.transpose(-1, -2), -1), 0.1, training=False) @ v,
    # GQA
    "gqa_repeat_interleave": lambda s, q, k, v, m: torch.softmax(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2), -1) @ v.repeat_interleave(2, dim=1),
    "gqa_expand_reshape": lambda s, q, k, v, m: torch.softmax(q @ k[:, :, None].expand(B, H // 2, 2, k.shape[2], D).reshape(B, H, k.shape[2], D).transpose(-1, -2), -1) @ v[:, :, None].expand(B, H // 2, 2, k.shape[2], D).reshape(B, H, k.shape[2], D),
    # SDPA calls
    "sdpa_plain": lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v),
    "sdpa_causal_scale": lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
    "sdpa_mask": lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
    "sdpa_gqa": lambda s, q, k, v, m: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
}

FP32_ROUNDING = {"relative_bias_no_scale", "softmax_upcast_to"}

NEGATIVE = {
    "softmax_over_queries": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v,
    "keys_are_parameters": lambda s, q, k, v, m: torch.softmax(q @ s.w, dim=-1) @ v[:, :, :N],
    "probabilities_escape": lambda s, q, k, v, m: (lambda p: (p @ v, p))(torch.softmax(q @ k.transpose(-1, -2), -1)),
    "data_dependent_mask": lambda s, q, k, v, m: (lambda a: torch.softmax(a.masked_fill(a > 1.0, float("-inf")), -1) @ v)(q @ k.transpose(-1, -2)),
    "logits_times_tensor": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)) * m.to(q.dtype), -1) @ v,
    "logits_times_buffer_no_fill": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)) * s.tril[:, :, :q.size(2), :q.size(2)], -1) @ v,
    "logits_times_buffer_small_fill": lambda s, q, k, v, m: (lambda w, b: torch.softmax(w * b + -10.0 * (1 - b), -1) @ v)(q @ k.transpose(-1, -2), s.tril[:, :, :q.size(2), :q.size(2)]),
    "zeroed_after_softmax_elsewhere": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(m == False, float("-inf")), -1).masked_fill(m.transpose(-1, -2) == False, 0.0) @ v,  # noqa: E712
    "fill_scaled_above_a_mask": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~m, -1e4) * 0.5, -1) @ v,
    "per_key_logit_scale": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)) * s.head_scale[:1, :1].expand(1, 1, q.size(2)), -1) @ v,
    "logits_subtracted_from_a_tensor": lambda s, q, k, v, m: torch.softmax(m - q @ k.transpose(-1, -2), -1) @ v,
    "difference_of_two_products": lambda s, q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) - q @ q.transpose(-1, -2), -1) @ v,
    "fill_not_a_mask": lambda s, q, k, v, m: torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~m, 0.5), -1) @ v,
}


def inputs(name, nq=N, nk=N):
    q = torch.randn(B, H, nq, D, dtype=torch.float64)
    hk = H // 2 if "gqa" in name else H
    k = torch.randn(B, hk, nk, D, dtype=torch.float64)
    v = torch.randn(B, hk, nk, D, dtype=torch.float64)
    if name == "pretransposed":
        k = k.transpose(-1, -2).contiguous()
    m = None
    if name == "five_d_streams":  # (B, n-gram stream, H, N, D), a bias per stream and position pair
        q, k, v = (torch.randn(B, 2, *t.shape[1:], dtype=torch.float64) for t in (q, k, v))
        return q, k, v, torch.randn(B, 2, 1, nq, nk, dtype=torch.float64)
    if name in ("additive_float", "relative_bias_no_scale", "bias_inside_the_scale", "per_head_logit_scale",
                "xlnet_sequence_first", "logits_subtracted_from_a_tensor"):
        m = torch.randn(1, H, nq, nk, dtype=torch.float64)
    if name == "padding_expand_as_logits":
        m = torch.ones(B, nk)
        m[1, nk - 4:] = 0
    if name == "finfo_min_padding":
        m = torch.ones(B, 1, 1, nk, dtype=torch.float64)
        m[0, ..., nk - 3:] = 0
    if name in ("masked_fill_bool", "where_bool", "sdpa_mask", "fill_not_a_mask", "logits_times_tensor",
                "zeroed_again_after_softmax", "zeroed_after_softmax_elsewhere", "mask_inside_the_scale",
                "fill_scaled_above_a_mask"):
        m = torch.rand(B, 1, nq, nk) > 0.3
        m[..., 0] = True
        if name == "zeroed_again_after_softmax":  # a row with no allowed key: 0 in the model and in the op
            m[0, :, 2] = False
    return (q, k, v, m)


def compile_site(fn, example):
    ctx = CompileContext()
    gm = capture(Site(fn).double(), example, ctx)
    gm = run_passes(gm, ctx, PASSES)
    return gm, ctx


def op_nodes(gm):
    return [n for n in gm.graph.nodes if ops.is_attention_node(n)]


def _out(x):
    return x[0] if isinstance(x, tuple) else x


@pytest.mark.parametrize("name", sorted(CASES))
def test_site_is_rewritten_and_exact(name):
    fn = CASES[name]
    ex = inputs(name)
    gm, ctx = compile_site(fn, ex)
    found = op_nodes(gm)
    assert len(found) == 1, f"{name}: {[(s.rewritten, s.reason) for s in ctx.sites]}\n{gm.graph}"
    assert ctx.sites and ctx.sites[0].rewritten
    # the original softmax is gone: the site is one op
    assert not any(n.target is torch.softmax for n in gm.graph.nodes if n.op == "call_function")
    ref_mod = Site(fn).double()
    ref_mod.load_state_dict(gm.state_dict(), strict=False)
    # sites that round through float32 in the model itself are compared at float32 precision
    tol = dict(rtol=1e-4, atol=1e-6) if name in FP32_ROUNDING else dict(rtol=1e-6, atol=1e-8)
    for nq in (N, 7):  # also a new sequence length: no re-tracing
        x = inputs(name, nq, nq)
        exp = _out(ref_mod(*x))
        got = _out(gm(*x))
        torch.testing.assert_close(got, exp, **tol)


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_twin_is_left_alone(name):
    fn = NEGATIVE[name]
    ex = inputs(name)
    gm, ctx = compile_site(fn, ex)
    assert op_nodes(gm) == []
    if name != "keys_are_parameters":
        assert ctx.sites and not ctx.sites[0].rewritten and ctx.sites[0].reason
    got = _out(gm(*ex))
    ref = Site(fn).double()
    ref.load_state_dict(gm.state_dict(), strict=False)
    torch.testing.assert_close(got, _out(ref(*ex)))


def _spec(gm):
    return AttentionSpec.from_json(op_nodes(gm)[0].args[ops.ARG_INDEX["spec"]])


def test_causal_buffer_becomes_causal_spec():
    gm, _ = compile_site(CASES["causal_buffer"], inputs("causal_buffer"))
    spec = _spec(gm)
    assert spec.causal and op_nodes(gm)[0].args[ops.ARG_INDEX["attn_mask"]] is None


@pytest.mark.parametrize("window", [1, 3, 40])
def test_banded_buffer_becomes_a_window(window):
    """GPT-Neo's local layers: a constant buffer ``tril ^ tril(-w)`` sliced from the top left allows
    ``0 <= i - j < w``: the spec gets ``causal`` and ``window_left = w - 1`` (a window wider than the
    buffer is plain causal), no mask tensor, values equal; a buffer that is not a band stays a mask."""
    n_max = 32

    def fn(self, q, k, v, m):
        nq, nk = q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = torch.where(self.local[:, :, :nq, :nk], s, torch.finfo(s.dtype).min)
        return torch.softmax(s, -1) @ v

    site = Site(fn, n_max).double()
    band = torch.tril(torch.ones(n_max, n_max, dtype=torch.bool))
    site.register_buffer("local", torch.bitwise_xor(band, torch.tril(band, -window))[None, None])
    ctx = CompileContext()
    gm = run_passes(capture(site, inputs("causal_buffer"), ctx), ctx, PASSES)
    spec = _spec(gm)
    want_left = None if window >= n_max else window - 1
    assert spec.causal and spec.window_left == want_left, (spec, ctx.sites[0].pattern)
    assert op_nodes(gm)[0].args[ops.ARG_INDEX["attn_mask"]] is None
    for nq in (N, 7):
        x = inputs("causal_buffer", nq, nq)
        torch.testing.assert_close(gm(*x), site(*x), rtol=1e-6, atol=1e-8)


def test_zeros_added_to_the_logits_are_no_mask():
    """``s + zeros`` of the logits' shape (``baddbmm(torch.zeros(...), q, kT)``) adds nothing: no bias tensor
    reaches the op. Zeros (or any bias) that broadcast the logits to more heads leave the site unmatched: the op's
    output has q's heads."""
    gm, _ = compile_site(CASES["zeros_added"], inputs("zeros_added"))
    assert _spec(gm).mask_kind == "none" and op_nodes(gm)[0].args[ops.ARG_INDEX["attn_mask"]] is None

    def wider(self, q, k, v, m):   # logits of one head, zeros of H heads: the sum has H heads
        s = q[:, :1] @ k[:, :1].transpose(-1, -2) + torch.zeros(q.size(0), H, q.size(2), k.size(2), dtype=q.dtype)
        return torch.softmax(s, -1) @ v

    ex = inputs("x")
    gm, ctx = compile_site(wider, ex)
    assert op_nodes(gm) == [] and "broadcasts the logits" in ctx.sites[0].reason, ctx.sites
    torch.testing.assert_close(gm(*ex), Site(wider).double()(*ex), rtol=1e-6, atol=1e-8)


def test_scales_fold_into_spec():
    assert _spec(compile_site(CASES["scale_on_both"], inputs("scale_on_both"))[0]).scale is None  # 1/sqrt(D)
    assert _spec(compile_site(CASES["no_scale"], inputs("no_scale"))[0]).scale == 1.0
    assert _spec(compile_site(CASES["scale_on_k"], inputs("scale_on_k"))[0]).scale == pytest.approx(1 / 3)
    assert _spec(compile_site(CASES["permute"], inputs("permute"))[0]).scale == pytest.approx(0.3)


def test_gqa_expansion_is_undone():
    for name in ("gqa_repeat_interleave", "gqa_expand_reshape", "sdpa_gqa"):
        gm, _ = compile_site(CASES[name], inputs(name))
        node = op_nodes(gm)[0]
        assert _spec(gm).gqa_groups == 2, name
        assert node.args[1].meta.get("tensor_meta").shape[1] == H // 2, name


def test_cross_attention_nq_ne_nk():
    fn = CASES["additive_float"]
    gm, _ = compile_site(fn, inputs("additive_float", 5, 9))
    x = inputs("additive_float", 6, 13)
    torch.testing.assert_close(gm(*x), Site(fn).double()(*x))


def test_dropout_in_training_keeps_rate_and_follows_mode():
    fn = lambda s, q, k, v, m: F.dropout(torch.softmax(q @ k.transpose(-1, -2), -1), 0.4, training=True) @ v  # noqa: E731
    gm, ctx = compile_site(fn, inputs("x"))
    spec = _spec(gm)
    assert spec.dropout_p == pytest.approx(0.4)
    x = inputs("x")
    with ops.training_mode(False):
        torch.testing.assert_close(gm(*x), F.scaled_dot_product_attention(*x[:3], scale=1.0))
    with ops.training_mode(True):
        out = gm(*x)
    assert not torch.allclose(out, F.scaled_dot_product_attention(*x[:3], scale=1.0))


def test_counters_count_rewrites():
    ctx_before = CompileContext()
    gm, ctx = compile_site(CASES["no_scale"], inputs("no_scale"))
    assert ctx.counters["match_attention"]["rewritten"] == 1
    assert ctx_before.counters["match_attention"]["rewritten"] == 0


def test_gqa_expansion_on_keys_only_runs_on_expanded_heads():
    fn = lambda s, q, k, v, m: torch.softmax(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2), -1) @ v  # noqa: E731
    ex = (torch.randn(B, H, N, D, dtype=torch.float64), torch.randn(B, H // 2, N, D, dtype=torch.float64),
          torch.randn(B, H, N, D, dtype=torch.float64), None)
    gm, _ = compile_site(fn, ex)
    assert _spec(gm).gqa_groups == 1
    torch.testing.assert_close(gm(*ex), Site(fn).double()(*ex))
