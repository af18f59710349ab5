"""Turn the masks models compute into the structured predicates of DESIGN.md §4.1.

Matches: every ``attncomp::attention`` node whose ``attn_mask`` argument is computed in the graph
(dynamo's torch-level graphs, torch.export's aten graphs and fx traces, after :mod:`.canonicalize`).
The subgraph that computes the mask is evaluated symbolically over the four axes ``(b, h, i, j)`` of
the logits: ``arange``s and position vectors (``cache_position``, ``position_ids``) are integer
vectors along one axis, kept as ``const + sum(coef * vector) + sum(coef * size)``; a comparison of an
``i``-vector with a ``j``-vector is a position bound (``abs(i - j) <= w`` two of them), an equality of
per-token vectors (``cumsum(position_ids == 0)``) a segment test, a boolean tensor that varies only
along ``(b, j)`` or ``(b, i)`` padding; ``&``, ``where``/``masked_fill``, casts, ``1 - m``, sums of
additive ``0``-or-large-negative floats (``torch.finfo(dtype).min``, ``-inf``) combine them.

Shapes: every tensor dim carries a label. Labels of dims that meet in an elementwise operation are
unified; views (``unsqueeze``, ``None``-indexing, ``expand``, ``view``/``reshape`` that only add or drop
size-1 dims, ``permute``/``transpose``, full slices) move labels, and give the moved value fresh ones,
so one vector read along two axes (``seg[:, :, None] == seg[:, None, :]``) stays two axes. Advanced
indexing takes the labels of its index tensors (``padding_mask[batch_idx, kv_idx]``; with plain
``arange`` indices over the whole tensor it is the tensor itself). In torch.vmap regions (dynamo keeps
``_add_batch_dim``/``_remove_batch_dim``), a batched value carries level ``l`` at position ``l - 1``;
only elementwise ops, comparisons and gathers of 0-d values are modelled there, and batched values are
never read outside. The mask's last four dims name ``b, h, i, j``. A tensor's broadcast value depends
only on the axes its non-size-1 dims carry, whatever op computed it: that is what makes the
classification sound for the ops the pass does not look into (they are leaves over their own dims).

The mask is a conjunction; each conjunct becomes

* position bounds ``lo <= k_expr[j] - q_expr[i] <= hi`` -> ``window(left, right)`` (``right == 0``:
  causal) on ``q_pos``/``k_pos`` built from the same vectors; plain ``arange``s from 0 need no tensors
  (top-left, or bottom-right when the query offset is provably ``Nk - Nq``);
* an equality of an ``i``-vector and a ``j``-vector -> ``q_seg``/``k_seg`` (packed documents);
* a boolean vector along ``(b, j)`` -> ``k_valid``; along ``(b, i)`` -> ``q_valid`` (padding);
* anything else (a value that depends on data along both ``i`` and ``j``, or on heads, or a second
  pair of position vectors) -> the dense residual ``attn_mask``; additive non-mask values (biases) stay
  additive. The report says why.

Requires: :mod:`.match_attention` ran (sites are ``attncomp::attention`` nodes) and the op has the
predicate arguments of DESIGN.md §4.1. Leaves (inputs, parameters, ops the pass does not model) need
shape metadata (``val``, ``example_value`` or ``tensor_meta``); without it the mask stays materialised.

Guarantees: the rewritten op allows exactly the entries the original mask allowed (float masks: values
``<= -1e4`` count as excluded, as :mod:`.match_attention` counts fills); predicate tensors are O(N)
values computed in the graph from the vectors the mask was built from, so the N x N mask nodes become
dead and are removed; a site whose mask cannot be analysed is left unchanged. Under the dynamo capture
the derivation is also checked on the values of the call being compiled (DESIGN §7): the predicates and
bias, evaluated from the graph's inputs, must allow exactly the entries the graph's own mask allows (and
add the same bias there); otherwise the mask stays materialised and the report says where they differ.
Each site's report gets a
``mask`` entry: the predicates in words (``causal``, ``causal (bottom-right)``, ``window(left, right)``,
``documents``, ``padding``), followed by ``materialised mask: <why>`` for a residual.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .base import MASK_FILL_MAX, CompileContext, PassResult
from .node_info import attention_sites, describe, dtype_of, is_symbolic_number, meta_shape, mutates, scalar_value, \
    set_spec, site_report, spec_of, spec_index, static_int, UNKNOWN

log = logging.getLogger(__name__)

__all__ = ["analyze_mask", "analyze", "MaskAnalysis"]

aten = torch.ops.aten

_PRED_NAMES = ("q_pos", "k_pos", "q_seg", "k_seg", "q_valid", "k_valid")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


class _Fail(Exception):
    """The mask cannot be analysed at all; the message is the reason."""


# ---------------------------------------------------------------------------------------------
# Labels of tensor dims (union-find) and abstract values


class _Labels:
    def __init__(self):
        self.parent: List[int] = []

    def new(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
        return ra


Layout = Tuple[Optional[int], ...]   # a label per dim; None for a dim of size 1


@dataclass(frozen=True)
class _Src:
    """A graph value equal to one conjunct: ``how`` says how to read it as "allowed"."""
    node: fx.Node
    layout: Layout
    how: str = "bool"         # bool | not | nonzero | zero

    def negated(self) -> "_Src":
        flip = {"bool": "not", "not": "bool", "nonzero": "zero", "zero": "nonzero"}
        return replace(self, how=flip[self.how])


@dataclass(frozen=True)
class _Leaf:
    """A tensor the pass does not look into, with the labels of its dims."""
    node: fx.Node
    layout: Layout

    def key(self):
        """Equal keys mean equal values along the axis the leaf indexes. ``arange(n)`` from 0 with step 1
        is the index itself whatever spells ``n`` (its length is the axis length)."""
        n = self.node
        if _is_plain_arange(self) is not None:
            return ("arange", str(n.kwargs.get("dtype")))
        return ("node", n.name)


@dataclass
class _Num:
    """``const + sum(coef * leaf) + sum(coef * scalar)``: a numeric tensor or scalar."""
    layout: Layout
    terms: Tuple[Tuple[Any, _Leaf], ...] = ()
    const: Any = 0
    syms: Tuple[Tuple[Any, fx.Node], ...] = ()

    def is_const(self) -> bool:
        return not self.terms and not self.syms


@dataclass(frozen=True)
class _Atom:
    """One conjunct. ``cmp``: ``lo <= lin <= hi`` (``lin`` has no constant); ``leaf``: ``src`` itself."""
    kind: str
    src: _Src
    lin: Optional[_Num] = None
    lo: Optional[int] = None
    hi: Optional[int] = None

    def negated(self) -> Optional["_Atom"]:
        if self.kind == "leaf":
            return replace(self, src=self.src.negated())
        if self.lo is not None and self.hi is not None:
            return None   # the negation of a two-sided bound is a disjunction
        if self.hi is not None:
            return replace(self, src=self.src.negated(), lo=self.hi + 1, hi=None)
        return replace(self, src=self.src.negated(), lo=None, hi=self.lo - 1)


@dataclass
class _Pred:
    """A boolean tensor: the AND of ``atoms`` (or constant False)."""
    layout: Layout
    atoms: Tuple[_Atom, ...] = ()
    false: bool = False
    inv: Optional["_Pred"] = None     # set on an opaque negation: what it negates (``~~p == p``)


@dataclass
class _FMask:
    """An additive float mask: 0 where ``pred`` holds, <= -1e4 elsewhere, plus ``biases`` (float leaves)."""
    layout: Layout
    pred: _Pred
    biases: Tuple[_Leaf, ...] = ()


@dataclass
class _Abs:
    """``abs(inner)`` of an integer expression (bidirectional windows: ``abs(q_idx - kv_idx) <= w``)."""
    layout: Layout
    inner: _Num


@dataclass
class _Ind:
    """A numeric 0/1 tensor: 1 where ``pred`` holds."""
    layout: Layout
    pred: _Pred


def _map_layouts(v, f):
    """``v`` with every layout in it (its own, its leaves', its atoms') passed through ``f``."""
    if v is None:
        return None
    if isinstance(v, _Leaf):
        return replace(v, layout=f(v.layout))
    if isinstance(v, _Src):
        return replace(v, layout=f(v.layout))
    if isinstance(v, _Num):
        return replace(v, layout=f(v.layout), terms=tuple((c, _map_layouts(l, f)) for c, l in v.terms))
    if isinstance(v, _Atom):
        return replace(v, src=_map_layouts(v.src, f), lin=_map_layouts(v.lin, f))
    if isinstance(v, _Pred):
        return replace(v, layout=f(v.layout), atoms=tuple(_map_layouts(a, f) for a in v.atoms),
                       inv=_map_layouts(v.inv, f))
    if isinstance(v, _FMask):
        return replace(v, layout=f(v.layout), pred=_map_layouts(v.pred, f),
                       biases=tuple(_map_layouts(b, f) for b in v.biases))
    if isinstance(v, _Ind):
        return replace(v, layout=f(v.layout), pred=_map_layouts(v.pred, f))
    if isinstance(v, _Abs):
        return replace(v, layout=f(v.layout), inner=_map_layouts(v.inner, f))
    raise TypeError(type(v))


# ---------------------------------------------------------------------------------------------
# Op tables (the three spellings of each op after canonicalize)

def _fn(*names):
    out = set()
    for nm in names:
        for mod in (torch, operator):
            f = getattr(mod, nm, None)
            if f is not None and callable(f):
                out.add(f)
    return out


_CMP = {
    "lt": _fn("lt") | {aten.lt.Tensor, aten.lt.Scalar}, "le": _fn("le") | {aten.le.Tensor, aten.le.Scalar},
    "gt": _fn("gt") | {aten.gt.Tensor, aten.gt.Scalar}, "ge": _fn("ge") | {aten.ge.Tensor, aten.ge.Scalar},
    "eq": _fn("eq") | {aten.eq.Tensor, aten.eq.Scalar}, "ne": _fn("ne") | {aten.ne.Tensor, aten.ne.Scalar},
}
_CMP_METHODS = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "__lt__": "lt",
                "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne",
                "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge"}
_SWAP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_FUNCS = {
    "and": {operator.and_, torch.logical_and, torch.bitwise_and, aten.logical_and.default,
            aten.bitwise_and.Tensor, aten.__and__.Tensor, aten.bitwise_and.Scalar},
    "or": {operator.or_, torch.logical_or, torch.bitwise_or, aten.logical_or.default, aten.bitwise_or.Tensor,
           aten.__or__.Tensor},
    "not": {operator.invert, torch.logical_not, torch.bitwise_not, aten.logical_not.default,
            aten.bitwise_not.default},
    "add": {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar},
    "sub": {operator.sub, torch.sub, torch.subtract, aten.sub.Tensor, aten.sub.Scalar},
    "rsub": {torch.rsub, aten.rsub.Scalar, aten.rsub.Tensor},
    "mul": {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar},
    "neg": {operator.neg, torch.neg, aten.neg.default},
    "abs": {abs, operator.abs, torch.abs, aten.abs.default},
    "where": {torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar},
    "masked_fill": {torch.masked_fill, aten.masked_fill.Scalar, aten.masked_fill.Tensor},
    "unsqueeze": {torch.unsqueeze, aten.unsqueeze.default},
    "squeeze": {torch.squeeze, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims},
    "expand": {aten.expand.default, torch.broadcast_to, aten.broadcast_to.default},
    "reshape": {torch.reshape, aten.view.default, aten._unsafe_view.default, aten.reshape.default},
    "permute": {torch.permute, aten.permute.default},
    "transpose": {torch.transpose, aten.transpose.int, torch.swapaxes},
    "identity": {torch.clone, aten.clone.default, aten.contiguous.default, aten.alias.default,
                 aten.detach.default, aten.detach_.default, torch.detach, aten.lift_fresh_copy.default},
    "index": {aten.index.Tensor, aten.index},
    "slice": {aten.slice.Tensor},
    "select": {aten.select.int, torch.select},
    "arange": {torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step},
    "full": {torch.ones, torch.full, aten.ones.default, aten.full.default, torch.zeros, aten.zeros.default},
    "new_full": {aten.new_ones.default, aten.new_full.default, aten.new_zeros.default},
    "like": {torch.ones_like, torch.zeros_like, torch.full_like, aten.ones_like.default, aten.zeros_like.default,
             aten.full_like.default},
    "cast": {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other},
}
_METHODS = {
    "__and__": "and", "logical_and": "and", "bitwise_and": "and", "__or__": "or", "logical_or": "or",
    "bitwise_or": "or", "__invert__": "not", "logical_not": "not", "bitwise_not": "not",
    "add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub", "__rsub__": "rsub",
    "mul": "mul", "__mul__": "mul", "__rmul__": "mul", "neg": "neg", "__neg__": "neg", "abs": "abs", "__abs__": "abs",
    "masked_fill": "masked_fill", "unsqueeze": "unsqueeze", "squeeze": "squeeze", "expand": "expand",
    "view": "reshape", "reshape": "reshape", "permute": "permute", "transpose": "transpose",
    "contiguous": "identity", "clone": "identity", "detach": "identity", "to": "cast", "type": "cast",
    "float": "cast", "double": "cast", "half": "cast", "bfloat16": "cast", "long": "cast", "int": "cast",
    "bool": "cast", "type_as": "cast", "new_ones": "new_full", "new_zeros": "new_full", "new_full": "new_full",
    "expand_as": "expand_as", "__getitem__": "getitem",
}
_CAST_METHOD_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                       "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "bool": torch.bool}


def _kind(n: fx.Node) -> Optional[str]:
    if n.op == "call_method":
        if n.target in _CMP_METHODS:
            return "cmp:" + _CMP_METHODS[n.target]
        return _METHODS.get(n.target)
    if n.op != "call_function":
        return None
    t = n.target
    if t is operator.getitem:
        return "getitem"
    for k, fs in _CMP.items():
        if t in fs:
            return "cmp:" + k
    for k, fs in _FUNCS.items():
        if t in fs:
            return k
    return None


# ---------------------------------------------------------------------------------------------
# The evaluator


_SCALAR_ARITH = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg}


def _size_node(n: fx.Node, depth: int = 0) -> bool:
    """Whether ``n`` is an int computed from tensor sizes (``x.size(2)``, ``x.shape[-1] - 1``), as fx
    traces them without metadata."""
    if not isinstance(n, fx.Node) or depth > 8 or isinstance(n.meta.get("val"), torch.Tensor) \
            or "tensor_meta" in n.meta:
        return False
    if n.op == "call_method" and n.target == "size" and len(n.args) == 2 and isinstance(n.args[1], int):
        return True
    if n.op == "call_function" and n.target is aten.sym_size.int:
        return True
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], int):
        src = n.args[0]
        return isinstance(src, fx.Node) and (
            (src.op == "call_function" and src.target is getattr and src.args[1] == "shape")
            or (src.op == "call_method" and src.target == "size" and len(src.args) == 1))
    if n.op == "call_function" and n.target in _SCALAR_ARITH:
        nodes = [a for a in n.args if isinstance(a, fx.Node)]
        return bool(nodes) and all(_size_node(a, depth + 1) for a in nodes) and \
            all(isinstance(a, (fx.Node, int)) and not isinstance(a, bool) for a in n.args)
    return False


def _shape(n: Any) -> Optional[Tuple]:
    """Shape from any capture's metadata (``val``, ``tensor_meta``, dynamo's ``example_value``)."""
    if not isinstance(n, fx.Node):
        return None
    shp = meta_shape(n)
    if shp is None:
        v = n.meta.get("example_value")
        shp = tuple(v.shape) if isinstance(v, torch.Tensor) else None
    return shp


def _vmap_op(n: fx.Node) -> Optional[str]:
    """``_add_batch_dim`` / ``_remove_batch_dim`` (torch.vmap in dynamo graphs), else None."""
    if n.op != "call_function":
        return None
    name = getattr(n.target, "__name__", "")
    mod = getattr(n.target, "__module__", "") or ""
    if name in ("_add_batch_dim", "_remove_batch_dim") and "functorch" in mod:
        return name
    return None


def _same_len(a: Any, b: Any) -> bool:
    """Whether an ``arange`` length argument and a tensor size are provably equal."""
    sa = static_int(a) if not isinstance(a, fx.Node) else static_int(a.meta.get("val", a.meta.get("example_value")))
    sb = static_int(b)
    if sa is not None and sb is not None:
        return sa == sb
    va = a.meta.get("val", a.meta.get("example_value")) if isinstance(a, fx.Node) else a
    return va is not None and str(va) == str(b)


def _is_big_negative(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v <= MASK_FILL_MAX


class _Eval:
    """Abstract values of the nodes that compute masks (memoised per graph)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.labels = _Labels()
        self.memo: Dict[fx.Node, Any] = {}
        self._batched: Dict[fx.Node, bool] = {}
        levels = [n.args[2] for n in gm.graph.nodes if _vmap_op(n) == "_add_batch_dim"]
        #: nesting depth of torch.vmap regions (Hugging Face vmaps over b, h, i, j: 4)
        self.vmap_depth = max((l for l in levels if isinstance(l, int)), default=0)

    # -- torch.vmap regions: a batched value carries its vmapped dims as leading dims, level l at
    # position l - 1 of ``vmap_depth`` (the order ``_remove_batch_dim`` chains put them back in); only
    # elementwise ops, comparisons and gathers are modelled inside, each on 0-d logical values
    def batched(self, n: Any) -> bool:
        """Whether ``n`` is a batched value inside a torch.vmap region (unusable outside it)."""
        if not isinstance(n, fx.Node):
            return False
        if n in self._batched:
            return self._batched[n]
        kind = _vmap_op(n)
        if kind == "_add_batch_dim":
            out = True
        elif kind == "_remove_batch_dim":
            out = n.args[1] != 1
        else:
            out = any(self.batched(a) for a in n.all_input_nodes)
        self._batched[n] = out
        return out

    def add_batch_dim(self, n):
        x, in_dim, level = n.args[:3]
        v = self(x)
        lv = n.meta.get("example_value", n.meta.get("val"))
        if self.batched(x) or in_dim != 0 or len(v.layout) != 1 or not isinstance(level, int) \
                or not isinstance(lv, torch.Tensor) or lv.dim() != 0:
            raise _Fail(f"{n.name}: a torch.vmap over other than a 1-D vector")
        K = self.vmap_depth
        return self.relayout(v, (None,) * (level - 1) + (v.layout[0],) + (None,) * (K - level))

    def remove_batch_dim(self, n):
        y, level, size, out_dim = n.args[:4]
        prev = y if isinstance(y, fx.Node) and _vmap_op(y) == "_remove_batch_dim" else None
        want = self.vmap_depth if prev is None else prev.args[1] - 1
        if out_dim != 0 or level != want:
            raise _Fail(f"{n.name}: a torch.vmap nesting the pass does not model")
        v = self(y)
        K = self.vmap_depth
        if len(v.layout) > K:
            raise _Fail(f"{n.name}: a torch.vmap body with non-scalar values")
        lay = (None,) * (K - len(v.layout)) + tuple(v.layout)
        if lay[level - 1] is None and size != 1:
            lay = lay[:level - 1] + (self.labels.new(),) + lay[level:]
        return self._with_layout(v, lay)

    # -- helpers ---------------------------------------------------------------------------------
    def relayout(self, v, layout: Layout):
        """``v`` moved to ``layout`` (a permutation/insertion/removal of its dims, as a view op does).

        The moved value gets fresh labels: one tensor used in two orientations (``seg[:, :, None]`` and
        ``seg[:, None, :]``) indexes two different axes, so its dims must not stay unified across uses.
        """
        find = self.labels.find
        fresh = {find(l): self.labels.new() for l in v.layout if l is not None}

        def f(lay):
            return tuple(None if l is None else fresh.get(find(l), l) for l in lay)
        moved = _map_layouts(v, f)
        new = tuple(None if l is None else fresh.get(find(l), l) for l in layout)
        return self._with_layout(moved, new)

    @staticmethod
    def _with_layout(v, layout: Layout):
        if isinstance(v, (_FMask, _Ind)):
            return replace(v, layout=layout, pred=_Eval._with_layout(v.pred, layout))
        if isinstance(v, _Pred) and v.inv is not None:
            return replace(v, layout=layout, inv=replace(v.inv, layout=layout))
        if isinstance(v, _Abs):
            return replace(v, layout=layout, inner=replace(v.inner, layout=layout))
        return replace(v, layout=layout)

    def fresh_layout(self, shape) -> Layout:
        return tuple(None if static_int(s) == 1 else self.labels.new() for s in shape)

    def broadcast(self, *layouts: Layout) -> Layout:
        r = max((len(l) for l in layouts), default=0)
        out: List[Optional[int]] = [None] * r
        for l in layouts:
            off = r - len(l)
            for d, lab in enumerate(l):
                if lab is None:
                    continue
                cur = out[off + d]
                out[off + d] = lab if cur is None else self.labels.union(cur, lab)
        return tuple(out)

    def opaque(self, n: fx.Node, layout: Optional[Layout] = None):
        """``n`` as a value the pass does not look into: a leaf over its own dims."""
        if self.batched(n):
            raise _Fail(f"{n.name} ({describe(n)}) inside torch.vmap is not an index expression the pass models")
        if layout is None:
            shape = _shape(n)
            if shape is None:
                raise _Fail(f"{n.name} ({describe(n)}) has no shape metadata")
            layout = self.fresh_layout(shape)
        dt = self.dtype(n)
        if dt is None:
            raise _Fail(f"{n.name} ({describe(n)}) has no dtype metadata")
        if dt == torch.bool:
            return _Pred(layout, (_Atom("leaf", _Src(n, layout)),))
        return _Num(layout, ((1, _Leaf(n, layout)),))

    def dtype(self, n: fx.Node) -> Optional[torch.dtype]:
        dt = dtype_of(n)
        if dt is None:
            v = n.meta.get("example_value")
            dt = v.dtype if isinstance(v, torch.Tensor) else None
        return dt

    def scalar(self, x):
        """A Python number, or a graph scalar (SymInt) node, as a value; None if ``x`` is a tensor."""
        if isinstance(x, bool):
            return _Pred((), false=not x)
        if isinstance(x, (int, float)):
            return _Num((), const=x)
        if isinstance(x, fx.Node):
            v = x.meta.get("val", x.meta.get("example_value"))
            if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
                c = static_int(v)
                return _Num((), const=c) if c is not None else _Num((), syms=((1, x),))
            if isinstance(v, (float, torch.SymFloat)):
                return _Num((), syms=((1, x),))
            if not isinstance(v, torch.Tensor):
                sv = scalar_value(self.gm, x)
                if sv is not UNKNOWN:
                    return _Pred((), false=not sv) if self.dtype(x) == torch.bool else _Num((), const=sv)
                if _size_node(x):
                    return _Num((), syms=((1, x),))
        return None

    # -- evaluation ------------------------------------------------------------------------------
    def __call__(self, x):
        s = self.scalar(x)
        if s is not None:
            return s
        if not isinstance(x, fx.Node):
            raise _Fail(f"unsupported mask operand {x!r}")
        if x in self.memo:
            return self.memo[x]
        v = self._eval(x)
        self.memo[x] = v
        return v

    def _eval(self, n: fx.Node):
        vk = _vmap_op(n)
        if vk == "_add_batch_dim":
            return self.add_batch_dim(n)
        if vk == "_remove_batch_dim":
            return self.remove_batch_dim(n)
        k = _kind(n)
        a = list(n.args)
        if k is None:
            sv = scalar_value(self.gm, n)  # 0-dim constants such as torch.tensor(0.0)
            if sv is not UNKNOWN and (_shape(n) in (None, ())):
                return _Num((), const=sv)
            return self.opaque(n)
        if k.startswith("cmp:"):
            return self.compare(n, k[4:], self(a[0]), self(a[1]))
        if k == "and":
            return self.conj(n, self(a[0]), self(a[1]))
        if k == "or":
            x, y = self(a[0]), self(a[1])
            for p, q in ((x, y), (y, x)):
                if isinstance(p, _Pred) and p.false and not p.layout:
                    return q
            return self.opaque(n)
        if k == "not":
            x = self(a[0])
            if isinstance(x, _Pred):
                return self.negate(n, x)
            return self.opaque(n)
        if k in ("add", "sub", "rsub", "mul", "neg"):
            return self.arith(n, k, a)
        if k == "abs":
            x = self(a[0])
            return _Abs(x.layout, x) if isinstance(x, _Num) and self.integral(x) else self.opaque(n)
        if k == "where":
            return self.where(n, self(a[0]), self(a[1]), self(a[2]))
        if k == "masked_fill":
            return self.where(n, self(a[1]), self(a[2]), self(a[0]))
        if k == "cast":
            return self.cast(n, a)
        if k == "identity":
            return self(a[0])
        if k == "arange":
            return self.arange(n, a)
        if k in ("full", "new_full", "like"):
            return self.full(n, k, a)
        return self.shape_op(n, k, a)

    # boolean structure
    def conj(self, n, x, y):
        if isinstance(x, _Ind) and isinstance(y, _Ind):
            return _Ind(self.broadcast(x.layout, y.layout), self.conj(n, x.pred, y.pred))
        if not (isinstance(x, _Pred) and isinstance(y, _Pred)):
            return self.opaque(n)
        lay = self.broadcast(x.layout, y.layout)
        return _Pred(lay, x.atoms + y.atoms, x.false or y.false)

    def negate(self, n, x: _Pred):
        if x.inv is not None:
            return x.inv
        if not x.atoms:
            return _Pred(x.layout, (), not x.false)
        if len(x.atoms) == 1 and not x.false:
            na = x.atoms[0].negated()
            if na is not None:
                return _Pred(x.layout, (na,))
        out = self.opaque(n, x.layout) if self.dtype(n) == torch.bool else self.opaque(n)
        return replace(out, inv=x) if isinstance(out, _Pred) and out.layout == x.layout else out

    def compare(self, n, op, x, y):
        # boolean / indicator / additive-mask operands compared with 0 or 1
        for p, c, o in ((x, y, op), (y, x, _SWAP[op])):
            if isinstance(c, _Num) and c.is_const() and not c.layout and op in ("eq", "ne"):
                val = c.const
                if isinstance(p, (_Pred, _Ind)):
                    pred = p if isinstance(p, _Pred) else p.pred
                    truth = val in (1, True) if op == "eq" else val in (0, False)
                    if val not in (0, 1):
                        return _Pred(p.layout, (), false=op == "eq")
                    return pred if truth else self.negate(n, pred)
                if isinstance(p, _FMask) and val == 0 and not p.biases:
                    return p.pred if op == "eq" else self.negate(n, p.pred)
        for p, c, o in ((x, y, op), (y, x, _SWAP[op])):
            # abs(e) <= c  <=>  -c <= e <= c (abs(e) >= c is a disjunction: not a conjunct)
            if isinstance(p, _Abs) and isinstance(c, _Num) and c.is_const() and not c.layout \
                    and isinstance(c.const, int) and o in ("le", "lt"):
                bound = c.const if o == "le" else c.const - 1
                lay = self.broadcast(p.layout, c.layout)
                if bound < 0:
                    return _Pred(lay, (), false=True)
                e = p.inner
                lin = replace(e, const=0, layout=lay)
                return _Pred(lay, (_Atom("cmp", _Src(n, lay), lin, -bound - e.const, bound - e.const),))
        if not (isinstance(x, _Num) and isinstance(y, _Num)):
            return self.opaque(n)
        d = self.lin_sub(x, y)
        lay = self.broadcast(x.layout, y.layout)
        if d.is_const():
            c = d.const
            truth = {"lt": c < 0, "le": c <= 0, "gt": c > 0, "ge": c >= 0, "eq": c == 0, "ne": c != 0}[op]
            return _Pred(lay, (), not truth)
        if op == "ne":
            return self.opaque(n)
        if not self.integral(d):
            return self.opaque(n)
        c = d.const
        lin = replace(d, const=0, layout=lay)
        lo, hi = {"lt": (None, -c - 1), "le": (None, -c), "gt": (-c + 1, None), "ge": (-c, None),
                  "eq": (-c, -c)}[op]
        return _Pred(lay, (_Atom("cmp", _Src(n, lay), lin, lo, hi),))

    def integral(self, d: _Num) -> bool:
        if not isinstance(d.const, int) or isinstance(d.const, bool):
            return False
        for coef, leaf in d.terms:
            if not isinstance(coef, int) or self.dtype(leaf.node) not in _INT_DTYPES:
                return False
        for coef, s in d.syms:
            v = s.meta.get("val", s.meta.get("example_value"))
            if not isinstance(coef, int) or not (isinstance(v, (int, torch.SymInt)) or _size_node(s)):
                return False
        return True

    # numbers
    def lin_scale(self, x: _Num, c) -> _Num:
        return _Num(x.layout, tuple((coef * c, l) for coef, l in x.terms), x.const * c,
                    tuple((coef * c, s) for coef, s in x.syms))

    def lin_add(self, x: _Num, y: _Num) -> _Num:
        return _Num(self.broadcast(x.layout, y.layout), x.terms + y.terms, x.const + y.const, x.syms + y.syms)

    def lin_sub(self, x: _Num, y: _Num) -> _Num:
        return self.lin_add(x, self.lin_scale(y, -1))

    def arith(self, n, k, a):
        if k == "neg":
            x = self(a[0])
            return self.lin_scale(x, -1) if isinstance(x, _Num) else self.opaque(n)
        if any(kw not in ("alpha",) for kw in n.kwargs) or (n.kwargs.get("alpha", 1) != 1) or len(a) > 2:
            return self.opaque(n)
        x, y = self(a[0]), self(a[1])
        if k == "rsub":
            x, y, k = y, x, "sub"
        if k == "mul":
            return self.mul(n, x, y)
        if isinstance(x, _Num) and isinstance(y, _Num):
            return self.lin_add(x, y) if k == "add" else self.lin_sub(x, y)
        if k == "add":
            for p, q in ((x, y), (y, x)):
                if isinstance(p, _FMask):
                    if isinstance(q, _FMask):
                        pred = self.conj(n, p.pred, q.pred)
                        return _FMask(pred.layout, pred, p.biases + q.biases)
                    if isinstance(q, _Num) and q.is_const() and q.const == 0:
                        return p
                    if isinstance(q, _Num) and not q.syms and q.const == 0 and len(q.terms) == 1 \
                            and q.terms[0][0] == 1:
                        lay = self.broadcast(p.layout, q.layout)
                        return _FMask(lay, replace(p.pred, layout=lay), p.biases + (q.terms[0][1],))
        if k == "sub" and isinstance(x, _Num) and x.is_const() and x.const == 1 and isinstance(y, _Ind):
            neg = self.negate(n, y.pred)
            if isinstance(neg, _Pred):
                return _Ind(y.layout, neg)
        return self.opaque(n)

    def mul(self, n, x, y):
        if isinstance(x, _Num) and isinstance(y, _Num):
            if y.is_const() and not y.layout:
                return self.lin_scale(x, y.const)
            if x.is_const() and not x.layout:
                return self.lin_scale(y, x.const)
            return self.opaque(n)
        if isinstance(x, _Pred) and isinstance(y, _Pred):
            return self.conj(n, x, y)
        for p, c in ((x, y), (y, x)):
            if isinstance(p, _Ind) and isinstance(c, _Num) and c.is_const() and not c.layout:
                if c.const == 1:
                    return p
                if _is_big_negative(c.const):
                    neg = self.negate(n, p.pred)
                    if not isinstance(neg, _Pred):  # allowed iff this product reads 0
                        lay = self.broadcast(p.layout, c.layout)
                        neg = _Pred(lay, (_Atom("leaf", _Src(n, lay, "zero")),))
                    return _FMask(neg.layout, neg)
            if isinstance(p, _Ind) and isinstance(c, _Ind):
                return _Ind(self.broadcast(p.layout, c.layout), self.conj(n, p.pred, c.pred))
        return self.opaque(n)

    def where(self, n, c, x, y):
        if not isinstance(c, _Pred):
            return self.opaque(n)
        lay = self.broadcast(c.layout, x.layout, y.layout)

        def const(v):  # a constant, possibly a broadcast tensor of one value (its dims are in ``lay``)
            if isinstance(v, _Num) and v.is_const():
                return v.const
            if isinstance(v, _Pred) and not v.atoms:
                return not v.false
            return None
        cx, cy = const(x), const(y)
        dt = self.dtype(n) if isinstance(n, fx.Node) else None
        if cx is not None and cy is not None:
            # where(c, 1, 0): c itself, as a bool or as a 0/1 number
            as_bool = dt == torch.bool or (dt is None and isinstance(cx, bool))
            if cx == 1 and cy == 0:
                p = _Pred(lay, c.atoms, c.false)
                return p if as_bool else _Ind(lay, p)
            if cx == 0 and cy == 1:
                neg = self.negate(n, c)
                if not isinstance(neg, _Pred) or (not as_bool and neg.inv is not None):
                    return self.opaque(n)
                return replace(neg, layout=lay) if as_bool else _Ind(lay, replace(neg, layout=lay))
            if cx == 0 and _is_big_negative(cy):
                return _FMask(lay, replace(c, layout=lay))
            if cy == 0 and _is_big_negative(cx):
                neg = self.negate(n, c)
                if not isinstance(neg, _Pred):  # allowed iff this where() reads 0
                    neg = _Pred(lay, (_Atom("leaf", _Src(n, lay, "zero")),))
                return _FMask(lay, replace(neg, layout=lay))
            return self.opaque(n)
        if cy is False and isinstance(x, _Pred):
            return _Pred(lay, c.atoms + x.atoms, c.false or x.false)
        if isinstance(x, _FMask) and cy is not None and _is_big_negative(cy):
            return _FMask(lay, _Pred(lay, c.atoms + x.pred.atoms, c.false or x.pred.false), x.biases)
        # where(c, bias, -big): the bias where c holds, excluded elsewhere (T5's position_bias masking)
        for cond, val, fill in ((c, x, cy), (None, y, cx)):
            if isinstance(val, _Num) and fill is not None and _is_big_negative(fill) and len(val.terms) == 1 \
                    and val.terms[0][0] == 1 and val.const == 0 and not val.syms:
                if cond is None:
                    cond = self.negate(n, c)
                    if not isinstance(cond, _Pred) or cond.inv is not None:
                        break
                return _FMask(lay, replace(cond, layout=lay), (val.terms[0][1],))
        return self.opaque(n)

    def cast(self, n, a):
        x = self(a[0])
        dt = self.dtype(n)   # what the capture recorded wins over reading the arguments
        if dt is None and n.op == "call_method" and n.target in _CAST_METHOD_DTYPES:
            dt = _CAST_METHOD_DTYPES[n.target]
        elif dt is None:
            if any(isinstance(v, fx.Node) for v in list(a[1:]) + list(n.kwargs.values())):
                return self.opaque(n)   # .to(other) / .to(x.dtype) without metadata: dtype unknown
            for v in list(a[1:]) + [n.kwargs.get("dtype")]:
                if isinstance(v, torch.dtype):
                    dt = v
        if dt is None:
            return x      # a device move
        if isinstance(x, _Pred):
            return x if dt == torch.bool else _Ind(x.layout, x)
        if isinstance(x, _Ind):
            return x.pred if dt == torch.bool else x
        if isinstance(x, _FMask):
            return x if dt.is_floating_point else self.opaque(n)
        if isinstance(x, _Num):
            if dt == torch.bool:
                return self.opaque(n)
            if dt.is_floating_point or dt in _INT_DTYPES:
                return x if x.is_const() or not dt.is_floating_point else self.opaque(n)
        return self.opaque(n)

    def arange(self, n, a):
        shape = _shape(n)
        if shape is not None:
            lay = self.fresh_layout(shape)
        else:
            ends = [x for x in a if isinstance(x, int)]
            lay = (None,) if len(a) == 1 and ends == [1] else (self.labels.new(),)
        return _Num(lay, ((1, _Leaf(n, lay)),))

    def full(self, n, k, a):
        if k == "like":
            base = self(a[0])
            lay = base.layout
            fill = {torch.ones_like: 1, aten.ones_like.default: 1, torch.zeros_like: 0,
                    aten.zeros_like.default: 0}.get(n.target, a[1] if len(a) > 1 else n.kwargs.get("fill_value"))
        else:
            if k == "new_full":
                shape = a[1] if len(a) > 1 else n.kwargs.get("size")
                name = n.target if n.op == "call_method" else n.target.__name__
                fill = 1 if "ones" in str(name) else 0 if "zeros" in str(name) else (a[2] if len(a) > 2 else
                                                                                      n.kwargs.get("fill_value"))
            else:
                # torch.ones(T, T) takes its sizes as separate arguments, torch.full((T, T), v) as one
                shape = list(a) if n.target in (torch.ones, torch.zeros) and a and not isinstance(
                    a[0], (list, tuple, torch.Size)) else a[0]
                fill = 1 if n.target in (torch.ones, aten.ones.default) else 0 if n.target in (
                    torch.zeros, aten.zeros.default) else (a[1] if len(a) > 1 else n.kwargs.get("fill_value"))
            if isinstance(shape, int):
                shape = [shape]
            if not isinstance(shape, (list, tuple)):
                return self.opaque(n)
            lay = self.fresh_layout([s if isinstance(s, int) else 2 for s in shape])
        fv = scalar_value(self.gm, fill) if not isinstance(fill, bool) else fill
        if fv is UNKNOWN:
            return self.opaque(n)
        dt = self.dtype(n) or n.kwargs.get("dtype")
        if dt == torch.bool or isinstance(fv, bool):
            return _Pred(lay, (), false=not bool(fv))
        return _Num(lay, const=fv)

    # shapes
    def shape_op(self, n, k, a):
        if self.batched(n) and k != "index":
            raise _Fail(f"{n.name} ({describe(n)}): a view inside torch.vmap")
        if k == "getitem":
            return self.getitem(n, self(a[0]), a[1])
        x = self(a[0])
        r = len(x.layout)
        if k == "unsqueeze":
            d = a[1] if len(a) > 1 else n.kwargs.get("dim")
            d = d % (r + 1)
            return self.relayout(x, x.layout[:d] + (None,) + x.layout[d:])
        if k == "squeeze":
            dims = a[1:] if len(a) > 1 else None
            if dims and isinstance(dims[0], (list, tuple)):
                dims = dims[0]
            dims = set(range(r)) if not dims else {d % r for d in dims}
            return self.relayout(x, tuple(l for d, l in enumerate(x.layout) if not (d in dims and l is None)))
        if k == "expand_as":
            other = self(a[1])
            if len(other.layout) < r:
                return self.opaque(n)
            off = len(other.layout) - r
            lay = list(other.layout[:off]) + [c if c is not None else o for c, o in zip(x.layout, other.layout[off:])]
            return self.relayout(x, self.broadcast(tuple(lay), other.layout))
        if k == "expand":
            sizes = list(a[1:])
            if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
                sizes = list(sizes[0])
            off = len(sizes) - r
            if off < 0:
                return self.opaque(n)
            lay = []
            for d, s in enumerate(sizes):
                cur = x.layout[d - off] if d >= off else None
                if cur is not None:
                    lay.append(cur)
                elif isinstance(s, int) and s in (1, -1):
                    lay.append(None)
                else:
                    lay.append(self.labels.new())
            return self.relayout(x, tuple(lay))
        if k == "reshape":
            return self.reshape(n, x)
        if k in ("permute", "transpose"):
            if k == "transpose":
                d0, d1 = a[1] % r, a[2] % r
                perm = list(range(r))
                perm[d0], perm[d1] = perm[d1], perm[d0]
            else:
                perm = list(a[1:])
                if len(perm) == 1 and isinstance(perm[0], (list, tuple)):
                    perm = list(perm[0])
                perm = [p % r for p in perm]
            return self.relayout(x, tuple(x.layout[p] for p in perm))
        if k == "slice":
            d = (a[1] if len(a) > 1 else 0) % r
            start = a[2] if len(a) > 2 else None
            end = a[3] if len(a) > 3 else None
            step = a[4] if len(a) > 4 else 1
            if self.full_slice(x, n, d, start, end, step):
                return x
            return self.opaque(n)
        if k == "select":
            d = a[1] % r
            if x.layout[d] is None:
                return self.relayout(x, x.layout[:d] + x.layout[d + 1:])
            return self.opaque(n)
        if k == "index":
            return self.adv_index(n, x, list(a[1]))
        return self.opaque(n)

    def full_slice(self, x, n, d, start, end, step) -> bool:
        if start not in (None, 0) or step not in (None, 1):
            return False
        if end is None or (isinstance(end, int) and end >= 2 ** 62):
            return True
        if x.layout[d] is None:
            return True
        src, out = _shape(n.args[0]), _shape(n)
        if src is not None and out is not None:
            from .node_info import same_dim
            return same_dim(src[d], out[d])
        return False

    def reshape(self, n, x):
        if any(isinstance(a, torch.dtype) for a in list(n.args[1:]) + list(n.kwargs.values())):
            return self.opaque(n)   # a bit-reinterpreting view
        src, out = _shape(n.args[0]), _shape(n)
        if src is None or out is None or len(src) != len(x.layout):
            return self.opaque(n)
        from .node_info import same_dim
        big_in = [(s, l) for s, l in zip(src, x.layout) if static_int(s) != 1]
        big_out = [s for s in out if static_int(s) != 1]
        if len(big_in) != len(big_out) or not all(same_dim(s, t) for (s, _), t in zip(big_in, big_out)):
            return self.opaque(n)
        labs = iter(l for _, l in big_in)
        return self.relayout(x, tuple(None if static_int(s) == 1 else next(labs) for s in out))

    def getitem(self, n, x, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        if any(isinstance(i, fx.Node) for i in idx):
            tens = [i for i in idx if isinstance(i, fx.Node)]
            if all(isinstance(i, fx.Node) or (isinstance(i, slice) and i == slice(None)) for i in idx) and \
                    idx[:len(tens)] == tuple(tens):
                return self.adv_index(n, x, list(tens))
            return self.opaque(n)
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        out: List[Optional[int]] = []
        d = 0
        r = len(x.layout)
        for i in idx:
            if i is Ellipsis:
                k = r - n_real
                out.extend(x.layout[d:d + k])
                d += k
            elif i is None:
                out.append(None)
            elif isinstance(i, slice):
                if d >= r:
                    return self.opaque(n)
                if i == slice(None) or x.layout[d] is None and i.start in (None, 0) and i.step in (None, 1):
                    out.append(x.layout[d])
                elif i.start in (None, 0) and i.step in (None, 1) and (
                        i.stop is None or (isinstance(i.stop, int) and i.stop >= 2 ** 62)):
                    out.append(x.layout[d])
                else:
                    return self.opaque(n)
                d += 1
            elif isinstance(i, int):
                if d >= r or x.layout[d] is not None:
                    return self.opaque(n)
                d += 1
            else:
                return self.opaque(n)
        out.extend(x.layout[d:])
        return self.relayout(x, tuple(out))

    def adv_index(self, n, x, idx: List[Any]):
        lays, vals = [], []
        for i in idx:
            if i is None:
                return self.opaque(n)
            v = self(i)
            if not isinstance(v, _Num) or self.dtype(i) == torch.bool:
                return self.opaque(n)
            lays.append(v.layout)
            vals.append(v)
        lay = self.broadcast(*lays) + tuple(x.layout[len(idx):])
        gathered = self.identity_gather(n, x, vals, lay)
        return gathered if gathered is not None else self.opaque(n, lay)

    def identity_gather(self, n, x, vals: List[_Num], lay: Layout):
        """``x[arange(n0)[..], arange(n1)[..]]`` with ``n_d == x.shape[d]`` is ``x`` itself with its dims
        moved to the indices' dims (``padding_mask[batch_idx, kv_idx]``), so it stays a vector of
        the graph outside torch.vmap too."""
        src = n.args[0]
        shp = _shape(src)
        if shp is None or self.batched(src) or len(vals) != len(x.layout) or len(shp) != len(vals):
            return None
        for v, dim in zip(vals, shp):
            if len(v.terms) != 1 or v.syms or v.const != 0 or v.terms[0][0] != 1:
                return None
            leaf = v.terms[0][1]
            ln = _is_plain_arange(leaf)
            if ln is None or len(leaf.layout) != 1 or not _same_len(ln, dim):
                return None
        fresh = self.relayout(x, x.layout)
        for d, v in enumerate(vals):
            xl, il = fresh.layout[d], v.terms[0][1].layout[0]
            if xl is None or il is None:
                if (xl is None) != (il is None):
                    return None
                continue
            self.labels.union(xl, il)
        return self._with_layout(fresh, lay)


# ---------------------------------------------------------------------------------------------
# Classification: which conjuncts are predicates


@dataclass
class MaskAnalysis:
    """What a mask is, in predicates: the terms each predicate vector is built from, the conjuncts
    left for the dense residual and why, and ``axis`` (a dim label -> ``"b"|"h"|"i"|"j"|"x"``)."""
    positions: Optional[Tuple] = None      # (k_terms, q_terms, q_syms, left, right): q_pos - left <= k_pos <= q_pos + right
    segments: Optional[Tuple] = None       # (k_terms, q_terms, q_syms, q_const): q_seg == k_seg
    k_valid: List[_Src] = field(default_factory=list)
    q_valid: List[_Src] = field(default_factory=list)
    residual: List[_Src] = field(default_factory=list)
    biases: List[_Leaf] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)
    axis: Any = None
    float_mask: bool = False

    def words(self, default_positions: Optional[str]) -> List[str]:
        out = []
        if self.positions is not None:
            left, right = self.positions[3], self.positions[4]
            if right == 0 and left is None:
                out.append(default_positions or "causal (positions)")
            else:
                f = (lambda w: "inf" if w is None else str(w))
                out.append(f"window({f(left)}, {f(right)})" + ("" if default_positions in ("causal", None)
                                                              else " bottom-right"))
        if self.segments is not None:
            out.append("documents")
        if self.k_valid or self.q_valid:
            out.append("padding" + ("" if self.k_valid and not self.q_valid else
                                    " (queries)" if not self.k_valid else " (keys and queries)"))
        return out


