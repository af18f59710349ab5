"""The pass pipeline: an ordered list of passes, run with a graph lint after each in debug mode.

A pass that raises is named in the error together with the passes that ran before it;
``ATTNCOMP_DEBUG=1`` logs the graph after every pass.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, List, Sequence, Tuple

import torch
import torch.fx as fx

from .base import CompileContext, PassResult
from .node_info import mutates

log = logging.getLogger(__name__)

__all__ = ["PassError", "default_passes", "run_passes"]

Pass = Callable[[fx.GraphModule, CompileContext], PassResult]


class PassError(RuntimeError):
    pass


def _side_effect_targets():
    out = set()
    try:
        from torch._functorch import predispatch

        out |= {predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting}
    except (ImportError, AttributeError):
        pass
    for nm in ("_vmap_increment_nesting", "_vmap_decrement_nesting"):
        f = getattr(torch._C._functorch, nm, None)
        if f is not None:
            out.add(f)
    return out


_SIDE_EFFECTS = _side_effect_targets()


def _is_impure(node: fx.Node) -> bool:
    """fx's impurity, in-place writes (:func:`~.node_info.mutates`), and the calls that open and close a
    ``torch.vmap`` level in dynamo graphs: they have no users, but removing them breaks the batched
    tensors between them."""
    return (node.is_impure() or mutates(node)
            or (node.op == "call_function" and node.target in _SIDE_EFFECTS))


def default_passes() -> List[Tuple[str, Pass]]:
    """The compile pipeline after capture, in order."""
    from . import (alibi, analyze_mask, canonicalize, decompose_mha, match_attention, relative_bias, scale_reorder,
                   fold_wv_wo, sparsify, select_backend, unflatten_heads)

    return [
        ("decompose_mha", decompose_mha.decompose_mha),
        ("canonicalize", canonicalize.canonicalize),
        ("unflatten_heads", unflatten_heads.unflatten_heads),
        ("match_attention", match_attention.match_attention),
        ("analyze_mask", analyze_mask.analyze_mask),
        ("relative_bias", relative_bias.relative_bias),
        ("alibi", alibi.alibi),
        ("scale_reorder", scale_reorder.scale_reorder),
        ("fold_wv_wo", fold_wv_wo.fold_wv_wo),
        ("sparsify", sparsify.sparsify),
        ("select_backend", select_backend.select_backend),
    ]


def run_passes(gm: fx.GraphModule, ctx: CompileContext, passes: Sequence[Tuple[str, Pass]] = None) -> fx.GraphModule:
    passes = default_passes() if passes is None else passes
    debug = os.environ.get("ATTNCOMP_DEBUG", "0") == "1"
    done: List[str] = []
    for name, fn in passes:
        try:
            res = fn(gm, ctx)
        except Exception as e:
            raise PassError(f"pass {name!r} failed (after {', '.join(done) or 'capture'}): {e}") from e
        gm = res.graph_module
        if res.modified:
            gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
            gm.recompile()
        if debug:
            gm.graph.lint()
            log.warning("attncomp: graph after %s:\n%s", name, gm.graph)
        done.append(name)
    return gm
