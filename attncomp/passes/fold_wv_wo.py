"""W_V·W_O folding (E.T. §3.1, eq. 4-5): precompute ``M_h = W_V,h^T W_O,h^T`` per head.

Matches, around one ``attncomp::attention`` node (q/k/v ``(B, H, N, d)``, no GQA)::

    V   = linear(X, W_V, b_V)                       (B, Nk, H*dv)
    v   = V split into heads: reshape to (B, Nk, H, dv), then transpose(1, 2) / permute(0, 2, 1, 3)
    z   = getitem(attention(q, k, v, ...), 0)        (B, H, Nq, dv)
    y   = z merged: transpose(1, 2) / permute(0, 2, 1, 3), then reshape to (B, Nq, H*dv)
    out = linear(y, W_O, b_O)                        (B, Nq, do)

contiguous/clone may appear anywhere in both chains; every intermediate value has one user.

Requires: ``match_attention`` has run; shape metadata (``meta['val']`` or ``meta['tensor_meta']``) on
the split and merge reshapes, to prove they split/merge the last dimension as ``(H, dv)``
row-major; weights of both projections known at compile time (``nn.Linear`` or ``get_attr``), or
read by the graph at run time (the parameters dynamo lifts to graph inputs unless they are frozen).

Rewrites to::

    V'  = linear(X, Wf, c)         Wf[h*do:(h+1)*do] = W_O,h W_V,h  (M_h^T),  c_h = W_O,h b_V,h
    z'  = getitem(attention(q, k, transpose(unflatten(V', -1, (H, do)), 1, 2), ...), 0)
    out = sum(z', dim=1) + b'

Guarantees: ``out`` equals the original in exact arithmetic for every input. The value bias is
handled so that this holds for every attention matrix ``S``: when the spec guarantees each row of
``S_h`` sums to 1 (dense/et policy, no mask, no dropout) it is folded into the output bias,
``b' = b_O + sum_h W_O,h b_V,h`` (eq. 5 as written); otherwise (a mask or sparsity can leave a row
with no kept key, whose output is 0; dropout rescales rows) ``c_h`` stays in ``V'``, where
``S_h (X M_h + 1 c_h^T) = (S_h V_h) W_O,h^T`` exactly, and ``b' = b_O``.
The folded tensors are new buffers of the compiled ``GraphModule``, computed in float64 and cast to
the weights' dtype. When training they are ``nn.Parameter``s and receive gradients; the user's
``W_V``/``W_O`` are never mutated and no longer train through this site (and ``M_h`` is then a free
``dm x do`` matrix, no longer a product of rank ``dv``).
Weights the graph reads at run time (dynamo's graphs of a module whose parameters require grad, in
training or in eval mode) are not read at compile time: the graph computes ``Wf``, ``c`` and ``b'``
from them on every call (``2 H do dv (dm + 1)`` FLOPs, counted by the cost model under ``auto``), so
the site sees the current weights and gradients reach the user's ``W_V``/``W_O`` (tied ones stay tied).

When: only under the ``ET`` policy. ``fold_wv_wo=True`` forces (when the structure matches),
``False`` forbids, ``"auto"`` folds when :mod:`.costmodel` predicts fewer FLOPs for the site's
shapes (in practice only ``H == 1``). Tied weights (``W_V`` or ``W_O`` read elsewhere) known at
compile time are not folded when training. A folded site's value head dim is ``do``: when the compile names the
``triton`` backend and ``do`` exceeds its limit (256) the fold is declined; under ``auto`` the
dispatch skips a backend that cannot take ``v`` when the op passes ``v`` to it.

Reports: predicted FLOPs and bytes of both forms in ``SiteReport.details["fold_wv_wo_flops"]`` and a
``ctx.notes`` line whenever the structure matches (applied or not); the decision, or the reason it
was not applied, in ``details["fold_wv_wo"]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from .. import ops
from ..policy import ET
from . import costmodel
from .node_info import (
    LinearInfo, attention_sites, describe, dtype_of, exclusive_chain, itemsize, match_linear, new_constant,
    only_getitem0, permutation, shape_of, site_report, spec_of, view_input, view_kind, weight_users,
)
from .base import CompileContext, PassResult

log = logging.getLogger(__name__)

__all__ = ["fold_wv_wo"]

NAME = "fold_wv_wo"
_HEAD_SWAP = (0, 2, 1, 3)
#: largest head dim of the Triton kernels (DESIGN.md §6); a folded site's value head dim is d_out
_TRITON_MAX_DV = 256


@dataclass
class _Site:
    v: LinearInfo
    o: LinearInfo
    v_chain: List[fx.Node]      # from the op's v argument back to the V projection (exclusive)
    out: fx.Node                # getitem(attention, 0)
    merge_chain: List[fx.Node]  # from out forward to the O projection's input
    H: int
    dv: int
    B: object
    Nq: object
    Nk: object


def _split_ok(chain: List[fx.Node], F: int, merge: bool) -> Tuple[Optional[tuple], str]:
    """Check that ``chain`` (in execution order) is a row-major head split (or merge) of F features.

    Split: reshape (B, N, F) -> (B, N, H, dv), then swap dims 1 and 2. Merge: the mirror image.
    Returns ``((B, N, H, dv), "")`` or ``(None, reason)``.
    """
    moves = [n for n in chain if view_kind(n) != "identity"]
    kinds = [view_kind(n) for n in moves]
    want = ["reshape", "swap"] if not merge else ["swap", "reshape"]
    got = ["swap" if k in ("transpose", "permute") else k for k in kinds]
    what = "head merge" if merge else "head split"
    if got != want:
        return None, f"the {what} is {' -> '.join(kinds) or 'missing'}, not {' -> '.join(want)}"
    swap = moves[want.index("swap")]
    if permutation(swap, 4) != _HEAD_SWAP:
        return None, f"the {what} transposes {permutation(swap, 4)} instead of swapping heads and tokens"
    r = moves[want.index("reshape")]
    src, dst = shape_of(view_input(r)), shape_of(r)
    if src is None or dst is None:
        return None, f"no shape metadata on the {what} ({r.name}); run shape propagation before this pass"
    four, three = (src, dst) if merge else (dst, src)
    if len(four) != 4 or len(three) != 3 or tuple(four[:2]) != tuple(three[:2]):
        return None, f"the {what} reshapes {src} to {dst}, not (B, N, {F}) <-> (B, N, H, dv)"
    H, dv = four[2], four[3]
    if not (isinstance(H, int) and isinstance(dv, int)) or H * dv != F or three[2] != F:
        return None, f"the {what} reshapes {src} to {dst}, which does not split {F} features into heads"
    return tuple(four), ""


def _match(gm: fx.GraphModule, site: fx.Node, spec) -> Tuple[Optional[_Site], str]:
    if spec.gqa_groups != 1:
        return None, f"grouped-query attention ({spec.gqa_groups} query heads per value head)"
    v = site.args[2]
    if sum(a is v for a in site.args) != 1 or len(v.users) != 1:
        return None, f"the value tensor ({v.name}) is used elsewhere too"
    v_chain, producer, problem = exclusive_chain(v)
    if problem:
        return None, f"the value path is shared: {problem}"
    vlin, why = match_linear(gm, producer, live=True)
    if vlin is None:
        return None, f"the value is not a Linear projection split into heads: {why}"
    vs, why = _split_ok(list(reversed(v_chain)), vlin.out_features, merge=False)
    if vs is None:
        return None, why
    B, Nk, H, dv = vs
    qs = shape_of(site.args[0])
    if qs is not None and qs[1] != H:
        return None, f"q has {qs[1]} heads but the value projection splits into {H} (grouped-query attention)"

    out = only_getitem0(site)
    if out is None:
        return None, "the op's outputs have users other than one getitem(·, 0) (e.g. the log-sum-exp)"
    merge, cur = [], out
    while True:
        users = list(cur.users)
        if len(users) != 1:
            return None, f"the attention output path has a value with {len(users)} users ({cur.name})"
        u = users[0]
        if view_kind(u) is not None and view_input(u) is cur:
            merge.append(u)
            cur = u
            continue
        break
    olin, why = match_linear(gm, u, live=True)
    if olin is None:
        return None, f"the merged heads reach {describe(u)} before any output projection"
    if olin.input is not cur:
        return None, f"the merged heads are not the input of {describe(u)}"
    ms, why = _split_ok(merge, H * dv, merge=True)
    if ms is None:
        return None, why
    if tuple(ms[2:]) != (H, dv) or ms[0] != B:
        return None, f"the merged output {ms} does not match the value heads {(B, H, dv)}"
    if olin.in_features != H * dv:
        return None, f"the output projection takes {olin.in_features} features, the heads give {H * dv}"
    return _Site(vlin, olin, v_chain, out, merge, H, dv, B, ms[1], Nk), ""


def _rows_sum_to_one(site: fx.Node, spec) -> str:
    """"" when every row of S sums to 1 by construction, else why not."""
    if spec.policy.name not in ("dense", "et"):
        return f"policy {spec.policy.name!r} may drop every key of a row"
    if spec.mask_kind != "none" or site.args[ops.ARG_INDEX['attn_mask']] is not None or any(
            site.args[ops.ARG_INDEX[p]] is not None for p in ops.PRED_NAMES):
        return "a mask may leave a row without an allowed key"
    dp = site.args[ops.ARG_INDEX['dropout_p']]
    if spec.dropout_p or not isinstance(dp, (int, float)) or dp != 0:
        return "dropout rescales rows"
    return ""


def _tensor_node(gm: fx.GraphModule, g: fx.Graph, lin: LinearInfo, which: str) -> Optional[fx.Node]:
    """The node that carries a projection's weight or bias in the graph (a live input, or its
    ``get_attr``); a ``call_module`` Linear's tensor gets a ``get_attr`` of its own."""
    node = getattr(lin, which + "_node")
    if isinstance(node, fx.Node):
        return node
    if getattr(lin, which) is None:
        return None
    return g.get_attr(f"{lin.node.target}.{which}")


