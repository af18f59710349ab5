"""Backend selection: fix each site's backend and state the rule that picks its kernel per call.

Matches: every ``attncomp::attention`` node.

Requires: the rewrites (scale reordering, folding, sparsification) have run; the spec is final
apart from ``backend``.

Guarantees: a site whose spec says ``backend="auto"`` takes the compile's backend when the caller
named one (``ctx.backend``); otherwise it stays ``auto`` and ``attncomp.runtime.dispatch`` chooses
per call (E.T. §3.2, sequence-length-aware lowering):

* CPU tensors: SDPA's CPU kernel for a policy that keeps every allowed entry without dropout; TVM's
  kernels for a large sparse call where apache-tvm is installed; otherwise the reference (exact).
  CUDA without Triton: SDPA where it computes the call, else the reference.
* CUDA with Triton, dense sites: SDPA's kernel or the Triton kernel, as the runtime chooses
  (:func:`attncomp.runtime.dispatch.describe_choice` says how). Sparse sites: the fused, on-the-fly
  kernel (one pass over K/V per query tile, no N×N intermediate) when the call's key length ``Nk`` is
  at most the measured threshold ``T`` for (policy, head dim D, dtype, GPU arch), the split form
  (``QK^T`` GEMM, softmax, ``AV`` GEMM) when ``Nk > T``; with no stored measurement, fused for every
  ``Nk``.

``SiteReport.details["select_backend"]`` states the rule in these terms (with ``T`` when a
measurement is stored for the GPU present at compile time). The graph only changes when a named
backend is written into a spec. Never imports triton or tvm.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime import dispatch
from .node_info import attention_sites, device_of, dtype_of, head_dim, set_spec, site_report, spec_of
from .base import CompileContext, PassResult

__all__ = ["select_backend"]

NAME = "select_backend"


def _rule_text(spec, site: fx.Node) -> str:
    """What ``auto`` runs for the site, per device (the rule dispatch applies per call)."""
    dev = device_of(site.args[0])
    d = head_dim(site, spec)
    dt = dtype_of(site.args[0]) or spec.torch_dtype()
    s = spec.replace(head_dim=d) if spec.head_dim is None and d is not None else spec
    parts = [] if dev is not None and dev.type == "cuda" else ["on CPU: " + dispatch.describe_choice(s, "cpu", dt)]
    parts.append("on CUDA: " + dispatch.describe_choice(s, "cuda", dt))
    return "auto, per call: " + "; ".join(parts)


def select_backend(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    """Write the compile's named backend into each site, or annotate the per-call ``auto`` rule."""
    modified = False
    for site in attention_sites(gm):
        rep = site_report(site, ctx)
        spec = spec_of(site)
        if spec.backend == "auto" and ctx.backend not in (None, "auto"):
            spec = spec.replace(backend=ctx.backend)
            set_spec(site, spec, rep)
            modified = True
        if spec.backend != "auto":
            rep.details[NAME] = f"{spec.backend} (as asked); an error names the reason if it cannot run a call"
            ctx.count(NAME, "named")
        else:
            rep.details[NAME] = _rule_text(spec, site)
            ctx.count(NAME, "auto")
    return PassResult(gm, modified)