_AXES = ("b", "h", "i", "j")


def _classify(ev: _Eval, v) -> MaskAnalysis:
    if isinstance(v, (_Num, _Ind)):
        raise _Fail("the mask adds values that are not 0 / large negative (a bias)")
    if not isinstance(v, (_Pred, _FMask)):
        raise _Fail("the mask is neither boolean nor an additive 0 / large negative float")
    res = MaskAnalysis()
    if isinstance(v, _FMask):
        pred, res.biases, res.float_mask = v.pred, list(v.biases), True
    else:
        pred = v
    if pred.false:
        raise _Fail("the mask excludes every entry")
    if len(v.layout) > 4:
        raise _Fail(f"the mask has {len(v.layout)} dims")
    lay = (None,) * (4 - len(v.layout)) + tuple(v.layout)
    finals = {ev.labels.find(l): ax for l, ax in zip(lay, _AXES) if l is not None}

    def axis(label):
        return finals.get(ev.labels.find(label), "x")

    res.axis = axis

    def axes_of(layout):
        return {axis(l) for l in layout if l is not None}

    for b in res.biases:
        if "x" in axes_of(b.layout):
            raise _Fail(f"{b.node.name} ({describe(b.node)}) does not broadcast to the logits")
    groups: Dict[Any, Dict[str, Any]] = {}
    for at in pred.atoms:
        if at.kind == "cmp" and _always_true(at):
            continue
        if at.kind == "leaf":
            ax = axes_of(at.src.layout)
            if ax and ax <= {"b", "j"} and "j" in ax:
                res.k_valid.append(at.src)
            elif ax and ax <= {"b", "i"} and "i" in ax:
                res.q_valid.append(at.src)
            else:
                _residual(res, at.src, ax)
            continue
        kt, qt, bad = [], [], []
        for coef, leaf in at.lin.terms:
            ax = axes_of(leaf.layout)
            if ax <= {"b", "j"} and "j" in ax:
                kt.append((coef, leaf))
            elif ax <= {"b", "i"}:
                qt.append((coef, leaf))
            else:
                bad.append(leaf)
        has_i = any("i" in axes_of(l.layout) for _, l in qt)
        if bad:
            _residual(res, at.src, axes_of(at.src.layout), f"{bad[0].node.name} ({describe(bad[0].node)})")
            continue
        if not kt or not has_i:
            ax = axes_of(at.src.layout)
            if kt and ax <= {"b", "j"}:
                res.k_valid.append(at.src)
            elif has_i and ax <= {"b", "i"}:
                res.q_valid.append(at.src)
            else:
                _residual(res, at.src, ax)
            continue
        lo, hi = at.lo, at.hi
        if kt[0][0] < 0:
            kt = [(-c, l) for c, l in kt]
            qt = [(-c, l) for c, l in qt]
            syms = tuple((-c, s) for c, s in at.lin.syms)
            lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
        else:
            syms = at.lin.syms
        key = (tuple(sorted((c, l.key()) for c, l in kt)), tuple(sorted((c, l.key()) for c, l in qt)),
               tuple(sorted((c, s.name) for c, s in syms)))
        g = groups.setdefault(key, {"k": kt, "q": qt, "syms": syms, "lo": None, "hi": None, "srcs": [],
                                    "eq_only": True})
        g["lo"] = lo if g["lo"] is None else (g["lo"] if lo is None else max(g["lo"], lo))
        g["hi"] = hi if g["hi"] is None else (g["hi"] if hi is None else min(g["hi"], hi))
        g["eq_only"] = g["eq_only"] and lo is not None and lo == hi
        g["srcs"].append(at.src)

    def arange_only(g):
        return all(l.key()[0] == "arange" for _, l in g["k"] + g["q"])

    order = sorted(groups.values(), key=lambda g: (g["eq_only"], not arange_only(g)))
    for g in order:
        if g["lo"] is not None and g["hi"] is not None and g["lo"] > g["hi"]:
            raise _Fail("the position bounds exclude every entry")
        if res.positions is None and (not g["eq_only"] or arange_only(g)):
            # lo <= k + q' <= hi with q_pos = -q': q_pos + lo <= k_pos <= q_pos + hi
            res.positions = (g["k"], [(-c, l) for c, l in g["q"]], tuple((-c, s) for c, s in g["syms"]),
                             None if g["lo"] is None else -g["lo"], g["hi"])
        elif res.segments is None and g["eq_only"]:
            res.segments = (g["k"], [(-c, l) for c, l in g["q"]], tuple((-c, s) for c, s in g["syms"]), g["hi"])
        else:
            for s in g["srcs"]:
                _residual(res, s, None, "a second pair of position vectors")
    return res


