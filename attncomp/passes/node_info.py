"""What passes ask about fx nodes: shapes, dtypes, devices, constants, data-movement chains, Linear
projections and attention sites.

Not a pass. Every pass reads node metadata (``meta["val"]`` from dynamo/export captures,
``meta["tensor_meta"]`` from ``ShapeProp``), evaluates constant scalars, walks pure data-movement
chains (views, transposes, permutes) and finds the ``attncomp::attention`` sites and their specs; those
answers live here once.

A graph after ``canonicalize`` may spell one operation at three levels (``call_method`` on a
tensor, a ``torch`` function, an ``aten`` overload); every predicate here accepts all three.

Two shape views: :func:`meta_shape` keeps symbolic sizes (``SymInt``) as they are, for proofs
(:func:`same_dim`, :func:`static_int`); :func:`shape_of` turns them into their hint (or name) for
figures such as cost estimates.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn

from ..ops import is_attention_node
from ..spec import AttentionSpec
from .base import CompileContext, SiteReport, SITE_META

__all__ = [
    # metadata
    "meta_val", "meta_shape", "meta_dtype", "shape_of", "dtype_of", "device_of", "same_dim", "static_int",
    "itemsize", "copy_shape_meta", "infer_meta",
    # constants
    "resolve_attr", "get_attr_value", "scalar_value", "UNKNOWN",
    # graph views and names
    "to_networkx", "site_name", "module_path", "module_paths", "MODULE_PATHS", "describe",
    # data movement and projections
    "view_kind", "view_input", "permutation", "exclusive_chain", "LinearInfo", "match_linear", "weight_users",
    "new_constant", "mutates",
    # attention sites
    "attention_sites", "spec_index", "spec_of", "set_spec", "predicates_of", "site_report", "only_getitem0", "head_dim",
]

aten = torch.ops.aten
_aten = aten


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


def without_guards(vals: Sequence[Any]):
    """A context in which ops on the fake values ``vals`` (shape metadata of new nodes) add no guard to
    their shape environment: dynamo's example values share its ShapeEnv, and a guard added while a pass
    computes metadata (torch 2.11 adds some for broadcasting products) would specialise the graph to the
    first call's sizes."""
    import contextlib

    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    env = getattr(mode, "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


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


_SCALAR_FNS: Dict[Any, Callable] = {
    operator.mul: operator.mul, operator.truediv: operator.truediv, operator.pow: operator.pow,
    operator.add: operator.add, operator.sub: operator.sub, operator.neg: operator.neg,
    math.sqrt: math.sqrt, math.pow: math.pow, torch.sqrt: math.sqrt, torch.rsqrt: lambda x: x ** -0.5,
    torch.mul: operator.mul, torch.div: operator.truediv, torch.pow: operator.pow,
    aten.sqrt.default: math.sqrt, aten.rsqrt.default: lambda x: x ** -0.5,
    aten.mul.Tensor: operator.mul, aten.div.Tensor: operator.truediv, aten.pow.Tensor_Scalar: operator.pow,
    aten.reciprocal.default: lambda x: 1.0 / x, torch.reciprocal: lambda x: 1.0 / x,
}


def is_symbolic_number(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymFloat))


def _sym_constant(v: Any):
    """The value of a symbolic number (dynamo's graphs: ``math.sqrt(x.size(-1) // h)``) that the shape
    environment has specialised to a constant (a guard of the graph fixes it), else ``UNKNOWN``."""
    if not is_symbolic_number(v):
        return UNKNOWN
    node = v.node
    try:
        expr = node.shape_env.replace(node.expr) if getattr(node, "shape_env", None) is not None else node.expr
    except Exception:  # an expression the shape env cannot simplify
        return UNKNOWN
    if getattr(expr, "is_number", False):
        try:
            return float(expr)
        except (TypeError, ValueError):
            return UNKNOWN
    return UNKNOWN


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
    sym = _sym_constant(n.meta.get("example_value", n.meta.get("val")))
    if sym is not UNKNOWN:
        return sym
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


#: ``graph_module.meta`` key: ``{id(module): path}`` of the model a graph was captured from, set by the
#: API before the passes run, so that site names are the paths ``model.named_modules()`` gives
MODULE_PATHS = "attncomp_module_paths"

# the root of a dynamo source: a frame's local or global (``L['self']``, ``L['args'][0]``, ``L['fn']``,
# ``G['model']``) with the subscripts that pick an argument, or fx/dynamo's older flat spellings
_SOURCE_ROOT = re.compile(r"""^(?:[LG]\[(['"])[^'"\]]*\1\](?:\[\d+\]|\[(['"])[^'"\]]*\2\])*(?=$|[.\[])"""
                          r"""|self(?=$|\.)|L__self___?(?=$|[^_]))""")
