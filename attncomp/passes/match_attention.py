"""Find every attention site and rewrite it to one ``attncomp::attention`` op.

Matches (on the canonical graph of :mod:`.canonicalize`)::

    s = matmul(q', kT)                      q' = q * c?, kT = transpose(k * c?) or any (.., D, Nk) tensor
    s = s * c | s + bias | s - bias | where(m, fill, s) | where(m, s, fill) | s.to(dtype)    (any order, repeated)
    p = softmax(s, dim=-1[, dtype])  [.to(dtype)]  [dropout(p, rate, training)]
    o = matmul(p, v)

and every ``scaled_dot_product_attention`` call. Scales are Python numbers, 0-dim constant tensors or
scalar expressions of the head dim (``d ** -0.5``, ``sqrt(d)``); a scale computed from other run-time
values is applied to q with a multiply instead. Masks: additive float tensors (summed), boolean
exclusions from ``where``/``masked_fill`` with a fill at or below -1e4 (``-inf``, ``finfo.min``), a
constant lower-triangular buffer sliced from the top left (GPT-2's registered ``bias``), which becomes
``causal=True``. Zeros the graph makes (``torch.zeros``, ``zeros_like``, ``new_zeros``: ``baddbmm``'s input
on GPT-NeoX-Japanese) added to logits of their shape are no bias; a bias that broadcasts the logits to a
larger shape (more heads than q has) leaves the site unmatched. GQA expansions of k and v (``repeat_interleave`` on dim 1, ``expand`` + ``reshape``)
are undone so the op sees the KV heads. 3-D (``bmm``-style) sites run as 4-D with one head.
Score modifiers (DESIGN.md §4.2, :mod:`.score_modifiers`): a soft-cap ``c * tanh(s / c)`` between the
scaled product and the mask, and a per-head sink column concatenated before the softmax (less its row max)
and dropped after it, go into the spec (``softcap``, ``sinks`` with the sink logits as the op's tensor);
the report names them per site (``details["modifiers"]``). A bias or mask inside the tanh, or any other
tanh, rejects the site with the reason.

Requires: :mod:`.canonicalize` ran. Shape metadata (``val`` or ``tensor_meta``) where present is used
to check ranks, softmax dim and GQA shapes; without it only the literal ``dim=-1`` is accepted.

Guarantees: each rewritten site is exactly one op node followed by ``getitem(·, 0)``, whose
``meta["attncomp_site"]`` is its :class:`SiteReport`; the region between the two matmuls is convex (no
node in it is used outside it, and no op input depends on it); every candidate that is not rewritten
is reported with the reason. A fully masked query row outputs zeros (eager gives NaN or a uniform
average over masked keys).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..policy import Dense
from ..spec import AttentionSpec, dtype_name
from .base import MASK_FILL_MAX, SITE_META, CompileContext, PassResult, SiteReport
from .canonicalize import ADD, DIV, DROPOUT, MATMUL, MUL, SDPA, SOFTMAX, TRANSPOSE, WHERE, is_cast
from .score_modifiers import drops_last_column, is_tanh, peel_sinks, softcap_of
from .node_info import (UNKNOWN, get_attr_value, infer_meta, is_symbolic_number, meta_dtype, meta_shape, same_dim, scalar_value,
                          site_name, static_int, to_networkx)

log = logging.getLogger(__name__)

__all__ = ["match_attention"]

aten = torch.ops.aten


class NoMatch(Exception):
    """A candidate that is not rewritten; the message is the reason shown in the report."""


@dataclass
class Site:
    anchor: fx.Node          # the node whose value the op replaces (AV matmul or SDPA call)
    name: str
    pattern: str
    q: fx.Node
    k: fx.Node
    v: fx.Node
    rank: int = 4
    scale: object = None     # float, None (default 1/sqrt(D)), or a node to multiply q by
    causal: bool = False
    window_left: Optional[int] = None                      # a banded causal buffer: i - j <= window_left
    biases: List[object] = field(default_factory=list)    # float tensors added to the logits
    bias_scales: List[float] = field(default_factory=list)  # each bias times the scale applied after it
    allowed: List[fx.Node] = field(default_factory=list)  # bool tensors, True = may attend
    mask: Optional[fx.Node] = None                         # an SDPA attn_mask as given
    dropout: float = 0.0
    dropout_node: Optional[fx.Node] = None
    k_transposed: bool = False                             # k is (.., D, Nk) and needs a transpose
    groups: int = 1
    notes: List[str] = field(default_factory=list)
    softcap: Optional[float] = None                        # c of c * tanh(s / c) (DESIGN.md §4.2)
    sinks: Optional[fx.Node] = None                        # the per-head sink logits, (1, H, 1, 1) or (H, 1, 1)


def match_attention(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    n_idx = 0
    for node in list(gm.graph.nodes):
        is_sm = node.op == "call_function" and node.target is SOFTMAX
        is_sdpa = node.op == "call_function" and node.target is SDPA
        if not (is_sm or is_sdpa):
            continue
        default_name = f"site{n_idx}"
        try:
            site = _match_sdpa(gm, node) if is_sdpa else _match_softmax(gm, node)
        except NoMatch as e:
            if str(e).startswith("not attention:"):
                continue
            name = site_name(node, default_name)
            ctx.sites.append(SiteReport(name=name, rewritten=False, policy=ctx.policy.name,
                                        pattern="sdpa" if is_sdpa else "matmul-softmax-matmul", reason=str(e)))
            ctx.count("match_attention", "rejected")
            n_idx += 1
            continue
        if site is None:
            continue
        site.name = site_name(node, default_name)
        _rewrite(gm, site, ctx)
        ctx.count("match_attention", "rewritten")
        ctx.count("match_attention", f"pattern:{site.pattern}")
        modified = True
        n_idx += 1
    return PassResult(gm, modified)


# ---------------------------------------------------------------------------------------------
# Matching


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _users(n: fx.Node) -> List[fx.Node]:
    return list(n.users)


def _match_softmax(gm: fx.GraphModule, sm: fx.Node) -> Optional[Site]:
    x = sm.args[0]
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    # --- up: from the softmax input to the QK^T matmul
    scale_factors: List[object] = []
    biases: List[object] = []
    bias_scales: List[float] = []
    exclusions_raw: List[Tuple[fx.Node, bool]] = []
    # score modifiers (.score_modifiers): a sink column concatenated to the logits, a soft-cap
    cur, sinks = peel_sinks(gm, x)
    softcap, before_cap = None, None
    qk = None
    for _ in range(64):
        if not isinstance(cur, fx.Node):
            raise NoMatch("not attention: softmax input is not computed")
        if _is(cur, MATMUL):
            qk = cur
            break
        if is_cast(cur):
            cur = cur.args[0]
            continue
        cap = softcap_of(gm, cur)
        if cap is not None:
            if softcap is not None:
                raise NoMatch("two soft-caps between QK^T and the softmax")
            if scale_factors:
                raise NoMatch("the soft-capped logits are scaled again (not c * tanh(s / c) of the logits)")
            cur, softcap = cap
            before_cap = (len(biases), len(exclusions_raw))
            continue
        if is_tanh(cur):
            raise NoMatch("tanh between QK^T and the softmax that is not a soft-cap c * tanh(s / c)")
        if _is(cur, MUL) or _is(cur, DIV):
            a, b = cur.args[0], cur.args[1]
            if _is(cur, MUL) and _reaches_matmul(b) and not _reaches_matmul(a):
                a, b = b, a
            if not _reaches_matmul(a):
                raise NoMatch("not attention: no QK^T product before the softmax")
            if not _is_scalar(gm, b) and _is(cur, MUL) and _per_head(b, cur):
                # Swin-V2's learned logit scale, one per head: a factor on q (run-time, differentiable)
                scale_factors.append(("mul", b))
                cur = a
                continue
            if not _is_scalar(gm, b):
                fill = _complement_fill(gm, biases, b) if _is(cur, MUL) else None
                if fill is None:
                    raise NoMatch(f"logits are multiplied by a tensor ({getattr(b, 'name', b)}), not a scalar scale")
                # OpenAI-GPT's ``w * b + -1e4 * (1 - b)`` with a 0/1 buffer b: where(b, w, -1e4), a mask
                if scale_factors:
                    raise NoMatch("logits masked by a 0/1 product are scaled again")
                del bias_scales[biases.index(fill)]
                biases.remove(fill)
                exclusions_raw.append((b, True))
                cur = a
                continue
            scale_factors.append(("div" if _is(cur, DIV) else "mul", b))
            cur = a
            continue
        if _is(cur, ADD):
            a, b = cur.args[0], cur.args[1]
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra and rb:
                raise NoMatch("logits are a sum of two products; not one attention site")
            if not (ra or rb):
                raise NoMatch("not attention: no QK^T product before the softmax")
            chain, bias = (a, b) if ra else (b, a)
            if meta_dtype(bias) == torch.bool:
                raise NoMatch("a boolean tensor is added to the logits")
            if _widens(cur, chain):
                raise NoMatch(f"the bias {getattr(bias, 'name', bias)} broadcasts the logits to a larger shape")
            if _adds_zeros(cur, chain, bias):  # baddbmm(zeros, q, kT): GPT-NeoX-Japanese's logits
                cur = chain
                continue
            if not isinstance(bias, (int, float)):  # a constant shift changes no softmax
                biases.append(bias)
                bias_scales.append(_outer_scale(gm, scale_factors, "a bias is added"))
            cur = chain
            continue
        if _is_sub(cur):
            a, b = cur.args[0], cur.args[1]
            if not _reaches_matmul(a):
                raise NoMatch("not attention: no QK^T product before the softmax" if not _reaches_matmul(b)
                              else "the logits are subtracted from a tensor (negated logits)")
            if _reaches_matmul(b):
                raise NoMatch("logits are a difference of two products; not one attention site")
            if meta_dtype(b) == torch.bool:
                raise NoMatch("a boolean tensor is subtracted from the logits")
            if _widens(cur, a):
                raise NoMatch(f"the bias {getattr(b, 'name', b)} broadcasts the logits to a larger shape")
            if not isinstance(b, (int, float)):  # s - b: the bias b times -1 (negation is exact)
                biases.append(b)
                bias_scales.append(-_outer_scale(gm, scale_factors, "a bias is subtracted"))
            cur = a
            continue
        if _is(cur, WHERE):
            cond, a, b = cur.args[0], cur.args[1], cur.args[2]
            ra, rb = _reaches_matmul(a), _reaches_matmul(b)
            if ra == rb:
                raise NoMatch("not attention: where() does not select between logits and a fill value")
            fill = b if ra else a
            fv = scalar_value(gm, fill)
            if fv is not UNKNOWN:
                c = _outer_scale(gm, scale_factors, "a mask is applied")
                fv = fv * c if c > 0 else float("nan")  # the fill as the softmax sees it, scaled after it
            if fv is UNKNOWN or not fv <= MASK_FILL_MAX:
                raise NoMatch(f"where()/masked_fill fills logits with {fill!r}, not a masking value (<= -1e4)")
            # where(cond, fill, s): cond marks excluded entries; where(cond, s, fill): cond marks allowed
            exclusions_raw.append((cond, ra))
            cur = a if ra else b
            continue
        raise NoMatch("not attention: unsupported op between QK^T and softmax: "
                      f"{cur.op} {getattr(cur.target, '__name__', cur.target)}")
    if qk is None:
        raise NoMatch("not attention: no QK^T product before the softmax")
    if softcap is not None and (len(biases), len(exclusions_raw)) != before_cap:
        # the spec's order: additive modifiers, the soft-cap, then the mask; a bias inside the tanh is
        # none of the modifiers the op carries, and a mask inside it is no longer a mask
        raise NoMatch("a bias or mask is applied to the logits inside the soft-cap's tanh")

    qa, kb = qk.args[0], qk.args[1]
    # --- down: from the softmax to the AV matmul
    chain = [sm]
    cur = sm
    dropout, dropout_node = 0.0, None
    av = None
    sink_dropped = sinks is None
    for _ in range(8):
        us = _users(cur)
        if len(us) != 1:
            raise NoMatch(f"attention probabilities escape the site (used by {len(us)} nodes: "
                          f"{', '.join(u.name for u in us)}), e.g. returned as attention weights")
        u = us[0]
        if not sink_dropped:
            if not drops_last_column(u):
                raise NoMatch("a sink column joins the softmax but its probability is not dropped ([..., :-1])")
            sink_dropped = True
            cur = u
            chain.append(u)
            continue
        if is_cast(u):
            cur = u
            chain.append(u)
            continue
        if _is(u, DROPOUT) or (u.op == "call_module" and "attncomp_module_dropout" in u.meta):
            if u.op == "call_module":
                p, train = u.meta["attncomp_module_dropout"], True
            else:
                p = u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.5)
                train = u.args[2] if len(u.args) > 2 else u.kwargs.get("training", True)
            if not isinstance(p, (int, float)):
                raise NoMatch("dropout rate is not a constant")
            if train is True:
                dropout = float(p)
            elif train is not False:
                raise NoMatch("dropout training flag is not a constant")
            dropout_node = u
            cur = u
            chain.append(u)
            continue
        if _is(u, MATMUL) and u.args[0] is cur:
            av = u
            break
        if _zeroes_excluded(gm, u, cur, exclusions_raw):
            # CPM-Ant zeroes the excluded probabilities again after the softmax: they are 0 already, and a row
            # with no allowed entry becomes 0, which is what the op returns for it
            cur = u
            chain.append(u)
            continue
        raise NoMatch(f"softmax output feeds {u.op} {getattr(u.target, '__name__', u.target)}, "
                      "not a product with values")
    if av is None:
        raise NoMatch("softmax output is not multiplied by values")
    v = av.args[1]

    # --- shapes and the softmax dim
    s_shape = meta_shape(x)
    rank = len(s_shape) if s_shape is not None else None
    if rank is None:
        if dim != -1:
            raise NoMatch(f"softmax over dim {dim} and shapes unknown; pass example_inputs")
        rank = 4
        notes = ["shapes unknown at compile time: 4-D assumed, checked at run time"]
    else:
        notes = []
        if dim not in (-1, rank - 1):
            raise NoMatch(f"softmax over dim {dim}, not over the keys (last dim of {rank}-D logits)")
        if rank not in (3, 4, 5):
            raise NoMatch(f"{rank}-D logits; attention sites are 3-D, 4-D or 5-D")
        for nm, t in (("query", qa), ("keys", kb), ("values", v)):
            ts = meta_shape(t)
            if ts is not None and len(ts) != rank:
                raise NoMatch(f"{nm} are {len(ts)}-D but the logits are {rank}-D (broadcast batch dims)")
    # a matmul-softmax-matmul whose "keys" are constants (a learned matrix) is not attention
    if _is_constant(gm, kb) or _is_constant(gm, v):
        raise NoMatch("key or value side is a constant (parameter or buffer), not an attention site")
    # learned queries over input keys (Perceiver's latents, an attention-pooling head) are attention
    if not _depends_on_input(kb):
        raise NoMatch("key side does not depend on the model inputs")

    # --- q and k: peel scalar multiplications (scale on q, on k, or both) and the transpose of k
    q, qf = _peel_scale(gm, qa)
    kT, kf1 = _peel_scale(gm, kb)
    k_transposed = True
    if _is(kT, TRANSPOSE) and {kT.args[1], kT.args[2]} in ({-1, -2}, {rank - 1, rank - 2}):
        k, kf2 = _peel_scale(gm, kT.args[0])
        k_transposed = False
    else:
        k, kf2 = kT, []
    factors = [("mul", f) for f in qf + kf1 + kf2] + scale_factors

    # --- GQA expansions of k and v
    k_full, v_full = k, v
    k, gk = _peel_gqa(gm, k)
    v, gv = _peel_gqa(gm, v)
    if gk != gv or rank == 5:  # k and v expanded differently (or 5-D: dim 1 is not the heads): as they are
        k, v, gk = k_full, v_full, 1
    groups = gk

    anchor = av
    lse_sink = _lse_sink_scale(gm, x, sm, av) if sinks is None else None
    if lse_sink is not None:  # Granite-SWA: out * sigmoid(logsumexp(s) - sink), a sink in the denominator
        anchor, sinks = lse_sink
    if sinks is not None and rank != 4:
        raise NoMatch("a sink column on 3-D logits (one head per batch entry)")
    site = Site(anchor=anchor, name="", pattern="", q=q, k=k, v=v, rank=rank, k_transposed=k_transposed,
                groups=groups, biases=biases, bias_scales=bias_scales, dropout=dropout, dropout_node=dropout_node, notes=notes,
                softcap=softcap, sinks=sinks)
    # --- masks
    exclusions_raw = [(_peel_expand_as(c), a) for c, a in exclusions_raw]
    site.biases = [_peel_expand_as(b) if isinstance(b, fx.Node) else b for b in site.biases]
    for cond, is_allowed in exclusions_raw:
        band = _causal_buffer(gm, cond, is_allowed, s_shape)
        if band is not None:
            site.causal = True
            if band != "causal":
                site.window_left = band if site.window_left is None else min(site.window_left, band)
            continue
        site.allowed.append(cond if is_allowed else ("not", cond))
    site.scale = _resolve_scale(gm, factors, site)
    # --- convexity: nothing inside the region is used outside it; no input depends on it
    _check_convex(gm, qk, anchor, site)
    bits = ["matmul-softmax-matmul"]
    if site.scale is None or factors:
        bits.append("scale on " + "/".join(sorted(set(
            ["q"] * bool(qf) + ["k"] * bool(kf1 or kf2) + ["scores"] * bool(scale_factors)))) if factors else "")
    if site.biases:
        bits.append("additive mask")
    if site.allowed:
        bits.append("bool mask")
    if site.causal:
        bits.append("causal buffer" if site.window_left is None else f"local buffer (window {site.window_left + 1})")
    if softcap is not None:
        bits.append("softcap")
    if sinks is not None:
        bits.append("sinks")
    if dropout_node is not None:
        bits.append("dropout")
    if groups > 1:
        bits.append(f"gqa x{groups}")
    if rank in (3, 5):
        bits.append(f"{rank}-D")
    site.pattern = ", ".join(b for b in bits if b)
    return site


_SUBS = {operator.sub, torch.sub, aten.sub.Tensor}


def _is_sub(n) -> bool:
    """``a - b`` on tensors (``alpha`` 1): canonicalize leaves subtraction as written (it also subtracts sizes)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SUBS and len(n.args) == 2 \
        and n.kwargs.get("alpha", 1) == 1 and any(isinstance(a, fx.Node) and meta_shape(a) is not None
                                                  for a in n.args)