def _apply_live(gm: fx.GraphModule, site: fx.Node, m: _Site, per_head_bias: bool) -> None:
    """The fold computed in the graph from the weights it reads at run time (dynamo's lifted parameters):
    every call sees the current weights, and gradients reach W_V and W_O (tied ones stay tied)."""
    H, dv = m.H, m.dv
    dm, do = m.v.in_features, m.o.out_features
    g = gm.graph
    with g.inserting_before(m.v.node):
        wv, bv = _tensor_node(gm, g, m.v, "weight"), _tensor_node(gm, g, m.v, "bias")
        wo, bo = _tensor_node(gm, g, m.o, "weight"), _tensor_node(gm, g, m.o, "bias")
        wo3 = g.call_function(torch.reshape, (wo, (do, H, dv)))
        wf = g.call_function(torch.einsum, ("ohd,hdm->hom", wo3, g.call_function(torch.reshape, (wv, (H, dv, dm)))))
        wf = g.call_function(torch.reshape, (wf, (H * do, dm)))
        c = None
        if bv is not None:
            c = g.call_function(torch.einsum, ("ohd,hd->ho", wo3, g.call_function(torch.reshape, (bv, (H, dv)))))
        lin_bias = post = None
        if c is not None and per_head_bias:
            lin_bias = g.call_function(torch.reshape, (c, (H * do,)))
            post = bo
        elif c is not None:
            post = g.call_function(torch.sum, (c, 0))
            if bo is not None:
                post = g.call_function(torch.add, (bo, post))
        else:
            post = bo
    _emit(g, site, m, wf, lin_bias, lambda: post)