_GETATTR = re.compile(r"""getattr\(([^(),]+),\s*(['"])([^'"]*)\2\)""")
_CONTAINERS = re.compile(r"""\._(?:modules|parameters|buffers)\[(['"])([^'"\]]+)\1\]""")
_SUBSCRIPT = re.compile(r"""\[(['"]?)([^'"\]]+)\1\]""")


def module_path(source: str) -> str:
    """The module path a dynamo source or an fx/export stack entry spells: ``L['args'][0].h.0.attn``,
    ``L['self']._modules['h'][0].attn``, ``getattr(L['self'].h, '0').attn``, ``G['model'].h.0.attn``,
    ``self.h.0.attn`` and ``h.0.attn`` all give ``h.0.attn``; the frame's root module gives ``""``."""
    path = str(source).strip()
    while True:  # getattr(X, 'y') -> X.y, innermost first
        new = _GETATTR.sub(r"\1.\3", path)
        if new == path:
            break
        path = new
    path = _SOURCE_ROOT.sub("", path, count=1)  # (L__self___h_0_attn leaves h_0_attn: flat, ambiguous)
    path = _CONTAINERS.sub(r".\2", path)
    path = _SUBSCRIPT.sub(r".\2", path)
    return path.strip(".")


def _known_path(path: str, stack_key: Any, paths: Dict[int, str]) -> Optional[str]:
    """``path`` as a key of the model's ``named_modules()``: by the module's identity where the stack
    entry's key is dynamo's ``id(module)``, else the path itself, its flat spelling (``h_0_attn``) or its
    longest tail that names a module (a wrapper's prefix such as ``_orig_mod.`` or ``module.``)."""
    key = str(stack_key).split("@")[0]
    if key.isdigit() and int(key) in paths:
        return paths[int(key)]
    names = set(paths.values())
    if path in names:
        return path
    flat = {n.replace(".", "_"): n for n in names}
    if path in flat:
        return flat[path]
    parts = path.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[i:]) in names:
            return ".".join(parts[i:])
    return None


def module_paths(model: nn.Module) -> Dict[int, str]:
    """``{id(module): path}`` for every submodule of ``model`` (a module reached by two paths keeps the
    first, as ``named_modules()`` does)."""
    return {id(m): name for name, m in model.named_modules()}


def site_name(n: fx.Node, default: str) -> str:
    """Dotted path of the innermost user module that produced ``n`` (``encoder.layer.0.attention.self``),
    as ``model.named_modules()`` names it: dynamo's source spellings (``L['self']``, ``L['args'][0]``,
    ``G[...]``, ``_modules[...]``) stripped and, where the graph carries the model's module paths
    (:data:`MODULE_PATHS`), resolved to one of them; ``""`` for a site in the root module's own forward.
    ``default`` where nothing says which module it is."""
    owner = n.graph.owning_module
    paths = owner.meta.get(MODULE_PATHS) if owner is not None else None
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return "" if paths else default
    entries = [(key, module_path(p if isinstance(p, str) else str(p))) for key, (p, _) in stack.items()]
    if paths:
        # innermost first; a module the model does not register (held in a plain list) gives way to the
        # nearest one that it does
        for key, path in reversed(entries):
            known = _known_path(path, key, paths)
            if known is not None:
                return known
    return entries[-1][1] or default


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
    """The node's dtype if the capture recorded it."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype
    tm = node.meta.get("tensor_meta")
    return getattr(tm, "dtype", None)


meta_dtype = dtype_of


def device_of(node: Any) -> Optional[torch.device]:
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.device
    return None


def resolve_attr(gm: fx.GraphModule, target: str) -> Any:
    """The object a dotted ``get_attr`` target names on ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def get_attr_value(gm: fx.GraphModule, n: fx.Node) -> Any:
    """The value a ``get_attr`` node reads."""
    return resolve_attr(gm, n.target)


@dataclass
class LinearInfo:
    """A recognised ``y = x W^T + b``: the node, its input, and the weight and bias tensors."""

    node: fx.Node
    input: fx.Node
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    #: read at run time (graph inputs: the parameters dynamo lifts): ``weight``/``bias`` are then their
    #: fake values (shapes and dtypes only) and ``weight_node``/``bias_node`` the nodes that carry them
    live: bool = False
    weight_node: Optional[fx.Node] = None
    bias_node: Optional[fx.Node] = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


