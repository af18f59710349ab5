"""SDPA sites traced into the graph that Inductor compiles.

Matches: every ``attncomp::attention`` node whose calls all run SDPA's kernel, as decided without
timing anything (:func:`attncomp.runtime.dispatch.inline_choice`): on a CPU each ``dense`` or ``et``
site without dropout; on a GPU where Triton cannot run the site, or where the autotune store holds
SDPA as the measured winner for the site's shape bucket. A float ``attn_mask`` that requires grad
keeps the op (SDPA's kernels give no gradient for it; the op does).

Requires: :mod:`.select_backend` ran (the specs are final). Only the graph handed to Inductor goes
through this pass: graphs kept for the report, ``CompiledModule.graphs`` and ``attncomp.export``
keep the op, which chooses among every backend on the machine that runs it.

Guarantees: each matched node calls the SDPA backend's ``inline_forward``
(:func:`attncomp.codegen.sdpa.inline_attention`) with the op's tensors and spec instead of the op:
the same torch ops the op runs on that backend, recorded by AOTAutograd like the rest of the model.
Inductor then builds the mask from the O(N) predicate vectors in its fused code and calls SDPA's
kernel from its own wrapper, without the op's dispatch and per-call Python host path (on this
project's CPU machine that path costs 80-280 us per call at a small model's shapes, most of it the
mask built op by op). Outputs are the op's ``(out, lse)``; the numerics are those of the op on the
SDPA backend. ``ATTNCOMP_INLINE_SDPA=0`` keeps every op. Never imports triton or tvm.
"""

from __future__ import annotations

import os

import torch.fx as fx

from .. import ops
from ..codegen import get_backend
from ..runtime import dispatch
from ..spec import Predicates
from .base import CompileContext, PassResult
from .node_info import attention_sites, meta_val, only_getitem0, site_report, spec_index

__all__ = ["inline_sdpa", "enabled"]

NAME = "inline_sdpa"
_A = ops.ARG_INDEX


def enabled() -> bool:
    """Whether compiled graphs inline their SDPA sites (``ATTNCOMP_INLINE_SDPA``, default on)."""
    return os.environ.get("ATTNCOMP_INLINE_SDPA", "1").strip().lower() not in ("0", "false", "no", "off")


def _arg(node: fx.Node, name: str):
    i = _A[name]
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _why_not(node: fx.Node):
    """``(None, why)`` where the site may be inlined (why: the choice's reason), else ``(reason, None)``."""
    if any(_arg(node, n) is not None for n in ("q_aux", "k_aux", "block_pattern")):
        return "the site brings policy tensors", None
    dropout = _arg(node, "dropout_p")
    if not isinstance(dropout, (int, float)):
        return "dropout rate not a constant", None
    q, k, v = (meta_val(_arg(node, n)) for n in ("q", "k", "v"))
    if q is None or k is None or v is None:
        return "no example value for q, k or v", None
    mask_node = _arg(node, "attn_mask")
    mask = meta_val(mask_node)
    if mask_node is not None and mask is None:
        return "no example value for the mask", None
    if mask is not None and mask.is_floating_point() and mask.requires_grad:
        return "the float mask requires grad (the op gives it one; SDPA's kernels do not)", None
    # which predicates are present is what the choice reads of them (nodes the passes added have no
    # example value: the node stands in)
    preds = Predicates(*(_arg(node, n) for n in Predicates._fields))
    spec = ops._resolved(node.args[spec_index(node)], q.dtype)
    ok, why = dispatch.inline_choice(spec, q, k, v, preds if preds.any() else None, float(dropout), mask,
                                     measure=True)
    return (None, why) if ok else (why, None)


def inline_sdpa(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Replace each SDPA site's op call by the traceable SDPA forward (see the module docstring)."""
    if not enabled():
        return PassResult(gm, False)
    modified = False
    for node in attention_sites(gm):
        rep = site_report(node, ctx)
        no, why = _why_not(node)
        if no is not None:
            rep.details[NAME] = f"op kept: {no}"
            ctx.count(NAME, "kept")
            continue
        spec_json = node.args[spec_index(node)]
        node.target = get_backend("sdpa").inline_forward
        node.args = tuple(_arg(node, n) for n in ("q", "k", "v", "attn_mask") + Predicates._fields) + (
            spec_json, only_getitem0(node) is None)  # whether the graph reads lse
        node.kwargs = {}
        rep.details[NAME] = (f"traced into the Inductor graph: {why}; Inductor builds the mask and calls "
                             "SDPA's kernel, no op call at run time")
        ctx.count(NAME, "inlined")
        modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