def _always_true(at: _Atom) -> bool:
    """``arange(n) >= c`` for ``c <= 0`` (Hugging Face's bidirectional ``q_idx >= 0``) and the like."""
    if len(at.lin.terms) != 1 or at.lin.syms or _is_plain_arange(at.lin.terms[0][1]) is None:
        return False
    coef = at.lin.terms[0][0]
    if coef == 1:
        return at.hi is None and (at.lo is None or at.lo <= 0)
    if coef == -1:
        return at.lo is None and (at.hi is None or at.hi >= 0)
    return False


def _vmap_exit(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "_remove_batch_dim"


def _residual(res: MaskAnalysis, src: _Src, axes, what: Optional[str] = None) -> None:
    res.residual.append(src)
    words = {"b": "batch", "h": "heads", "i": "queries", "j": "keys", "x": "other dims"}
    if what is None:
        what = f"{src.node.name} ({describe(src.node)})"
    if _vmap_exit(src.node):
        res.reasons.append(f"{what} is built inside torch.vmap (batched values are not analysed)")
    elif axes is None:
        res.reasons.append(f"{what}")
    elif "h" in axes:
        res.reasons.append(f"{what} varies over heads")
    elif {"i", "j"} <= axes:
        res.reasons.append(f"{what} depends on data along both queries and keys")
    else:
        res.reasons.append(f"{what} varies over {', '.join(words[a] for a in sorted(axes)) or 'nothing'}")


# ---------------------------------------------------------------------------------------------
# Emission: predicate vectors as graph values


class _Emitter:
    def __init__(self, g: fx.Graph, axis, batched=lambda n: False):
        self.g, self.axis, self.batched = g, axis, batched

    def layout_to(self, node: fx.Node, layout: Layout, axes: Tuple[str, ...]) -> fx.Node:
        """``node`` (dims labelled ``layout``) as a tensor with dims ``axes`` (size 1 where absent)."""
        g = self.g
        if self.batched(node):
            raise _Fail(f"{node.name} is a batched value inside torch.vmap")
        present = [(d, self.axis(l)) for d, l in enumerate(layout) if l is not None]
        names = [a for _, a in present]
        if len(set(names)) != len(names) or any(a not in axes for a in names):
            raise _Fail(f"{node.name} does not map onto {axes}")
        x = node
        if len(present) != len(layout):
            x = g.call_function(operator.getitem, (x, tuple(0 if l is None else slice(None) for l in layout)))
        want = [a for a in axes if a in names]
        if names != want:
            x = g.call_method("permute", (x, tuple(names.index(a) for a in want)))
        if len(want) != len(axes):
            x = g.call_function(operator.getitem, (x, tuple(slice(None) if a in want else None for a in axes)))
        return x

    def bool_of(self, src: _Src, axes) -> fx.Node:
        x = self.layout_to(src.node, src.layout, axes)
        g = self.g
        if src.how == "not":
            return g.call_function(torch.logical_not, (x,))
        if src.how == "nonzero":
            return g.call_function(torch.ne, (x, 0))
        if src.how == "zero":
            return g.call_function(torch.eq, (x, 0))
        return x

    def all_of(self, srcs: List[_Src], axes) -> Optional[fx.Node]:
        out = None
        for s in srcs:
            b = self.bool_of(s, axes)
            out = b if out is None else self.g.call_function(torch.logical_and, (out, b))
        return out

    def vector(self, terms, syms, const, axes) -> fx.Node:
        g = self.g
        out = None
        for coef, leaf in terms:
            x = self.layout_to(leaf.node, leaf.layout, axes)
            x = g.call_method("to", (x, torch.int64))
            if coef == -1:
                x = g.call_function(torch.neg, (x,))
            elif coef != 1:
                x = g.call_function(torch.mul, (x, coef))
            out = x if out is None else g.call_function(torch.add, (out, x))
        for coef, s in syms:
            term = s if coef == 1 else g.call_function(operator.mul, (s, coef))
            out = g.call_function(torch.add, (out, term))
        if const:
            out = g.call_function(torch.add, (out, const))
        return out


# ---------------------------------------------------------------------------------------------
# The pass


def _op_args() -> Dict[str, int]:
    schema = torch.ops.attncomp.attention.default._schema
    return {a.name: i for i, a in enumerate(schema.arguments)}


#: the two operations of transformers' packed-sequence ids that the mask kinds (:func:`_kind`) do not name
_CUMSUM, _DIFF = _fn("cumsum") | {aten.cumsum.default}, _fn("diff")


def _calls(n: Any, fns: set, method: str) -> bool:
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in fns)
                                       or (n.op == "call_method" and n.target == method))


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _not_tensor(x: Any) -> bool:
    """An int, or a node of a size (a SymInt, or a size expression), not of a tensor."""
    if isinstance(x, int):
        return not isinstance(x, bool)
    return isinstance(x, fx.Node) and (is_symbolic_number(x.meta.get("example_value", x.meta.get("val")))
                                       or _size_node(x))


