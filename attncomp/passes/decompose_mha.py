"""Open ``nn.MultiheadAttention`` calls into projections around one ``scaled_dot_product_attention``.

Matches (before :mod:`.canonicalize`), whichever way the capture spelt the call:

* ``F.multi_head_attention_forward(query, key, value, embed_dim, num_heads, in_proj_weight, ...)``:
  dynamo keeps the function as one graph call (``nn.MultiheadAttention.forward`` is traced through, and its
  fused fast path is never taken under dynamo, which reports itself as make_fx tracing);
* ``call_module`` of an ``nn.MultiheadAttention`` (a leaf module of ``torch.fx.symbolic_trace``);
* ``torch._native_multi_head_attention`` / ``aten._native_multi_head_attention``, the fused op of the
  fast path (eval mode, self-attention, batch first, no autograd), where a graph calls it directly;
* ``torch._transformer_encoder_layer_fwd``, ``nn.TransformerEncoderLayer``'s fast path (one op for the
  whole layer), which dynamo does capture (eval, batch first, no autograd): its attention becomes the
  decomposition below, between the layer's layer norms, residuals and feed-forward block, and the site is
  named after the layer's ``self_attn``.

``torch.export`` traces through all of them into aten ops, which :mod:`.match_attention` matches as they are.

Requires: shape and dtype metadata on the inputs and masks (``meta["val"]`` from dynamo/export or
``meta["tensor_meta"]`` from ``ShapeProp``), to know the masks' dtypes.

Rewrites each call, when the attention weights it returns are not used (``need_weights=False``, or the
default ``need_weights=True`` with the weights dropped), to::

    q, k, v = linear(query, W_q, b_q), linear(key, W_k, b_k), linear(value, W_v, b_v)   (one packed linear
                                                   and a chunk for self-attention with the packed weight)
    q, k, v = x.unflatten(-1, (H, E // H)).transpose(1, 2)      (B, H, N, E // H), batch first
    o = scaled_dot_product_attention(q, k, v, mask, dropout_p if training else 0)
    out = linear(o.transpose(1, 2).flatten(2), W_out, b_out)    (transposed back to (L, B, E) if so called)

``mask``: ``key_padding_mask`` (``(B, S)``, True or ``-inf`` = ignore) and ``attn_mask`` (``(L, S)``,
``(B*H, L, S)``, or the fused ops' merged ``(B, H, L, S)``) combined as PyTorch combines them: a boolean
"may attend" mask when both are boolean, else the sum of their additive forms. ``is_causal`` is a hint in
PyTorch (it requires ``attn_mask``, which is what applies) and is not read. The result equals the call's
output in exact arithmetic (PyTorch's weights path scales q before ``q @ k^T``; its SDPA path is this one).

Counters: ``decompose_mha``: ``decomposed``, ``left_alone`` and per form (``form:functional``,
``form:module``, ``form:fused_mha``, ``form:fused_layer``).

Guarantees: the call node and its ``getitem(·, 0)`` are replaced; new nodes carry the call's
``nn_module_stack`` (the site is named after the ``MultiheadAttention`` module) and fake values.
Unbatched calls (``(L, E)`` inputs) run as a batch of one. Calls left alone, each with its reason in the
report (``SiteReport`` with ``rewritten=False``): the weights are used, ``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``/``static_v``,
a mask of unknown dtype.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .base import CompileContext, PassResult, SiteReport
from .node_info import dtype_of, resolve_attr, site_name

log = logging.getLogger(__name__)

__all__ = ["decompose_mha"]

NAME = "decompose_mha"
PATTERN = "nn.MultiheadAttention"

_NATIVE = (torch._native_multi_head_attention, torch.ops.aten._native_multi_head_attention.default)
_NATIVE_LAYER = (torch._transformer_encoder_layer_fwd, torch.ops.aten._transformer_encoder_layer_fwd.default)
# F.multi_head_attention_forward's parameters, in order
_MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
               "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
               "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
               "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_MHA_DEFAULTS = dict(training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                     use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                     static_k=None, static_v=None, average_attn_weights=True, is_causal=False)
_NATIVE_PARAMS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight",
                  "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type")
_LAYER_PARAMS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
                 "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2", "ffn_weight_1",
                 "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask", "mask_type")
_MODULE_PARAMS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
                  "is_causal")


class _Skip(Exception):
    """The call is left alone; the message is the report's reason."""


