"""Small helpers shared by passes: node metadata (shapes, dtypes), constant scalars, graph views."""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, Optional, Tuple

import networkx as nx
import torch
import torch.fx as fx

__all__ = ["meta_val", "meta_shape", "meta_dtype", "same_dim", "scalar_value", "to_networkx", "site_name",
           "get_attr_value", "UNKNOWN"]

aten = torch.ops.aten


class _Unknown:
    def __repr__(self):
        return "UNKNOWN"


UNKNOWN = _Unknown()


def meta_val(n: Any):
    if not isinstance(n, fx.Node):
        return None
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v
    return None


def meta_shape(n: Any) -> Optional[Tuple]:
    """The node's shape (ints or SymInts) if the capture recorded it."""
    if not isinstance(n, fx.Node):
        return None
    v = meta_val(n)
    if v is not None:
        return tuple(v.shape)
    tm = n.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(tm.shape)
    return None


def meta_dtype(n: Any) -> Optional[torch.dtype]:
    if not isinstance(n, fx.Node):
        return None
    v = meta_val(n)
    if v is not None:
        return v.dtype
    tm = n.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "dtype"):
        return tm.dtype
    return None


def same_dim(a, b) -> bool:
    """True only when two (possibly symbolic) sizes are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def static_int(x) -> Optional[int]:
    if isinstance(x, int):
        return x
    try:
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        if is_concrete_int(x):
            return int(x)
    except Exception:
        pass
    return None


def get_attr_value(gm: fx.GraphModule, n: fx.Node):
    obj = gm
    for part in n.target.split("."):
        obj = getattr(obj, part)
    return obj


_SCALAR_FNS: Dict[Any, Callable] = {
    operator.mul: operator.mul, operator.truediv: operator.truediv, operator.pow: operator.pow,
    operator.add: operator.add, operator.sub: operator.sub, operator.neg: operator.neg,
    math.sqrt: math.sqrt, math.pow: math.pow, torch.sqrt: math.sqrt, torch.rsqrt: lambda x: x ** -0.5,
    torch.mul: operator.mul, torch.div: operator.truediv, torch.pow: operator.pow,
    aten.sqrt.default: math.sqrt, aten.rsqrt.default: lambda x: x ** -0.5,
    aten.mul.Tensor: operator.mul, aten.div.Tensor: operator.truediv, aten.pow.Tensor_Scalar: operator.pow,
    aten.reciprocal.default: lambda x: 1.0 / x, torch.reciprocal: lambda x: 1.0 / x,
}


def scalar_value(gm: fx.GraphModule, n: Any, leaf: Optional[Callable[[fx.Node], Any]] = None, depth: int = 0):
    """Evaluate ``n`` as a Python number if it is one, or a 0-dim constant tensor, or built from such
    values by scalar arithmetic (``sqrt``, ``**``, ``/``, ``full([], c)``...). ``leaf(node)`` may supply
    values for other nodes (e.g. the head dim). Returns ``UNKNOWN`` otherwise."""
    if isinstance(n, bool):
        return UNKNOWN
    if isinstance(n, (int, float)):
        return float(n)
    if not isinstance(n, fx.Node) or depth > 12:
        return UNKNOWN
    if leaf is not None:
        v = leaf(n)
        if v is not UNKNOWN:
            return v
    if n.op == "get_attr":
        try:
            t = get_attr_value(gm, n)
        except AttributeError:
            return UNKNOWN
        if isinstance(t, torch.Tensor) and t.numel() == 1 and t.dim() == 0:
            return float(t.item())
        return UNKNOWN
    if n.op == "call_method" and n.target in ("to", "type_as", "float", "half", "bfloat16", "double", "item",
                                              "clone", "detach"):
        return scalar_value(gm, n.args[0], leaf, depth + 1)
    if n.op == "call_method" and n.target in ("sqrt", "rsqrt", "reciprocal", "__truediv__", "__mul__", "__pow__",
                                              "mul", "div", "pow"):
        fn = {"sqrt": math.sqrt, "rsqrt": lambda x: x ** -0.5, "reciprocal": lambda x: 1.0 / x,
              "__truediv__": operator.truediv, "div": operator.truediv, "__mul__": operator.mul,
              "mul": operator.mul, "__pow__": operator.pow, "pow": operator.pow}[n.target]
        vals = [scalar_value(gm, a, leaf, depth + 1) for a in n.args]
        return UNKNOWN if any(v is UNKNOWN for v in vals) else float(fn(*vals))
    if n.op != "call_function":
        return UNKNOWN
    t = n.target
    if t in (torch.full, aten.full.default) and list(n.args[0]) == []:
        return scalar_value(gm, n.args[1], leaf, depth + 1)
    if t in (torch.tensor, torch.scalar_tensor, torch.as_tensor, aten.scalar_tensor.default,
             aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype, aten.clone.default,
             aten.detach.default, torch.ops.aten.alias.default, aten.item.default):
        return scalar_value(gm, n.args[0], leaf, depth + 1)
    if t in _SCALAR_FNS:
        vals = [scalar_value(gm, a, leaf, depth + 1) for a in n.args]
        if any(v is UNKNOWN for v in vals):
            return UNKNOWN
        try:
            return float(_SCALAR_FNS[t](*vals))
        except (ValueError, ZeroDivisionError, OverflowError):
            return UNKNOWN
    return UNKNOWN


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow DiGraph of the fx graph (edge a -> b when b reads a)."""
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n)
        for a in n.all_input_nodes:
            g.add_edge(a, n)
    return g


def site_name(n: fx.Node, default: str) -> str:
    """Dotted path of the innermost user module that produced ``n`` (``encoder.layer.0.attention.self``)."""
    stack = n.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        path = path if isinstance(path, str) else str(path)
        path = path.replace("L['self'].", "").replace("L__self___", "")
        return path or default
    return default