def _counting(p: Any) -> bool:
    """Whether ``p`` holds positions that count up by one along its last axis: an integer ``arange`` with step 1
    from any start, plus or minus a size, unsqueezed at the front and expanded over a batch (a model's default
    ``position_ids``)."""
    while isinstance(p, fx.Node):
        k = _kind(p)
        if k == "arange":
            step = p.args[2] if len(p.args) > 2 else p.kwargs.get("step", 1)
            dt = p.kwargs.get("dtype")
            return step == 1 and (dt is None or not dt.is_floating_point)
        if k == "unsqueeze" and _arg(p, 1, "dim") == 0 or k in ("expand", "identity"):
            p = p.args[0]
        elif k in ("add", "sub") and len(p.args) == 2 and not _not_tensor(p.args[0]) and _not_tensor(p.args[1]):
            p = p.args[0]
        elif k == "add" and len(p.args) == 2 and _not_tensor(p.args[0]):
            p = p.args[1]
        else:
            return False
    return False


def _one_document(n: Any) -> bool:
    """Whether ``n`` is ``cumsum(diff(p, prepend=p[:, :1] - 1, dim=-1) != 1, -1)`` over counting positions ``p``
    (:func:`_counting`): the segment ids transformers derives from ``position_ids`` to find packed sequences,
    which are 0 everywhere when the positions are the model's own (one document per row, whatever the length)."""
    if not _calls(n, _CUMSUM, "cumsum") or _arg(n, 1, "dim") != -1:
        return False
    ne = n.args[0]
    if not isinstance(ne, fx.Node) or _kind(ne) != "cmp:ne" or len(ne.args) != 2 or ne.args[1] != 1:
        return False
    d = ne.args[0]
    if not _calls(d, _DIFF, "diff") or _arg(d, 1, "n", 1) != 1 or _arg(d, 2, "dim", -1) != -1:
        return False
    p, pre = d.args[0], _arg(d, 3, "prepend")
    if not isinstance(pre, fx.Node) or _kind(pre) != "sub" or len(pre.args) != 2 or pre.args[1] != 1:
        return False
    first = pre.args[0]
    if not isinstance(first, fx.Node) or _kind(first) != "getitem" or first.args[0] is not p:
        return False
    idx = first.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not idx or idx[-1] != slice(None, 1, None) or any(i != slice(None) for i in idx[:-1]):
        return False
    return _counting(p)