_ZEROS = {torch.zeros, torch.zeros_like, aten.zeros.default, aten.zeros_like.default}
_SAME_VALUES = {"view", "reshape", "unflatten", "flatten", "expand", "contiguous"}


def _is_zeros(n, depth: int = 0) -> bool:
    """Whether ``n`` is a tensor of zeros the graph makes (``zeros``, ``zeros_like``, ``new_zeros``), seen
    through views, expansions and casts."""
    if not isinstance(n, fx.Node) or depth > 16:
        return False
    if n.op == "call_function" and n.target in _ZEROS:
        return "out" not in n.kwargs
    if n.op == "call_method" and n.target == "new_zeros":
        return True
    if is_cast(n) or (n.op == "call_method" and n.target in _SAME_VALUES) \
            or (n.op == "call_function" and n.target in (torch.reshape, torch.flatten, torch.unflatten)):
        return _is_zeros(n.args[0], depth + 1)
    return False


def _adds_zeros(total: fx.Node, logits: fx.Node, bias) -> bool:
    """Whether ``total = logits + bias`` adds a tensor of zeros that does not broadcast the logits to a
    larger shape: the sum has the logits' values (a -0.0 becomes +0.0; the softmax sees the same exp)."""
    if not _is_zeros(bias):
        return False
    st, sl = meta_shape(total), meta_shape(logits)
    return st is not None and sl is not None and len(st) == len(sl) and all(same_dim(a, b) for a, b in zip(st, sl)) \
        and meta_dtype(total) == meta_dtype(logits)


