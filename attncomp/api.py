"""Public API: ``compile``, ``backend`` (the torch.compile route), ``report``, ``export``, ``load``."""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import ops
from .passes.base import CompileContext, SiteReport
from .passes.capture import CaptureError, capture, split_inputs
from .passes.pipeline import run_passes
from .policy import Policy, get_policy
from .spec import BACKENDS

log = logging.getLogger(__name__)

__all__ = ["compile", "backend", "report", "export", "load", "CompiledModule", "Report", "CaptureError"]

_FALLBACKS = ("error", "eager")


@dataclass
class Report:
    """What a compile found and did: one entry per attention site, plus counters and notes."""

    sites: List[SiteReport] = field(default_factory=list)
    policy: str = ""
    backend: str = ""
    capture: str = ""
    counters: Dict[str, Dict[str, int]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    @property
    def rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def __str__(self) -> str:
        lines = [f"attncomp report: policy={self.policy}, backend={self.backend}",
                 f"capture: {self.capture}",
                 f"{len(self.sites)} attention site(s), {self.rewritten} rewritten", ""]
        rows = [("site", "rewritten", "policy", "pattern")]
        rows += [(s.name, "yes" if s.rewritten else "NO", s.policy, s.pattern or "-") for s in self.sites]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        for s in self.sites:
            lines.append("")
            lines.append(f"[{s.name}]")
            if not s.rewritten:
                lines.append(f"  not rewritten: {s.reason}")
                continue
            if s.spec:
                lines.append(f"  spec: {s.spec}")
            lines.append(f"  rewrites: {', '.join(s.rewrites) or '-'}")
            for k, v in s.details.items():
                if k == "notes":
                    for note in v:
                        lines.append(f"  note: {note}")
                else:
                    lines.append(f"  {k}: {v}")
        if self.notes:
            lines.append("")
            lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    __repr__ = __str__


def _make_report(ctx: CompileContext) -> Report:
    return Report(sites=ctx.sites, policy=ctx.policy.describe(), backend=ctx.backend, capture=ctx.capture,
                  counters={k: dict(v) for k, v in ctx.counters.items()}, notes=ctx.notes)


def _check_options(policy, backend: str, fallback: str) -> Policy:
    pol = get_policy(policy)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
    return pol


def _frozen(model: nn.Module) -> bool:
    return not model.training and not any(p.requires_grad for p in model.parameters())


class CompiledModule(nn.Module):
    """The compiled model: same call signature and outputs as the original.

    One graph is captured per training mode and per call structure (which arguments are given, which
    are ``None``, tensor dtypes and devices, the values of non-tensor arguments: what tracing bakes
    in); shapes stay symbolic, so
    new batch sizes and sequence lengths reuse the graph. Graphs share the original's parameters (plus
    any folded copies rewrites made); each is traced from a structural copy of the model, so switching
    ``train()``/``eval()`` here never changes the user's module.
    """

    def __init__(self, model: nn.Module, policy: Policy, backend: str, example_inputs, inference: Optional[bool],
                 fallback: str, options: Dict[str, Any]):
        super().__init__()
        self._policy, self._backend, self._fallback = policy, backend, fallback
        self._inference, self._options = inference, options
        self._lock = threading.RLock()
        self._report: Optional[Report] = None
        self._example = None
        self._eager = False
        self.graphs = nn.ModuleDict()
        self._keys: Dict[Any, str] = {}
        self._static: Dict[Any, bool] = {}
        object.__setattr__(self, "_original", model)  # not a submodule: parameters are not listed twice
        self.training = model.training
        if example_inputs is not None:
            args, kwargs = split_inputs(example_inputs)
            self._example = (args, kwargs)
            self._graph_for(args, kwargs)

    @property
    def original(self) -> nn.Module:
        return self._original

    @property
    def graph_module(self) -> Optional[fx.GraphModule]:
        """The graph of the most recent capture (``None`` before the first)."""
        if not len(self.graphs):
            return None
        return self.graphs[list(self.graphs.keys())[-1]]

    def train(self, mode: bool = True):
        # graphs are per mode; exported graphs refuse train(), and module flags must not leak to the user
        self.training = bool(mode)
        return self

    def _structure(self, args, kwargs):
        """Keyword form of a call and the key of its structure."""
        sig = inspect.signature(self._original.forward)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"compiled {type(self._original).__name__}: {e}") from None
        call = {}
        for name, val in bound.arguments.items():
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                call.update(val)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                return None, None  # *args: keep the positional form
            else:
                call[name] = val
        leaves, spec = tree_flatten(call)
        return call, (self.training, str(spec), tuple(_kind(x) for x in leaves))

    def _graph_for(self, args, kwargs):
        call, key = self._structure(args, kwargs)
        if call is None:
            call, key = None, (self.training, "positional", tuple(_kind(a) for a in args))
        shape_key = key + (tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                                 if isinstance(t, torch.Tensor)),)
        name = self._keys.get(shape_key) or self._keys.get(key)
        if name is None:
            with self._lock:
                name = self._capture(call, args, kwargs, key, shape_key)
        return self.graphs[name], call

    def _capture(self, call, args, kwargs, key, shape_key) -> str:
        model = _structural_copy(self._original)
        model.train(self.training)
        inference = (not self.training and not any(p.requires_grad for p in model.parameters())) \
            if self._inference is None else bool(self._inference)
        ctx = CompileContext(policy=self._policy, backend=self._backend, inference=inference,
                             options=dict(self._options))
        example = call if call is not None else args
        gm = capture(model, example, ctx)
        gm = run_passes(gm, ctx)
        static = "static shapes" in ctx.capture
        name = f"g{len(self.graphs)}"
        self.graphs[name] = gm
        self._keys[shape_key if static else key] = name
        if static:
            ctx.notes.append("captured with static shapes: each new input shape is captured again")
        self._report = _make_report(ctx)
        if not self._report.sites:
            self._report.notes.append("no attention site found: the model runs unchanged")
        log.info("%s", self._report)
        return name

    def forward(self, *args, **kwargs):
        if self._eager:
            return self._original(*args, **kwargs)
        try:
            gm, call = self._graph_for(args, kwargs)
        except CaptureError as e:
            if self._fallback != "eager":
                raise
            warnings.warn(f"attncomp: running the original module: {e}", RuntimeWarning, stacklevel=2)
            self._eager = True
            return self._original(*args, **kwargs)
        with ops.training_mode(self.training):
            if call is None:
                return gm(*args)
            positional = gm.meta.get("attncomp_positional")
            if positional is not None:  # captured with its non-tensor arguments fixed
                return gm(*(call[n] for n in positional))
            return gm(**call)

    def report(self) -> Report:
        if self._report is None:
            return Report(policy=self._policy.describe(), backend=self._backend,
                          notes=["not captured yet: the model is compiled on its first call"])
        return self._report


