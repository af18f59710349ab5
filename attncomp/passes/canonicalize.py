"""Canonicalise the spellings of the operations attention is written with, so one shape is matched.

Matches: any node of a captured graph (torch.fx ``symbolic_trace``, ``torch.export`` aten graphs, or
dynamo graphs) that spells one of the operations below.

Requires: a graph from :mod:`attncomp.passes.capture`.

Guarantees (same values, canonical spelling, as ``call_function`` nodes):

* ``torch.matmul(a, b)``: from ``@``, ``matmul``/``bmm`` (functions, methods, aten), and two-operand
  ``einsum`` equations that are batched matrix products (``bhid,bhjd->bhij`` and friends), also with the dims
  in another order (``ibnd,jbnd->bnij``: the operands and the product permuted);
* ``torch.transpose(x, d0, d1)``: from methods, aten, ``.mT``, ``swapaxes``/``swapdims``;
* ``torch.mul(a, b)`` / ``torch.div(a, b)`` / ``torch.add(a, b)``: from operators, methods, aten;
  division by a Python number becomes multiplication by its reciprocal;
* ``torch.where(cond, a, b)``: from ``masked_fill`` (``where(mask, value, x)``);
* ``torch.softmax(x, dim, dtype=...)``: from ``F.softmax``, methods, ``nn.Softmax`` modules, aten;
* ``torch.nn.functional.dropout(x, p, training)``: from aten and keyword spellings; ``nn.Dropout``
  module calls stay module calls (their mode decides at run time) with the rate recorded in
  ``node.meta["attncomp_module_dropout"]``;
* ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
  scale=, enable_gqa=)``: from aten;
* casts ``x.to(dtype)`` (``call_method`` ``to`` with one dtype argument): from ``float()``, ``half()``,
  ``bfloat16()``, ``type(dtype)``, aten ``to``/``_to_copy``;
* ``tril(x, d)`` / ``triu(x, d)`` (a causal mask built in ``forward``, ``torch.triu(torch.ones(T, T), 1)``):
  ``x`` where ``arange(m)[None, :] - arange(n)[:, None] <= d`` (``>= d``), else 0, so that the mask
  analysis reads a position bound (:mod:`.analyze_mask`) instead of an opaque N x N tensor;
* export's ``_assert_tensor_metadata`` checks are dropped (they only re-check dtypes the graph fixes);
* in-place ``masked_fill_``/``add_``/``mul_``/``div_`` (and ``+=``/``*=``/``/=``) on a value become out-of-place, and later readers
  of the mutated value read the new node (functionalisation of those four), unless the written memory is
  a graph input or attribute, or another view of it is read after the write (then the write stays).
"""

from __future__ import annotations

import logging
import operator
import re
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .base import CompileContext, PassResult
from .node_info import infer_meta

log = logging.getLogger(__name__)

__all__ = ["canonicalize", "MATMUL", "TRANSPOSE", "MUL", "DIV", "ADD", "WHERE", "SOFTMAX", "DROPOUT", "SDPA",
           "is_cast", "cast_dtype"]

aten = torch.ops.aten

MATMUL = torch.matmul
TRANSPOSE = torch.transpose
MUL = torch.mul
DIV = torch.div
ADD = torch.add
WHERE = torch.where
SOFTMAX = torch.softmax
DROPOUT = F.dropout
SDPA = F.scaled_dot_product_attention