def _emit(g: fx.Graph, site: fx.Node, m: _Site, wf: fx.Node, head_bias: Optional[fx.Node], post) -> None:
    """The folded site: the op reads ``X M_h (+ c_h)`` per head as its values, the heads' outputs are
    summed in place of the output projection (``+ post()``, a node made after the op, or None), and the
    value and output projections (with the head merge between them) are removed."""
    H, do = m.H, m.o.out_features
    with g.inserting_before(m.v.node):
        target = m.v.node.target if m.v.node.op == "call_function" else torch.nn.functional.linear
        vp = g.call_function(target, (m.v.input, wf, head_bias))
        vp = g.call_function(torch.unflatten, (vp, -1, (H, do)))
        vp = g.call_function(torch.transpose, (vp, 1, 2))
    site.update_arg(2, vp)
    with g.inserting_before(m.o.node):
        y = g.call_function(torch.sum, (m.out, 1))
        bias = post()
        if bias is not None:
            y = g.call_function(torch.add, (y, bias))
    m.o.node.replace_all_uses_with(y)
    for n in [m.o.node] + list(reversed(m.merge_chain)) + m.v_chain + [m.v.node]:
        g.erase_node(n)


def _apply(gm: fx.GraphModule, site: fx.Node, m: _Site, per_head_bias: bool, trainable: bool) -> None:
    if m.v.live or m.o.live:
        return _apply_live(gm, site, m, per_head_bias)
    H, dv = m.H, m.dv
    wv, wo = m.v.weight.detach(), m.o.weight.detach()
    dm, do = m.v.in_features, m.o.out_features
    f64 = torch.float64
    Wv = wv.to(f64).reshape(H, dv, dm)
    Wo = wo.to(f64).reshape(do, H, dv)
    Wf = torch.einsum("ohd,hdm->hom", Wo, Wv).reshape(H * do, dm)
    c = None
    if m.v.bias is not None:
        c = torch.einsum("ohd,hd->ho", Wo, m.v.bias.detach().to(f64).reshape(H, dv))
    post = m.o.bias.detach().to(f64) if m.o.bias is not None else None
    lin_bias = None
    if c is not None and per_head_bias:
        lin_bias = c.reshape(H * do)
    elif c is not None:
        post = c.sum(0) if post is None else post + c.sum(0)
    dt = wv.dtype
    wf_name = new_constant(gm, "_attncomp_wvwo_weight", Wf.to(dt), trainable)
    cb_name = new_constant(gm, "_attncomp_wvwo_head_bias", lin_bias.to(dt), trainable) if lin_bias is not None else None
    pb_name = new_constant(gm, "_attncomp_wvwo_bias", post.to(wo.dtype), trainable) if post is not None else None

    g = gm.graph
    with g.inserting_before(m.v.node):
        wf = g.get_attr(wf_name)
        cb = g.get_attr(cb_name) if cb_name else None
    _emit(g, site, m, wf, cb, lambda: g.get_attr(pb_name) if pb_name else None)


