"""Turn an ALiBi bias left in a site's mask into the spec's ALiBi modifier (DESIGN.md §4.2).

Matches: every ``attncomp::attention`` node whose float ``attn_mask`` (what :mod:`.analyze_mask` left once
the masks became predicates) is computed as a per-head slope times a position, however the model spells
it: the mask's subgraph holds a product of an ``(H,)``-sized value that depends on no model input (the
slopes: Bloom's ``torch.pow(base, arange)``, a buffer, a parameter) and a position tensor (Bloom's
``(cumsum(attention_mask) - 1) * attention_mask``, or ``arange(Nk) - arange(Nq)``), reshaped and broadcast
to the logits.

Requires: :mod:`.analyze_mask` ran; the real example inputs of the compile (``ctx.example_inputs``,
dynamo capture) to evaluate the mask.

Guarantees: the check of DESIGN.md §7 holds before anything changes: the graph's mask and the slopes are
evaluated on the example inputs, and on every entry the op allows (its predicates, evaluated the same way),
``mask - slope[h] * (k_pos[j] - q_pos[i])`` must be one value per query row (a shift the softmax and every
policy's selection ignore: Bloom's positions count from each row's first valid key) within float32
rounding. Then the spec gets ``alibi=True``, the slopes (reshaped to ``(H,)``) become the op's
``alibi_slopes`` and the mask goes. Otherwise the mask stays and ``details["modifiers"]`` says why. The
check runs at the example's shapes and padding only (the mask reads the input's padding, which another
shape cannot be given): a model whose positions differ from ``arange`` by more than a per-row shift on
other inputs would not be caught.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from ..codegen.reference import predicate_mask
from ..spec import Predicates
from .base import MASK_FILL_MAX, CompileContext, PassResult
from .node_info import attention_sites, meta_shape, set_op_args, set_spec, site_report, spec_of, static_int
from .relative_bias import _Keep, _arg, _ancestors, _evaluate, _placeholder_values, _positions

log = logging.getLogger(__name__)

__all__ = ["alibi"]

NAME = "alibi"
_MULS = (torch.mul, operator.mul)


def _is_input(p: fx.Node) -> bool:
    """A placeholder that is a model input: not a size, nor a parameter or buffer dynamo lifted."""
    ev = p.meta.get("example_value", p.meta.get("val"))
    if isinstance(ev, (int, torch.SymInt)):
        return False
    return not (isinstance(ev, torch.nn.Parameter) or "_parameters_" in p.name or "_buffers_" in p.name)


def _depends_on_placeholder(n: fx.Node, sizes: bool = True) -> bool:
    """Whether ``n`` depends on a model input (or, with ``sizes``, on a symbolic size)."""
    return any(a.op == "placeholder" and (_is_input(a) or sizes and isinstance(
        a.meta.get("example_value", a.meta.get("val")), (int, torch.SymInt))) for a in _ancestors([n]))


def _slopes(mask: fx.Node, heads: int) -> Optional[fx.Node]:
    """The ``(H,)``-sized, input-independent factor of a product in the mask's subgraph, or None."""
    for n in _ancestors([mask]):
        if n.op != "call_function" or n.target not in _MULS or len(n.args) != 2:
            continue
        for a, b in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            shp = meta_shape(a)
            if shp is None:
                continue
            dims = [static_int(d) for d in shp]
            if None in dims or [d for d in dims if d != 1] != [heads]:
                continue
            if not _depends_on_placeholder(a) and _depends_on_placeholder(b):
                return a
    return None


def _check(gm, ctx, node, spec, mask: fx.Node, slopes: fx.Node) -> None:
    values = _placeholder_values(gm, ctx)
    if not values:
        raise _Keep("no example inputs to check the bias against (dynamo capture gives them)")
    names = Predicates._fields
    pred_nodes = [_arg(node, n) for n in names]
    got = _evaluate(gm, [mask, slopes] + pred_nodes, values, None)
    m, s = (t.detach() if isinstance(t, torch.Tensor) else t for t in got[:2])
    preds = Predicates(*got[2:])
    if not isinstance(m, torch.Tensor) or m.dim() != 4:
        raise _Keep("the mask is not a 4-D tensor")
    q = meta_shape(_arg(node, "q"))
    k = meta_shape(_arg(node, "k"))
    nq, nk = static_int(q[2]) if q else None, static_int(k[2]) if k else None
    if nq is None or nk is None:
        hq = [x for x in (preds.q_valid, preds.q_pos) if x is not None]
        nq = nq or (hq[0].shape[-1] if hq else m.shape[-2])
        nk = nk or m.shape[-1]
    m = m.double().expand(m.shape[0], m.shape[1], nq, nk)
    qp = _positions(spec, preds.q_pos, nq, nk, True)
    kp = _positions(spec, preds.k_pos, nk, nq, False)
    rel = (kp[:, None, None, :] - qp[:, None, :, None]).double()
    d = m - s.double().reshape(1, -1, 1, 1) * rel
    allowed = predicate_mask(spec, nq, nk, m.device, preds)
    if allowed is None:
        allowed = torch.ones_like(d, dtype=torch.bool)
    shape = torch.broadcast_shapes(d.shape, allowed.shape)
    d, allowed, m = d.expand(shape), allowed.expand(shape), m.expand(shape)
    if not bool(allowed.any()):
        raise _Keep("no entry is allowed on the example inputs: nothing to check against")
    if bool((allowed & (m <= MASK_FILL_MAX)).any()):
        raise _Keep("the mask also excludes entries (values <= -1e4) that no predicate does")
    big = float("inf")
    hi = torch.where(allowed, d, torch.full_like(d, -big)).amax(-1)
    lo = torch.where(allowed, d, torch.full_like(d, big)).amin(-1)
    rows = allowed.any(-1)
    spread = float(torch.where(rows, hi - lo, torch.zeros_like(hi)).max())
    tol = 1e-5 * max(1.0, float(m.abs().amax()))
    if spread > tol:
        raise _Keep(f"the bias is not slope[h] * (k_pos - q_pos) plus a per-row shift on the example inputs "
                    f"(rows vary by {spread:.3g})")


def alibi(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    for node in attention_sites(gm):
        mask = _arg(node, "attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        spec = spec_of(node)
        if spec.modifiers() or spec.mask_kind == "bool":
            continue
        q = meta_shape(_arg(node, "q"))
        heads = static_int(q[1]) if q is not None and len(q) == 4 else None
        slopes = _slopes(mask, heads) if heads else None
        if slopes is None:
            continue
        rep = site_report(node, ctx)
        try:
            _check(gm, ctx, node, spec, mask, slopes)
        except _Keep as e:
            rep.details["modifiers"] = f"materialised bias: {e}"
            ctx.count(NAME, "kept")
            continue
        except Exception as e:  # noqa: BLE001 - an evaluation that fails keeps the bias
            rep.details["modifiers"] = f"materialised bias: the check could not run ({type(e).__name__}: {e})"
            ctx.count(NAME, "kept")
            continue
        with gm.graph.inserting_before(node):
            flat = gm.graph.call_method("reshape", (slopes, -1))
        set_op_args(node, attn_mask=None, alibi_slopes=flat)
        new = spec.replace(alibi=True, mask_kind="none")
        set_spec(node, new, rep)
        rep.details["modifiers"] = "alibi (checked against the graph's bias on the example inputs)"
        rep.rewrites.append("alibi bias -> spec modifier")
        ctx.count(NAME, "rewritten")
        modified = True
    return PassResult(gm, modified)