def _widens(total: fx.Node, logits: fx.Node) -> bool:
    """Whether ``total`` (logits plus a bias) is provably larger than ``logits``: more dims, or a size-1 dim
    of the logits broadcast to more (the op's output would have q's heads and batch, not the sum's)."""
    st, sl = meta_shape(total), meta_shape(logits)
    if st is None or sl is None:
        return False
    if len(st) > len(sl):
        return True
    return any(static_int(b) == 1 and static_int(a) != 1 for a, b in zip(st[::-1], sl[::-1]))


def _reaches_matmul(n, depth: int = 0) -> bool:
    """Whether ``n`` is (through the ops allowed between QK^T and softmax) a matmul."""
    if not isinstance(n, fx.Node) or depth > 64:
        return False
    if _is(n, MATMUL):
        return True
    if is_cast(n) or is_tanh(n):
        return _reaches_matmul(n.args[0], depth + 1)
    if _is(n, MUL) or _is(n, DIV) or _is(n, ADD) or _is_sub(n):
        return any(_reaches_matmul(a, depth + 1) for a in n.args[:2])
    if _is(n, WHERE):
        return any(_reaches_matmul(a, depth + 1) for a in n.args[1:3])
    return False


def _is_constant(gm: fx.GraphModule, n) -> bool:
    """True if ``n`` depends on no placeholder (only parameters, buffers and constants)."""
    return isinstance(n, fx.Node) and not _depends_on_input(n)


