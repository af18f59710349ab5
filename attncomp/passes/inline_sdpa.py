"""SDPA sites traced into the graph that Inductor compiles.

Matches: every ``attncomp::attention`` node that runs SDPA's kernel traced, as the runtime decides
(:func:`attncomp.runtime.dispatch.inline_choice`): on a CPU each ``dense`` or ``et`` site without
dropout; on a GPU such a site where Triton cannot run it, or where SDPA's kernel is the choice for
its shape bucket: measured (the autotune store), else in the table shipped for the GPU model, else
by the default rule (SDPA). The pass never times kernels: it passes the compile's ``mode`` on, and only
under ``mode="max-autotune"`` does the runtime measure a bucket that nothing measured yet (SDPA traced
against the op on Triton, per call with host time, at the sizes the graph was traced with; kept in the
autotune store). A float ``attn_mask`` that requires grad keeps the op (SDPA's kernels give no gradient
for it; the op does).

Requires: :mod:`.select_backend` ran (the specs are final). Only the graph handed to Inductor goes
through this pass: graphs kept for the report, ``CompiledModule.graphs`` and ``attncomp.export``
keep the op, which chooses among every backend on the machine that runs it.

Guarantees: each matched node calls the SDPA backend's ``inline_forward``
(:func:`attncomp.codegen.sdpa.inline_attention`) with the op's tensors and spec instead of the op,
and a mask plan node (``inline_plan``) that the sites with equal mask values share: the torch ops the
op runs on that backend (on CUDA, for a graph that reads only the output, ``scaled_dot_product_attention``
itself), recorded by AOTAutograd like the rest of the model. Scale reordering's runtime multiply of q
goes back into SDPA's call.
Inductor then builds the mask from the O(N) predicate vectors in its fused code and calls SDPA's
kernel from its own wrapper, without the op's dispatch and per-call Python host path (on this
project's CPU machine that path costs 80-280 us per call at a small model's shapes, most of it the
mask built op by op). Outputs are the op's ``(out, lse)``; the numerics are those of the op on the
SDPA backend. ``ATTNCOMP_INLINE_SDPA=0`` keeps every op (:func:`enabled`: the caller does not run the
pass then). Never imports triton or tvm.
"""

from __future__ import annotations

import torch.fx as fx

from ..codegen import get_backend
from ..opspec import ARG_INDEX, MOD_NAMES, parsed, resolved
from ..runtime import dispatch, env
from ..spec import Predicates
from .base import CompileContext, PassResult
from .node_info import attention_sites, meta_val, only_getitem0, site_report, spec_index
from .scale_reorder import RUNTIME_MUL

__all__ = ["inline_sdpa", "enabled"]

NAME = "inline_sdpa"
_A = ARG_INDEX


def enabled() -> bool:
    """Whether compiled graphs inline their SDPA sites (``ATTNCOMP_INLINE_SDPA``, default on)."""
    return env.flag("ATTNCOMP_INLINE_SDPA", True)


def _arg(node: fx.Node, name: str):
    i = _A[name]
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _choice(node: fx.Node, ctx: CompileContext):
    """``(traced, why)`` for a site: the runtime's choice (``ctx.cuda_graphs``: the graph runs as a CUDA
    graph; ``ctx.mode``: the compile's mode, which alone may let the runtime measure)."""
    if any(_arg(node, n) is not None for n in ("q_aux", "k_aux", "block_pattern")):
        return False, "the site brings policy tensors"
    if any(_arg(node, n) is not None for n in MOD_NAMES) or parsed(node.args[spec_index(node)]).modifiers():
        return False, "score modifiers (SDPA's kernels apply none of them)"
    dropout = _arg(node, "dropout_p")
    if not isinstance(dropout, (int, float)):
        return False, "dropout rate not a constant"
    q, k, v = (meta_val(_arg(node, n)) for n in ("q", "k", "v"))
    if q is None or k is None or v is None:
        return False, "no example value for q, k or v"
    mask_node = _arg(node, "attn_mask")
    mask = meta_val(mask_node)
    if mask_node is not None and mask is None:
        return False, "no example value for the mask"
    if mask is not None and mask.is_floating_point() and mask.requires_grad:
        return False, "the float mask requires grad (the op gives it one; SDPA's kernels do not)"
    # which predicates are present is what the choice reads of them (nodes the passes added have no
    # example value: the node stands in)
    preds = Predicates(*(_arg(node, n) for n in Predicates._fields))
    spec = resolved(node.args[spec_index(node)], q.dtype)
    return dispatch.inline_choice(spec, q, k, v, preds if preds.any() else None, float(dropout), mask, mode=ctx.mode,
                                  device_only=ctx.cuda_graphs)


