"""Give attention written on merged batch and head dims its heads back.

Matches (on the canonical graph of :mod:`.canonicalize`) attention computed on ``(B*H, N, D)`` tensors
(``bmm``/``baddbmm``, as BART-era and Bloom-style code writes it) whose logits or probabilities are
viewed as ``(B, H, Nq, Nk)`` on the way, to add a ``(B, 1, Nq, Nk)`` mask or to return weights::

    s = matmul(q3, kT3) [* c] [+ bias3]         q3 (B*H, Nq, D), kT3 (B*H, D, Nk), bias3 (B*H or 1, ., Nk)
    s = s.view(B, H, Nq, Nk) [+ mask] [max(s, finfo.min)] [.view(B*H, Nq, Nk)]   (views in any order)
    p = softmax(s, -1) [.to()] [dropout] [.view(...)]
    o = matmul(p3, v3)                          v3 (B*H, Nk, Dv)
    o = matmul(p4, v4)                          or p viewed as (B, H, Nq, Nk), v4 (B, H, Nk, Dv)

Requires: :mod:`.canonicalize` ran; shape metadata (``val``/``example_value``) on the nodes of the site.

Guarantees: the site is rewritten to the same computation on ``(B, H, ., .)`` tensors: q, k and v (and
``(B*H, ...)`` biases) are unflattened (``unflatten(0, (-1, H))``, the inverse of the model's merge), the
views between the two products become no-ops, and the product with a 3-D v is flattened back to ``(B*H, Nq,
Dv)`` for its users (a 4-D v is used as it is), so :mod:`.match_attention` sees one 4-D site whose masks broadcast as the model's
do. Values are equal on every query row that attends to a key. The one op dropped is a clamp of the
logits at a masking value (``max(s, finfo.min)``, XGLM's guard against ``-inf``): it changes only rows
whose every key is masked, which the op outputs as zeros. A site whose chain holds anything else (a
view that is not a split or merge of the first dim, probabilities used elsewhere) is left as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from .base import CompileContext, PassResult, SiteReport
from .canonicalize import ADD, DIV, DROPOUT, MATMUL, MUL, SOFTMAX, WHERE, is_cast
from .node_info import meta_shape, same_dim, scalar_value, site_name, static_int, without_guards, UNKNOWN

log = logging.getLogger(__name__)

__all__ = ["unflatten_heads"]

_RESHAPES = {"view", "reshape"}
_ELEMENTWISE = (MUL, DIV, ADD, WHERE)
_CLAMPS = {torch.max, torch.maximum, torch.clamp, torch.clamp_min}
_MASK_LEVEL = -1e4


class _Skip(Exception):
    pass


def unflatten_heads(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    done = 0
    for sm in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SOFTMAX]:
        try:
            plan = _plan(gm, sm)
        except _Skip as e:
            # match_attention does not follow the views of such a site: it is reported here
            ctx.sites.append(SiteReport(name=site_name(sm, f"site{len(ctx.sites)}"), rewritten=False,
                                        policy=ctx.policy.name, pattern="matmul-softmax-matmul, merged heads",
                                        reason=str(e)))
            ctx.count("unflatten_heads", "rejected")
            continue
        if plan is not None:
            _apply(gm, *plan)
            done += 1
    if done:
        ctx.count("unflatten_heads", "sites", done)
    return PassResult(gm, done > 0)


def _rank(n) -> Optional[int]:
    s = meta_shape(n)
    return None if s is None else len(s)


def _is_reshape(n: fx.Node) -> bool:
    return (n.op == "call_method" and n.target in _RESHAPES) or (n.op == "call_function" and n.target is torch.reshape)


def _sizes(n: fx.Node) -> List[Any]:
    rest = list(n.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    if not rest:
        return list(n.kwargs.get("shape", n.kwargs.get("size", ())))
    return rest


def _clamp_at_mask_level(gm, n: fx.Node) -> Optional[fx.Node]:
    """``max(s, c)``/``clamp(s, min=c)`` with ``c`` at a masking value: the clamped input, else None."""
    if n.op != "call_function" or n.target not in _CLAMPS:
        return None
    if n.target in (torch.max, torch.maximum) and len(n.args) == 2 and not n.kwargs:
        x, c = n.args
    elif n.target in (torch.clamp, torch.clamp_min):
        x = n.args[0]
        c = n.kwargs.get("min", n.args[1] if len(n.args) > 1 else None)
        if n.kwargs.get("max", n.args[2] if len(n.args) > 2 else None) is not None:
            return None
    else:
        return None
    v = scalar_value(gm, c)
    return x if v is not UNKNOWN and v <= _MASK_LEVEL else None


def _chain_input(n: fx.Node) -> Optional[fx.Node]:
    """The argument of a chain node that carries the logits (the one that leads to a matmul)."""
    cands = [a for a in n.args if isinstance(a, fx.Node) and _reaches_matmul(a)]
    return cands[0] if len(cands) == 1 else None


def _reaches_matmul(n: fx.Node, depth: int = 0) -> bool:
    if n.op == "call_function" and n.target is MATMUL:
        return True
    if depth > 12 or n.op not in ("call_function", "call_method"):
        return False
    return any(_reaches_matmul(a, depth + 1) for a in n.args if isinstance(a, fx.Node))


def _heads_of(view: fx.Node) -> Any:
    """H of a view that splits ``(B*H, Nq, Nk)`` into ``(B, H, Nq, Nk)`` (an int or a graph node)."""
    sizes = _sizes(view)
    out = meta_shape(view)
    h = sizes[1] if len(sizes) == 4 else None
    if isinstance(h, int) and h > 0:
        return h
    if isinstance(h, fx.Node):
        return h
    return static_int(out[1]) if out is not None else None


def _down_step(u: fx.Node) -> bool:
    return (is_cast(u) or _is_reshape(u) or (u.op == "call_function" and u.target is DROPOUT)
            or (u.op == "call_module" and "attncomp_module_dropout" in u.meta))


def _plan(gm: fx.GraphModule, sm: fx.Node):
    """``(qk, up, sm, down, av, H)`` for a merged-heads site, None for anything else; ``_Skip`` (with the
    reason) for a merged-heads site that cannot be given its heads."""
    problems: List[str] = []
    # up: softmax -> ... -> matmul(q3, kT3)
    up: List[fx.Node] = []
    cur = sm.args[0]
    for _ in range(32):
        if not isinstance(cur, fx.Node):
            return None
        if cur.op == "call_function" and cur.target is MATMUL:
            break
        up.append(cur)
        if len(cur.users) != 1:
            problems.append(f"the logits ({cur.name}) are used outside the site")
        clamped = _clamp_at_mask_level(gm, cur)
        if is_cast(cur) or _is_reshape(cur):
            cur = cur.args[0]
        elif clamped is not None:
            cur = clamped
        elif cur.op == "call_function" and cur.target in _ELEMENTWISE:
            nxt = _chain_input(cur)
            if nxt is None:
                return None
            cur = nxt
        else:
            return None
    else:
        return None
    qk = cur
    if _rank(qk) != 3:
        return None
    if len(qk.users) != 1:
        problems.append("the logits are used outside the site")
    # down: softmax -> casts, dropout, views -> matmul(p3, v3)
    down: List[fx.Node] = []
    cur = sm
    av = None
    for _ in range(8):
        us = list(cur.users)
        nxt = [u for u in us if (u.op == "call_function" and u.target is MATMUL and u.args[0] is cur) or _down_step(u)]
        if len(nxt) != 1:
            return None
        if len(us) != 1:
            problems.append(f"attention probabilities escape the site ({cur.name} is used by "
                            f"{', '.join(u.name for u in us)}), e.g. returned as attention weights")
        u = nxt[0]
        if u.op == "call_function" and u.target is MATMUL:
            av = u
            break
        down.append(u)
        cur = u
    # the probabilities meet v as (B*H, Nk, Dv) (bmm) or, viewed back to the heads, as (B, H, Nk, Dv)
    # (GPT-NeoX-Japanese's baddbmm logits with a 4-D matmul)
    if av is None or _rank(av) not in (3, 4) or _rank(av.args[0]) != _rank(av):
        return None
    views = [n for n in up + down if _is_reshape(n)]
    if not views:
        return None   # a 3-D site: match_attention runs it as one head
    splits = []
    for n in views:
        src, out = meta_shape(n.args[0]), meta_shape(n)
        if src is None or out is None:
            raise _Skip("merged batch and head dims, shapes unknown at compile time")
        if len(src) == 3 and len(out) == 4 and same_dim(src[1], out[2]) and same_dim(src[2], out[3]):
            splits.append(n)
        elif not (len(src) == 4 and len(out) == 3 and same_dim(src[2], out[1]) and same_dim(src[3], out[2])):
            problems.append(f"{n.name} reshapes the logits beyond splitting or merging batch and heads")
    if not splits and not problems:
        return None
    h = _heads_of(splits[0]) if splits else None
    if splits and h is None:
        problems.append("the head count of the (B*H) dim is not known")
    elif any(not same_dim(meta_shape(n)[1], meta_shape(splits[0])[1]) for n in splits[1:]):
        # the op's heads are those of the first split; the model's 4-D tensors must all have them
        problems.append("the logits are split into different head counts")
    for n in (qk.args[0], qk.args[1]):
        if not isinstance(n, fx.Node) or _rank(n) != 3:
            problems.append("q or k is not a 3-D tensor")
    if not isinstance(av.args[1], fx.Node) or _rank(av.args[1]) != _rank(av):
        problems.append(f"v is not a {_rank(av)}-D tensor as the probabilities it is multiplied with")
    bhs = _batch_dims(qk)
    for n in up:   # every operand the 4-D chain will read is checked here, before the graph changes
        if not (_is_reshape(n) or is_cast(n) or _clamp_at_mask_level(gm, n) is not None):
            src = _chain_input(n)
            for a in n.args:
                if a is not src:
                    _merged(a, bhs)
    if problems:
        raise _Skip(problems[0])
    return qk, list(reversed(up)), sm, down, av, h


def _unflat(g: fx.Graph, x: fx.Node, h) -> fx.Node:
    return _val(g.call_method("unflatten", (x, 0, (-1, h))))


def _val(n: fx.Node) -> fx.Node:
    """Shape metadata for a new node: the op run on its inputs' fake values."""
    ins = n.all_input_nodes
    key = next((k for k in ("val", "example_value") if any(isinstance(a.meta.get(k), torch.Tensor) for a in ins)),
               None)
    if key is None:
        return n
    try:
        args = fx.node.map_arg(n.args, lambda a: a.meta.get(key))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta.get(key))
        with without_guards([a.meta.get(key) for a in ins]):
            if n.op == "call_method":
                n.meta[key] = getattr(args[0], n.target)(*args[1:], **kwargs)
            elif n.op == "call_function":
                n.meta[key] = n.target(*args, **kwargs)
    except Exception:  # metadata only
        pass
    return n