def _depends_on_input(n) -> bool:
    if not isinstance(n, fx.Node):
        return False
    seen, stack = set(), [n]
    params = _param_placeholders(n.graph)
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op == "placeholder" and m not in params:
            return True
        stack.extend(m.all_input_nodes)
    return False


def _param_placeholders(graph: fx.Graph):
    """Placeholders that carry parameters/buffers (dynamo lifts them as graph inputs)."""
    out = set()
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        ga = n.meta.get("grapharg")
        example = getattr(ga, "_example", None) if ga is not None else None
        if callable(example):  # a weakref in some versions
            example = example()
        if isinstance(example, nn.Parameter) or "_parameters_" in n.name or "_buffers_" in n.name:
            out.add(n)
            continue
        src = getattr(ga, "source", None)
        gs = getattr(src, "guard_source", None)
        gs = gs() if callable(gs) else gs
        if gs is not None and getattr(gs, "is_specialized_nn_module", lambda: False)():
            out.add(n)
    return out


def _peel_scale(gm, n) -> Tuple[fx.Node, List[object]]:
    """Strip multiplications/divisions by scalars (and dtype casts between them) off ``n``."""
    factors: List[object] = []
    while isinstance(n, fx.Node):
        if _is(n, MUL):
            a, b = n.args[0], n.args[1]
            if _is_scalar(gm, b):
                factors.append(b)
                n = a
                continue
            if _is_scalar(gm, a):
                factors.append(a)
                n = b
                continue
        if _is(n, DIV) and _is_scalar(gm, n.args[1]):
            factors.append(("recip", n.args[1]))
            n = n.args[0]
            continue
        break
    return n, factors