_MATMULS = {operator.matmul, torch.matmul, torch.bmm, aten.matmul.default, aten.bmm.default}
_TRANSPOSES = {torch.transpose, torch.swapaxes, torch.swapdims, aten.transpose.int}
_MULS = {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}
_DIVS = {operator.truediv, torch.div, torch.true_divide, aten.div.Tensor, aten.div.Scalar}
_ADDS = {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar}
_WHERES = {torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}
_MASKED_FILLS = {torch.masked_fill, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
_SOFTMAXES = {torch.softmax, F.softmax, torch.nn.functional.softmax, aten.softmax.int, torch.special.softmax}
_DROPOUTS = {F.dropout, torch.dropout, aten.dropout.default}
_SDPAS = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
_METHOD_MAP = {
    "matmul": MATMUL, "bmm": MATMUL, "__matmul__": MATMUL,
    "transpose": TRANSPOSE, "swapaxes": TRANSPOSE, "swapdims": TRANSPOSE,
    "mul": MUL, "__mul__": MUL, "div": DIV, "__truediv__": DIV, "true_divide": DIV,
    "add": ADD, "__add__": ADD,
    "softmax": SOFTMAX,
}
_INPLACE = {"masked_fill_": "masked_fill", "add_": "add", "mul_": "mul", "div_": "div"}
# ``x += y`` as dynamo records it (MPNet's ``attention_scores += position_bias``)
_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.imul: operator.mul, operator.itruediv: operator.truediv}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def is_cast(n: fx.Node) -> bool:
    """Whether ``n`` is a pure dtype cast of its first argument (canonical ``to`` or ``type_as``)."""
    if n.op != "call_method":
        return False
    if n.target == "to":
        if len(n.args) != 2 or n.kwargs:
            return False
        d = n.args[1]
        return isinstance(d, torch.dtype) or (isinstance(d, fx.Node) and d.op == "call_function"
                                              and d.target is getattr and d.args[1] == "dtype")
    return n.target == "type_as"


def cast_dtype(n: fx.Node) -> Optional[torch.dtype]:
    if n.op == "call_method" and n.target == "to":
        d = n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None)
        return d if isinstance(d, torch.dtype) else None
    return None


def _replace(gm: fx.GraphModule, n: fx.Node, target, args: Tuple, kwargs: Dict[str, Any] = None,
             op: str = "call_function") -> fx.Node:
    """Swap ``n`` for a new node (same meta) and return it."""
    with gm.graph.inserting_after(n):
        new = gm.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    return new


def _kw(n: fx.Node, name: str, pos: int, default=None):
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[pos] if len(n.args) > pos else default


def _einsum_to_matmul(eq: str) -> Optional[Tuple[bool, bool]]:
    """For ``'...ij,...jk->...ik'``-like equations return (transpose_a, transpose_b); else None."""
    eq = eq.replace(" ", "")
    m = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)", eq)
    if not m:
        return None
    a, b, o = m.groups()
    if not (len(a) == len(b) == len(o) >= 2) or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    batch = a[:-2]
    if b[:-2] != batch or o[:-2] != batch:
        return None
    a2, b2, o2 = a[-2:], b[-2:], o[-2:]
    shared = set(a2) & set(b2)
    if len(shared) != 1:
        return None
    c = shared.pop()
    ai = (set(a2) - {c}).pop()
    bi = (set(b2) - {c}).pop()
    if o2 != ai + bi or c in o2:
        return None
    return a2[1] != c, b2[0] != c


def _einsum_permuted(eq: str) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """For a two-operand equation that is a batched matrix product up to the order of dims (XLNet's
    ``'ibnd,jbnd->bnij'`` and ``'bnij,jbnd->ibnd'``: batch letters in both operands and the output, one free
    letter in each operand, one contracted letter), the permutations ``(pa, pb, po)``: ``einsum`` equals
    ``matmul(a.permute(pa), b.permute(pb)).permute(po)``; None otherwise."""
    m = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)", eq.replace(" ", ""))
    if not m:
        return None
    a, b, o = m.groups()
    if any(len(set(x)) != len(x) for x in (a, b, o)):
        return None
    batch = [c for c in o if c in a and c in b]
    ai = [c for c in a if c not in b]
    bj = [c for c in b if c not in a]
    con = [c for c in a if c in b and c not in o]
    if len(ai) != 1 or len(bj) != 1 or len(con) != 1 or len(a) != len(batch) + 2 or len(b) != len(batch) + 2 \
            or sorted(o) != sorted(batch + ai + bj):
        return None
    ra, rb, rr = batch + ai + con, batch + con + bj, batch + ai + bj
    return (tuple(a.index(c) for c in ra), tuple(b.index(c) for c in rb), tuple(rr.index(c) for c in o))