def _kind(x) -> str:
    """What a traced graph is specialised on for one argument: a tensor's dtype and device (its shape
    stays symbolic), or a non-tensor's value."""
    if isinstance(x, torch.Tensor):
        return f"T:{x.dtype}:{x.device.type}"
    return repr(x)


def _structural_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer with ``model``."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def compile(model: nn.Module, policy: Union[str, Policy] = "dense", *, example_inputs=None, backend: str = "auto",
            fallback: str = "error", inference: Optional[bool] = None, **options) -> nn.Module:
    """Compile the attention of ``model``.

    Every attention site (``QK^T -> scale -> mask -> softmax -> dropout -> AV``, however written, and
    ``scaled_dot_product_attention`` calls) becomes one ``attncomp::attention`` op running ``policy``
    (``"dense"``, ``"dfss"``, ``"hash"``, ``"drop"``, ``"spion"``, ``"et"`` or a policy object) on
    ``backend`` (``"auto"``: Triton on CUDA, the exact reference elsewhere).

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments; without it the
    model is captured on its first call. ``fallback="eager"`` returns the original module (with a
    warning) when the model cannot be captured. ``inference`` says whether weights are frozen (default:
    eval mode and no parameter requires grad), which lets rewrites fold constants into weights. The
    user's module and its parameters are never modified.
    """
    pol = _check_options(policy, backend, fallback)
    if not isinstance(model, nn.Module):
        raise TypeError(f"attncomp.compile expects an nn.Module, got {type(model).__name__}")
    try:
        return CompiledModule(model, pol, backend, example_inputs, inference, fallback, options)
    except CaptureError as e:
        if fallback == "eager":
            warnings.warn(f"attncomp: returning the original module: {e}", RuntimeWarning, stacklevel=2)
            return model
        raise


def report(obj) -> Report:
    """The report of a compiled module (or of a :func:`backend` after ``torch.compile`` ran it)."""
    if isinstance(obj, CompiledModule):
        return obj.report()
    if isinstance(obj, _DynamoBackend):
        return obj.report()
    rep = getattr(obj, "_attncomp_report", None)
    if rep is not None:
        return rep
    inner = getattr(obj, "_orig_mod", None)
    if isinstance(inner, CompiledModule):
        return inner.report()
    raise TypeError(f"no attncomp report for {type(obj).__name__}: pass a module returned by attncomp.compile "
                    "or attncomp.load, or the object returned by attncomp.backend()")