_NOT_PURE = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential", "poisson",
             "empty", "seed")


def _pure(n: fx.Node) -> bool:
    """Whether two calls of ``n``'s form on the same values give the same value: no side effect, no
    in-place method, no random draw, no uninitialised memory."""
    if n.op not in ("call_function", "call_method") or n.is_impure():
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    if name.endswith("_") and not name.endswith("__"):
        return False
    return not any(w in name.lower() for w in _NOT_PURE)


def _structure(x, depth: int = 6):
    """A key equal for graph values computed the same way from the same nodes: a pure call's target
    and its arguments' keys (a model's layers each slice the one mask the model built), down to
    ``depth`` calls; a placeholder, attribute or impure call is its own key."""
    if isinstance(x, fx.Node):
        if depth == 0 or not _pure(x):
            return x
        return (x.op, x.target, _structure(tuple(x.args), depth - 1),
                _structure(tuple(sorted(x.kwargs.items())), depth - 1))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_structure(a, depth) for a in x)
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    try:
        hash(x)
    except TypeError:
        return ("unhashable", id(x))  # never equal to another value: no sharing, never a wrong one
    return x


def _plan_key(node: fx.Node, need_lse: bool) -> tuple:
    """What a site's mask plan depends on: the mask and predicate values (:func:`_structure`), the
    mask's part of the spec, the query and key lengths, q's dtype and device, and whether the site
    calls SDPA's public function."""
    spec = parsed(node.args[spec_index(node)])
    q, k = meta_val(_arg(node, "q")), meta_val(_arg(node, "k"))
    return (tuple(_structure(_arg(node, n)) for n in ("attn_mask",) + Predicates._fields)
            + (spec.causal, spec.causal_align, spec.window_left, spec.window_right, str(q.shape[-2]),
               str(k.shape[-2]), q.dtype, q.device, q.is_cuda and not need_lse))


def _take_back_scale(node: fx.Node) -> bool:
    """Undo scale reordering's runtime ``mul`` of q (:data:`.scale_reorder.RUNTIME_MUL`) where the site
    is its only user: SDPA's kernels apply the scale to the float32 scores themselves, and the multiply
    would be one more kernel per site. True where undone."""
    m = _arg(node, "q")
    if not isinstance(m, fx.Node) or RUNTIME_MUL not in m.meta or len(m.users) != 1:
        return False
    i = spec_index(node)
    spec = parsed(node.args[i])
    if spec.scale != 1.0:
        return False
    args = list(node.args)
    args[_A["q"]] = m.args[0]
    args[i] = spec.replace(scale=float(m.meta[RUNTIME_MUL])).to_json()
    node.args = tuple(args)
    return True


def inline_sdpa(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Replace each SDPA site's op call by the traceable SDPA forward (see the module docstring); the
    sites that share a mask plan (:func:`_plan_key`: a model's layers) share one plan node."""
    modified = False
    plans: dict = {}
    for node in attention_sites(gm):
        rep = site_report(node, ctx)
        traced, why = _choice(node, ctx)
        if not traced:
            rep.details[NAME] = f"op kept: {why}"
            ctx.count(NAME, "kept")
            continue
        unscaled = _take_back_scale(node)
        spec_json = node.args[spec_index(node)]
        need_lse = only_getitem0(node) is None  # whether the graph reads lse
        sd = get_backend("sdpa")
        key = _plan_key(node, need_lse)
        plan = plans.get(key)
        if plan is None:
            with gm.graph.inserting_before(node):
                plan = plans[key] = gm.graph.call_function(sd.inline_plan, tuple(
                    _arg(node, n) for n in ("q", "k", "attn_mask") + Predicates._fields) + (spec_json, need_lse))
            ctx.count(NAME, "mask plans")
        node.target = sd.inline_forward
        node.args = (_arg(node, "q"), _arg(node, "k"), _arg(node, "v"), plan, spec_json, need_lse)
        node.kwargs = {}
        rep.details[NAME] = (f"traced into the Inductor graph: {why}; Inductor builds the mask (once for the "
                             "sites that share it) and calls SDPA's kernel, no op call at run time"
                             + ("; the scale goes to SDPA's kernel (no runtime multiply of q)" if unscaled else ""))
        ctx.count(NAME, "inlined")
        modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
