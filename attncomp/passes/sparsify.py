"""Apply the compile's sparsification policy to every attention site.

Matches: every ``attncomp::attention`` node (its spec's policy is ``dense`` after matching).

Requires: :mod:`.match_attention` ran.

Guarantees: each site's spec carries the compile policy, resolved for the site's dtype where known
(DFSS 2:4 for fp16/bf16, 1:2 for fp32). ``hash`` sites without caller-given buckets keep
``q_aux``/``k_aux`` empty: the buckets depend only on q, k and the policy's fixed seed, so the op
derives them itself, forward and backward alike (fused with the sort in the Triton kernels, through
:func:`attncomp.ops.materialize_aux` on every other backend). ``drop`` sites without caller-given
masks keep them empty too and get the op's seed from :func:`attncomp.ops.next_seed` (fresh per
training call, the policy's seed in eval mode): the op draws the masks from it, forward and backward
alike (fused with the sort in the Triton kernels), so both see the same draw. ``dense``
and ``et`` keep every allowed entry: those sites compute exactly what the model computed. ``spion``
sites without a caller-given pattern get an ``attncomp::spion_pattern`` node (:mod:`attncomp.spion`)
that feeds the op every block while the site is in its dense phase and its calibrated pattern after
it switches (Alg. 2), and an ``attncomp::spion_record`` node after the op that records the call's
pooled attention statistic from q, k, the masks and the op's ``lse`` when the pattern node ran it
dense for recording (its zero scalar is added to the op's output, so it stays in the data flow); the
pattern also lives in a graph buffer, so exported packages keep it.
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.fx as fx

from .. import ops, spion
from ..policy import SPION, Drop, Hash
from ..spec import AttentionSpec
from .base import MASK_FILL_MAX, SITE_META, CompileContext, PassResult

__all__ = ["sparsify"]


def sparsify(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    modified = False
    pol = ctx.policy
    n_spion = 0
    for n in list(gm.graph.nodes):
        if not ops.is_attention_node(n):
            continue
        rep = n.meta.get(SITE_META)
        A = ops.ARG_INDEX
        spec = AttentionSpec.from_json(n.args[A["spec"]])
        dt = spec.torch_dtype()
        new_pol = pol.resolved(dt) if dt is not None else pol
        args = list(n.args)
        if isinstance(pol, SPION):
            # kernels depend only on the block size; the training knobs stay in the compile's state
            new_pol = SPION(block_size=pol.block_size)
        args[A["spec"]] = spec.replace(policy=new_pol).to_json()
        if isinstance(pol, SPION) and n.args[A["block_pattern"]] is None:
            args[A["block_pattern"]] = _spion_pattern_node(gm, ctx, n, args, pol, rep, n_spion)
            # the pattern node's args end with (spec, key, block_size, heads)
            _spion_record_node(gm, n, args, args[A["block_pattern"]].args[-3])
            n_spion += 1
        derived = isinstance(pol, Hash) and n.args[A["q_aux"]] is None
        cached = derived and _buckets_from_cache(gm, n, args, pol)
        derived = derived and not cached
        drawn = isinstance(pol, Drop) and n.args[A["q_aux"]] is None and n.args[A["k_aux"]] is None
        old_seed = args[A["seed"]]
        if drawn:
            # the op draws the keep masks from its seed (forward and backward alike): a fresh seed per
            # training call, the policy's in eval mode; the site's dropout, if any, draws from the same
            # seed in streams of its own
            with gm.graph.inserting_before(n):
                args[A["seed"]] = gm.graph.call_function(ops.next_seed, (pol.seed,))
        lowest = _exclude_lowest(gm, n, args, new_pol)
        n.args = tuple(args)
        if drawn and isinstance(old_seed, fx.Node) and not old_seed.users:
            gm.graph.erase_node(old_seed)
        if rep is not None:
            rep.policy = pol.name
            rep.spec = spec.replace(policy=new_pol).describe()
            if pol.name not in ("dense",):
                rep.rewrites.append(f"policy {new_pol.describe()}")
            if cached:
                rep.details["buckets"] = _CACHED
            elif derived:
                rep.details["buckets"] = ("derived inside the op from q and k (LSH, fixed seed), forward and "
                                          "backward: fused with the sort in the Triton kernels, "
                                          "attncomp.ops.materialize_aux on other backends")
            if lowest:
                rep.details["mask"] = (rep.details.get("mask", "materialised") + "; " + lowest)
            if drawn:
                rep.details["keep masks"] = ("drawn inside the op from the site's seed (fresh per training call, "
                                             f"the policy's seed {pol.seed} in eval mode), forward and backward "
                                             "alike: fused with the sort in the Triton kernels, "
                                             "attncomp.ops.materialize_aux on other backends")
        ctx.count("sparsify", pol.name)
        modified = True
    return PassResult(gm, modified)


#: queries per call at most of a call given a KV cache's buckets (the decode kernels' ``MAX_QUERIES``; the passes do
#: not import the Triton backend)
_DECODE_QUERIES = 16
#: the report's words for a site whose decoding steps take the buckets a KV cache keeps
_CACHED = ("decoding steps: the keys' kept in the KV cache, each computed once when its key was appended "
           "(attncomp::lsh in the cache's update), the queries' by attncomp::lsh before the op; calls of more than "
           f"{_DECODE_QUERIES} queries (a prefill) derive them inside the op")


def _buckets_from_cache(gm: fx.GraphModule, n: fx.Node, args: list, pol: Hash) -> bool:
    """Give a ``hash`` site the buckets that a KV cache layer keeps for its keys (:mod:`attncomp.kvcache`), and its
    queries' from an ``attncomp::lsh`` node; returns whether it did. The site's keys must be the layer's keys as
    the layer's ``update`` returns them, and its buckets must be written from the same appended keys in the same
    way: a dynamic layer concatenates both (``cat([keys, new], -2)``, ``cat([buckets, lsh(new)], -1)``), a static
    one copies both in place along the sequence (``keys.index_copy_(2, pos, new)``,
    ``buckets.index_copy_(2, pos, lsh(new))``, before the site), the keys possibly upcast to float32 on the way
    (:func:`_before_upcast`). Anything else (keys repeated for GQA, reshaped, sliced, converted to a lower precision;
    another policy's buckets) derives them in the op as before, and so do calls that may have more than
    :data:`_DECODE_QUERIES` queries (a prefill: its queries see about all of the keys, and the op's own derivation
    sorts them by bucket in one pass)."""
    A = ops.ARG_INDEX
    k = _before_upcast(args[1])
    kv = getattr(k, "meta", {}).get("val") if isinstance(k, fx.Node) else None
    qv = getattr(args[0], "meta", {}).get("val") if isinstance(args[0], fx.Node) else None
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or not isinstance(kv.shape[1], int):
        return False
    if not isinstance(qv, torch.Tensor) or not isinstance(qv.shape[2], int) or qv.shape[2] > _DECODE_QUERIES:
        return False
    lsh_args = (kv.shape[1], pol.n_buckets, pol.seed)

    def lsh_of(new):
        return [u for u in new.users if u.op == "call_function" and u.target in _LSH and tuple(u.args[1:4]) == lsh_args]

    kb = None
    if k.op == "call_function" and k.target is torch.cat and _cat_dim(k) in (-2, 2) and len(k.args[0]) == 2:
        new_lsh = lsh_of(k.args[0][1])
        for b in (x for u in new_lsh for x in u.users):
            if (b.op == "call_function" and b.target is torch.cat and _cat_dim(b) in (-1, 2)
                    and len(b.args[0]) == 2 and b.args[0][1] in new_lsh):
                kb = b
    else:
        order = {u: i for i, u in enumerate(gm.graph.nodes)}
        for w in k.users:
            if not (_copies_along_sequence(w) and w.args[0] is k and order[w] < order[n]):
                continue
            for b in (x for u in lsh_of(w.args[3]) for x in u.users):
                if _copies_along_sequence(b) and b.args[3].target in _LSH and order[b] < order[n]:
                    kb = b.args[0]
    bv = getattr(kb, "meta", {}).get("val") if kb is not None else None
    if not isinstance(bv, torch.Tensor) or bv.dtype != torch.int32 or not _same_sizes(bv.shape, kv.shape[:3]):
        return False
    with gm.graph.inserting_before(n):
        qb = gm.graph.call_function(torch.ops.attncomp.lsh.default, (args[0],) + lsh_args)
    qb.meta["val"] = qv.new_empty(qv.shape[:3], dtype=torch.int32)
    args[A["q_aux"]], args[A["k_aux"]] = qb, kb
    return True


_LSH = (torch.ops.attncomp.lsh.default, torch.ops.attncomp.lsh)


_UPCASTS = (torch.float16, torch.bfloat16, torch.float32)


def _before_upcast(node):
    """The keys before a conversion to float32 that keeps their values (``keys.to(torch.float32)`` of half or float32
    keys, as GPT-Neo, GPT-J and CodeGen upcast them): their buckets are the converted keys' buckets, since the LSH
    computes in float32 from half inputs too (:func:`attncomp.policy.lsh_side`)."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("to", "float") and node.args:
        src = node.args[0]
        out = node.meta.get("val")
        inp = getattr(src, "meta", {}).get("val") if isinstance(src, fx.Node) else None
        if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == torch.float32
                and inp.dtype in _UPCASTS and out.device == inp.device):
            break
        node = src
    return node