_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as",
                 "squeeze", "unsqueeze", "flatten", "unflatten", "narrow", "select", "unbind", "split", "chunk",
                 "t", "as_strided", "detach", "contiguous", "__getitem__", "swapaxes", "swapdims", "movedim",
                 "diagonal", "unfold", "real", "imag", "view_as_real", "view_as_complex"}
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.reshape, torch.flatten, torch.narrow, torch.select,
                   torch.squeeze, torch.unsqueeze, torch.permute, torch.t, torch.chunk, torch.split, torch.unbind,
                   torch.movedim, torch.swapaxes, torch.swapdims, torch.diagonal, torch.detach, torch.as_strided}


def _is_view(n: fx.Node) -> bool:
    """Whether ``n`` may return a view of (share memory with) its first argument."""
    if n.op == "call_method":
        return n.target in _VIEW_METHODS
    if n.op != "call_function":
        return False
    if n.target in _VIEW_FUNCTIONS:
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _views_of(a: fx.Node, base: fx.Node) -> bool:
    while a is not base and _is_view(a) and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a is base


def _alias_read_after(base: fx.Node, n: fx.Node, order: Dict[fx.Node, int]) -> Optional[str]:
    """Why writing into ``base`` at ``n`` cannot be made out of place: ``base`` is a graph input or
    attribute (the caller or the module sees the write), or another view of its memory is read after
    ``n`` (readers of that view would miss the write)."""
    root = base
    while _is_view(root) and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    if root.op in ("placeholder", "get_attr"):
        return f"{root.name} is a graph input or attribute"
    aliases, todo = set(), [root]
    while todo:
        a = todo.pop()
        aliases.add(a)
        todo.extend(u for u in a.users if _is_view(u) and u.args and u.args[0] is a and u not in aliases)
    for a in aliases - {base}:
        if order[a] > order[n] and _views_of(a, base):
            continue  # made after the write from its result: redirected with base's other readers
        if any(order.get(u, -1) > order[n] and u not in aliases for u in a.users):
            return f"{a.name} shares its memory and is read after the write"
    return None