def _static_len(n: Any) -> Optional[int]:
    """The sequence length (dim -2) of q or k on a graph specialised to its shapes (dynamo's
    ``example_value`` or export's ``val`` with a static size), else None."""
    if not isinstance(n, fx.Node):
        return None
    v = n.meta.get("val", n.meta.get("example_value"))
    if not isinstance(v, torch.Tensor) or v.dim() < 2 or not isinstance(v.shape[-2], int):
        return None
    return int(v.shape[-2])


def _size_key(x: Any):
    """A key equal for two scalars that are the same size expression, else None."""
    if isinstance(x, int) and not isinstance(x, bool):
        return ("int",)
    if not isinstance(x, fx.Node):
        return None
    v = x.meta.get("val", x.meta.get("example_value"))
    if isinstance(v, torch.SymInt):
        return ("expr", str(v))
    src, d = None, None
    if x.op == "call_method" and x.target == "size" and len(x.args) == 2:
        src, d = x.args
    elif x.op == "call_function" and x.target is aten.sym_size.int:
        src, d = x.args
    elif x.op == "call_function" and x.target is operator.getitem and isinstance(x.args[0], fx.Node) \
            and x.args[0].op == "call_function" and x.args[0].target is getattr and x.args[0].args[1] == "shape":
        src, d = x.args[0].args[0], x.args[1]
    if src is None or not isinstance(d, int):
        return ("node", x.name)
    shp = _shape(src)
    if d < 0 and shp is not None:
        d += len(shp)
    return ("size", src.name, d)


