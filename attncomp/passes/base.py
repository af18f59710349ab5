"""Shared pass infrastructure: the pass result, the compile context, per-site report entries, counters."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch.fx as fx

from ..policy import Dense, Policy

__all__ = ["PassResult", "CompileContext", "SiteReport", "counters", "SITE_META", "MASK_FILL_MAX"]

#: ``node.meta`` key holding the :class:`SiteReport` of an ``attncomp::attention`` node
SITE_META = "attncomp_site"
#: a mask value at or below this excludes the entry: models fill disallowed logits with ``-inf``,
#: ``finfo(dtype).min`` (or a fraction of it) or ``-1e4``, all of which dense attention weighs exactly 0
MASK_FILL_MAX = -1e4

#: process-wide counters, e.g. ``counters["match_attention"]["rewritten"]``; tests read and clear them
counters: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool


@dataclass
class SiteReport:
    """One attention site as the report shows it."""

    name: str
    rewritten: bool
    policy: str
    pattern: str = ""
    rewrites: List[str] = field(default_factory=list)
    reason: Optional[str] = None
    spec: Optional[str] = None
    details: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CompileContext:
    """What every pass may read: the policy and backend of this compile, and what it found."""

    policy: Policy = field(default_factory=Dense)
    backend: str = "auto"
    #: True when the compiled module will run with frozen weights (eval mode, no grads)
    inference: bool = False
    #: per-compile counters (also added to the process-wide ``counters``)
    counters: Dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    #: every site found, rewritten or not, in graph order
    sites: List[SiteReport] = field(default_factory=list)
    #: free-form notes of passes for the report (e.g. cost model figures)
    notes: List[str] = field(default_factory=list)
    capture: str = ""
    #: the compiled graphs run as CUDA graphs (Inductor's ``mode="reduce-overhead"``): no host time
    #: between kernels, so choices between kernels compare device time only
    cuda_graphs: bool = False
    #: Inductor's mode of this compile (``attncomp.compile(mode=...)``): under ``"max-autotune"`` the runtime
    #: may time kernels for the passes' choices (:func:`attncomp.runtime.dispatch.inline_choice`)
    mode: Optional[str] = None
    #: the real values the graph's placeholders take on the call being compiled (dynamo capture), by
    #: placeholder name; passes may evaluate small subgraphs on them to check what they derived
    example_inputs: Optional[Dict[str, Any]] = None

    def count(self, pass_name: str, what: str, n: int = 1) -> None:
        self.counters[pass_name][what] += n
        counters[pass_name][what] += n
