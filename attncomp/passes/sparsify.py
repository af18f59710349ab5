"""Apply the compile's sparsification policy to every attention site.

Matches: every ``attncomp::attention`` node (its spec's policy is ``dense`` after matching).

Requires: :mod:`.match_attention` ran.

Guarantees: each site's spec carries the compile policy, resolved for the site's dtype where known
(DFSS 2:4 for fp16/bf16, 1:2 for fp32); for ``hash``/``drop`` without caller-given tensors, a node
computing the buckets (LSH) or keep masks (a fresh seeded draw per training call) feeds the op, so
the op always receives explicit per-token tensors. ``dense`` and ``et`` keep every allowed entry:
those sites compute exactly what the model computed.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .. import ops
from ..policy import SPION, Drop, Hash
from ..spec import AttentionSpec
from .base import SITE_META, CompileContext, PassResult

__all__ = ["sparsify"]


def sparsify(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    pol = ctx.policy
    for n in list(gm.graph.nodes):
        if not ops.is_attention_node(n):
            continue
        rep = n.meta.get(SITE_META)
        spec = AttentionSpec.from_json(n.args[7])
        dt = spec.torch_dtype()
        new_pol = pol.resolved(dt) if dt is not None else pol
        if isinstance(pol, SPION) and n.args[6] is None:
            if rep is not None:
                rep.details["sparsify"] = ("kept dense: policy 'spion' needs a block pattern per layer "
                                           "(calibration not run)")
            ctx.count("sparsify", "skipped")
            continue
        args = list(n.args)
        args[7] = spec.replace(policy=new_pol).to_json()
        if isinstance(pol, (Hash, Drop)) and n.args[4] is None:
            with gm.graph.inserting_before(n):
                draw = gm.graph.call_function(ops.next_seed, (getattr(pol, "seed", 0),)) \
                    if isinstance(pol, Drop) else None
                aux = gm.graph.call_function(ops.policy_aux, (args[7], args[0], args[1], draw))
                args[4] = gm.graph.call_function(operator.getitem, (aux, 0))
                args[5] = gm.graph.call_function(operator.getitem, (aux, 1))
        n.args = tuple(args)
        if rep is not None:
            rep.policy = pol.name
            rep.spec = spec.replace(policy=new_pol).describe()
            if pol.name not in ("dense",):
                rep.rewrites.append(f"policy {new_pol.describe()}")
        ctx.count("sparsify", pol.name)
        modified = True
    return PassResult(gm, modified)