def _sym_sum(syms) -> Optional[Dict[Any, int]]:
    """``sum(coef * s)`` as ``{size key: coef}`` (integer constants under ``("int",)``), through
    scalar ``+``/``-``; None if a term is not a size expression."""
    out: Dict[Any, int] = {}

    def add(x, c, depth=0):
        if depth > 8:
            return False
        if isinstance(x, int) and not isinstance(x, bool):
            out[("int",)] = out.get(("int",), 0) + c * x
            return True
        if isinstance(x, fx.Node) and x.op == "call_function" and x.target in (operator.add, operator.sub):
            sign = 1 if x.target is operator.add else -1
            return add(x.args[0], c, depth + 1) and add(x.args[1], c * sign, depth + 1)
        key = _size_key(x)
        if key is None:
            return False
        out[key] = out.get(key, 0) + c
        return True
    for coef, x in syms:
        if not add(x, coef):
            return None
    return {k: v for k, v in out.items() if v != 0}


def _is_plain_arange(leaf: _Leaf) -> Optional[Any]:
    """The length of ``arange(n)`` (from 0, step 1, integer), else None."""
    n = leaf.node
    if n.op != "call_function" or n.target not in _FUNCS["arange"]:
        return None
    a = list(n.args)
    if len(a) == 1:
        return a[0]
    if len(a) == 2 and a[0] == 0:
        return a[1]
    if len(a) == 3 and a[0] == 0 and a[2] == 1:
        return a[1]
    return None


