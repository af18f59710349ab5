"""Recognisers of the score modifiers of DESIGN.md §4.2 in a site's logits, for :mod:`.match_attention`.

Not a pass: the functions here read the nodes between a site's ``QK^T`` product and its softmax (and
just after the softmax) and say which modifier the model computes there, so the matcher can carry it in
the site's spec instead of leaving it in the graph:

* soft-capping: ``tanh(s * (1/c)) * c`` or ``tanh(s / c) * c`` with a constant ``c`` (Gemma2's
  ``attn_logit_softcapping``, canonicalised: division by a number is a multiplication by its reciprocal);
  :func:`softcap_of`;
* attention sinks: ``softmax(cat([s, sink.reshape(1, H, 1, 1).expand(B, H, Nq, 1)], -1) [- its row max])``
  followed by ``[..., :-1]`` (GPT-OSS): a learned per-head logit that joins the denominator and attends to
  nothing; :func:`peel_sinks` and :func:`drops_last_column`.

Each recogniser is structural and exact: it accepts only the forms whose value is the modifier's formula
(the row-max shift is a no-op of the softmax; the sink column must be one value per head, broadcast over
batch and queries, which the shapes in the node metadata prove). Anything else is left to the matcher,
which rejects the site with a reason or keeps the bias materialised.
"""

from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
import torch.fx as fx

from .canonicalize import DIV, MUL
from .node_info import UNKNOWN, meta_shape, scalar_value, static_int

__all__ = ["TANH", "is_tanh", "softcap_of", "peel_sinks", "drops_last_column"]

aten = torch.ops.aten

TANH = (torch.tanh, aten.tanh.default)


def is_tanh(n) -> bool:
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in TANH)
                                       or (n.op == "call_method" and n.target == "tanh"))


def _const(gm, x) -> Optional[float]:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node):
        v = scalar_value(gm, x)
        if v is not UNKNOWN and isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def softcap_of(gm, n) -> Optional[Tuple[fx.Node, float]]:
    """``(s, c)`` when ``n`` computes ``c * tanh(s / c)`` (as ``mul(tanh(mul(s, 1/c)), c)``, the factors
    in either order, or ``div(s, c)`` inside); else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is MUL):
        return None
    a, b = n.args[0], n.args[1]
    if is_tanh(b):
        a, b = b, a
    if not is_tanh(a):
        return None
    c = _const(gm, b)
    if c is None or not c > 0:
        return None
    t = a.args[0]
    if not isinstance(t, fx.Node) or t.op != "call_function":
        return None
    if t.target is DIV:
        c2 = _const(gm, t.args[1])
        if c2 is not None and c2 == c:
            return t.args[0], c
        return None
    if t.target is MUL:
        x, f = t.args[0], t.args[1]
        cf = _const(gm, f)
        if cf is None:
            x, f = f, x
            cf = _const(gm, f)
        # the reciprocal as the model computed it (1/c rounded): equal to 1/c within one rounding
        if cf is not None and cf > 0 and abs(cf * c - 1.0) <= 1e-6:
            return x, c
    return None


def _is_row_max(m, x) -> bool:
    """Whether ``m`` is ``x.max(dim=-1, keepdim=True).values`` or ``x.amax(-1, keepdim=True)``."""
    if not isinstance(m, fx.Node):
        return False
    if m.op == "call_function" and ((m.target is operator.getitem and m.args[1] == 0)
                                    or (m.target is getattr and m.args[1] == "values")):
        mx = m.args[0]
        if isinstance(mx, fx.Node) and mx.args and mx.args[0] is x and (
                (mx.op == "call_method" and mx.target == "max")
                or (mx.op == "call_function" and mx.target in (torch.max, aten.max.dim))):
            dim = mx.args[1] if len(mx.args) > 1 else mx.kwargs.get("dim")
            keep = mx.args[2] if len(mx.args) > 2 else mx.kwargs.get("keepdim", False)
            return dim in (-1, _last(x)) and keep is True
        return False
    if ((m.op == "call_method" and m.target == "amax") or
            (m.op == "call_function" and m.target in (torch.amax, aten.amax.default))) and m.args and m.args[0] is x:
        dim = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim")
        keep = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
        return dim in (-1, [-1], (-1,), _last(x), [_last(x)]) and keep is True
    return False


def _last(x) -> Optional[int]:
    shp = meta_shape(x)
    return None if shp is None else len(shp) - 1


_SUB = (operator.sub, torch.sub, aten.sub.Tensor)


def peel_sinks(gm, x) -> Tuple[object, Optional[fx.Node]]:
    """``(s, sink)`` when the softmax input ``x`` is ``cat([s, col], -1)`` (less its row max, a shift the
    softmax ignores) with ``col`` one learned logit per head, broadcast: ``sink`` is the ``(1, H, 1, 1)``
    (or ``(H, 1, 1)``) tensor before the broadcast. Else ``(x, None)``, or ``(s, None)`` for ``x = s - rowmax(s)``
    without a sink column (MiMo-V2-Flash's layers without sinks: the softmax subtracts the row max itself)."""
    n = x
    if isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SUB and _is_row_max(n.args[1], n.args[0]):
        n = n.args[0]
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in (torch.cat, aten.cat.default)):
        return n, None
    parts = n.args[0] if n.args else n.kwargs.get("tensors")
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, _last(n)):
        return x, None
    s, col = parts
    cs, ss = meta_shape(col), meta_shape(s)
    if cs is None or ss is None or len(cs) != len(ss) or len(ss) != 4 or static_int(cs[-1]) != 1:
        return x, None
    src = col
    while isinstance(src, fx.Node) and ((src.op == "call_method" and src.target in ("expand", "expand_as"))
                                        or (src.op == "call_function" and src.target is aten.expand.default)):
        src = src.args[0]
    sh = meta_shape(src)
    if sh is None or len(sh) not in (3, 4):
        return x, None
    sh = [static_int(d) for d in sh]
    heads = static_int(ss[1])
    # one value per head: every dim but the heads' is 1 before the broadcast
    if heads is None or sh[-3] != heads or any(d != 1 for d in sh[-2:]) or (len(sh) == 4 and sh[0] != 1):
        return x, None
    return s, src


def drops_last_column(n) -> bool:
    """Whether ``n`` is ``p[..., :-1]`` (the softmax's probabilities less the sink's column)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    if n.target is operator.getitem:
        idx = n.args[1]
        if isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice):
            sl = idx[1]
            return sl.start in (None, 0) and sl.stop == -1 and sl.step in (None, 1)
        return False
    if n.target is aten.slice.Tensor:
        dim = n.args[1] if len(n.args) > 1 else 0
        start = n.args[2] if len(n.args) > 2 else None
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        return dim in (-1, _last(n.args[0])) and start in (None, 0) and end == -1 and step == 1
    return False