def _functionalize_inplace(gm: fx.GraphModule, ctx: CompileContext) -> int:
    """Turn the in-place methods attention code uses into out-of-place ones, where no other view of the
    written memory (nor the caller) could see the difference."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    n_done = 0
    for n in list(gm.graph.nodes):
        method = n.op == "call_method" and n.target in _INPLACE
        if method or (n.op == "call_function" and n.target in _INPLACE_OPERATORS):
            base = n.args[0]
            if not isinstance(base, fx.Node):
                continue
            why = _alias_read_after(base, n, order)
            if why is not None:
                log.debug("attncomp: %s left in place: %s", n.name, why)
                continue
            later = [u for u in base.users if u is not n and order.get(u, -1) > order[n]]
            with gm.graph.inserting_after(n):
                new = (gm.graph.call_method(_INPLACE[n.target], n.args, n.kwargs) if method
                       else gm.graph.call_function(_INPLACE_OPERATORS[n.target], n.args, n.kwargs))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            for u in later:
                u.replace_input_with(base, new)
            gm.graph.erase_node(n)
            n_done += 1
    return n_done


def canonicalize(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = _functionalize_inplace(gm, ctx) > 0
    # export's dtype/device assertions read values without using them; they would pin matched regions
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
            modified = True
    modules = dict(gm.named_modules())
    for n in list(gm.graph.nodes):
        new = _canon_node(gm, n, modules)
        if new is not None:
            modified = True
            ctx.count("canonicalize", "rewritten")
    return PassResult(gm, modified)


def _scalar_valued(n: fx.Node) -> bool:
    """Whether the node computes a Python/symbolic scalar (dynamo's size arithmetic on SymInts), not a
    tensor: such nodes keep their spelling (``torch.add`` on two ints would return a tensor)."""
    val = n.meta.get("val", n.meta.get("example_value"))
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _canon_node(gm: fx.GraphModule, n: fx.Node, modules) -> Optional[fx.Node]:
    op, t, a, kw = n.op, n.target, n.args, n.kwargs
    if op in ("call_function", "call_method") and _scalar_valued(n):
        return None
    if op == "call_module":
        mod = modules.get(t)
        if isinstance(mod, nn.Softmax):
            return _replace(gm, n, SOFTMAX, (a[0], mod.dim if mod.dim is not None else -1))
        if isinstance(mod, nn.Dropout) and type(mod) is nn.Dropout:
            # stays a module call (its mode decides at run time); the matcher reads the rate here
            if n.meta.get("attncomp_module_dropout") != float(mod.p):
                n.meta["attncomp_module_dropout"] = float(mod.p)
        return None
    if (op == "call_method" and t in ("tril", "triu")) or (op == "call_function" and t in _TRIS):
        return _canon_tri(gm, n)
    if op == "call_method":
        if t in _METHOD_MAP:
            target = _METHOD_MAP[t]
            if target is ADD and (kw.get("alpha", 1) != 1 or len(a) > 2):
                return None
            if target is SOFTMAX:
                return _replace(gm, n, SOFTMAX, (a[0], _kw(n, "dim", 1, None)), _dtype_kw(n, 2))
            if target is DIV and kw.get("rounding_mode") is not None:
                return None
            return _canon_arith(gm, n, target, a[0], a[1], a[2:] if target is TRANSPOSE else ()) \
                if target in (MUL, DIV, ADD) else _replace(gm, n, target, a, {})
        if t == "baddbmm":  # alibi.baddbmm(q, k, beta=, alpha=): Bloom's logits
            return _canon_baddbmm(gm, n)
        if t == "masked_fill":
            x, mask, val = a[0], _kw(n, "mask", 1), _kw(n, "value", 2)
            return _replace(gm, n, WHERE, (mask, val, x))
        if t in _CAST_METHODS and not a[1:] and not kw:
            return _replace(gm, n, "to", (a[0], _CAST_METHODS[t]), op="call_method")
        if t in ("to", "type") and len(a) == 2 and isinstance(a[1], torch.dtype) and not kw:
            if t == "type":
                return _replace(gm, n, "to", (a[0], a[1]), op="call_method")
            return None
        if t == "to" and len(a) == 1 and isinstance(kw.get("dtype"), torch.dtype) and set(kw) == {"dtype"}:
            return _replace(gm, n, "to", (a[0], kw["dtype"]), op="call_method")
        return None
    if op != "call_function":
        return None
    if t is getattr and len(a) == 2 and a[1] == "mT":
        return _replace(gm, n, TRANSPOSE, (a[0], -2, -1))
    if t in (torch.baddbmm, aten.baddbmm.default):
        return _canon_baddbmm(gm, n)
    if t in _MATMULS and t is not MATMUL:
        return _replace(gm, n, MATMUL, (a[0], a[1]))
    if t in (torch.einsum, aten.einsum.default):
        eq, ops = a[0], a[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if isinstance(eq, str) and len(ops) == 2:
            tr = _einsum_to_matmul(eq)
            if tr is not None:
                x, y = ops
                with gm.graph.inserting_before(n):
                    if tr[0]:
                        x = gm.graph.call_function(TRANSPOSE, (x, -2, -1))
                    if tr[1]:
                        y = gm.graph.call_function(TRANSPOSE, (y, -2, -1))
                return _replace(gm, n, MATMUL, (x, y))
            perms = _einsum_permuted(eq)
            if perms is not None:
                return _einsum_as_matmul(gm, n, ops[0], ops[1], *perms)
        return None
    if t in _TRANSPOSES and t is not TRANSPOSE:
        return _replace(gm, n, TRANSPOSE, (a[0], a[1], a[2]))
    if t in _MULS and t is not MUL:
        return _canon_arith(gm, n, MUL, a[0], a[1])
    if t in _DIVS and (t is not DIV or isinstance(a[1], (int, float))):
        if kw.get("rounding_mode") is not None:
            return None
        return _canon_arith(gm, n, DIV, a[0], a[1])
    if t in _ADDS and t is not ADD:
        if kw.get("alpha", 1) != 1 or len(a) > 2:
            return None
        return _canon_arith(gm, n, ADD, a[0], a[1])
    if t in _WHERES and t is not WHERE:
        return _replace(gm, n, WHERE, tuple(a[:3]))
    if t in _MASKED_FILLS:
        return _replace(gm, n, WHERE, (a[1], a[2], a[0]))
    if t in _SOFTMAXES and (t is not SOFTMAX or kw):
        if t is aten.softmax.int:
            return _replace(gm, n, SOFTMAX, (a[0], a[1]), {"dtype": a[2]} if len(a) > 2 and a[2] is not None else {})
        return _replace(gm, n, SOFTMAX, (a[0], _kw(n, "dim", 1, None)), _dtype_kw(n, 3 if t is F.softmax else 2))
    if t is aten._softmax.default:
        x, dim, half_to_float = a[0], a[1], a[2]
        return _replace(gm, n, SOFTMAX, (x, dim), {"dtype": torch.float32} if half_to_float else {})
    if t in _DROPOUTS and t is not DROPOUT:
        p = _kw(n, "p", 1, 0.5)
        train = _kw(n, "train", 2, _kw(n, "training", 2, True))
        return _replace(gm, n, DROPOUT, (a[0], p, train))
    if t is DROPOUT and (kw or len(a) != 3):
        return _replace(gm, n, DROPOUT, (a[0], _kw(n, "p", 1, 0.5), _kw(n, "training", 2, True)))
    if t in _SDPAS and (t is not SDPA or a[3:] or kw):
        names = ("attn_mask", "dropout_p", "is_causal")
        defaults = (None, 0.0, False)
        extra = {nm: _kw(n, nm, 3 + i, d) for i, (nm, d) in enumerate(zip(names, defaults))}
        extra["scale"] = kw.get("scale")
        extra["enable_gqa"] = kw.get("enable_gqa", False)
        if t is SDPA and (list(a[3:]) + list(kw)) == [] :
            return None
        return _replace(gm, n, SDPA, (a[0], a[1], a[2]), extra)
    if t in (aten.to.dtype, aten._to_copy.default):
        d = _kw(n, "dtype", 1)
        rest = {k: v for k, v in kw.items() if k not in ("dtype", "layout")}
        if isinstance(d, torch.dtype) and len(a) <= 2 and all(v in (None, False) for v in rest.values()):
            return _replace(gm, n, "to", (a[0], d), op="call_method")
        return None
    return None


def _einsum_as_matmul(gm: fx.GraphModule, n: fx.Node, x, y, pa, pb, po) -> Optional[fx.Node]:
    """``einsum`` as ``matmul(x.permute(pa), y.permute(pb)).permute(po)`` (identity permutations left out;
    a swap of the last two dims written as ``transpose(-2, -1)``, as match_attention reads k)."""
    if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
        return None
    g = gm.graph

    def perm(node, p):
        if p == tuple(range(len(p))):
            return node
        if p == tuple(range(len(p) - 2)) + (len(p) - 1, len(p) - 2):
            return infer_meta(g.call_function(TRANSPOSE, (node, -2, -1)))
        return infer_meta(g.call_method("permute", (node, *p)))

    with g.inserting_before(n):
        mm = infer_meta(g.call_function(MATMUL, (perm(x, pa), perm(y, pb))), like=n)
        out = perm(mm, po)
    return _swap(n, out)


def _canon_baddbmm(gm: fx.GraphModule, n: fx.Node) -> Optional[fx.Node]:
    """``input*beta + alpha*(b1 @ b2)`` (function or method spelling): Bloom adds its ALiBi bias this way."""
    inp, b1, b2 = _kw(n, "input", 0), _kw(n, "batch1", 1), _kw(n, "batch2", 2)
    beta, alpha = _kw(n, "beta", 3, 1), _kw(n, "alpha", 4, 1)
    if not all(isinstance(x, (int, float)) for x in (beta, alpha)) or None in (inp, b1, b2):
        return None
    with gm.graph.inserting_before(n):
        mm = infer_meta(gm.graph.call_function(MATMUL, (b1, b2)), like=n)
        if alpha != 1:
            mm = infer_meta(gm.graph.call_function(MUL, (mm, float(alpha))), like=n)
        if beta == 0:
            return _swap(n, mm)
        if beta != 1:
            inp = infer_meta(gm.graph.call_function(MUL, (inp, float(beta))), like=n)
    return _replace(gm, n, ADD, (mm, inp))


_TRIS = {torch.tril: "tril", torch.triu: "triu", aten.tril.default: "tril", aten.triu.default: "triu"}


def _canon_tri(gm: fx.GraphModule, n: fx.Node) -> Optional[fx.Node]:
    """``tril(x, d)`` / ``triu(x, d)`` as a position comparison (module docstring); None where the shape or the
    diagonal is not known, or for dtypes other than bool, integers and floats."""
    kind = n.target if n.op == "call_method" else _TRIS[n.target]
    x, d = n.args[0], _kw(n, "diagonal", 1, 0)
    xv = (x.meta.get("val", x.meta.get("example_value"))) if isinstance(x, fx.Node) else None
    if not isinstance(d, int) or isinstance(d, bool) or not isinstance(xv, torch.Tensor) or xv.dim() < 2 \
            or xv.dtype.is_complex:
        return None
    g = gm.graph

    def emit(target, args, kwargs=None, op="call_function"):
        return infer_meta(g.create_node(op, target, args, kwargs or {}), like=n)

    with g.inserting_before(n):
        sizes = []
        for dim in (-2, -1):
            sz = xv.shape[dim]
            sizes.append(int(sz) if isinstance(sz, int) else emit("size", (x, dim), op="call_method"))
        rows = emit("unsqueeze", (emit(torch.arange, (sizes[0],), {"device": xv.device}), -1), op="call_method")
        cols = emit(torch.arange, (sizes[1],), {"device": xv.device})
        diff = emit(torch.sub, (cols, rows))
        keep = emit(torch.le if kind == "tril" else torch.ge, (diff, d))
        if xv.dtype == torch.bool:
            out = emit(torch.logical_and, (x, keep))
        else:
            out = emit(torch.where, (keep, x, 0.0 if xv.dtype.is_floating_point else 0))
    return _swap(n, out)


def _swap(n: fx.Node, new: fx.Node) -> fx.Node:
    new.meta.update(n.meta)
    n.replace_all_uses_with(new)
    n.graph.erase_node(n)
    return new


def _dtype_kw(n: fx.Node, pos: int) -> Dict[str, Any]:
    d = n.kwargs.get("dtype", n.args[pos] if len(n.args) > pos else None)
    return {"dtype": d} if isinstance(d, torch.dtype) else {}


def _canon_arith(gm, n, target, x, y, _unused=()) -> Optional[fx.Node]:
    if target is DIV and isinstance(y, (int, float)) and not isinstance(y, bool) and y != 0:
        return _replace(gm, n, MUL, (x, 1.0 / y))
    if n.op == "call_function" and n.target is target and not n.kwargs:
        return None
    return _replace(gm, n, target, (x, y))
