"""Graph helpers for the E.T. rewrites: Linear projections, pure data-movement chains, shapes, sites.

Not a pass. ``scale_reorder`` and ``fold_wv_wo`` both need to see through the view/transpose
chain between a Linear projection and an ``attncomp::attention`` argument, to read the Linear's
frozen weights, and to register new constant tensors on the ``GraphModule`` without touching the
user's modules; the shared parts live here.

A graph after ``canonicalize`` may spell one operation at three levels (``call_method`` on a
tensor, a ``torch`` function, an ``aten`` overload); every predicate here accepts all three.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..ops import is_attention_node
from ..spec import AttentionSpec
from .base import CompileContext, SiteReport, SITE_META

__all__ = [
    "LinearInfo", "match_linear", "view_kind", "view_input", "permutation", "shape_of", "dtype_of", "device_of",
    "resolve_attr", "weight_users", "exclusive_chain", "new_constant", "attention_sites", "spec_of", "set_spec",
    "site_report", "only_getitem0", "head_dim", "itemsize", "copy_shape_meta", "describe",
]

_aten = torch.ops.aten

# kind of each pure data-movement op, by (op, target); "reshape" covers every row-major reshape
_VIEW_METHODS = {
    "view": "reshape", "reshape": "reshape", "unflatten": "reshape", "flatten": "reshape",
    "transpose": "transpose", "swapaxes": "transpose", "permute": "permute",
    "unsqueeze": "reshape", "squeeze": "reshape",
    "contiguous": "identity", "clone": "identity",
}
_VIEW_FUNCTIONS = {
    torch.reshape: "reshape", torch.flatten: "reshape", torch.unflatten: "reshape",
    torch.transpose: "transpose", torch.swapaxes: "transpose", torch.permute: "permute",
    torch.unsqueeze: "reshape", torch.squeeze: "reshape", torch.clone: "identity",
    _aten.unsqueeze.default: "reshape", _aten.squeeze.dim: "reshape",
    _aten.view.default: "reshape", _aten._unsafe_view.default: "reshape", _aten.reshape.default: "reshape",
    _aten.unflatten.int: "reshape", _aten.flatten.using_ints: "reshape",
    _aten.transpose.int: "transpose", _aten.swapaxes.default: "transpose", _aten.permute.default: "permute",
    _aten.clone.default: "identity", _aten.contiguous.default: "identity", _aten.alias.default: "identity",
}
_LINEAR_FUNCTIONS = (torch.nn.functional.linear, torch._C._nn.linear, _aten.linear.default)


def describe(node: fx.Node) -> str:
    """A short name for a node's operation, for reasons in the report."""
    if node.op == "call_module":
        return f"module {node.target!r}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        t = node.target
        return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    return f"{node.op} {node.target!r}"


def view_kind(node: fx.Node) -> Optional[str]:
    """``"reshape"``, ``"transpose"``, ``"permute"`` or ``"identity"`` for pure data movement, else None.

    Every such op only moves elements, so an elementwise scale commutes with it.
    """
    if node.op == "call_method":
        if node.target == "view" and any(isinstance(a, torch.dtype) for a in list(node.args[1:]) + list(node.kwargs.values())):
            return None  # a bit-reinterpreting view changes values
        return _VIEW_METHODS.get(node.target)
    if node.op == "call_function":
        return _VIEW_FUNCTIONS.get(node.target)
    return None


def view_input(node: fx.Node) -> Optional[fx.Node]:
    a = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return a if isinstance(a, fx.Node) else None


def permutation(node: fx.Node, ndim: int) -> Optional[Tuple[int, ...]]:
    """The dimension permutation a transpose/permute node applies to an ``ndim`` tensor, if literal."""
    kind = view_kind(node)
    if kind == "transpose":
        dims = list(node.args[1:3])
        if len(dims) < 2:
            dims += [node.kwargs.get(k) for k in ("dim0", "dim1")][len(dims):]
        if not all(isinstance(d, int) for d in dims):
            return None
        a, b = (d % ndim for d in dims)
        p = list(range(ndim))
        p[a], p[b] = p[b], p[a]
        return tuple(p)
    if kind == "permute":
        rest = node.args[1:] or (node.kwargs.get("dims"),)
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if dims is None or len(dims) != ndim or not all(isinstance(d, int) for d in dims):
            return None
        return tuple(d % ndim for d in dims)
    return None


def _dim(s) -> Any:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else str(s)


def shape_of(node: Any) -> Optional[Tuple[Any, ...]]:
    """Shape from ``meta['val']`` (capture) or ``meta['tensor_meta']`` (ShapeProp); None if unknown.

    A symbolic dimension becomes its hint when it has one, else its name (equal names mean equal sizes).
    """
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return tuple(_dim(s) for s in v.shape)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(_dim(s) for s in tm.shape)
    return None


def dtype_of(node: Any) -> Optional[torch.dtype]:
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype
    tm = node.meta.get("tensor_meta")
    return getattr(tm, "dtype", None)


def device_of(node: Any) -> Optional[torch.device]:
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.device
    return None


def resolve_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class LinearInfo:
    """A recognised ``y = x W^T + b``: the node, its input, and the weight and bias tensors."""

    node: fx.Node
    input: fx.Node
    weight: torch.Tensor
    bias: Optional[torch.Tensor]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


