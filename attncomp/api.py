"""Public API: ``compile``, ``backend`` (the torch.compile route), ``report``, ``export``, ``load``."""

from __future__ import annotations

import collections
import contextlib
import copy
import difflib
import functools
import inspect
import logging
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import ops
from .passes.base import CompileContext, SiteReport, counters
from .passes.capture import CaptureError, capture, fix_dynamo_bound_methods, split_inputs
from .passes.inline_sdpa import enabled as inline_sdpa_enabled, inline_sdpa
from .passes.node_info import MODULE_PATHS, module_paths
from .passes.pipeline import run_passes
from .kvcache import keep_key_buckets
from .policy import Hash, Policy, get_policy
from .runtime import env
from .runtime.dispatch import MEASURING_MODES
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
    #: graphs compiled for the module (dynamo: one per recompile or graph break)
    graphs: int = 0

    @property
    def rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def __str__(self) -> str:
        lines = [f"attncomp report: policy={self.policy}, backend={self.backend}",
                 f"capture: {self.capture}" + (f" ({self.graphs} graph(s))" if self.graphs else ""),
                 f"{len(self.sites)} attention site(s), {self.rewritten} rewritten", ""]
        rows = [("site", "rewritten", "policy", "pattern")]
        rows += [(_shown(s.name), "yes" if s.rewritten else "NO", s.policy, s.pattern or "-") for s in self.sites]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        for s in self.sites:
            lines.append("")
            lines.append(f"[{_shown(s.name)}]")
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


def _shown(name: str) -> str:
    """A site name as the report prints it: the root module's path is ``""`` in ``named_modules()``."""
    return name if name else "(root module)"


def _make_report(ctx: CompileContext) -> Report:
    return Report(sites=ctx.sites, policy=ctx.policy.describe(), backend=ctx.backend, capture=ctx.capture,
                  counters={k: dict(v) for k, v in ctx.counters.items()}, notes=ctx.notes)


def _check_options(policy, backend: str, fallback: str, mode: Optional[str], extra: Dict[str, Any],
                   entry) -> Policy:
    """The policy object of a compile's arguments, after checking them all: a misspelt keyword
    (``extra``: what ``entry``'s signature did not name) or mode must not compile something else silently."""
    if extra:
        name = next(iter(extra))
        known = [p for p in inspect.signature(entry).parameters if p not in ("model", "options")]
        close = difflib.get_close_matches(name, known, n=1)
        raise TypeError(f"attncomp.{entry.__name__}() got an unexpected keyword argument {name!r}"
                        + (f"; did you mean {close[0]!r}?" if close else "") + f" (its keywords: {', '.join(known)})")
    if mode is not None:
        torch._inductor.list_mode_options(mode)  # raises, naming the valid modes, on an unknown one
    pol = get_policy(policy)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
    return pol


_CAPTURES = ("dynamo", "export", "fx")
#: this many graphs for one compiled module is a recompile storm (dynamo's own limit per frame)
STORM = 8


def _inductor_default() -> bool:
    """Inductor compiles everything around the op unless ``ATTNCOMP_INDUCTOR=0``."""
    return env.flag("ATTNCOMP_INDUCTOR", True)


#: site details that may differ between a site's graphs and are listed from all of them
_PER_GRAPH_DETAILS = ("buckets",)