def _spec_words(spec) -> str:
    """The report's words for a site whose mask is only in its spec (``is_causal``, a causal buffer)."""
    out = []
    if spec.causal:
        out.append("causal" if spec.causal_align == "top_left" else "causal (bottom-right)")
    if spec.window_left is not None or spec.window_right is not None:
        f = (lambda w: "inf" if w is None else str(w))
        out.append(f"window({f(spec.window_left)}, {f(spec.window_right)})")
    return ", ".join(out) or "none"


def analyze(gm: fx.GraphModule, mask: fx.Node, ev: Optional[_Eval] = None) -> MaskAnalysis:
    """The predicates of the mask computed at ``mask`` (raises ``_Fail`` with the reason)."""
    ev = ev or _Eval(gm)
    return _classify(ev, ev(mask))


def analyze_mask(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    ev = _Eval(gm)
    try:
        idx = _op_args()
    except Exception:
        idx = {}
    has_preds = all(nm in idx for nm in _PRED_NAMES)
    for node in attention_sites(gm):
        mask = node.args[idx["attn_mask"]] if "attn_mask" in idx and len(node.args) > idx["attn_mask"] else None
        rep = site_report(node, ctx)
        if not isinstance(mask, fx.Node):
            rep.details.setdefault("mask", _spec_words(spec_of(node)))
            continue
        try:
            res = _classify(ev, ev(mask))
        except _Fail as e:
            rep.details["mask"] = f"materialised mask: {e}"
            ctx.count("analyze_mask", "materialised")
            continue
        except Exception as e:  # an op the evaluator mis-reads must never break compilation
            log.debug("analyze_mask: %s", e, exc_info=True)
            rep.details["mask"] = f"materialised mask: analysis failed ({type(e).__name__}: {e})"
            ctx.count("analyze_mask", "materialised")
            continue
        if not has_preds:
            rep.details["mask"] = "materialised mask: the op takes no predicate arguments"
            continue
        before = node.args
        try:
            words = _rewrite(gm, node, idx, res, ev)
        except Exception as e:   # the op is only changed at the end of _rewrite: it is intact here
            why = str(e) if isinstance(e, _Fail) else f"rewrite failed ({type(e).__name__}: {e})"
            log.debug("analyze_mask: %s", why, exc_info=not isinstance(e, _Fail))
            rep.details["mask"] = f"materialised mask: {why}"
            ctx.count("analyze_mask", "materialised")
            modified = True   # nodes emitted before the failure are dead: let the pipeline remove them
            continue
        modified = True
        why = _disagreement(gm, node, idx, before, ctx.example_inputs)
        if why is not None:
            node.args = before
            rep.details["mask"] = f"materialised mask: the derived predicates ({words}) {why}"
            ctx.count("analyze_mask", "disagreed")
            continue
        rep.details["mask"] = words
        set_spec(node, spec_of(node), rep)
        ctx.count("analyze_mask", "rewritten")
    return PassResult(gm, modified)


def _evaluate(gm: fx.GraphModule, targets: List[fx.Node], inputs: Dict[str, Any]) -> Optional[Dict[fx.Node, Any]]:
    """The values of ``targets`` on the example inputs: only their ancestors run (for a mask: position
    vectors, the padding mask, comparisons; no layer), on copies of the inputs. None when an ancestor is
    a placeholder without a value."""
    need, todo = set(), list(targets)
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)
    interp = fx.Interpreter(gm)
    with torch.no_grad():
        for n in gm.graph.nodes:
            if n not in need:
                continue
            if n.op == "placeholder":
                if n.name not in inputs:
                    return None
                v = inputs[n.name]
                interp.env[n] = v.clone() if isinstance(v, torch.Tensor) else v
            else:
                interp.env[n] = interp.run_node(n)
    return interp.env