def _same_sizes(a, b) -> bool:
    """Whether two shapes had the same sizes in the example the graph was traced with (symbolic sizes by their hints:
    a comparison of two symbols would add a guard after the trace). A dynamic cache's keys and buckets have lengths of
    their own symbols, equal by construction (the same appends); this is a check of the structure matched, not the
    proof."""
    def hint(x):
        return x if isinstance(x, int) else getattr(getattr(x, "node", None), "hint", None)

    return len(a) == len(b) and all(hint(x) is not None and hint(x) == hint(y) for x, y in zip(a, b))


def _cat_dim(node: fx.Node):
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)


def _copies_along_sequence(node: fx.Node) -> bool:
    """``x.index_copy_(2, pos, src)`` (a static cache layer's write)."""
    return (node.op == "call_method" and node.target == "index_copy_" and len(node.args) == 4
            and node.args[1] in (2, -2) and isinstance(node.args[3], fx.Node))


def _exclude_lowest(gm: fx.GraphModule, n: fx.Node, args: list, pol) -> str:
    """A float mask that stays materialised, under a policy that does not keep every allowed entry: its entries at
    or below :data:`MASK_FILL_MAX` (a model's fill for disallowed logits: ``finfo(dtype).min`` or a fraction of it,
    ``-1e4``; what the mask passes count as excluded) become ``-inf``, so that they are disallowed (DESIGN §4)
    rather than allowed with a huge negative bias. Dense attention weighs them 0 whenever a row has any other
    entry; a policy that drops a row's other entries (no earlier key in the query's bucket, every such key dropped)
    would otherwise keep them and attend to the tokens the model masked (future or padding). Returns the report's
    words, or ``""``."""
    A = ops.ARG_INDEX
    mask = args[A["attn_mask"]]
    val = getattr(mask, "meta", {}).get("val") if isinstance(mask, fx.Node) else None
    if pol.keeps_all() or not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return ""
    with gm.graph.inserting_before(n):
        low = gm.graph.call_function(torch.le, (mask, MASK_FILL_MAX))
        args[A["attn_mask"]] = gm.graph.call_function(torch.masked_fill, (mask, low, float("-inf")))
    low.meta["val"] = val.new_empty(val.shape, dtype=torch.bool)
    args[A["attn_mask"]].meta["val"] = val
    return f"its entries <= {MASK_FILL_MAX:g} (the model's fill for masked logits) made -inf: the policy keeps none"