def _is_scalar(gm, x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    if not isinstance(x, fx.Node):
        return False
    if scalar_value(gm, x) is not UNKNOWN:
        return True
    if is_symbolic_number(x.meta.get("example_value", x.meta.get("val"))):
        return True  # a run-time scalar (symbolic sizes): becomes a multiply on q
    shp = meta_shape(x)
    if shp is not None:
        return len(shp) == 0
    # fx graphs without shapes: a size()-based Python expression is a scalar
    return "example_value" not in x.meta and _is_size_expr(x)


def _is_size_expr(n, depth=0) -> bool:
    if isinstance(n, (int, float)):
        return True
    if not isinstance(n, fx.Node) or depth > 10:
        return False
    if n.op == "call_method" and n.target in ("size", "dim"):
        return True
    if n.op == "call_function" and n.target in (getattr, operator.getitem) and isinstance(n.args[0], fx.Node) \
            and (n.args[0].target == "shape" or n.target is getattr and n.args[1] == "shape"):
        return True
    if n.op == "call_function" and n.target in (operator.pow, operator.mul, operator.truediv, math.sqrt,
                                                operator.getitem, MUL, DIV, torch.pow, torch.sqrt,
                                                torch.sym_sqrt if hasattr(torch, "sym_sqrt") else None):
        return all(_is_size_expr(a, depth + 1) for a in n.args)
    if n.op == "call_function" and n.target is aten.sym_size.int:
        return True
    return False


def _head_dim_leaf(site_q, site_k):
    """Leaf evaluator: size(-1)/shape[-1] of q or k is the head dim (a free variable D)."""
    def leaf_for(D):
        def leaf(n):
            if n.op == "call_method" and n.target == "size" and len(n.args) == 2 and n.args[1] in (-1, 3) \
                    and n.args[0] in (site_q, site_k):
                return float(D)
            if n.op == "call_function" and n.target is aten.sym_size.int and n.args[0] in (site_q, site_k) \
                    and n.args[1] in (-1, 3):
                return float(D)
            if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
                sh = n.args[0]
                if sh.op == "call_function" and sh.target is getattr and sh.args[1] == "shape" \
                        and sh.args[0] in (site_q, site_k) and n.args[1] in (-1, 3):
                    return float(D)
            return UNKNOWN
        return leaf
    return leaf_for


def _resolve_scale(gm, factors, site: Site):
    """Combine the scale factors: a float, ``None`` when it is exactly ``1/sqrt(D)``, or a node."""
    if not factors:
        return 1.0
    leaf_for = _head_dim_leaf(site.q, site.k)

    def value(D):
        total = 1.0
        for kind, f in factors:
            if isinstance(f, tuple) and f[0] == "recip":
                kind, f = "div", f[1]
            val = scalar_value(gm, f, leaf_for(D))
            if val is UNKNOWN:
                return UNKNOWN
            total = total / val if kind == "div" else total * val
        return total

    consts = [value(D) for D in (64.0, 80.0, 128.0)]
    if all(c is not UNKNOWN for c in consts):
        if consts[0] == consts[1] == consts[2]:
            return float(consts[0])
        if all(math.isclose(c, D ** -0.5, rel_tol=1e-12) for c, D in zip(consts, (64.0, 80.0, 128.0))):
            return None
        # a head-dim expression that is not 1/sqrt(D): evaluate at the site's D if it is static
        d = _static_head_dim(site)
        if d is not None:
            return float(value(float(d)))
    # a run-time scalar: multiply q by it
    site.notes.append("scale computed at run time: applied to q")
    return ("runtime", factors)


def _static_head_dim(site: Site) -> Optional[int]:
    shp = meta_shape(site.q)
    return static_int(shp[-1]) if shp else None


def _peel_gqa(gm, n) -> Tuple[fx.Node, int]:
    """Undo ``repeat_interleave(x, g, dim=1)`` or ``x[:, :, None].expand(B, Hk, g, N, D).reshape(B, Hk*g, N, D)``."""
    if not isinstance(n, fx.Node):
        return n, 1
    if (n.op == "call_method" and n.target == "repeat_interleave") or \
            (n.op == "call_function" and n.target in (torch.repeat_interleave, aten.repeat_interleave.self_int)):
        x = n.args[0]
        reps = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        shp = meta_shape(x)
        if isinstance(reps, int) and reps >= 1 and shp is not None and len(shp) == 4 and dim in (1, -3):
            return x, reps
        return n, 1
    is_reshape = (n.op == "call_method" and n.target in ("reshape", "view")) or \
        (n.op == "call_function" and n.target in (torch.reshape, aten.reshape.default, aten.view.default,
                                                  aten._unsafe_view.default))
    if not is_reshape:
        return n, 1
    e = _skip_noop_slices(n.args[0])
    is_expand = isinstance(e, fx.Node) and ((e.op == "call_method" and e.target == "expand") or
                                            (e.op == "call_function" and e.target is aten.expand.default))
    if not is_expand:
        return n, 1
    src = _skip_noop_slices(e.args[0])
    src_shape, e_shape, out_shape = meta_shape(src), meta_shape(e), meta_shape(n)
    if src_shape is None or e_shape is None or out_shape is None or len(e_shape) != 5 or len(out_shape) != 4:
        return n, 1
    if not (static_int(src_shape[2]) == 1 and len(src_shape) == 5):
        return n, 1
    g = static_int(e_shape[2])
    if g is None:
        return n, 1
    # src is x[:, :, None] (B, Hk, 1, N, D); find x (B, Hk, N, D)
    x = _skip_noop_slices(src.args[0]) if isinstance(src, fx.Node) else None
    x_shape = meta_shape(x)
    unsq = isinstance(src, fx.Node) and (
        (src.op == "call_method" and src.target == "unsqueeze" and src.args[1] in (2, -3)) or
        (src.op == "call_function" and src.target is aten.unsqueeze.default and src.args[1] in (2, -3)))
    if not unsq:
        # x[:, :, None, :, :] indexing
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem:
            idx = src.args[1]
            if isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None and all(
                    isinstance(i, slice) and i == slice(None) for i in idx[:2] + idx[3:]):
                unsq = True
    if not unsq or x_shape is None or len(x_shape) != 4:
        return n, 1
    if not all(same_dim(a, b) for a, b in zip(
            (x_shape[0], x_shape[2], x_shape[3]), (out_shape[0], out_shape[2], out_shape[3]))):
        return n, 1
    return x, g


def _skip_noop_slices(n):
    """Skip ``aten.slice(x, d, 0|None, end)`` nodes that keep the whole dim (export spells ``x[:, :]`` so)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.slice.Tensor:
        start = n.args[2] if len(n.args) > 2 else None
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        src = n.args[0]
        ss, ns = meta_shape(src), meta_shape(n)
        full = end is None or (isinstance(end, int) and end >= 2 ** 62) or (
            ss is not None and ns is not None and all(same_dim(a, b) for a, b in zip(ss, ns)))
        if start in (None, 0) and step in (None, 1) and full:
            n = src
            continue
        break
    return n


def _causal_buffer(gm, cond, is_allowed: bool, s_shape):
    """``"causal"`` when ``cond`` selects exactly the causal (``j <= i``) entries, from a tril buffer
    sliced from the top left; the window's ``left`` when it selects a band (``0 <= i - j <= left``,
    GPT-Neo's local layers); None otherwise."""
    pol = is_allowed
    n = cond
    for _ in range(8):
        if not isinstance(n, fx.Node):
            return None
        if n.op == "call_method" and n.target in ("bool", "to") or (n.op == "call_method" and n.target == "to"):
            n = n.args[0]
            continue
        if n.op == "call_function" and n.target in (aten._to_copy.default,):
            n = n.args[0]
            continue
        if (n.op == "call_function" and n.target in (operator.invert, torch.logical_not, aten.logical_not.default,
                                                      aten.bitwise_not.default)) or \
                (n.op == "call_method" and n.target in ("logical_not", "__invert__", "bitwise_not")):
            pol = not pol
            n = n.args[0]
            continue
        if (n.op == "call_function" and n.target in (operator.eq, torch.eq, aten.eq.Scalar)) or \
                (n.op == "call_method" and n.target == "eq"):
            if n.args[1] != 0:
                return None
            pol = not pol
            n = n.args[0]
            continue
        if (n.op == "call_function" and n.target in (operator.ne, torch.ne, aten.ne.Scalar)) or \
                (n.op == "call_method" and n.target == "ne"):
            if n.args[1] != 0:
                return None
            n = n.args[0]
            continue
        break
    # slicing chain down to a get_attr buffer
    slices = {}
    while isinstance(n, fx.Node) and n.op == "call_function":
        if n.target is operator.getitem and isinstance(n.args[1], tuple):
            for d, sl in enumerate(n.args[1]):
                if sl is Ellipsis:
                    return None
                if isinstance(sl, slice):
                    slices[d] = (sl.start, sl.step)
                elif sl is not None:
                    return None
            n = n.args[0]
            continue
        if n.target is aten.slice.Tensor:
            d = n.args[1] if len(n.args) > 1 else 0
            start = n.args[2] if len(n.args) > 2 else None
            step = n.args[4] if len(n.args) > 4 else 1
            slices[d] = (start, step)
            n = n.args[0]
            continue
        break
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return None
    buf = get_attr_value(gm, n)
    if not isinstance(buf, torch.Tensor) or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2]:
        return None
    nd = buf.dim()
    for d, (start, step) in slices.items():
        d = d % nd
        if isinstance(start, fx.Node):  # GPT-Neo's key_length - query_length: 0 when dynamo proves it
            start = start.meta.get("example_value", start.meta.get("val"))
            start = 0 if start is not None and same_dim(start, 0) else start
        if start not in (None, 0) or step not in (None, 1):
            return None
    mask = (buf != 0).reshape(-1, *buf.shape[-2:])
    if not bool((mask == mask[:1]).all()):
        return None
    mask = mask[0] if pol else ~mask[0]
    ones = torch.ones(buf.shape[-2:], dtype=torch.bool, device=buf.device)
    tril = ones.tril()
    if bool((mask == tril).all()):
        band = "causal"
    else:
        gap = tril & ~mask   # causal entries the buffer excludes: the nearest one bounds the window
        if bool((mask & ~tril).any()) or not bool(gap.any()):
            return None
        idx = gap.nonzero()
        band = int((idx[:, 0] - idx[:, 1]).min()) - 1
        if band < 0 or not bool((mask == (tril & ~ones.tril(-band - 1))).all()):
            return None
    # the sliced mask must cover the logits' last two dims exactly (a size-1 slice would broadcast)
    cshape = meta_shape(cond)
    if s_shape is None or cshape is None or len(cshape) < 2:
        return None
    return band if same_dim(cshape[-1], s_shape[-1]) and same_dim(cshape[-2], s_shape[-2]) else None