class _GraphCompiler:
    """A dynamo backend: attncomp passes on each captured graph, then Inductor (or the rewritten graph
    as it is). Shared by :func:`compile` (capture="dynamo") and :func:`backend` (``torch.compile``)."""

    def __init__(self, policy: Policy, backend: str, inference: Optional[bool], inductor: bool,
                 mode: Optional[str], capture_name: str):
        self.policy, self.backend, self.inference = policy, backend, inference
        self.inductor, self.mode = inductor, mode
        self.capture_name = capture_name
        self.contexts: List[CompileContext] = []
        self.graphs: List[fx.GraphModule] = []
        #: graph breaks seen while this module compiled: reason -> count
        self.breaks: Dict[str, int] = {}
        #: set by CompiledModule: the code object whose recompiles are reported
        self.code = None
        #: set by CompiledModule: the model, whose module paths name the sites
        self.root: Optional[nn.Module] = None
        self.module_training: Optional[bool] = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        inference = self._inference(example_inputs)
        where = "Inductor around the op" if self.inductor else "no Inductor (ATTNCOMP_INDUCTOR=0 / inductor=False)"
        ctx = CompileContext(policy=self.policy, backend=self.backend, inference=inference,
                             capture=f"{self.capture_name}; {where}", cuda_graphs=self._cuda_graphs(),
                             mode=self.mode, example_inputs=_real_inputs(gm, example_inputs))
        _propagate_fake(gm, example_inputs)
        frozen = _freeze_parameters(gm, example_inputs) if inference else 0
        _constant_mask_buffers(gm, example_inputs)
        if self.root is not None:
            gm.meta[MODULE_PATHS] = module_paths(self.root)
        if frozen:
            ctx.notes.append(f"graph {len(self.graphs)}: {frozen} frozen parameter(s) treated as constants "
                             "(inference: eval mode, no parameter requires grad)")
        gm = run_passes(gm, ctx)
        self.contexts.append(ctx)
        self.graphs.append(gm)
        counters["capture"]["graphs"] += 1
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        patches = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
        if patches.get("triton.cudagraphs") and _returns_allocated(gm):
            # a graph that allocates state its caller keeps (a static KV cache's storage, made by the prefill's
            # lazy initialisation): as a CUDA graph its outputs would live in the graph's pool and the next
            # replay would overwrite them; it runs without (the decode steps that then read the cache still
            # replay as CUDA graphs)
            patches["triton.cudagraphs"] = False
            ctx.notes.append(f"graph {len(self.graphs) - 1}: returns tensors it allocates (a cache's storage): "
                             "not run as a CUDA graph")
        patches["post_grad_custom_post_pass"] = _op_revision_pass()
        # SDPA sites become traced SDPA calls in Inductor's copy of the graph only (the graph kept
        # above, and exports, keep the op)
        lowered = inline_sdpa(_copy_graph_module(gm), ctx).graph_module if inline_sdpa_enabled() else gm
        lifted, seeds, inputs = _lift_seeds(lowered, list(example_inputs))
        _name_new_constants(lifted)
        try:
            compiled = compile_fx(lifted, inputs, config_patches=patches or None)
        except Exception as e:  # an Inductor failure (e.g. a C++ codegen bug) must not fail the user's model
            first = (str(e).strip().splitlines() or [""])[0][:200]
            log.warning("attncomp: Inductor failed on graph %d (%s: %s); it runs without Inductor",
                        len(self.graphs) - 1, type(e).__name__, first)
            ctx.notes.append(f"graph {len(self.graphs) - 1}: Inductor failed ({type(e).__name__}: {first}); "
                             "this graph runs with the attncomp op but without Inductor")
            counters["capture"]["inductor_failed"] += 1
            return gm.forward
        if not seeds:
            return compiled

        def run(*args):
            # the per-call seeds Inductor must not bake in: computed now, passed as symbolic ints
            return compiled(*args, *(ops.next_seed(b) for b in seeds))

        return run

    def _inference(self, example_inputs) -> bool:
        if self.inference is not None:
            return bool(self.inference)
        params = [t for t in example_inputs if isinstance(t, nn.Parameter)]
        training = self.module_training if self.module_training is not None else torch.is_grad_enabled()
        return bool(params) and not training and not any(p.requires_grad for p in params)

    def guard_failures(self) -> List[str]:
        if self.code is None:
            return []
        from torch._dynamo.utils import guard_failures

        return [str(r) for r in guard_failures.get(self.code, [])]

    def _cuda_graphs(self) -> bool:
        """Whether Inductor runs the compiled graphs as CUDA graphs (``mode="reduce-overhead"``)."""
        if not (self.inductor and self.mode):
            return False
        return bool(torch._inductor.list_mode_options(self.mode).get("triton.cudagraphs"))

    def report(self) -> Report:
        ctx = CompileContext(policy=self.policy, backend=self.backend,
                             capture=self.contexts[-1].capture if self.contexts else self.capture_name)
        # a site is its module path and, for a module with several sites (or called several times), its
        # place among them in the graph
        by_name: Dict[Any, SiteReport] = {}
        for i, c in enumerate(self.contexts):
            nth: Dict[str, int] = collections.Counter()
            for site in c.sites:
                key = (site.name, nth[site.name])
                nth[site.name] += 1
                first = by_name.get(key)
                if first is None:
                    by_name[key] = site
                    site.details["graphs"] = [i]
                    ctx.sites.append(site)
                    continue
                first.details["graphs"] = first.details.get("graphs", []) + [i]
                for k in _PER_GRAPH_DETAILS:  # details a graph's calls decide (a prefill's and a step's differ)
                    mine = site.details.get(k)
                    if mine and mine not in first.details.get(k, ""):
                        first.details[k] = f"{first.details[k]}; {mine}" if first.details.get(k) else mine
                if (site.spec, site.rewritten, site.reason) != (first.spec, first.rewritten, first.reason):
                    variants = first.details.setdefault("variants", [])
                    v = site.spec if site.rewritten else f"not rewritten: {site.reason}"
                    if v not in variants:
                        variants.append(v)
            for n in c.notes:
                if n not in ctx.notes:
                    ctx.notes.append(n)
            for k, v in c.counters.items():
                ctx.counters[k].update(v)
        n = len(self.contexts)
        ctx.counters["capture"]["graphs"] = n
        ctx.counters["capture"]["recompiles"] = max(0, n - 1)
        rep = _make_report(ctx)
        rep.graphs = n
        for reason, count in self.breaks.items():
            rep.notes.append(f"graph break ({count}x): {reason.splitlines()[0][:300]} -- code there runs "
                             "without attncomp")
        if n >= STORM:
            fails = self.guard_failures()
            rep.notes.append(f"recompile storm: {n} graphs for one module (dynamo recompiles a frame at most "
                             f"{STORM} times, then runs it without attncomp); last failed guard: "
                             f"{' '.join(fails[-1].split())[:300] if fails else 'unknown'}")
        return rep


#: factory functions whose result is new storage (a graph returning one, filled in place or not, allocates state)
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like, torch.empty_like,
              torch.full_like}


