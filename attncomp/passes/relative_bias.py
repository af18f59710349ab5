"""Turn a T5-style relative-position bias left in a site's mask into the spec's modifier (DESIGN.md §4.2).

Matches: every ``attncomp::attention`` node whose float ``attn_mask`` (what :mod:`.analyze_mask` left
once the masks became predicates) is a learned table looked up by a bucketed relative position::

    bias = embedding(idx, table).permute(2, 0, 1)[None]     (or .unsqueeze(0))
    table (n_buckets, H), idx (Nq, Nk) or (B, Nq, Nk) integer

as T5's ``compute_bias`` and MPNet's ``compute_position_bias`` write it.

Requires: :mod:`.analyze_mask` ran (the mask's predicate part is gone, so the bias is the whole mask);
shape metadata on the table.

Guarantees: the site's spec gets ``rel_buckets`` / ``rel_max_distance`` / ``rel_bidirectional``, the
table itself becomes the op's ``rel_table`` (gradients flow to it, as to the model's embedding) and the
mask goes (``mask_kind="none"``), only after a check (DESIGN.md §7): the graph's own index subgraph is
evaluated, and ``rel_bucket(k_pos - q_pos)`` with the op's positions must equal it, at the example shapes
and, where the index depends on sizes only, at edge shapes (a length of 1 and one past the largest
max distance tried, so that every bucket, the logarithmic ones included, is compared). The bucket
parameters are those for which every evaluation agrees (bidirectional or not; max distance among
powers of two from 8 to 4096); none or several -> the mask stays materialised and the report says why
(``details["modifiers"]``).
"""

from __future__ import annotations

import logging
import operator
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .. import ops
from ..spec import rel_bucket
from .base import CompileContext, PassResult
from .node_info import attention_sites, meta_shape, set_op_args, set_spec, site_report, spec_of, static_int

log = logging.getLogger(__name__)

__all__ = ["relative_bias"]

NAME = "relative_bias"
aten = torch.ops.aten
_A = ops.ARG_INDEX
_DISTANCES = tuple(2 ** e for e in range(3, 13))
_EDGE = 4097  # one past the largest max distance tried


class _Keep(Exception):
    """The bias stays materialised; the message says why."""