def _bind(node: fx.Node, names, defaults) -> Dict[str, Any]:
    a = dict(defaults)
    a.update(zip(names, node.args))
    a.update(node.kwargs)
    return a


def _call(gm: fx.GraphModule, node: fx.Node) -> Optional[Dict[str, Any]]:
    """The call's arguments in one form (``F.multi_head_attention_forward``'s, plus ``batch_first``), or
    None if ``node`` is not a multi-head attention call. Tensors are nodes (module tensors: ``get_attr``)."""
    if node.op == "call_function" and node.target is F.multi_head_attention_forward:
        a = _bind(node, _MHA_PARAMS, _MHA_DEFAULTS)
        a["batch_first"] = False
        return a
    if node.op == "call_function" and node.target in _NATIVE:
        n = _bind(node, _NATIVE_PARAMS, dict(mask=None, need_weights=True, average_attn_weights=True,
                                              mask_type=None))
        return dict(_fused_masks(n["mask"], n["mask_type"], n["query"]), query=n["query"], key=n["key"],
                    value=n["value"], num_heads=n["num_head"], in_proj_weight=n["qkv_weight"],
                    in_proj_bias=n["qkv_bias"], bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                    out_proj_weight=n["proj_weight"], out_proj_bias=n["proj_bias"], training=False,
                    need_weights=n["need_weights"], use_separate_proj_weight=False, static_k=None,
                    static_v=None, batch_first=True)
    if node.op == "call_function" and node.target in _NATIVE_LAYER:
        n = _bind(node, _LAYER_PARAMS, dict(mask=None, mask_type=None))
        mha = dict(_fused_masks(n["mask"], n["mask_type"], n["src"]), query=n["src"], key=n["src"],
                   value=n["src"], num_heads=n["num_heads"], in_proj_weight=n["qkv_weight"],
                   in_proj_bias=n["qkv_bias"], bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                   out_proj_weight=n["proj_weight"], out_proj_bias=n["proj_bias"], training=False,
                   need_weights=False, use_separate_proj_weight=False, static_k=None, static_v=None,
                   batch_first=True)
        return dict(mha, layer=n)
    if node.op == "call_module":
        mod = resolve_attr(gm, node.target)
        if not isinstance(mod, nn.MultiheadAttention):
            return None
        if type(mod).forward is not nn.MultiheadAttention.forward:
            raise _Skip(f"{type(mod).__name__} overrides nn.MultiheadAttention.forward")
        if mod._forward_hooks or mod._forward_pre_hooks or nn.modules.module._global_forward_hooks:
            raise _Skip("the nn.MultiheadAttention module has forward hooks")
        a = _bind(node, _MODULE_PARAMS, dict(key_padding_mask=None, need_weights=True, attn_mask=None,
                                              average_attn_weights=True, is_causal=False))
        g = node.graph

        def attr(name):
            return g.get_attr(f"{node.target}.{name}") if getattr(mod, name, None) is not None else None

        with g.inserting_before(node):
            sep = not mod._qkv_same_embed_dim
            a.update(num_heads=mod.num_heads, in_proj_weight=attr("in_proj_weight"), in_proj_bias=attr("in_proj_bias"),
                     bias_k=mod.bias_k, bias_v=mod.bias_v, add_zero_attn=mod.add_zero_attn, dropout_p=mod.dropout,
                     out_proj_weight=g.get_attr(f"{node.target}.out_proj.weight"),
                     out_proj_bias=g.get_attr(f"{node.target}.out_proj.bias") if mod.out_proj.bias is not None
                     else None,
                     training=mod.training, use_separate_proj_weight=sep,
                     q_proj_weight=attr("q_proj_weight") if sep else None,
                     k_proj_weight=attr("k_proj_weight") if sep else None,
                     v_proj_weight=attr("v_proj_weight") if sep else None,
                     static_k=None, static_v=None, batch_first=mod.batch_first)
        return a
    return None