def match_linear(gm: fx.GraphModule, node: fx.Node) -> Tuple[Optional[LinearInfo], str]:
    """Recognise a Linear projection with weights known at compile time.

    Accepts ``call_module`` to a plain ``nn.Linear`` without hooks, and ``F.linear`` /
    ``torch._C._nn.linear`` / ``aten.linear`` whose weight and bias are ``get_attr`` nodes.
    Returns ``(info, "")`` or ``(None, reason)``.
    """
    if node.op == "call_module":
        mod = resolve_attr(gm, node.target)
        if not isinstance(mod, nn.Linear):
            return None, f"it is produced by {describe(node)} ({type(mod).__name__}), not a Linear"
        if type(mod).forward is not nn.Linear.forward:
            return None, f"{describe(node)} is a {type(mod).__name__} with its own forward"
        if mod._forward_hooks or mod._forward_pre_hooks or nn.modules.module._global_forward_hooks:
            return None, f"{describe(node)} has forward hooks"
        x = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(x, fx.Node):
            return None, f"{describe(node)} has no tensor input"
        return _checked(LinearInfo(node, x, mod.weight, mod.bias))
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        args = list(node.args) + [None] * (3 - len(node.args))
        x = args[0] if args[0] is not None else node.kwargs.get("input")
        w = args[1] if args[1] is not None else node.kwargs.get("weight")
        b = args[2] if args[2] is not None else node.kwargs.get("bias")
        if not isinstance(x, fx.Node):
            return None, "the linear has no tensor input"
        tensors = []
        for t in (w, b):
            if t is None:
                tensors.append(None)
                continue
            if isinstance(t, fx.Node) and t.op == "placeholder":
                return None, "the linear's weight or bias is a graph input (lifted parameter), unknown at compile time"
            if not isinstance(t, fx.Node) or t.op != "get_attr":
                return None, "the linear's weight or bias is computed in the graph, not a module attribute"
            tensors.append(resolve_attr(gm, t.target))
        if tensors[0] is None:
            return None, "the linear has no weight"
        return _checked(LinearInfo(node, x, tensors[0], tensors[1]))
    return None, f"it is produced by {describe(node)}, not a Linear"


def _checked(lin: LinearInfo) -> Tuple[Optional[LinearInfo], str]:
    for t in (lin.weight, lin.bias):
        if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.is_meta):
            return None, f"{describe(lin.node)} has no floating-point weight known at compile time"
    if lin.weight.dim() != 2:
        return None, f"{describe(lin.node)} has a {lin.weight.dim()}-d weight"
    return lin, ""


def weight_users(gm: fx.GraphModule, tensor: torch.Tensor) -> List[fx.Node]:
    """Nodes that read ``tensor`` (as a module parameter or through ``get_attr``)."""
    users = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = resolve_attr(gm, n.target)
            if any(p is tensor for p in mod.parameters(recurse=True)) or any(b is tensor for b in mod.buffers()):
                users.append(n)
        elif n.op == "get_attr":
            try:
                if resolve_attr(gm, n.target) is tensor:
                    users.extend(n.users)
            except AttributeError:
                pass
    return users


def exclusive_chain(start: fx.Node) -> Tuple[List[fx.Node], fx.Node, Optional[str]]:
    """Walk back from ``start`` through pure data movement.

    Returns ``(chain, producer, problem)``: ``chain`` lists the data-movement nodes from ``start``
    back (``start`` first, if it is one), ``producer`` the first node that is not data movement, and
    ``problem`` names a chain node (or the producer) with a user outside the chain, else None.
    """
    chain: List[fx.Node] = []
    cur = start
    while view_kind(cur) is not None and view_input(cur) is not None:
        chain.append(cur)
        cur = view_input(cur)
    problem = None
    for n in chain[1:] + [cur]:
        if len(n.users) != 1:
            problem = f"{n.name} ({describe(n)}) has {len(n.users)} users"
            break
    return chain, cur, problem


def new_constant(gm: fx.GraphModule, prefix: str, value: torch.Tensor, trainable: bool) -> str:
    """Register ``value`` on ``gm`` under a fresh name: a parameter if ``trainable``, else a buffer."""
    i = 0
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    name = f"{prefix}_{i}"
    if trainable:
        gm.register_parameter(name, nn.Parameter(value))
    else:
        gm.register_buffer(name, value)
    return name


def attention_sites(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if is_attention_node(n)]


def spec_of(node: fx.Node) -> AttentionSpec:
    return AttentionSpec.from_json(node.args[7])


def set_spec(node: fx.Node, spec: AttentionSpec, report: Optional[SiteReport] = None) -> None:
    node.update_arg(7, spec.to_json())
    if report is not None:
        report.spec = spec.describe()


def site_report(node: fx.Node, ctx: CompileContext) -> SiteReport:
    """The site's report entry; one is created (and listed in ``ctx.sites``) if the matcher left none."""
    rep = node.meta.get(SITE_META)
    if rep is None:
        spec = spec_of(node)
        rep = SiteReport(name=node.name, rewritten=True, policy=spec.policy.name, spec=spec.describe())
        node.meta[SITE_META] = rep
        ctx.sites.append(rep)
    return rep


def only_getitem0(node: fx.Node) -> Optional[fx.Node]:
    """The single ``getitem(node, 0)`` user of an attention node if that is its only live user."""
    out = None
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 and out is None:
            out = u
        elif u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1 and not u.users:
            continue
        else:
            return None
    return out


def head_dim(node: fx.Node, spec: AttentionSpec) -> Optional[int]:
    if spec.head_dim:
        return int(spec.head_dim)
    s = shape_of(node.args[0])
    return s[-1] if s and isinstance(s[-1], int) else None


def itemsize(dtype: Optional[torch.dtype]) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


def copy_shape_meta(dst: fx.Node, src: fx.Node) -> None:
    for k in ("val", "tensor_meta"):
        if k in src.meta:
            dst.meta[k] = src.meta[k]