def _match_sdpa(gm: fx.GraphModule, n: fx.Node) -> Site:
    q, k, v = n.args[0], n.args[1], n.args[2]
    kw = n.kwargs
    mask, p, causal = kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False)
    scale, gqa = kw.get("scale"), kw.get("enable_gqa", False)
    if not isinstance(p, (int, float)) or not isinstance(causal, bool):
        raise NoMatch("dropout_p or is_causal is not a constant")
    if causal and mask is not None:
        raise NoMatch("is_causal together with attn_mask (SDPA rejects it)")
    shp = meta_shape(q)
    rank = len(shp) if shp is not None else 4
    if rank not in (3, 4):
        raise NoMatch(f"{rank}-D inputs; attention sites are 3-D or 4-D")
    if scale is not None and not isinstance(scale, (int, float)):
        sv = scalar_value(gm, scale)
        if sv is UNKNOWN:
            raise NoMatch("scale is not a constant")
        scale = sv
    kk, gk = _peel_gqa(gm, k)
    vv, gv = _peel_gqa(gm, v)
    if gk == gv and gk > 1:
        k, v = kk, vv
    groups = gk if gk == gv else 1
    qs, ks = meta_shape(q), meta_shape(k)
    if groups == 1 and rank == 4 and qs is not None and ks is not None and static_int(qs[-3]) and static_int(ks[-3]):
        groups = static_int(qs[-3]) // static_int(ks[-3])
    site = Site(anchor=n, name="", pattern="sdpa", q=q, k=k, v=v, rank=rank, causal=causal,
                scale=None if scale is None else float(scale), mask=mask, dropout=float(p), groups=groups)
    if gqa:
        site.pattern += ", enable_gqa"
    if site.groups > 1:
        site.pattern += f", gqa x{site.groups}"
    if mask is not None:
        site.pattern += ", mask"
    if causal:
        site.pattern += ", causal"
    return site


def _outer_scale(gm, factors, what: str) -> float:
    """The product of the scale factors met so far walking up from the softmax, which apply to what is added
    below them as well as to the logits (``(s + b) * c``); a factor known only at run time raises."""
    c = 1.0
    for kind, f in factors:
        val = scalar_value(gm, f)
        if val is UNKNOWN or val == 0:
            raise NoMatch(f"{what} to the logits before a scale that is not a nonzero constant")
        c = c / val if kind == "div" else c * val
    return c


def _lse_sink_scale(gm, x, sm, av):
    """``(out, sink)`` when the site's output is rescaled by a sink through the logits' log-sum-exp:
    ``out = (softmax(x) @ v) * sigmoid(logsumexp(x, -1) - sink)[..., None]`` (casts anywhere), with ``sink``
    one value per head (``(1, H, 1)`` or ``(H, 1)``). Since ``sigmoid(lse - t) = e^lse / (e^lse + e^t)``, that is
    the softmax whose denominator gains ``exp(sink)``: the spec's sinks. None otherwise."""
    others = [u for u in x.users if u is not sm]
    if len(others) != 1:
        return None
    n = others[0]
    is_lse = (n.op == "call_function" and n.target in (torch.logsumexp, aten.logsumexp.default)) or \
        (n.op == "call_method" and n.target == "logsumexp")
    if not is_lse or n.args[0] is not x:
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    xs = meta_shape(x)
    if dim != -1 and not (xs is not None and dim == len(xs) - 1) or n.kwargs.get("keepdim", False) \
            or (len(n.args) > 2 and n.args[2]):
        return None

    def single_user(m):
        us = list(m.users)
        return us[0] if len(us) == 1 else None

    def skip_casts(m):
        while m is not None and is_cast(m):
            m = single_user(m)
        return m

    sub = single_user(n)
    if sub is None or getattr(sub.target, "__name__", sub.target) != "sub" or len(sub.args) != 2 \
            or sub.args[0] is not n or not isinstance(sub.args[1], fx.Node) or _depends_on_input(sub.args[1]):
        return None
    sink = sub.args[1]
    sh = meta_shape(sink)
    if sh is None or not 2 <= len(sh) <= 3 or any(static_int(d) != 1 for d in sh[-1:]) \
            or (len(sh) == 3 and static_int(sh[0]) != 1):
        return None
    sig = skip_casts(single_user(sub))
    if sig is None or not ((sig.op == "call_function" and sig.target in (torch.sigmoid, aten.sigmoid.default))
                           or (sig.op == "call_method" and sig.target == "sigmoid")):
        return None
    un = skip_casts(single_user(sig))
    if un is None or not (un.op == "call_method" and un.target == "unsqueeze" and tuple(un.args[1:]) in ((-1,), (3,))):
        return None
    mul = skip_casts(single_user(un))
    last = un
    while last is not None and single_user(last) is not mul:
        last = single_user(last)
    if mul is None or not _is(mul, MUL) or last is None or set(mul.args[:2]) != {av, last} or len(av.users) != 1:
        return None
    return mul, sink