def _fused_masks(mask, kind, query) -> Dict[str, Any]:
    """The fused ops' one mask as ``key_padding_mask``/``attn_mask``: ``mask_type`` 1 is a key padding mask
    ``(B, S)``, 0 an ``(L, S)`` mask and 2 one merged by ``MultiheadAttention.merge_masks`` ``(B, H, L, S)``."""
    if mask is not None and kind not in (0, 1, 2):
        kind = 1 if _rank(mask) == 2 and not _is_lxs(mask, query) else 0
    return dict(key_padding_mask=mask if kind == 1 else None, attn_mask=mask if kind in (0, 2) else None)


def _rank(n) -> Optional[int]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    if isinstance(v, torch.Tensor):
        return v.dim()
    tm = n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None
    return len(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _is_lxs(mask, query) -> bool:
    v, q = (x.meta.get("val") for x in (mask, query))
    return isinstance(v, torch.Tensor) and isinstance(q, torch.Tensor) and v.shape[0] == q.shape[1]


def _weights_used(node: fx.Node) -> bool:
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0:
            continue
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1 and not u.users:
            continue
        return True
    return False


def _check(a: Dict[str, Any]) -> None:
    if a.get("bias_k") is not None or a.get("bias_v") is not None:
        raise _Skip("bias_k/bias_v append learned keys and values")
    if a.get("add_zero_attn"):
        raise _Skip("add_zero_attn appends a zero key and value")
    if a.get("static_k") is not None or a.get("static_v") is not None:
        raise _Skip("static_k/static_v replace the projected keys and values")
    if _rank(a["query"]) not in (2, 3):
        raise _Skip("no shape metadata on the query (or it is neither 2-D nor 3-D)")
    if not isinstance(a.get("dropout_p"), (int, float)) or not isinstance(a.get("training"), bool):
        raise _Skip("dropout rate or training flag is not a constant")
    for m in ("key_padding_mask", "attn_mask"):
        if isinstance(a.get(m), fx.Node) and dtype_of(a[m]) is None:
            raise _Skip(f"{m} has no dtype metadata")
    if isinstance(a.get("attn_mask"), fx.Node) and _rank(a["attn_mask"]) not in (2, 3, 4):
        raise _Skip("attn_mask is neither (L, S), (B*H, L, S) nor (B, H, L, S)")


def _emit(g: fx.Graph, a: Dict[str, Any], tracer=None) -> fx.Proxy:
    """The decomposition, written on proxies that append nodes to ``g`` at its insertion point."""
    tracer = tracer or fx.proxy.GraphAppendingTracer(g)

    def P(x):
        return fx.Proxy(x, tracer) if isinstance(x, fx.Node) else x

    if "layer" in a:
        return _emit_layer(g, a, tracer, P)

    query, key, value = a["query"], a["key"], a["value"]
    H = int(a["num_heads"])
    self_attn = query is key and key is value
    q_in, k_in, v_in = P(query), P(key), P(value)
    unbatched = isinstance(query, fx.Node) and _rank(query) == 2
    if unbatched:  # (L, E) -> (1, L, E)
        q_in = q_in.unsqueeze(0)
        k_in = q_in if self_attn else k_in.unsqueeze(0)
        v_in = q_in if self_attn else (k_in if value is key else v_in.unsqueeze(0))
    elif not a["batch_first"]:  # (L, B, E) -> (B, L, E)
        q_in = q_in.transpose(0, 1)
        k_in = q_in if self_attn else k_in.transpose(0, 1)
        v_in = q_in if self_attn else (k_in if value is key else v_in.transpose(0, 1))
    in_b = P(a["in_proj_bias"])
    if a["use_separate_proj_weight"]:
        ws = [P(a[n]) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")]
        bs = [None] * 3 if in_b is None else [in_b.chunk(3)[i] for i in range(3)]
        q, k, v = (F.linear(x, w, b) for x, w, b in zip((q_in, k_in, v_in), ws, bs))
    elif self_attn:
        qkv = F.linear(q_in, P(a["in_proj_weight"]), in_b).chunk(3, -1)
        q, k, v = qkv[0], qkv[1], qkv[2]
    else:
        w = P(a["in_proj_weight"]).chunk(3)
        bs = [None] * 3 if in_b is None else [in_b.chunk(3)[i] for i in range(3)]
        q, k, v = (F.linear(x, w[i], bs[i]) for i, x in enumerate((q_in, k_in, v_in)))
    E = _last_dim(a["out_proj_weight"], 1)
    query = query.node if isinstance(query, fx.Proxy) else query
    q, k, v = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in (q, k, v))

    kpm, am = a.get("key_padding_mask"), a.get("attn_mask")
    masks = []  # (proxy, is_bool), each broadcastable to (B, H, L, S), True / -inf = excluded
    if isinstance(kpm, fx.Node):
        m = P(kpm).unsqueeze(0) if unbatched else P(kpm)
        masks.append((m.unsqueeze(1).unsqueeze(2), dtype_of(kpm) == torch.bool))
    if isinstance(am, fx.Node):
        m = P(am)
        if _rank(am) == 3:
            m = m.unflatten(0, (-1, H))
        masks.append((m, dtype_of(am) == torch.bool))
    mask = None
    if masks and all(b for _, b in masks):
        for m, _ in masks:
            allowed = ~m
            mask = allowed if mask is None else torch.logical_and(mask, allowed)
    else:
        for m, is_bool in masks:
            if is_bool:
                m = torch.zeros_like(m, dtype=_dtype(query, a["out_proj_weight"])).masked_fill(m, float("-inf"))
            mask = m if mask is None else mask + m
    p = float(a["dropout_p"]) if a["training"] else 0.0
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    out = F.linear(o.transpose(1, 2).flatten(2), P(a["out_proj_weight"]), P(a.get("out_proj_bias")))
    if unbatched:
        return out.squeeze(0)
    return out if a["batch_first"] else out.transpose(0, 1)


def _emit_layer(g: fx.Graph, a: Dict[str, Any], tracer, P) -> fx.Proxy:
    """``torch._transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s fast path, one op for the
    whole layer): the attention above between the layer's norms, residuals and feed-forward block."""
    n = a["layer"]
    E = int(n["embed_dim"])
    mha = {k: v for k, v in a.items() if k != "layer"}

    def norm(x, i):
        return F.layer_norm(x, (E,), P(n[f"norm_weight_{i}"]), P(n[f"norm_bias_{i}"]), float(n["eps"]))

    def sa(x):
        return _emit(g, dict(mha, query=x, key=x, value=x), tracer)

    def ff(x):
        h = F.linear(x, P(n["ffn_weight_1"]), P(n["ffn_bias_1"]))
        h = F.gelu(h) if n["use_gelu"] else F.relu(h)
        return F.linear(h, P(n["ffn_weight_2"]), P(n["ffn_bias_2"]))

    src = P(n["src"])
    if n["norm_first"]:
        x = src + sa(norm(src, 1))
        return x + ff(norm(x, 2))
    x = norm(src + sa(src), 1)
    return norm(x + ff(x), 2)


def _meta_tensor(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _last_dim(n, i: int) -> int:
    owner = n.graph.owning_module
    if n.op == "get_attr":
        return int(resolve_attr(owner, n.target).shape[i])
    v = _meta_tensor(n)
    if v is None:
        tm = n.meta.get("tensor_meta")
        return int(tm.shape[i])
    return int(v.shape[i])


def _dtype(*nodes) -> torch.dtype:
    """The first known dtype of ``nodes`` (graph values, or module tensors read by ``get_attr``)."""
    for n in nodes:
        if not isinstance(n, fx.Node):
            continue
        if dtype_of(n) is not None:
            return dtype_of(n)
        if n.op == "get_attr":
            return resolve_attr(n.graph.owning_module, n.target).dtype
    return torch.float32


def _fake_values(gm: fx.GraphModule, nodes: List[fx.Node]) -> None:
    """``meta["val"]`` of new nodes, computed from their inputs' under the graph's fake mode (dynamo and
    export graphs), or from ``tensor_meta`` shapes in a fake mode of our own (fx graphs)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    # the mode of the graph's own values (a tracing context around the backend may hold another one)
    mode = next((n.meta["val"].fake_mode for n in gm.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)),
                None) or FakeTensorMode(allow_non_fake_inputs=True)
    cache: Dict[fx.Node, Any] = {}

    def val(n):
        if n in cache:
            return cache[n]
        v = n.meta.get("val", n.meta.get("example_value"))
        if v is None and n.op == "get_attr":
            v = mode.from_tensor(resolve_attr(gm, n.target))
        if v is None and "tensor_meta" in n.meta:
            tm = n.meta["tensor_meta"]
            with mode:
                v = torch.empty(tm.shape, dtype=tm.dtype)
        cache[n] = v
        return v

    with mode:
        for n in nodes:
            args = fx.node.map_arg(n.args, val)
            kwargs = fx.node.map_arg(n.kwargs, val)
            try:
                if n.op == "get_attr":
                    out = val(n)
                elif n.op == "call_method":
                    out = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    out = n.target(*args, **kwargs)
            except Exception as e:  # metadata only: later passes then work without shapes
                log.info("decompose_mha: no fake value for %s (%s: %s)", n.name, type(e).__name__, e)
                return
            n.meta["val"] = out
            cache[n] = out


def _drop_unused_reads(g: fx.Graph, node: fx.Node) -> None:
    """Erase the ``get_attr`` nodes :func:`_call` put before a module call that is then left alone."""
    prev = node.prev
    while prev.op == "get_attr" and not prev.users:
        nxt = prev.prev
        g.erase_node(prev)
        prev = nxt


def _form(node: fx.Node) -> str:
    if node.op == "call_module":
        return "module"
    return {F.multi_head_attention_forward: "functional"}.get(
        node.target, "fused_layer" if node.target in _NATIVE_LAYER else "fused_mha")


def decompose_mha(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Open every multi-head attention call whose weights are unused into projections around SDPA."""
    g = gm.graph
    modified = False
    for node in list(g.nodes):
        try:
            a = _call(gm, node)
        except _Skip as e:
            a, why = None, str(e)
        else:
            why = None
        if a is None and why is None:
            continue
        name = site_name(node, f"mha{len(ctx.sites)}")
        if node.op == "call_module" and "nn_module_stack" in node.meta:
            # fx records the stack of a leaf module's caller: the site is the module itself
            stack = dict(node.meta["nn_module_stack"] or {})
            stack[node.target] = (node.target, type(resolve_attr(gm, node.target)))
            node.meta["nn_module_stack"] = stack
            name = site_name(node, name)
        try:
            if why is not None:
                raise _Skip(why)
            if "layer" not in a and _weights_used(node):
                raise _Skip("the attention weights it returns are used (need_weights=True and read): the "
                            "op does not return them")
            _check(a)
        except _Skip as e:
            ctx.sites.append(SiteReport(name=name, rewritten=False, policy=ctx.policy.name, pattern=PATTERN,
                                        reason=str(e)))
            ctx.count(NAME, "left_alone")
            _drop_unused_reads(g, node)
            continue
        before = set(g.nodes)
        with g.inserting_before(node):
            out = _emit(g, a).node
        new = [n for n in g.nodes if n not in before]
        keep = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        if "layer" in a and keep.get("nn_module_stack"):
            # the fused layer op runs the layer's self_attn: the site is named after it, as in other captures
            stack = dict(keep["nn_module_stack"])
            key, (path, _) = list(stack.items())[-1]
            stack[f"{key}.self_attn"] = (f"{path}.self_attn", nn.MultiheadAttention)
            keep["nn_module_stack"] = stack
        for n in new:
            n.meta.update(keep)
        _fake_values(gm, new)
        if "layer" in a:  # one output, the layer's
            node.replace_all_uses_with(out)
        for u in list(node.users):
            if u.args[1] == 0:
                u.replace_all_uses_with(out)
            g.erase_node(u)
        g.erase_node(node)
        ctx.count(NAME, "decomposed")
        ctx.count(NAME, "form:" + _form(node))
        modified = True
    if modified:
        g.lint()
        gm.recompile()
    return PassResult(gm, modified)