def _spion_record_node(gm: fx.GraphModule, n: fx.Node, args, key: str) -> None:
    """After the site: ``attncomp::spion_record`` (the statistic of a recorded call, from q, k, the
    masks and the op's ``lse``), whose zero scalar is added to the op's output, so that it stays in
    the data flow."""
    A = ops.ARG_INDEX
    outs = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
    if not outs:
        return
    lse = next((u for u in n.users if u.op == "call_function" and u.target is operator.getitem
                and u.args[1] == 1), None)
    preds = [args[A[p]] for p in ops.PRED_NAMES]
    order = {u: i for i, u in enumerate(gm.graph.nodes)}
    anchor = max(outs + ([lse] if lse is not None else []), key=order.__getitem__)
    if lse is None:
        with gm.graph.inserting_after(anchor):
            lse = anchor = gm.graph.call_function(operator.getitem, (n, 1))
    with gm.graph.inserting_after(anchor):
        zero = gm.graph.call_function(torch.ops.attncomp.spion_record.default,
                                      (args[0], args[1], args[A["attn_mask"]], *preds, lse, args[A["spec"]], key))
    for out in outs:
        users = list(out.users)
        with gm.graph.inserting_after(zero):
            added = gm.graph.call_function(operator.add, (out, zero))
        for u in users:
            u.replace_input_with(out, added)
        added.meta.update({k: v for k, v in out.meta.items() if k == "val"})


def _spion_pattern_node(gm: fx.GraphModule, ctx: CompileContext, n: fx.Node, args, pol: SPION, rep,
                        i: int) -> fx.Node:
    """A node computing the site's block pattern per call (:func:`attncomp.spion._spion_pattern`):
    every block during the site's dense phase (recording its statistic), its pattern after."""
    A = ops.ARG_INDEX
    st = spion.state_for(pol)
    qv = getattr(args[0], "meta", {}).get("val")
    heads = qv.shape[1] if isinstance(qv, torch.Tensor) and qv.dim() == 4 and isinstance(qv.shape[1], int) else None
    site = st.site(rep.name if rep is not None else n.name, heads)
    stored_attr = None
    if "dynamo" not in ctx.capture and "torch.compile" not in ctx.capture:
        # graphs that torch.export may trace (attncomp.export) hold the pattern in a non-persistent
        # buffer, saved with the exported program; dynamo graphs (whose buffers must have a source in
        # the user's module) read the live state only
        stored_attr = f"_spion_pattern_{i}"
        while hasattr(gm, stored_attr):
            stored_attr += "_"
        gm.register_buffer(stored_attr, st.stored(site), persistent=False)
        site.buffers.append((weakref.ref(gm), stored_attr))
    if rep is not None:
        site.reports.append(rep)
        rep.details["spion"] = site.describe()
    preds = [args[A[p]] if p in A else None for p in ops.PRED_NAMES] if hasattr(ops, "PRED_NAMES") else [None] * 6
    with gm.graph.inserting_before(n):
        stored = gm.graph.get_attr(stored_attr) if stored_attr is not None else None
        return gm.graph.call_function(torch.ops.attncomp.spion_pattern.default,
                                      (args[0], args[1], args[A["attn_mask"]], *preds, stored, args[A["spec"]],
                                       st.key(site), pol.block_size, 0 if pol.per_head else 1))