def _same_value(a, b, depth: int = 0) -> bool:
    """Whether ``a`` and ``b`` compute the same value: the same node, equal constants, or the same pure
    operation on arguments that compute the same values (a mask written twice)."""
    if a is b:
        return True
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if depth > 12 or a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method") \
                or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            return False
        return all(_same_value(x, y, depth + 1) for x, y in zip(a.args, b.args)) and \
            all(_same_value(a.kwargs[kw], b.kwargs[kw], depth + 1) for kw in a.kwargs)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, fx.Node) or isinstance(b, fx.Node) or type(a) is not type(b):
        return False
    return a == b


def _zeroes_excluded(gm, u, p, exclusions_raw) -> bool:
    """Whether ``u`` is ``where(cond, 0, p)`` / ``where(cond, p, 0)`` that sets to 0 exactly the entries one of
    the site's own masks excluded before the softmax (the same condition, computed again)."""
    if not _is(u, WHERE) or len(u.args) != 3:
        return False
    cond, a, b = u.args
    if a is p and b is not p:
        fill, p_is_kept = b, True    # where(cond, p, 0): cond marks the kept entries
    elif b is p and a is not p:
        fill, p_is_kept = a, False   # where(cond, 0, p): cond marks the zeroed entries
    else:
        return False
    fv = fill if isinstance(fill, (int, float)) else scalar_value(gm, fill)
    if fv is UNKNOWN or fv != 0:
        return False
    return any(is_allowed == p_is_kept and _same_value(cond, c) for c, is_allowed in exclusions_raw)


def _per_head(b, logits) -> bool:
    """Whether ``b`` holds one value per head of the 4-D ``logits``: shape ``(H, 1, 1)`` or ``(1, H, 1, 1)``."""
    bs, ls = meta_shape(b), meta_shape(logits)
    if bs is None or ls is None or len(ls) != 4 or len(bs) not in (3, 4):
        return False
    bs = [static_int(d) for d in bs]
    return bs[-3] == static_int(ls[1]) and bs[-3] is not None and bs[-2:] == [1, 1] and (len(bs) == 3 or bs[0] == 1)


def _zero_one_buffer(gm, n) -> bool:
    """Whether ``n`` is a slice of a constant buffer whose entries are all 0 or 1."""
    while isinstance(n, fx.Node) and n.op == "call_function" and (
            n.target is operator.getitem and isinstance(n.args[1], tuple) or n.target is aten.slice.Tensor):
        n = n.args[0]
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return False
    buf = get_attr_value(gm, n)
    return isinstance(buf, torch.Tensor) and bool(((buf == 0) | (buf == 1)).all())


def _complement_fill(gm, biases: list, b):
    """The entry of ``biases`` that is ``c * (1 - b)`` with a constant ``c <= -1e4`` (either order, ``1 - b``
    as ``sub`` or ``rsub``), when ``b`` is a 0/1 buffer: then ``s * b + c * (1 - b)`` keeps ``s`` where
    ``b`` is 1 and is ``c`` (an excluded entry) where it is 0. None otherwise."""
    if not _zero_one_buffer(gm, b):
        return None

    def complement(t) -> bool:
        if not isinstance(t, fx.Node) or t.op not in ("call_function", "call_method"):
            return False
        name = getattr(t.target, "__name__", t.target)
        if name in ("sub", "rsub") and len(t.args) == 2:
            one, x = t.args if name == "sub" else t.args[::-1]
            return x is b and isinstance(one, (int, float)) and one == 1
        return False

    for f in biases:
        if isinstance(f, fx.Node) and _is(f, MUL):
            for c, t in (f.args[:2], f.args[1::-1]):
                cv = scalar_value(gm, c) if not isinstance(c, fx.Node) or _is_scalar(gm, c) else UNKNOWN
                if cv is not UNKNOWN and cv <= MASK_FILL_MAX and complement(t):
                    return f
    return None


def _peel_expand_as(n):
    """``x`` for ``x.expand_as(other)`` (XLM: ``mask.view(...).expand_as(scores)``): the expansion reads only
    ``other``'s shape, and a mask broadcasts against the logits as it is, so the mask no longer depends on
    the logits it masks."""
    while isinstance(n, fx.Node) and len(n.args) == 2 and isinstance(n.args[0], fx.Node) and (
            n.op == "call_method" and n.target == "expand_as"
            or n.op == "call_function" and n.target in (aten.expand_as.default, torch.Tensor.expand_as)):
        n = n.args[0]
    return n


def _check_convex(gm, qk: fx.Node, av: fx.Node, site: Site) -> None:
    g = to_networkx(gm.graph)
    region = (nx.descendants(g, qk) & nx.ancestors(g, av)) | {qk, av}
    for node in region:
        if node is av:
            continue
        outside = [u for u in node.users if u not in region]
        if outside:
            raise NoMatch(f"{node.name} inside the attention site is also used outside it by "
                          f"{', '.join(u.name for u in outside)} (e.g. attention weights returned)")
    inputs = [site.q, site.k, site.v] + [b for b in site.biases if isinstance(b, fx.Node)] + \
        [c[1] if isinstance(c, tuple) else c for c in site.allowed] + [site.sinks]
    if isinstance(site.scale, tuple):
        inputs += [f[1] if isinstance(f, tuple) else f for _, f in site.scale[1]]
    desc = nx.descendants(g, qk) | {qk}
    for i in inputs:
        if isinstance(i, fx.Node) and i in desc:
            raise NoMatch(f"{i.name} feeds the site but depends on its logits (data-dependent mask)")