def _live_fold_flops(m: _Site) -> int:
    """FLOPs of computing ``M_h`` (and ``c_h``) once per call from live weights."""
    return 2 * m.H * m.o.out_features * m.dv * (m.v.in_features + (m.v.bias is not None))


def fold_wv_wo(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Fold W_V·W_O per head where the ET policy asks and the cost model (or the caller) agrees."""
    modified = False
    pol = ctx.policy
    for site in attention_sites(gm):
        rep = site_report(site, ctx)
        spec = spec_of(site)
        if not isinstance(pol, ET):
            rep.details[NAME] = f"not applied: only the 'et' policy folds W_V·W_O (policy is {pol.name!r})"
            ctx.count(NAME, "skipped")
            continue
        m, why = _match(gm, site, spec)
        if m is None:
            rep.details[NAME] = f"not applied: {why}"
            ctx.count(NAME, "no_match")
            continue
        rows = _rows_sum_to_one(site, spec)
        dims = (m.B, m.Nq, m.Nk)
        cost = None
        if all(isinstance(d, int) for d in dims):
            cost = costmodel.fold_cost(m.B, m.Nq, m.Nk, m.H, m.v.in_features, m.dv, m.o.out_features,
                                       d_head_qk=(shape_of(site.args[0]) or (None,) * 4)[3],
                                       itemsize=itemsize(dtype_of(m.out) or m.v.weight.dtype),
                                       v_bias=m.v.bias is not None, o_bias=m.o.bias is not None,
                                       per_head_bias=bool(rows))
            rep.details[NAME + "_flops"] = {"original": cost.flops_original, "folded": cost.flops_folded,
                                            "bytes_original": cost.bytes_original, "bytes_folded": cost.bytes_folded}
        if pol.fold_wv_wo is False:
            decision, why = False, "forbidden by the policy (ET(fold_wv_wo=False))"
        elif pol.fold_wv_wo is True:
            decision, why = True, "forced by the policy (ET(fold_wv_wo=True))"
        elif cost is None:
            decision, why = False, f"the cost model needs concrete shapes, got B, Nq, Nk = {dims}"
        elif (cost.cheaper_folded if not (m.v.live or m.o.live)
              else cost.flops_folded + _live_fold_flops(m) < cost.flops_original):
            decision, why = True, "the cost model predicts fewer FLOPs folded" + (
                " (M_h computed per call included)" if m.v.live or m.o.live else "")
        else:
            decision, why = False, (f"the cost model predicts the folded form costs more "
                                    f"({cost.flops_folded:.4g} vs {cost.flops_original:.4g} FLOP, "
                                    f"{cost.flops_folded / max(1, cost.flops_original):.2f}x)")
        if decision and "triton" in (spec.backend, ctx.backend) and m.o.out_features > _TRITON_MAX_DV:
            decision, why = False, (f"the folded value head dim {m.o.out_features} exceeds what the triton "
                                    f"backend runs ({_TRITON_MAX_DV})")
        live = m.v.live or m.o.live
        if decision and not ctx.inference and not live:
            shared = [nm for nm, t in (("W_V", m.v.weight), ("W_O", m.o.weight)) if len(weight_users(gm, t)) > 1]
            if shared:
                decision, why = False, f"{' and '.join(shared)} also used elsewhere; folding would untie them in training"
        if cost is not None:
            ctx.notes.append(f"{NAME} {rep.name}: {cost.summary()} -> {'folded' if decision else 'not folded'} ({why})")
        if not decision:
            rep.details[NAME] = f"not applied: {why}"
            ctx.count(NAME, "declined")
            continue
        bias = ("value bias folded into b' (rows of S sum to 1)" if not rows
                else f"value bias kept per head in V' ({rows})") if m.v.bias is not None else "no value bias"
        _apply(gm, site, m, per_head_bias=bool(rows), trainable=not ctx.inference)
        rep.rewrites.append(NAME)
        rep.details[NAME] = (f"applied: {why}; H={m.H}, M_h {m.v.in_features}x{m.o.out_features}, {bias}; "
                             f"the op now runs with value head dim {m.o.out_features}"
                             + (f"; M_h computed in the graph from the weights it reads at run time "
                                f"({_live_fold_flops(m)} FLOP per call, gradients reach W_V and W_O)" if live
                                else "; folded matrices are trainable parameters" if not ctx.inference else ""))
        ctx.count(NAME, "applied")
        modified = True
        log.debug("fold_wv_wo %s: %s", rep.name, rep.details[NAME])
    return PassResult(gm, modified)