def _allowed(spec, mask, preds, nq: int, nk: int) -> Optional[torch.Tensor]:
    """The bool ``(B or 1, H or 1, Nq, Nk)`` entries a site may attend to (float masks: above ``-1e4``)."""
    from ..codegen.reference import predicate_mask

    tensors = [x for x in (mask,) + tuple(preds) if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")  # the predicates' own (a GPU call's)
    a = predicate_mask(spec, nq, nk, device, preds)
    if isinstance(mask, torch.Tensor):
        m = mask if mask.dtype == torch.bool else mask > MASK_FILL_MAX
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m
        a = m if a is None else a & m
    return a


def _disagreement(gm: fx.GraphModule, node: fx.Node, idx: Dict[str, int], before: tuple,
                  inputs: Optional[Dict[str, Any]]) -> Optional[str]:
    """DESIGN §7: the predicates (and bias) derived for ``node`` against the mask the graph computes,
    both evaluated on the example inputs of this compile; a sentence saying how they differ, or None
    (they agree, or there are no example values to evaluate them on)."""
    from ..spec import AttentionSpec, Predicates

    if not inputs:
        return None
    q, k = node.args[idx["q"]], node.args[idx["k"]]
    nq, nk = (_static_len(x) for x in (q, k))
    if nq is None or nk is None:
        shapes = [meta_shape(x) for x in (q, k)]
        hints = [getattr(getattr(s[-2], "node", None), "hint", None) if s else None for s in shapes]
        if not all(isinstance(h, int) for h in hints):
            return None
        nq, nk = hints
    olds = {nm: before[idx[nm]] if idx[nm] < len(before) else None for nm in ("attn_mask",) + _PRED_NAMES}
    news = {nm: node.args[idx[nm]] for nm in ("attn_mask",) + _PRED_NAMES}
    nodes = [v for v in list(olds.values()) + list(news.values()) if isinstance(v, fx.Node)]
    try:
        env = _evaluate(gm, nodes, inputs)
        if env is None:
            return None
        val = {nm: env[v] if isinstance(v, fx.Node) else v for nm, v in olds.items()}, \
            {nm: env[v] if isinstance(v, fx.Node) else v for nm, v in news.items()}
        specs = [AttentionSpec.from_json(before[spec_index(node)]), spec_of(node)]
        was, now = (_allowed(sp, vals["attn_mask"], Predicates(*(vals[nm] for nm in Predicates._fields)), nq, nk)
                    for sp, vals in zip(specs, val))
    except Exception as e:  # values the check cannot compute: the derivation stands as analysed
        log.debug("analyze_mask: the check could not evaluate the mask: %s", e, exc_info=True)
        return None
    ones = torch.ones(1, 1, nq, nk, dtype=torch.bool)
    was, now = torch.broadcast_tensors(*(ones if x is None else x.cpu() for x in (was, now)))
    bad = int((was != now).sum())
    if bad:
        return f"disagree with the mask the graph computes on this call's inputs at {bad} of {was.numel()} entries"
    m_old, m_new = val[0]["attn_mask"], val[1]["attn_mask"]
    if isinstance(m_old, torch.Tensor) and m_old.is_floating_point():
        bias_new = m_new if isinstance(m_new, torch.Tensor) and m_new.is_floating_point() else torch.zeros(())
        a, b = m_old.float().cpu(), bias_new.float().cpu()  # ``now`` is on the CPU
        shape = torch.broadcast_shapes(a.shape, b.shape, now.shape)
        a, b, keep = a.expand(shape), b.expand(shape), now.expand(shape)
        if not keep.any():  # no allowed entry on this call's inputs: no bias value to compare
            return None
        err = float((a - b).abs()[keep].amax())
        if not err <= 1e-5 * (1.0 + float(a.abs()[keep].amax())):
            return f"add a bias that differs from the graph's mask by {err:.3g} on allowed entries"
    return None


def _read_where_the_mask_read(g: fx.Graph, emitted: List[fx.Node], mask) -> None:
    """Move the ``emitted`` nodes (the predicate vectors, in graph order) to just after the mask and everything they
    read, so that they read the values the mask read. Emitted before the attention they would read a tensor as it is
    there, and a graph may advance it in place in between (transformers' static cache builds the mask from the
    layer's ``cumulative_length`` and adds the new tokens to it before the first attention: query positions read at
    the attention are one prompt too far, and every query sees the cache's empty slots). Raises :class:`_Fail` where a
    tensor they read is written in place before that point (the mask may have read it before or after the write)."""
    if not emitted:
        return
    order = {n: i for i, n in enumerate(g.nodes)}
    new = set(emitted)
    reads = {a for n in emitted for a in n.all_input_nodes if a not in new}
    last = max(reads | ({mask} if isinstance(mask, fx.Node) else set()), key=order.__getitem__, default=None)
    if last is None:
        return
    for w in g.nodes:
        if order[w] >= order[last]:
            break
        if mutates(w) and w.args and w.args[0] in reads and order[w] > order[w.args[0]]:
            raise _Fail(f"{w.args[0].name}, which the predicates read, is written in place ({w.name}) before the mask "
                        "is complete")
    at = last.next
    while at.op == "placeholder":
        at = at.next
    if at is emitted[0]:
        return
    for n in emitted:
        at.prepend(n)


def _rewrite(gm: fx.GraphModule, node: fx.Node, idx: Dict[str, int], res: MaskAnalysis, ev: _Eval) -> str:
    spec = spec_of(node)
    g = gm.graph
    em = _Emitter(g, res.axis, ev.batched)
    new: Dict[str, Any] = {}
    fields: Dict[str, Any] = {}
    default_words = None
    q_node, k_node = node.args[idx["q"]], node.args[idx["k"]]
    before = set(g.nodes)
    with g.inserting_before(node):
        if res.positions is not None:
            kt, qt, syms, left, right = res.positions
            align = None
            if len(kt) == 1 and kt[0][0] == 1 and len(qt) == 1 and qt[0][0] == 1 \
                    and _is_plain_arange(kt[0][1]) is not None and _is_plain_arange(qt[0][1]) is not None \
                    and ev.dtype(qt[0][1].node) in _INT_DTYPES and ev.dtype(kt[0][1].node) in _INT_DTYPES:
                ln_q, ln_k = _is_plain_arange(qt[0][1]), _is_plain_arange(kt[0][1])
                offset = _sym_sum(syms)
                if offset == {}:
                    align = "top_left"
                    # a constant query offset (folded into the bounds) that is Nk - Nq on a graph
                    # specialised to its shapes (dynamo, static export) is bottom-right alignment
                    nq, nk = _static_len(q_node), _static_len(k_node)
                    if nq is not None and nk is not None and nk != nq and right is not None \
                            and right >= nk - nq:
                        align = "bottom_right"
                        right -= nk - nq
                        left = None if left is None else left + nk - nq
                elif offset is not None and offset == _sym_sum(((1, ln_k), (-1, ln_q))):
                    align = "bottom_right"
            if spec.causal:   # is_causal / a causal buffer: top-left on default positions, AND-ed
                if align != "top_left":
                    raise _Fail("the site is causal (is_causal or a causal buffer) on default positions and "
                                "the mask bounds other positions")
                right = 0 if right is None else min(right, 0)
                if spec.window_left is not None:   # a banded buffer (GPT-Neo's local layers) AND-ed
                    left = spec.window_left if left is None else min(left, spec.window_left)
            if align is None:
                new["q_pos"] = em.vector(qt, syms, 0, ("b", "i"))
                new["k_pos"] = em.vector(kt, (), 0, ("b", "j"))
            causal = right == 0
            fields.update(causal=causal or spec.causal, window_left=left, window_right=None if causal else right,
                          causal_align=align or "top_left")
            if align is not None:
                default_words = "causal" if align == "top_left" else "causal (bottom-right)"
            res.positions = res.positions[:3] + (left, right)
        one_doc = False
        if res.segments is not None:
            kt, qt, syms, c = res.segments
            # segment ids that are 0 on both sides whatever the length (transformers' packed-sequence ids of the
            # model's own positions): one document per row, no predicate
            one_doc = (kt and qt and not syms and c == 0
                       and all(_one_document(t[1].node) for t in list(kt) + list(qt)))
            if one_doc:
                res.segments = None
            else:
                new["q_seg"] = em.vector(qt, syms, c, ("b", "i"))
                new["k_seg"] = em.vector(kt, (), 0, ("b", "j"))
        if res.k_valid:
            new["k_valid"] = em.all_of(res.k_valid, ("b", "j"))
        if res.q_valid:
            new["q_valid"] = em.all_of(res.q_valid, ("b", "i"))
        mask = None
        kind = "none"
        if res.residual:
            mask = em.all_of(res.residual, _AXES)
            kind = "bool"
        if res.biases:
            bias = None
            for b in res.biases:
                x = em.layout_to(b.node, b.layout, _AXES)
                bias = x if bias is None else g.call_function(torch.add, (bias, x))
            if mask is not None:
                bias = g.call_function(torch.where, (mask, bias, float("-inf")))
            mask, kind = bias, "float"
    for nm, val in new.items():
        old = node.args[idx[nm]]
        if old is not None:
            raise _Fail(f"the site already has {nm}")
    _read_where_the_mask_read(g, [n for n in g.nodes if n not in before], node.args[idx["attn_mask"]])
    args = list(node.args)
    for nm, val in new.items():
        args[idx[nm]] = val
    args[idx["attn_mask"]] = mask
    spec = spec.replace(mask_kind=kind, **fields)
    args[spec_index(node)] = spec.to_json()
    node.args = tuple(args)
    words = res.words(default_words)
    if one_doc:
        words.append("one document per row (segment ids of counting positions: no predicate)")
    if res.residual:
        words.append(f"materialised mask: {'; '.join(res.reasons)}")
    if res.biases:   # e.g. a relative-position bias: a float input of the op, not a mask
        words.append("additive bias (" + ", ".join(b.node.name for b in res.biases) + ")")
    return ", ".join(words) if words else "no predicate (the mask allows every entry)"