def _returns_allocated(gm: fx.GraphModule) -> bool:
    """Whether the graph returns a tensor it allocated with a factory function (possibly written in place since:
    ``index_copy_``, ``copy_``, ``fill_``, ...), as a static cache's lazy initialisation does. Only new storage
    counts: a result computed from the inputs does not."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return False
    for n in _flat_nodes(out.args):
        while (n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("__")
               and n.args and isinstance(n.args[0], fx.Node)):
            n = n.args[0]  # an in-place method returns its receiver
        if n.op == "call_function" and n.target in _FACTORIES:
            return True
    return False


def _flat_nodes(args) -> List[fx.Node]:
    found: List[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return found


def _real_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[Dict[str, Any]]:
    """The example inputs by placeholder name when they are real values (dynamo hands real tensors to
    its backends; fake ones carry no data)."""
    from torch._subclasses.fake_tensor import is_fake

    ins = []
    for t in example_inputs:
        if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # a dynamic size: its hint, read without a guard (int(t) would specialise the graph to it)
            hint = getattr(t.node, "hint", None)
            if hint is None:
                return None
            t = hint
        elif isinstance(t, torch.Tensor) and is_fake(t):
            return None
        ins.append(t)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ins):
        return None
    return dict(zip(placeholders, ins))


def _name_new_constants(gm: fx.GraphModule) -> None:
    """Tensors the passes attached to a dynamo graph (frozen weights, folded weights, read-only buffers)
    get a source of their own, as AOTAutograd expects of every attribute of a dynamo graph."""
    table = getattr(gm, "_param_name_to_source", None)
    if table is None:
        return
    from torch._dynamo.source import ConstantSource

    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in table:
            table[name] = ConstantSource(f"attncomp_{name}")


def _lift_seeds(gm: fx.GraphModule, example_inputs: List[Any]):
    """Per-call seeds (:func:`attncomp.ops.next_seed`, fresh per training call) become graph inputs of
    symbolic int type, so that Inductor's tracing does not turn the first call's seed into a constant.
    Returns the graph (a copy when seeds were lifted), the base seeds (one per lifted input, in order)
    and the extended example inputs."""
    if not any(n.op == "call_function" and n.target is ops.next_seed for n in gm.graph.nodes):
        return gm, [], example_inputs
    gm = _copy_graph_module(gm)  # dynamo reads its own graph's placeholders after the backend returns
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.next_seed]
    from torch._dynamo.source import ConstantSource
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    fake = detect_fake_mode(example_inputs)
    if fake is None or fake.shape_env is None:
        raise CaptureError("cannot lift per-call seeds: the graph has no symbolic shape environment")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bases, inputs = [], list(example_inputs)
    for i, node in enumerate(nodes):
        base = int(node.args[0]) if node.args else 0
        source = ConstantSource(f"attncomp_seed_{i}")
        sym = fake.shape_env.create_unspecified_symint_and_symbol(0x2545F491 + i, source, DimDynamic.DYNAMIC)
        with gm.graph.inserting_after(placeholders[-1] if placeholders else next(iter(gm.graph.nodes))):
            ph = gm.graph.placeholder(f"attncomp_seed_{i}")
        placeholders.append(ph)
        ph._dynamo_source = source
        ph.meta["val"] = ph.meta["example_value"] = sym
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        bases.append(base)
        inputs.append(sym)
    gm.recompile()
    return gm, bases, inputs


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module with a copy of ``gm``'s graph (nodes and their metadata), sharing its attributes."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new_node in env.items():
        if hasattr(old, "_dynamo_source"):
            new_node._dynamo_source = old._dynamo_source
    new = fx.GraphModule(gm, graph, gm.__class__.__name__)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = dict(gm._param_name_to_source)
    return new


def _constant_mask_buffers(gm: fx.GraphModule, example_inputs) -> int:
    """Module buffers that the graph only reads (causal ``bias`` masks such as nanoGPT's) become
    ``get_attr`` nodes, as in fx and export graphs, so that the mask analysis can read them; they still
    refer to the module's tensor, so nothing is copied or frozen."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return 0
    count = 0
    for i, (node, val) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        src = getattr(grapharg, "source", None)
        name = getattr(src, "name", "") if src is not None else ""
        name = (name() if callable(name) else str(name)) + " " + node.name
        if not isinstance(val, torch.Tensor) or isinstance(val, nn.Parameter) or "_buffers" not in name \
                or not node.users or any(_mutates(u, node) for u in node.users):
            continue
        gm.register_buffer(f"_attncomp_buffer_{i}", val, persistent=False)
        _to_attr(gm, node, f"_attncomp_buffer_{i}", placeholders[-1])
        count += 1
    if count:
        gm.recompile()
    return count


def _to_attr(gm: fx.GraphModule, node: fx.Node, attr: str, after: fx.Node) -> None:
    """Every use of placeholder ``node`` reads the graph module's attribute ``attr`` instead."""
    with gm.graph.inserting_after(after):
        ga = gm.graph.get_attr(attr)
    ga.meta.update(node.meta)
    node.replace_all_uses_with(ga)


def _mutates(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` may write into ``node`` (an in-place op, or an op with out= / copy semantics)."""
    t = user.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return name.endswith("_") and not name.endswith("__") or "out" in user.kwargs or name in ("setitem",)


def _freeze_parameters(gm: fx.GraphModule, example_inputs) -> int:
    """Inference graphs: placeholders fed by frozen parameters become ``get_attr`` constants, so that
    rewrites can fold into weights (scale into the q projection, W_V·W_O)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return 0
    count = 0
    for i, (node, val) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(val, nn.Parameter) or val.requires_grad or not node.users:
            continue
        gm.register_parameter(f"_attncomp_frozen_{i}", val)
        _to_attr(gm, node, f"_attncomp_frozen_{i}", placeholders[-1])
        count += 1
    if count:
        gm.recompile()
    return count


class CompiledModule(nn.Module):
    """A compiled model: an instance of the model's own class (so ``generate()``, ``.config``,
    ``state_dict()``, ``parameters()`` work from the start and share the user's tensors) whose
    ``forward`` runs the compiled graphs.

    ``capture="dynamo"`` (the default) captures as ``torch.compile`` does (guards, graph breaks,
    automatic dynamic shapes, cache objects), runs the attncomp passes on each graph and hands it to
    Inductor. ``capture="export"``/``"fx"`` keep one graph per training mode and call structure
    (which arguments are given, tensor dtypes/devices, values of non-tensor arguments), each traced from
    a structural copy of the model. Submodules are shared with the user's module, so ``train()``/
    ``eval()`` switch both, as with ``torch.compile``.
    """

    _attncomp: "_State"

    @property
    def original(self) -> nn.Module:
        return self._attncomp.model

    @property
    def graphs(self) -> List[fx.GraphModule]:
        """Every graph compiled so far, in order (post-pass, before Inductor)."""
        st = self._attncomp
        return list(st.compiler.graphs) + list(st.graphs.values())

    @property
    def graph_module(self) -> Optional[fx.GraphModule]:
        """The graph of the most recent capture (``None`` before the first)."""
        return self._attncomp.last

    def forward(self, *args, **kwargs):
        st = self._attncomp
        if st.eager:
            return st.forward_fn(self)(*args, **kwargs)
        if st.reads_key_index:
            st.full_windows(kwargs.get("past_key_values"))
        if st.keeps_buckets:
            st.key_buckets(kwargs.get("past_key_values"))
        try:
            if st.capture == "dynamo":
                return st.run_dynamo(self, args, kwargs)
            gm, call = st.graph_for(self, args, kwargs)
        except CaptureError as e:
            return st.fall_back(self, e, args, kwargs)
        with ops.training_mode(self.training):
            if call is None:
                return gm(*args)
            positional = gm.meta.get("attncomp_positional")
            if positional is not None:  # captured with its non-tensor arguments fixed
                return gm(*(call[n] for n in positional))
            return gm(**call)

    def report(self) -> Report:
        return self._attncomp.report(self)

    def __reduce_ex__(self, protocol):
        raise TypeError("a compiled attncomp module cannot be pickled: use attncomp.export to save it, or "
                        "save the original module's state_dict")


def revision_files() -> tuple:
    """The sources whose code a compiled graph depends on beyond the graph itself: ``attncomp/ops.py``
    and ``attncomp/opspec.py`` (the fakes promise the op's output sizes and strides, which compiled
    code asserts; the strides are computed in ``opspec``) and the code
    that traced SDPA sites run (``codegen/sdpa.py``, ``codegen/reference.py``,
    ``passes/inline_sdpa.py``), a precaution: the graph handed to Inductor names that code's functions,
    not their source (AOTAutograd's cache bypasses such graphs on torch 2.13; Inductor's own keys the
    traced aten graph)."""
    from . import opspec
    from .codegen import reference, sdpa
    from .passes import inline_sdpa as inline

    return (ops.__file__, opspec.__file__, sdpa.__file__, reference.__file__, inline.__file__)


def _op_revision_pass():
    """Inductor's post-grad custom pass for attncomp's graphs: the one configured (if any) and, in
    Inductor's cache key, the source of :func:`revision_files`. Without it a cache filled by another
    attncomp version would be reused with the old promises or the old traced code."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    inner = torch._inductor.config.post_grad_custom_post_pass

    class _OpRevision(CustomGraphPass):
        def __call__(self, graph):
            if inner is not None:
                inner(graph)

        def uuid(self):
            if inner is None:
                return get_hash_for_files(revision_files())
            theirs = getattr(inner, "uuid", lambda: None)()  # None: not cacheable, as without attncomp
            return None if theirs is None else (get_hash_for_files(revision_files()), theirs)

    return _OpRevision()


_LEAVES = (type(None), bool, int, float, str)


def _input_tensors(args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors of a call's arguments: at the top level directly (the usual ``model(**inputs)``),
    inside containers through ``tree_flatten`` (per call: the plain walk costs a tenth of it)."""
    out = []
    for vals in (args, kwargs.values()):
        for a in vals:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif not isinstance(a, _LEAVES):
                out.extend(t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))
    return out


def _wrap(model: nn.Module, state: "_State") -> CompiledModule:
    """An alias of ``model`` (the same ``__dict__``: parameters, buffers, submodules, hooks, flags such as
    ``training``) whose class is the model's class with :class:`CompiledModule` mixed in, named like it
    (code that prints or checks the class name sees the model's). Each compile gets its own class, which
    holds its state."""
    cls = type(model)

    def forward(self, *args, **kwargs):
        return CompiledModule.forward(self, *args, **kwargs)

    # the model's signature, name and docstring (``inspect.signature(fast.forward)`` equals the model's, as
    # with torch.compile's wrapper): transformers decides from it which arguments ``generate()`` passes
    # (``position_ids`` for left-padded batches, ``attention_mask``) and which columns its Trainer keeps
    functools.update_wrapper(forward, cls.forward)
    body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_attncomp": state, "forward": forward}
    prepare = getattr(cls, "prepare_inputs_for_generation", None)
    if prepare is not None and state.reads_key_index:
        # generate() builds a static cache's masks here, before the first forward: its layers get every key first
        def prepare_inputs_for_generation(self, *args, **kwargs):
            self._attncomp.full_windows(kwargs.get("past_key_values"))
            return prepare(self, *args, **kwargs)

        body["prepare_inputs_for_generation"] = functools.update_wrapper(prepare_inputs_for_generation, prepare)
    sub = type(cls.__name__, (CompiledModule, cls), body)
    fast = object.__new__(sub)
    object.__setattr__(fast, "__dict__", model.__dict__)
    return fast


class _State:
    """What a compiled module holds besides the model's own attributes."""

    def __init__(self, model, policy, backend, fallback, inference, capture, inductor, mode, dynamic):
        self.model, self.policy, self.backend, self.fallback = model, policy, backend, fallback
        self.inference, self.capture = inference, capture
        self.inductor, self.mode, self.dynamic = inductor, mode, dynamic
        self.lock = threading.RLock()
        self.eager = False
        self.example = None
        self.graphs: Dict[str, fx.GraphModule] = {}
        self.keys: Dict[Any, str] = {}
        self.last: Optional[fx.GraphModule] = None
        self.last_ctx: Optional[CompileContext] = None
        self.compiler = _GraphCompiler(policy, backend, inference, inductor, mode,
                                       "dynamo (the torch.compile mechanism)")
        self.compiler.root = model
        self.compiled = None
        #: what compile() did besides capturing (listed in the report)
        self.notes: List[str] = []
        #: calls run through dynamo so far
        self.calls = 0
        #: the latest KV cache the CUDA-graph route saw with its storage in place (a weak reference): the decode
        #: steps that follow pass it again, and are not checked layer by layer each time
        self.ready_cache = None
        #: whether the policy's keep rule reads key indices (:func:`_full_window_layers`), and the latest KV cache
        #: checked for sliding-window layers (a weak reference: the decode steps that follow pass it again)
        self.reads_key_index = policy.reads_key_index()
        self.window_cache = None
        #: whether KV caches keep their keys' hash buckets (:mod:`attncomp.kvcache`), and the latest cache made so
        self.keeps_buckets = isinstance(policy, Hash)
        self.bucket_cache = None

    def full_windows(self, cache) -> None:
        """:func:`_full_window_layers` on a KV cache the compiled module meets for the first time; the report
        notes the layers it gave every key."""
        if cache is None or (self.window_cache is not None and self.window_cache() is cache):
            return
        cfg = getattr(self.model, "config", None)
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
        done = _full_window_layers(cache, self.policy, window)
        self.window_cache = _weak(cache)
        if done:
            self.note(f"KV cache: sliding-window layers keep every key under policy {self.policy.name!r}, whose keep "
                      f"rule reads key positions (a window cache drops the keys before the window and shifts them); "
                      f"the model's mask still limits each query to its window")

    def key_buckets(self, cache) -> None:
        """:func:`attncomp.kvcache.keep_key_buckets` on a KV cache the compiled module meets for the first time; the
        report notes which layers keep their keys' buckets and which do not."""
        if cache is None or (self.bucket_cache is not None and self.bucket_cache() is cache):
            return
        kept, left = keep_key_buckets(cache, self.policy)
        self.bucket_cache = _weak(cache)
        if kept:
            self.note("KV cache: its layers keep each key's hash bucket, computed once when the key is appended; a "
                      "decoding step reads the buckets and only the keys in its queries' buckets")
        if left:
            kinds = ", ".join(sorted({k for _, k in left}))
            self.note(f"KV cache: layers of kind {kinds} keep no buckets: their sites derive the buckets of every "
                      f"cached key at each step")

    def note(self, text: str) -> None:
        """A note for the report, once."""
        if text not in self.notes:
            self.notes.append(text)

    # -- the original forward, as the model's class defines it ---------------------------------
    def forward_fn(self, fast):
        return types.MethodType(type(self.model).forward, fast)

    def fall_back(self, fast, err, args, kwargs):
        if self.fallback != "eager":
            raise err
        warnings.warn(f"attncomp: running the original module: {err}", RuntimeWarning, stacklevel=3)
        self.eager = True
        return self.forward_fn(fast)(*args, **kwargs)

    # -- dynamo route -------------------------------------------------------------------------
    def run_dynamo(self, fast, args, kwargs):
        if self.compiled is None:
            fix_dynamo_bound_methods()
            fwd = _own_code(type(self.model).forward)
            self.compiler.code = getattr(fwd, "__code__", None)
            self.compiled = torch.compile(types.MethodType(fwd, fast), backend=self.compiler, dynamic=self.dynamic)
        if self.dynamic is None:
            for t in _input_tensors(args, kwargs):
                for d in range(t.dim()):
                    torch._dynamo.maybe_mark_dynamic(t, d)
        self.compiler.module_training = fast.training
        if self.compiler._cuda_graphs():
            cache = kwargs.get("past_key_values")
            if cache is not None and (self.ready_cache is None or self.ready_cache() is not cache):
                _early_cache_init(self.model, args, kwargs)
                self.ready_cache = _weak(cache)
        n0 = len(self.compiler.graphs)
        self.breaks = dict(torch._dynamo.utils.counters["graph_break"])
        # float attributes (dropout rates, scales) stay constants the passes can read, as in eager code.
        # Set and restored around the call rather than with config.patch, whose context manager adds
        # tens of microseconds to every call of the compiled function (BERT-sized models are host-bound)
        dcfg = torch._dynamo.config
        flip = not dcfg.specialize_float
        tok = ops._training.set(fast.training)
        if flip:
            dcfg.specialize_float = True
        try:
            out = self.compiled(*args, **kwargs)
        except (CaptureError, TypeError):
            raise
        except Exception as e:
            if len(self.compiler.graphs) > n0 or not _is_dynamo_error(e):
                raise
            raise CaptureError(f"dynamo could not capture {type(self.model).__name__}: "
                               f"{type(e).__name__}: {_first_line(e)}") from e
        finally:
            if flip:
                dcfg.specialize_float = False
            ops._training.reset(tok)
        self.calls += 1
        if len(self.compiler.graphs) > n0:
            self.last = self.compiler.graphs[-1]
        breaks = torch._dynamo.utils.counters["graph_break"]
        for reason, n in breaks.items():
            if n > self.breaks.get(reason, 0):
                self.compiler.breaks[reason] = self.compiler.breaks.get(reason, 0) + n - self.breaks.get(reason, 0)
        self.breaks = dict(breaks)
        return out

    # -- export / fx routes: one graph per call structure ---------------------------------------
    def structure(self, fast, args, kwargs):
        sig = inspect.signature(type(self.model).forward)
        try:
            bound = sig.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"compiled {type(self.model).__name__}: {e}") from None
        call = {}
        for i, (name, val) in enumerate(bound.arguments.items()):
            if i == 0:
                continue  # self
            kind = sig.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                call.update(val)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                return None, None  # *args: keep the positional form
            else:
                call[name] = val
        leaves, spec = tree_flatten(call)
        return call, (fast.training, str(spec), tuple(_kind(x) for x in leaves))

    def graph_for(self, fast, args, kwargs):
        call, key = self.structure(fast, args, kwargs)
        if call is None:
            call, key = None, (fast.training, "positional", tuple(_kind(a) for a in args))
        shape_key = key + (tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                                 if isinstance(t, torch.Tensor)),)
        name = self.keys.get(shape_key) or self.keys.get(key)
        if name is None:
            with self.lock:
                name = self._capture(fast, call, args, kwargs, key, shape_key)
        return self.graphs[name], call

    def _capture(self, fast, call, args, kwargs, key, shape_key) -> str:
        model = _structural_copy(self.model)
        model.train(fast.training)
        inference = (not fast.training and not any(p.requires_grad for p in model.parameters())) \
            if self.inference is None else bool(self.inference)
        ctx = CompileContext(policy=self.policy, backend=self.backend, inference=inference)
        example = call if call is not None else args
        gm = capture(model, example, ctx, route=self.capture)
        gm.meta[MODULE_PATHS] = module_paths(model)
        gm = run_passes(gm, ctx)
        static = "static shapes" in ctx.capture
        name = f"g{len(self.graphs)}"
        self.graphs[name] = gm
        self.last, self.last_ctx = gm, ctx
        self.keys[shape_key if static else key] = name
        if static:
            ctx.notes.append("captured with static shapes: each new input shape is captured again")
        log.info("%s", _make_report(ctx))
        return name

    def report(self, fast) -> Report:
        if self.capture == "dynamo":
            if not self.compiler.contexts:
                first = "not captured yet: the model is compiled on its first call" if not self.calls else (
                    f"no graph captured: {self.calls} call(s) ran without attncomp, dynamo ran every frame "
                    "eagerly (it skips a frame with a graph break inside a loop, and stops compiling a frame "
                    "once torch._dynamo.config.recompile_limit graphs of it exist; under FSDP2 the hooks "
                    "break the layer loop, so each layer's forward is a frame of its own, whose graphs every "
                    "compiled module of that class in the process counts; torch._dynamo.reset() clears them)")
                rep = Report(policy=self.policy.describe(), backend=self.backend,
                             capture="dynamo (the torch.compile mechanism)", notes=[first] + self.notes)
                for reason, count in self.compiler.breaks.items():
                    rep.notes.append(f"graph break ({count}x): {reason.splitlines()[0][:300]}")
                return rep
            rep = self.compiler.report()
        else:
            if self.last_ctx is None:
                return Report(policy=self.policy.describe(), backend=self.backend,
                              notes=["not captured yet: the model is compiled on its first call"] + self.notes)
            rep = _make_report(self.last_ctx)
            rep.graphs = len(self.graphs)
        rep.notes.extend(n for n in self.notes if n not in rep.notes)
        if self.eager:
            rep.notes.append("the original module runs (fallback='eager' after a capture failure)")
        if not rep.sites:
            rep.notes.append("no attention site found: the model runs unchanged")
        return rep


def _weak(obj) -> Optional[weakref.ref]:
    """A weak reference to ``obj``, or ``None`` for an object that takes none (then it is checked every call)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _early_cache_init(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Allocate a transformers static cache's storage before the compiled call, as transformers' own compiled
    decoding does (its prefill runs eagerly): initialised inside a graph, the storage would be that graph's
    output, not marked as a fixed address, so the decode steps that update it in place could not replay as CUDA
    graphs (``mode="reduce-overhead"``). Sizes from the model's config (KV heads, head dim), the batch from the
    inputs, the dtype of the parameters. Returns whether it initialised anything; a cache or config it does not
    understand is left to initialise itself."""
    cache = kwargs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    init = getattr(cache, "early_initialization", None)
    # layers of a fixed length (a dynamic cache's grow by concatenation: nothing to place ahead)
    if not layers or init is None or not any(getattr(l, "supports_early_init", False) and hasattr(l, "max_cache_len")
                                             and not getattr(l, "is_initialized", True) for l in layers):
        return False
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    param = next(model.parameters(), None)
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and isinstance(x, torch.Tensor)
            and param is not None and param.is_floating_point()):
        return False
    init(x.shape[0], kv_heads, head_dim, param.dtype, x.device)
    return True


def _full_window_layers(cache, policy: Policy, window: Optional[int] = None) -> List[int]:
    """Give the sliding-window layers of a transformers KV cache every key, for a policy whose keep rule reads
    key indices (:meth:`Policy.reads_key_index`). Such a layer keeps only the keys of its window (a dynamic one the
    last ``window - 1``, a static one a ring buffer), so a decoding step's key ``j`` is not key ``j`` of the full
    sequence: N:M groups, keep draws and block patterns would be taken at other positions than the full forward's,
    and the step's rows would differ from it. A full layer holds every key; the model's sliding-window mask still
    limits each query to its window, so dense rows are unchanged and the policy's rows are the full forward's.
    Replaces layers that hold nothing yet (or, dynamic, nothing dropped yet; a hybrid of linear attention and a
    window only while it holds nothing at all) and returns their indices; a static
    layer shorter than the model's ``window`` (the cache is shorter than the window) never drops a key and stays.
    Raises ``ValueError`` for a layer that already dropped keys or that it does not know how to replace."""
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not any(getattr(l, "is_sliding", False) for l in layers):
        return []
    from transformers import cache_utils as cu

    # window layer -> its full twin; the hybrids (linear attention beside the window) are swapped only while empty
    twins = {cu.DynamicSlidingWindowLayer: cu.DynamicLayer, cu.StaticSlidingWindowLayer: cu.StaticLayer}
    hybrids = {getattr(cu, w): getattr(cu, f) for w, f in (
        ("LinearAttentionAndSlidingWindowAttentionLayer", "LinearAttentionAndFullAttentionLayer"),
        ("LinearAttentionAndStaticSlidingWindowAttentionLayer", "LinearAttentionAndStaticFullAttentionLayer"))
        if hasattr(cu, w) and hasattr(cu, f)}
    full_len = max((l.max_cache_len for l in layers
                    if isinstance(l, cu.StaticLayer) and not getattr(l, "is_sliding", False)), default=None)
    done = []
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_sliding", False):
            continue
        kind = type(layer)
        static = isinstance(layer, cu.StaticLayer)
        if static and isinstance(window, int) and layer.max_cache_len < window:
            continue  # shorter than the window: it never drops a key
        full, why = twins.get(kind, hybrids.get(kind)), None
        states = [v for d in ("is_conv_states_initialized", "is_recurrent_states_initialized")
                  for v in getattr(layer, d, {}).values()]
        if full is None:
            why = "is of a kind that keeps only a window of keys and that attncomp does not replace"
        elif kind in hybrids and (layer.is_initialized or any(states)):
            why = "already holds state"
        elif static and layer.is_initialized:
            why = "already holds keys (in a ring buffer)"
        elif static and full_len is None:
            why = "is static and no full-attention layer of the cache gives the cache's length"
        elif not static and layer.is_initialized and layer.cumulative_length != layer.keys.shape[-2]:
            why = "has already dropped the keys before its window"
        if why is not None:
            raise ValueError(
                f"policy {policy.name!r} keeps entries by key position, and layer {i} of this KV cache "
                f"({kind.__name__}) {why}: decoding steps over it would not compute the full forward's rows. "
                f"Start from a new cache (attncomp gives its sliding-window layers every key under this policy), pass "
                f"a cache built without the model's config (transformers.DynamicCache()), or use a policy that reads "
                f"no key index ('dense', 'hash')")
        kw = {"max_cache_len": full_len} if static else {}
        if kind in hybrids:
            kw["number_of_states"] = layer.number_of_states
        new = full(**kw)
        if not static and layer.is_initialized and layer.keys.numel():
            new.update(layer.keys, layer.values)  # a dynamic window layer that has dropped nothing yet
        layers[i] = new
        done.append(i)
    return done


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, guards and its recompile
    limit per code object: without this, every compiled module of one class would share them (a
    ninth compile of the same class would silently run eagerly, and a new module could hit the cached
    graphs of an old one)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    new = types.FunctionType(code.replace(co_name=code.co_name), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


def _first_line(e: BaseException) -> str:
    inner = getattr(e, "inner_exception", None)
    if inner is not None:  # BackendCompilerFailed: say what failed inside
        return f"{type(inner).__name__}: {_first_line(inner)}"
    s = str(e).strip()
    return s.splitlines()[0][:300] if s else ""


def _is_dynamo_error(e: BaseException) -> bool:
    mod = type(e).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor") or "BackendCompilerFailed" in \
        type(e).__name__


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
            fallback: str = "error", inference: Optional[bool] = None, capture: str = "dynamo",
            inductor: Optional[bool] = None, mode: Optional[str] = None, dynamic: Optional[bool] = None,
            **options) -> nn.Module:
    """Compile the attention of ``model``.

    Every attention site (``QK^T -> scale -> mask -> softmax -> dropout -> AV``, however written, and
    ``scaled_dot_product_attention`` calls) becomes one ``attncomp::attention`` op running ``policy``
    (``"dense"``, ``"dfss"``, ``"hash"``, ``"drop"``, ``"spion"``, ``"et"`` or a policy object) on
    ``backend`` (``"auto"``: the fastest correct kernel for the device).

    The returned module is an instance of the model's class sharing its parameters, buffers and
    submodules (``parameters()``, ``state_dict()``, ``.config``, ``generate()`` work before the first
    call); its ``forward`` runs the compiled graphs. ``capture``: ``"dynamo"`` (default; as
    ``torch.compile``: guards, graph breaks, dynamic shapes, KV-cache objects), ``"export"``
    (``torch.export``, one graph per call structure) or ``"fx"`` (``torch.fx.symbolic_trace``).
    ``inductor`` (default ``True``, or ``ATTNCOMP_INDUCTOR=0``): compile everything around the op with
    Inductor (dynamo capture only); ``mode`` is Inductor's (``"reduce-overhead"``: CUDA graphs);
    ``dynamic`` as in ``torch.compile`` (default: every input dim dynamic from the first call).

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments; given, the
    model is compiled now (it runs once on them; ``fully_shard``-ed modules that this forward without
    backward leaves unsharded get their sharded parameters back), otherwise on its first call.
    ``fallback="eager"`` returns the original module (with a warning) when the model cannot be
    captured. ``inference`` says whether weights are frozen (default: eval mode and no parameter
    requires grad), which lets rewrites fold constants into weights.
    The user's parameters are never modified by compilation. Any other keyword, or an unknown
    ``mode``, raises (``TypeError`` naming the closest keyword, Inductor's list of modes) before
    anything is compiled.
    """
    pol = _check_options(policy, backend, fallback, mode, options, compile)
    if capture not in _CAPTURES:
        raise ValueError(f"capture must be one of {_CAPTURES}, got {capture!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"attncomp.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise ValueError("this module is already compiled by attncomp; compile the original "
                         "(compiled.original) instead")
    inductor = _inductor_default() if inductor is None else bool(inductor)
    if mode in MEASURING_MODES:  # this process may time kernels from now on (DESIGN.md §6)
        env.allow_measuring()
    state = _State(model, pol, backend, fallback, inference, capture, inductor, mode, dynamic)
    fast = _wrap(model, state)
    if example_inputs is None:
        return fast
    args, kwargs = split_inputs(example_inputs)
    state.example = (args, kwargs)
    from .distributed import _param_ids, _restore_fsdp

    before = _param_ids(model)
    try:
        if capture == "dynamo":
            with torch.no_grad() if not model.training else contextlib.nullcontext():
                fast(*args, **kwargs)
        else:
            state.graph_for(fast, args, kwargs)
    except CaptureError as e:
        if fallback == "eager":
            warnings.warn(f"attncomp: returning the original module: {e}", RuntimeWarning, stacklevel=2)
            return model
        raise
    finally:
        # no backward follows this call: FSDP2 modules must not stay in the middle of an iteration
        reset = _restore_fsdp(model, before)
        if reset:
            state.notes.append(f"example inputs: the compile-time call left FSDP2 parameters unsharded; "
                               f"reset to the sharded parameters: {', '.join(reset)}; parameters(), "
                               "state_dict() and optimizers see them as before the call")
    return fast


def report(obj) -> Report:
    """The report of a compiled module (or of a :func:`backend` after ``torch.compile`` ran it)."""
    if isinstance(obj, CompiledModule):
        return obj.report()
    if isinstance(obj, _GraphCompiler):
        return obj.report()
    rep = getattr(obj, "_attncomp_report", None)
    if rep is not None:
        return rep
    inner = getattr(obj, "_orig_mod", None) or getattr(obj, "module", None)
    if isinstance(inner, CompiledModule):
        return inner.report()
    raise TypeError(f"no attncomp report for {type(obj).__name__}: pass a module returned by attncomp.compile "
                    "or attncomp.load, or the object returned by attncomp.backend()")


def _propagate_fake(gm: fx.GraphModule, example_inputs) -> None:
    """Dynamo graphs carry ``example_value`` on nodes; expose it as ``val`` for the passes."""
    for n in gm.graph.nodes:
        ev = n.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and "val" not in n.meta:
            n.meta["val"] = ev


def backend(policy: Union[str, Policy] = "dense", *, backend: str = "auto", inference: Optional[bool] = None,
            inductor: Optional[bool] = None, mode: Optional[str] = None, **options):
    """A backend for ``torch.compile(model, backend=attncomp.backend(policy=...))``: the same passes as
    :func:`compile`, then Inductor (``inductor``, default as in :func:`compile`). ``attncomp.report(the_backend)``
    lists the sites of every graph it compiled (a site recompiled by dynamo for new shapes is listed once).
    Its arguments are checked as :func:`compile`'s."""
    pol = _check_options(policy, backend, "error", mode, options, _BACKEND_ENTRY)
    inductor = _inductor_default() if inductor is None else bool(inductor)
    fix_dynamo_bound_methods()
    return _GraphCompiler(pol, backend, inference, inductor, mode, "torch.compile (dynamo)")


_BACKEND_ENTRY = backend  # (inside backend() the name is its argument)


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
        if compiled._attncomp.example is None:
            raise ValueError("attncomp.export needs example_inputs (a tuple of arguments or a dict of keyword "
                             "arguments)")
        args, kwargs = compiled._attncomp.example
    else:
        args, kwargs = split_inputs(example_inputs)
    st = compiled._attncomp
    was_training = compiled.training
    compiled.training = False
    try:
        gm, call = st.graph_for(compiled, args, kwargs)
    finally:
        compiled.training = was_training
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
    rep = _make_report(st.last_ctx) if st.last_ctx is not None else compiled.report()
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