def match_linear(gm: fx.GraphModule, node: fx.Node, live: bool = False) -> Tuple[Optional[LinearInfo], str]:
    """Recognise a Linear projection with weights known at compile time.

    Accepts ``call_module`` to a plain ``nn.Linear`` without hooks, and ``F.linear`` /
    ``torch._C._nn.linear`` / ``aten.linear`` whose weight and bias are ``get_attr`` nodes.
    ``live``: also accept weights that are graph inputs (dynamo lifts a module's parameters so, unless
    they are frozen for inference); the result is then marked ``live`` and carries their nodes, for a
    rewrite that computes from them in the graph rather than reading values at compile time.
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
        is_live = False
        for t in (w, b):
            if t is None:
                tensors.append(None)
                continue
            if isinstance(t, fx.Node) and t.op == "placeholder":
                val = t.meta.get("val", t.meta.get("example_value"))
                if not live:
                    return None, "the linear's weight or bias is a graph input (lifted parameter), unknown at compile time"
                if not isinstance(val, torch.Tensor):
                    return None, "the linear's weight or bias is a graph input without shape metadata"
                tensors.append(val)
                is_live = True
                continue
            if not isinstance(t, fx.Node) or t.op != "get_attr":
                return None, "the linear's weight or bias is computed in the graph, not a module attribute"
            tensors.append(resolve_attr(gm, t.target))
        if tensors[0] is None:
            return None, "the linear has no weight"
        return _checked(LinearInfo(node, x, tensors[0], tensors[1], is_live, w, b))
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


def spec_index(node: fx.Node) -> int:
    """Position of the ``spec`` string among an attention node's arguments (the first ``str``)."""
    for i, a in enumerate(node.args):
        if isinstance(a, str):
            return i
    raise ValueError(f"{node.name} has no spec argument")


def spec_of(node: fx.Node) -> AttentionSpec:
    return AttentionSpec.from_json(node.args[spec_index(node)])


def predicates_of(node: fx.Node):
    """The structured-mask arguments of an attention node (DESIGN §4.1) as a ``Predicates`` of graph
    values (None where absent), or None if the op has no such arguments."""
    from ..spec import Predicates

    names = [a.name for a in torch.ops.attncomp.attention.default._schema.arguments]
    if not all(f in names for f in Predicates._fields):
        return None
    return Predicates(*(node.args[names.index(f)] if names.index(f) < len(node.args) else None
                        for f in Predicates._fields))


def set_op_args(node: fx.Node, **named: Any) -> None:
    """Set arguments of an ``attncomp::attention`` node by name; trailing optional arguments left None
    are dropped, so the call reads as the op's older schema where it can."""
    from ..ops import ARG_INDEX

    args = list(node.args) + [None] * (len(ARG_INDEX) - len(node.args))
    for name, value in named.items():
        args[ARG_INDEX[name]] = value
    while len(args) > ARG_INDEX["seed"] + 1 and args[-1] is None:
        args.pop()
    node.args = tuple(args)


def set_spec(node: fx.Node, spec: AttentionSpec, report: Optional[SiteReport] = None) -> None:
    node.update_arg(spec_index(node), spec.to_json())
    if report is not None:
        report.spec = spec.describe(predicates_of(node))


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


def infer_meta(node: fx.Node, like: Optional[fx.Node] = None) -> fx.Node:
    """Shape metadata for a node a pass created (``call_function`` or ``call_method``): its target run on its
    arguments' recorded values (fake tensors, SymInts) under :func:`without_guards`, stored under the key the
    graph uses (``val`` for aten/export graphs, ``example_value`` for dynamo's; ``like``'s or the first
    argument's). Nothing is stored where an argument has no value or the op fails on them."""
    args = list(node.args) + list(node.kwargs.values())
    src = like if like is not None else next((a for a in args if isinstance(a, fx.Node)), None)
    if src is None:
        return node
    key = "val" if "val" in src.meta else ("example_value" if "example_value" in src.meta else None)
    if key is None:
        return node

    def val(a):
        if isinstance(a, fx.Node):
            if key not in a.meta:
                raise KeyError(a.name)
            return a.meta[key]
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    try:
        vals, kw = [val(a) for a in node.args], {k: val(v) for k, v in node.kwargs.items()}
        with without_guards(vals):
            if node.op == "call_method":
                out = getattr(vals[0], node.target)(*vals[1:], **kw)
            elif node.op == "call_function":
                out = node.target(*vals, **kw)
            else:
                return node
        node.meta[key] = out
    except Exception:  # metadata only: the passes cope without it
        pass
    return node


# ---------------------------------------------------------------------------------------------
# Effects

_INPLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it is given: dynamo keeps in-place calls whose results are
    unused (``group_mask.scatter_(...)``, ``ids.clamp_(max=...)``, ``x[i] = y``), and fx's impurity
    does not see methods. Removing them as dead code changes what later readers of the tensor see
    (an MoE router's expert choice, and with it the whole output)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op != "call_function":
        return False
    t = node.target
    if t in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    schema = getattr(t, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    if getattr(t, "__module__", None) in ("_operator", "operator"):
        return False  # and_, or_, not_: named with a trailing underscore, pure
    name = getattr(t, "__name__", "")
    return name.endswith("_") and not name.startswith("_")
