"""Scale reordering (E.T. §3.3): apply the softmax scale to q instead of to the scores.

Matches: every ``attncomp::attention`` node whose spec scale (``None`` meaning ``1/sqrt(D)``) is
not 1.

Requires: ``match_attention`` has run, so q/k/v are the unscaled head tensors ``(B, H, N, D)`` and
every constant factor on the scores, q or k is already folded into ``spec.scale``. D comes from
``spec.head_dim`` or from q's shape metadata.

Guarantees: the site computes ``(s*q)·k`` with ``spec.scale = 1``, which equals ``s*(q·k)`` in
exact arithmetic; in fp16 a score whose unscaled value overflows (``|q·k| > 65504``) while the
scaled one does not stays finite. How ``s*q`` is formed:

* ``ctx.inference`` and q is ``Linear(x)`` followed only by data movement (view, reshape,
  transpose, permute, contiguous, clone), none of which has another user: ``s`` is folded into a new
  weight ``s*W`` and bias ``s*b``, registered as buffers of the compiled ``GraphModule`` and read by a
  new linear node. No runtime multiply remains; the user's module and parameters are untouched
  (and, being read at compile time, later changes to them are not seen by the compiled module).
* otherwise (training, q from another op, a shared projection), under the ``et`` policy (which asks
  for E.T.'s rewrites): a runtime ``mul`` of q by ``s`` right before the op, so gradients reach the
  user's parameters. Under the other policies the scale then stays in the op: every backend computes
  half-precision scores in float32 and applies the scale there, so no score overflows in either order,
  and the multiply would be one more kernel per site (a pass over q) for nothing.

Not applied (reason in ``SiteReport.details["scale_reorder"]``): the scale cannot be folded and the
policy is not ``et`` (above), the policy is ``ET(reorder_scale=False)``, the scale is already 1 (e.g. a
model without scaling), the scale is not positive (hash buckets derived from q later must not change),
or the head dim is unknown; the scale then stays in the op, unchanged.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx

from ..policy import ET
from .node_info import (
    attention_sites, copy_shape_meta, exclusive_chain, head_dim, match_linear, new_constant,
    set_spec, site_report, spec_of,
)
from .base import CompileContext, PassResult

#: meta key of the runtime ``mul`` this pass puts before a site (its value: the scale)
RUNTIME_MUL = "attncomp_scale_reorder_mul"

log = logging.getLogger(__name__)

__all__ = ["scale_reorder"]

NAME = "scale_reorder"


def _disabled(ctx: CompileContext, spec) -> bool:
    return any(isinstance(p, ET) and not p.reorder_scale for p in (ctx.policy, spec.policy))


def _fold_into_linear(gm: fx.GraphModule, site: fx.Node, scale: float) -> str:
    """Fold ``scale`` into the q projection; return "" on success, else why it cannot."""
    q = site.args[0]
    if sum(a is q for a in site.args) != 1 or len(q.users) != 1:
        return f"q ({q.name}) is used elsewhere too"
    chain, producer, problem = exclusive_chain(q)
    if problem:
        return f"the path from the q projection is shared: {problem}"
    lin, why = match_linear(gm, producer)
    if lin is None:
        return f"q is not a Linear followed by views: {why}"
    w = lin.weight.detach()
    new_w = (w.to(torch.float64) * scale).to(w.dtype)
    wname = new_constant(gm, "_attncomp_q_weight_scaled", new_w, trainable=False)
    bname = None
    if lin.bias is not None:
        b = lin.bias.detach()
        bname = new_constant(gm, "_attncomp_q_bias_scaled", (b.to(torch.float64) * scale).to(b.dtype), trainable=False)
    g = gm.graph
    node = lin.node
    with g.inserting_before(node):
        w_node = g.get_attr(wname)
        b_node = g.get_attr(bname) if bname else None
        target = node.target if node.op == "call_function" else torch.nn.functional.linear
        new = g.call_function(target, (lin.input, w_node, b_node))
    copy_shape_meta(new, node)
    new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return ""


def scale_reorder(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Move each site's softmax scale onto q (folded into the q projection when weights are frozen)."""
    modified = False
    g = gm.graph
    for site in attention_sites(gm):
        rep = site_report(site, ctx)
        spec = spec_of(site)
        if _disabled(ctx, spec):
            rep.details[NAME] = "not applied: disabled by the policy (ET(reorder_scale=False))"
            ctx.count(NAME, "disabled")
            continue
        scale = spec.scale
        if scale is None:
            d = head_dim(site, spec)
            if d is None:
                rep.details[NAME] = "not applied: head dim unknown (no spec.head_dim, no shape metadata on q); the scale stays in the op"
                ctx.count(NAME, "skipped")
                continue
            scale = 1.0 / math.sqrt(d)
        scale = float(scale)
        if scale == 1.0:
            rep.details[NAME] = "not needed: the scores are not scaled (scale is 1)"
            ctx.count(NAME, "not_needed")
            continue
        if not scale > 0.0:
            # LSH buckets derived from q afterwards would flip sign with q; keep the op's own order
            rep.details[NAME] = f"not applied: non-positive scale {scale:.6g} stays in the op"
            ctx.count(NAME, "skipped")
            continue
        why = "the weights are not frozen (training)"
        if ctx.inference:
            why = _fold_into_linear(gm, site, scale)
        if why and not isinstance(spec.policy, ET) and not isinstance(ctx.policy, ET):
            rep.details[NAME] = (f"not applied: {why}; scale {scale:.6g} stays in the op, whose kernels apply it to "
                                 "float32 scores (no overflow in either order; a runtime multiply of q would be one "
                                 "more kernel per site); the et policy multiplies q at run time")
            ctx.count(NAME, "kept_in_op")
            continue
        if not why:
            how = f"scale {scale:.6g} folded into the q projection's weight and bias (no runtime multiply)"
            ctx.count(NAME, "folded")
        else:
            q = site.args[0]
            with g.inserting_before(site):
                m = g.call_function(torch.mul, (q, scale))
            copy_shape_meta(m, q)
            m.meta[RUNTIME_MUL] = scale  # (a site that runs SDPA's kernel traced takes the scale back)
            site.update_arg(0, m)
            how = f"scale {scale:.6g} applied to q by a runtime multiply ({why})"
            ctx.count(NAME, "runtime_mul")
        set_spec(site, spec.replace(scale=1.0), rep)
        rep.rewrites.append(NAME)
        rep.details[NAME] = "applied: " + how
        ctx.count(NAME, "applied")
        modified = True
        log.debug("scale_reorder %s: %s", rep.name, how)
    return PassResult(gm, modified)