def _merged(x: Any, bhs) -> bool:
    """Whether an operand of the 3-D part of the chain carries the ``(B*H)`` dim (to be unflattened);
    ``_Skip`` when its first dim is neither that nor 1."""
    s = meta_shape(x) if isinstance(x, fx.Node) else None
    if s is None or len(s) != 3 or same_dim(s[0], 1):
        return False
    if not any(same_dim(s[0], bh) for bh in bhs):
        raise _Skip(f"{x.name} has a first dim that is neither 1 nor B*H")
    return True


def _batch_dims(qk: fx.Node) -> List[Any]:
    """The ``B*H`` size as the logits and q/k carry it (one expression may be specialised where another
    is symbolic)."""
    return [s[0] for s in (meta_shape(qk), meta_shape(qk.args[0]), meta_shape(qk.args[1])) if s]


def _operand(g: fx.Graph, x: Any, bhs, h) -> Any:
    """An operand of an elementwise node in the 4-D chain: ``(B*H, ...)`` tensors unflattened."""
    return _unflat(g, x, h) if _merged(x, bhs) else x


def _apply(gm: fx.GraphModule, qk: fx.Node, up: List[fx.Node], sm: fx.Node, down: List[fx.Node], av: fx.Node,
           h) -> None:
    g = gm.graph
    bhs = _batch_dims(qk)
    new: Dict[fx.Node, fx.Node] = {}
    with g.inserting_before(sm):
        s = _val(g.call_function(MATMUL, (_unflat(g, qk.args[0], h), _unflat(g, qk.args[1], h))))
        new[qk] = s
        for n in up:
            if _is_reshape(n):
                new[n] = new[n.args[0]]
                continue
            clamped = _clamp_at_mask_level(gm, n)
            if clamped is not None:
                new[n] = new[clamped]
                continue
            src = _chain_input(n) if not is_cast(n) else n.args[0]
            args = tuple(new[a] if a is src else _operand(g, a, bhs, h) for a in n.args)
            new[n] = _val(g.create_node(n.op, n.target, args, dict(n.kwargs)))
        p = _val(g.call_function(SOFTMAX, (new[up[-1]] if up else s,) + tuple(sm.args[1:]), dict(sm.kwargs)))
    new[sm] = p
    with g.inserting_before(av):
        for n in down:
            if _is_reshape(n):
                new[n] = new[n.args[0]]
                continue
            args = tuple(new.get(a, a) if isinstance(a, fx.Node) else a for a in n.args)
            node = g.create_node(n.op, n.target, args, dict(n.kwargs))
            node.meta.update({k: v for k, v in n.meta.items() if k.startswith("attncomp")})
            new[n] = _val(node)
        merged = _rank(av) == 3
        v = _unflat(g, av.args[1], h) if merged else av.args[1]
        o = _val(g.call_function(MATMUL, (new[down[-1]] if down else p, v)))
        out = _val(g.call_method("flatten", (o, 0, 1))) if merged else o
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        for a, b in ((sm, p), (av, o), (av, out)):
            if k in a.meta:
                b.meta[k] = a.meta[k]
    av.replace_all_uses_with(out)