class _DynamoBackend:
    """A ``torch.compile`` backend: runs the attncomp passes on each graph dynamo captures."""

    def __init__(self, policy: Policy, backend: str, inference: Optional[bool]):
        self.policy, self.backend, self.inference = policy, backend, inference
        self.contexts: List[CompileContext] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
        ctx = CompileContext(policy=self.policy, backend=self.backend, inference=bool(self.inference),
                             capture="torch.compile (dynamo)")
        _propagate_fake(gm, example_inputs)
        gm = run_passes(gm, ctx)
        self.contexts.append(ctx)

        def run(*args):
            return gm(*args)

        return run

    def report(self) -> Report:
        ctx = CompileContext(policy=self.policy, backend=self.backend, capture="torch.compile (dynamo)")
        seen = set()
        for c in self.contexts:
            # dynamo recompiles a graph for new shapes: list each site once
            for site in c.sites:
                key = (site.name, site.pattern, site.spec, site.rewritten, site.reason)
                if key not in seen:
                    seen.add(key)
                    ctx.sites.append(site)
            ctx.notes.extend(c.notes)
            for k, v in c.counters.items():
                ctx.counters[k].update(v)
        return _make_report(ctx)


def _propagate_fake(gm: fx.GraphModule, example_inputs) -> None:
    """Dynamo graphs carry ``example_value`` on nodes; expose it as ``val`` for the passes."""
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and "val" not in n.meta:
            n.meta["val"] = ev


def backend(policy: Union[str, Policy] = "dense", *, backend: str = "auto", inference: Optional[bool] = None):
    """A backend for ``torch.compile(model, backend=attncomp.backend(policy=...))``; the same passes as
    :func:`compile`. ``attncomp.report(the_backend)`` lists the sites of every graph it compiled (a site
    recompiled by dynamo for new shapes is listed once)."""
    pol = _check_options(policy, backend, "error")
    return _DynamoBackend(pol, backend, inference)


def export(compiled: nn.Module, path: str, example_inputs=None) -> str:
    """Export a compiled module ahead of time to ``path`` (see :mod:`attncomp.runtime.package`).

    The eval-mode graph is exported with every input dim dynamic; ``example_inputs`` default to those
    given to :func:`compile`.
    """
    from .passes.capture import dynamic_shapes_for
    from .runtime import package

    if not isinstance(compiled, CompiledModule):
        raise TypeError("attncomp.export expects a module returned by attncomp.compile")
    if example_inputs is None:
        if compiled._example is None:
            raise ValueError("attncomp.export needs example_inputs (a tuple of arguments or a dict of keyword "
                             "arguments)")
        args, kwargs = compiled._example
    else:
        args, kwargs = split_inputs(example_inputs)
    was_training = compiled.training
    compiled.train(False)
    try:
        gm, call = compiled._graph_for(args, kwargs)
    finally:
        compiled.train(was_training)
    positional = gm.meta.get("attncomp_positional")
    if positional is not None:
        args, kwargs = tuple(call[n] for n in positional), {}
    elif call is not None:
        args, kwargs = (), call
    with ops.training_mode(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ep = torch.export.export(gm, args, kwargs, dynamic_shapes=dynamic_shapes_for(gm.forward, args, kwargs),
                                     strict=False)
        except Exception as e:
            log.warning("attncomp.export: dynamic-shape export failed (%s); exporting with static shapes", e)
            ep = torch.export.export(gm, args, kwargs, strict=False)
    rep = compiled.report()
    params = [p.name for p in inspect.signature(compiled.original.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    meta = {"report": {"policy": rep.policy, "backend": rep.backend, "capture": rep.capture,
                       "sites": [s.as_dict() for s in rep.sites], "notes": rep.notes},
            "call": {"keywords": call is not None and positional is None, "parameters": params,
                     "positional": positional}}
    package.save_package(path, ep, meta)
    return path


class LoadedModule(nn.Module):
    """A module loaded from a package: runs the exported program; no tracing, matching or tuning."""

    def __init__(self, ep, meta: Dict[str, Any]):
        super().__init__()
        self.program = ep.module()
        call = meta.get("call", {})
        self._keywords = bool(call.get("keywords"))
        self._params = list(call.get("parameters", []))
        self._positional = call.get("positional")
        r = meta.get("report", {})
        self._attncomp_report = Report(sites=[SiteReport(**s) for s in r.get("sites", [])],
                                       policy=r.get("policy", ""), backend=r.get("backend", ""),
                                       capture="loaded package (" + r.get("capture", "") + ")",
                                       notes=list(r.get("notes", [])))

    def forward(self, *args, **kwargs):
        if self._positional is not None and kwargs:  # exported with its non-tensor arguments fixed
            bound = {**dict(zip(self._params, args)), **kwargs}
            args, kwargs = tuple(bound[n] for n in self._positional), {}
        if self._keywords and args:
            if len(args) > len(self._params):
                raise TypeError(f"expected at most {len(self._params)} positional arguments, got {len(args)}")
            kwargs = {**dict(zip(self._params, args)), **kwargs}
            args = ()
        with ops.training_mode(False):
            return self.program(*args, **kwargs)

    def train(self, mode: bool = True):
        if mode:
            raise RuntimeError("a loaded attncomp package runs inference only; compile the model to train it")
        self.training = False
        return self


def load(path: str) -> nn.Module:
    """Load a package written by :func:`export`; refuses tampered or incompatible packages."""
    from .runtime import package

    ep, meta = package.load_package(path)
    return LoadedModule(ep, meta)