# ---------------------------------------------------------------------------------------------
# Rewriting


def _rewrite(gm: fx.GraphModule, site: Site, ctx: CompileContext) -> None:
    g = gm.graph
    anchor = site.anchor
    with g.inserting_before(anchor):
        q, k, v = site.q, site.k, site.v
        scale = site.scale
        if isinstance(scale, tuple):
            for kind, f in scale[1]:
                if isinstance(f, tuple) and f[0] == "recip":
                    q = g.call_function(DIV, (q, f[1]))
                elif kind == "div":
                    q = g.call_function(DIV, (q, f))
                else:
                    q = g.call_function(MUL, (q, f))
            scale = 1.0
        if site.k_transposed:
            k = g.call_function(TRANSPOSE, (k, -1, -2))
        mask = site.mask
        if site.mask is None and (site.biases or site.allowed):
            mask = _combine_masks(g, site)
        if site.rank == 3:
            q, k, v = (g.call_method("unsqueeze", (t, 1)) for t in (q, k, v))
            if mask is not None:
                mshape = meta_shape(mask)
                if mshape is None or len(mshape) == 3:
                    mask = g.call_method("unsqueeze", (mask, 1))
        lead = None
        if site.rank == 5:  # (B, n, H, N, D) (ProphetNet's n-gram streams): the op runs (B*n, H, N, D)
            def size(t, d):
                return infer_meta(g.call_method("size", (t, d)))

            lead = (size(site.q, 0), size(site.q, 1))
            k, v = (infer_meta(g.call_method("expand", (t, *lead, -1, -1, -1))) for t in (k, v))
            if mask is not None:
                full = lead + (size(site.q, 2), size(site.q, 3), size(k, 3))
                mask = infer_meta(g.call_method("expand", (mask, *full)))
                mask = infer_meta(g.call_method("flatten", (mask, 0, 1)))
            q, k, v = (infer_meta(g.call_method("flatten", (t, 0, 1))) for t in (q, k, v))
        dt = meta_dtype(site.q) or meta_dtype(anchor)
        qshape = meta_shape(site.q)
        head_dim = static_int(qshape[-1]) if qshape else None
        mask_kind = "none"
        if mask is not None:
            md = meta_dtype(site.mask) if site.mask is not None else (torch.float32 if site.biases else torch.bool)
            mask_kind = "bool" if md == torch.bool else "float"
            if md is None:
                mask_kind = "float"  # refined at run time: backends check the tensor's dtype
        spec = AttentionSpec(causal=site.causal, window_left=site.window_left, mask_kind=mask_kind, scale=scale,
                             dropout_p=site.dropout,
                             dtype=dtype_name(dt) if dt in (torch.float16, torch.bfloat16, torch.float32,
                                                            torch.float64) else None,
                             head_dim=head_dim, gqa_groups=site.groups, policy=Dense(),
                             backend=ctx.backend, softcap=site.softcap, sinks=site.sinks is not None)
        sinks = None if site.sinks is None else g.call_method("reshape", (site.sinks, -1))
        p_arg = g.call_function(ops.site_dropout, (site.dropout,)) if site.dropout else 0.0
        seed_arg = g.call_function(ops.next_seed, (0,)) if site.dropout else 0
        op_args = [None] * len(ops.ARG_INDEX)
        for name, val in (("q", q), ("k", k), ("v", v), ("attn_mask", mask), ("spec", spec.to_json()),
                          ("dropout_p", p_arg), ("seed", seed_arg), ("sinks", sinks)):
            op_args[ops.ARG_INDEX[name]] = val
        while op_args and op_args[-1] is None and len(op_args) > ops.ARG_INDEX["seed"] + 1:
            op_args.pop()  # the modifier tensors are optional and last: a site without them omits them
        attn = g.call_function(torch.ops.attncomp.attention.default, tuple(op_args))
        out = g.call_function(operator.getitem, (attn, 0))
        if site.rank == 3:
            out = g.call_method("squeeze", (out, 1))
        if lead is not None:
            out = g.call_method("unflatten", (out, 0, lead))
    out.meta.update({k: v for k, v in anchor.meta.items() if k in ("nn_module_stack", "stack_trace")})
    if "val" in anchor.meta:
        out.meta["val"] = anchor.meta["val"]
    if "tensor_meta" in anchor.meta:
        out.meta["tensor_meta"] = anchor.meta["tensor_meta"]
    attn.meta["nn_module_stack"] = anchor.meta.get("nn_module_stack")
    anchor.replace_all_uses_with(out)
    report = SiteReport(name=site.name, rewritten=True, policy="dense", pattern=site.pattern,
                        rewrites=["attention -> attncomp::attention"], spec=spec.describe(),
                        details={"notes": site.notes} if site.notes else {})
    if spec.modifiers():
        report.details["modifiers"] = spec.describe_modifiers()
    attn.meta[SITE_META] = report
    ctx.sites.append(report)
    if site.dropout_node is not None and site.dropout_node.op == "call_module":
        report.details["dropout"] = (f"rate {site.dropout} from module {site.dropout_node.target}, "
                                     "active in training mode only")


def _combine_masks(g: fx.Graph, site: Site) -> fx.Node:
    """One mask from the site's exclusions and biases: bool if only exclusions, else an additive float."""
    allowed = None

    def fn(target, args):  # (with shape metadata: the mask analysis reads it)
        return infer_meta(g.call_function(target, args))

    for a in site.allowed:
        node = fn(torch.logical_not, (a[1],)) if isinstance(a, tuple) else a
        if meta_dtype(node if not isinstance(a, tuple) else a[1]) not in (torch.bool, None):
            node = infer_meta(g.call_method("to", (node, torch.bool)))
        allowed = node if allowed is None else fn(torch.logical_and, (allowed, node))
    bias = None
    for b, c in zip(site.biases, site.bias_scales):
        if c != 1.0:  # (s + b) * c: the site's scale takes c for s, b is multiplied here
            b = fn(MUL, (b, c))
        bias = b if bias is None else fn(ADD, (bias, b))
    if bias is None:
        return allowed
    if allowed is not None:
        neg = fn(torch.where, (allowed, 0.0, float("-inf")))
        bias = fn(ADD, (bias, neg))
    return bias