def _arg(node: fx.Node, name: str):
    i = _A[name]
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _is_method(n, *names) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _lookup(gm: fx.GraphModule, mask) -> Optional[Tuple[object, tuple, fx.Node]]:
    """``(table, table_shape, idx)`` when ``mask`` is ``embedding(idx, table).permute(2, 0, 1)`` with a
    leading size-1 dim added; else None. ``table`` is a node, or the qualified name of an ``nn.Embedding``
    module's weight (fx traces keep the module call)."""
    n = mask
    if _is_method(n, "unsqueeze") and n.args[1] == 0:
        n = n.args[0]
    elif isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem:
        idx = n.args[1]
        if not (isinstance(idx, tuple) and len(idx) >= 1 and idx[0] is None
                and all(isinstance(i, slice) and i == slice(None) for i in idx[1:])):
            return None
        n = n.args[0]
    else:
        return None
    if _is_method(n, "permute"):
        perm = tuple(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else tuple(n.args[1:])
    elif isinstance(n, fx.Node) and n.op == "call_function" and n.target in (torch.permute, aten.permute.default):
        perm = tuple(n.args[1])
    else:
        return None
    if perm != (2, 0, 1):
        return None
    e = n.args[0]
    if isinstance(e, fx.Node) and e.op == "call_module":
        mod = gm.get_submodule(e.target)
        if type(mod) is not torch.nn.Embedding or mod.padding_idx is not None or mod.max_norm is not None \
                or len(e.args) != 1:
            return None
        return f"{e.target}.weight", tuple(mod.weight.shape), e.args[0]
    if not isinstance(e, fx.Node) or e.op != "call_function":
        return None
    if e.target is torch.nn.functional.embedding:
        idx, table = e.args[0], e.args[1]
        # padding_idx (its row gets no gradient) and max_norm (renormalises the table): not a plain lookup
        padding_idx = e.args[2] if len(e.args) > 2 else e.kwargs.get("padding_idx")
        max_norm = e.args[3] if len(e.args) > 3 else e.kwargs.get("max_norm")
        if padding_idx is not None or max_norm is not None:
            return None
    elif e.target is aten.embedding.default:
        table, idx = e.args[0], e.args[1]
    else:
        return None
    ts = meta_shape(table)
    if ts is None or len(ts) != 2 or static_int(ts[0]) is None:
        return None
    return table, tuple(static_int(d) for d in ts), idx


def _placeholder_values(gm: fx.GraphModule, ctx: CompileContext) -> Dict[str, object]:
    return ctx.example_inputs or {}


def _hint(v) -> Optional[int]:
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            return int(v.node.hint)
        except Exception:
            return None
    return None


def _ancestors(targets: List[fx.Node]) -> set:
    seen, stack = set(), [t for t in targets if isinstance(t, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _evaluate(gm: fx.GraphModule, targets: List[fx.Node], values: Dict[str, object], sizes: Optional[int]):
    """The values of ``targets``, running the nodes they depend on: symbolic-int placeholders take their
    traced value (``sizes=None``) or ``sizes``; tensor placeholders their example value (a size change
    cannot resize them: ``_Keep``)."""
    need = _ancestors(targets)
    env: Dict[fx.Node, object] = {}
    for n in gm.graph.nodes:
        if n not in need:
            continue
        if n.op == "placeholder":
            ev = n.meta.get("example_value", n.meta.get("val"))
            if isinstance(ev, (int, torch.SymInt)):
                h = _hint(ev)
                if h is None:
                    raise _Keep(f"no value for the size {n.name}")
                env[n] = h if sizes is None else sizes
                continue
            if n.name in values and sizes is None:
                env[n] = values[n.name]
                continue
            raise _Keep(f"the index depends on the input {n.name}, "
                        + ("whose value is not known at compile time" if sizes is None else "at other sizes"))
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        with torch.no_grad():
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            elif n.op == "get_attr":
                obj = gm
                for p in n.target.split("."):
                    obj = getattr(obj, p)
                env[n] = obj
            elif n.op == "call_module":
                env[n] = gm.get_submodule(n.target)(*args, **kwargs)
            else:
                raise _Keep(f"cannot evaluate {n.op} {n.name}")
    return [env[t] if isinstance(t, fx.Node) else t for t in targets]


def _positions(spec, pos, n: int, other: int, is_q: bool) -> torch.Tensor:
    if pos is not None:
        return torch.as_tensor(pos).to(torch.int64).reshape(-1, n)
    off = (other - n) if (is_q and spec.causal_align == "bottom_right") else 0
    return (torch.arange(n) + off)[None]


def _arange_from(p: torch.Tensor) -> bool:
    return p.shape[0] == 1 and torch.equal(p[0], p[0, 0] + torch.arange(p.shape[1], dtype=p.dtype))


def _candidates(idx: torch.Tensor, qp, kp, n_buckets: int, cands) -> list:
    idx = idx.to(torch.int64)
    if _arange_from(qp) and _arange_from(kp) and min(idx.shape[-2:]) > 1:
        # positions counted 1 by 1: k_pos[j] - q_pos[i] is constant along each diagonal, so an index that is
        # too holds every value in its first row and column (checking the whole N x N at the 4097 edge size
        # per candidate took seconds a site)
        i3 = idx.reshape(-1, *idx.shape[-2:])
        if not torch.equal(i3[:, 1:, 1:], i3[:, :-1, :-1]):
            return []
        idx = torch.cat([i3[:, 0, :], i3[:, 1:, 0]], -1)
        rel = torch.cat([kp[0] - qp[0, 0], kp[0, 0] - qp[0, 1:]])[None]
    else:
        rel = kp[:, None, :] - qp[:, :, None]
    out = []
    for bd, md in cands:
        try:
            want = rel_bucket(rel, n_buckets, md, bd)
            if torch.equal(torch.broadcast_to(want, torch.broadcast_shapes(want.shape, idx.shape)),
                           torch.broadcast_to(idx, torch.broadcast_shapes(want.shape, idx.shape))):
                out.append((bd, md))
        except RuntimeError:
            continue
    return out


def _identify(gm, ctx, node, spec, idx: fx.Node, n_buckets: int) -> Tuple[bool, int]:
    values = _placeholder_values(gm, ctx)
    qn, kn = _arg(node, "q_pos"), _arg(node, "k_pos")
    cands = [(bd, md) for bd in (True, False) for md in _DISTANCES
             if md > ((n_buckets // 2 if bd else n_buckets) // 2)]
    checked = []
    for sizes in (None, 1, _EDGE):
        try:
            iv, qv, kv = _evaluate(gm, [idx, qn, kn], values, sizes)
        except _Keep as e:
            if sizes is None:
                raise
            log.debug("relative_bias: no edge-shape check at size %s: %s", sizes, e)
            continue
        except Exception as e:  # noqa: BLE001 - any failure to evaluate keeps the bias
            raise _Keep(f"the index could not be evaluated ({type(e).__name__}: {e})") from None
        if not isinstance(iv, torch.Tensor) or iv.dim() not in (2, 3):
            raise _Keep("the looked-up index is not an (Nq, Nk) tensor")
        nq, nk = iv.shape[-2], iv.shape[-1]
        qp = _positions(spec, qv, nq, nk, True)
        kp = _positions(spec, kv, nk, nq, False)
        cands = _candidates(iv, qp, kp, n_buckets, cands)
        checked.append("example shapes" if sizes is None else f"N={sizes}")
        if not cands:
            raise _Keep(f"the index is not T5's bucket of k_pos - q_pos ({', '.join(checked)})")
    if len(cands) != 1:
        raise _Keep(f"{len(cands)} bucket settings agree at the shapes checked ({', '.join(checked)}): "
                    "max distance not determined")
    return cands[0]


def relative_bias(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    for node in attention_sites(gm):
        mask = _arg(node, "attn_mask")
        found = _lookup(gm, mask)
        if found is None:
            continue
        table, tshape, idx = found
        spec = spec_of(node)
        rep = site_report(node, ctx)
        if spec.modifiers() or spec.mask_kind == "bool":
            continue
        n_buckets = tshape[0]
        q = meta_shape(_arg(node, "q"))
        heads = static_int(q[1]) if q is not None and len(q) == 4 else None
        if heads is None or tshape[1] != heads:
            rep.details["modifiers"] = "materialised bias: the table's columns are not the site's query heads"
            ctx.count(NAME, "kept")
            continue
        try:
            bd, md = _identify(gm, ctx, node, spec, idx, n_buckets)
            new = spec.replace(rel_buckets=n_buckets, rel_max_distance=md, rel_bidirectional=bd, mask_kind="none")
        except (_Keep, ValueError) as e:
            rep.details["modifiers"] = f"materialised bias: {e}"
            ctx.count(NAME, "kept")
            continue
        if isinstance(table, str):
            with gm.graph.inserting_before(node):
                table = gm.graph.get_attr(table)
        set_op_args(node, attn_mask=None, rel_table=table)
        set_spec(node, new, rep)
        rep.details["modifiers"] = new.describe_modifiers() + " (checked against the graph's bias index)"
        rep.rewrites.append("relative-position bias -> spec modifier")
        ctx.count(NAME, "rewritten")
        modified = True
    return PassResult(gm, modified)
