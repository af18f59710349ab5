"""Capture an ``nn.Module`` as one torch.fx ``GraphModule`` that later passes share.

Order: ``torch.fx.symbolic_trace`` first (keeps the module structure and Python-level ops); if that
fails, or the traced graph does not reproduce the model on the example inputs, ``torch.export``
(non-strict, every input dim dynamic) which handles models such as Hugging Face transformers; the
dynamo backend hands its own graphs straight to the passes. Both captures keep the batch and
sequence dims symbolic, so a compiled module runs new shapes without re-tracing.

Guarantees: the returned graph module has the model's call signature (positional and keyword
arguments, nested outputs), shares the model's parameters (the model is never modified), and carries
shape metadata (``tensor_meta`` for fx with example inputs, ``val`` for export).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_flatten, tree_map

from .base import CompileContext

log = logging.getLogger(__name__)

__all__ = ["capture", "CaptureError", "split_inputs", "fix_dynamo_bound_methods"]


class CaptureError(RuntimeError):
    """The model could not be captured; the message says which capture failed and why."""


def split_inputs(example_inputs) -> Tuple[Tuple, Dict[str, Any]]:
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ValueError("example_inputs must be a tuple of positional arguments, a dict of keyword arguments "
                     f"or a single tensor, got {type(example_inputs).__name__}")


class _Tracer(fx.Tracer):
    # buffers (e.g. GPT-2's causal ``bias``) become get_attr nodes, so slicing them by a traced length works
    proxy_buffer_attributes = True


def _fx_capture(model: nn.Module, args, kwargs) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    if args or kwargs:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        flat = []
        for p in placeholders:
            name = p.target.lstrip("*")
            if name not in bound.arguments:
                raise CaptureError(f"fx graph input {name!r} has no example value")
            flat.append(bound.arguments[name])
        with torch.no_grad():
            ShapeProp(gm).propagate(*flat)
            if not model.training:
                ref = model(*args, **kwargs)
                got = gm(*args, **kwargs)
                if not _same(ref, got):
                    raise CaptureError("the fx trace does not reproduce the model on the example inputs "
                                       "(data-dependent control flow?)")
    return gm


def _same(a, b) -> bool:
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x, y) and not torch.allclose(x, y, equal_nan=True):
                return False
    return True


def _dynamic_shapes(args, kwargs):
    auto = torch.export.Dim.AUTO

    def spec(t):
        if isinstance(t, torch.Tensor):
            return {i: auto for i in range(t.dim())}
        return None

    return tree_map(spec, args), tree_map(spec, kwargs)


def dynamic_shapes_for(fn, args, kwargs):
    """``dynamic_shapes`` for torch.export with every dim of every tensor input dynamic, keyed the way
    export wants it (by the signature's parameter names when keyword arguments are given)."""
    params = list(inspect.signature(fn).parameters.values())
    if not kwargs and len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return {params[0].name: _dynamic_shapes(args, kwargs)[0]}
    if not kwargs:
        return _dynamic_shapes(args, kwargs)[0]
    bound = inspect.signature(fn).bind(*args, **kwargs)
    return {k: _dynamic_shapes((v,), {})[0][0] for k, v in bound.arguments.items()}


class _WithConstants(nn.Module):
    """Calls ``model`` with tensor arguments by position and the non-tensor keyword arguments fixed
    (torch.export cannot take dynamic shapes next to non-tensor ``**kwargs`` values)."""

    def __init__(self, model: nn.Module, names, constants):
        super().__init__()
        self.model = model
        self.names = list(names)
        self.constants = dict(constants)

    def forward(self, *tensors):
        return self.model(**dict(zip(self.names, tensors)), **self.constants)


def _has_tensor(x) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(x)[0])


def _export_capture(model: nn.Module, args, kwargs) -> Tuple[fx.GraphModule, str]:
    if kwargs and not args and not all(_has_tensor(v) for v in kwargs.values()):
        names = [k for k, v in kwargs.items() if _has_tensor(v)]
        consts = {k: v for k, v in kwargs.items() if not _has_tensor(v)}
        gm, note = _export_capture(_WithConstants(model, names, consts), tuple(kwargs[k] for k in names), {})
        gm.meta["attncomp_positional"] = names
        for n in gm.graph.nodes:  # report paths as in the user's model, not the wrapper's
            stack = n.meta.get("nn_module_stack")
            if stack:
                n.meta["nn_module_stack"] = {k: (v[0][len("model."):] if isinstance(v[0], str) and
                                                 v[0].startswith("model.") else v[0], v[1])
                                             for k, v in stack.items()}
        return gm, note + f"; fixed arguments {sorted(consts)}"
    dynamic = dynamic_shapes_for(model.forward, args, kwargs)
    note = "dynamic shapes"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
        except Exception as e:
            log.info("export with dynamic shapes failed (%s); exporting with static shapes", e)
            ep = torch.export.export(model, args, kwargs, strict=False)
            note = f"static shapes (dynamic export failed: {str(e).splitlines()[0][:200]})"
    return ep.module(), note


def capture(model: nn.Module, example_inputs, ctx: Optional[CompileContext] = None,
            route: str = "fx") -> fx.GraphModule:
    """Return a GraphModule equivalent to ``model``; raise :class:`CaptureError` naming what failed.

    ``route``: ``"export"`` (torch.export only), or ``"fx"`` (symbolic_trace, then torch.export for
    models fx cannot trace). Dynamo's graphs do not come through here: its backend hands them to the passes directly.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"attncomp.compile expects an nn.Module, got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    if route == "export":
        return _export_only(model, args, kwargs, ctx)
    try:
        gm = _fx_capture(model, args, kwargs)
        if ctx is not None:
            ctx.capture = "torch.fx symbolic_trace"
        return gm
    except Exception as e:
        fx_err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.info("fx symbolic_trace failed: %s", fx_err)
    if not args and not kwargs:
        raise CaptureError(f"torch.fx could not trace {type(model).__name__} ({fx_err}); pass example_inputs "
                           "so that torch.export can capture it")
    return _export_only(model, args, kwargs, ctx, fx_err)


def _export_only(model, args, kwargs, ctx, fx_err: Optional[str] = None) -> fx.GraphModule:
    """torch.export; ``fx_err`` (why fx failed first, if it was tried) goes into the error and the report."""
    if not args and not kwargs:
        raise CaptureError(f"torch.export needs example inputs to capture {type(model).__name__}")
    fx_part = f"torch.fx symbolic_trace failed ({fx_err}); " if fx_err else ""
    try:
        gm, note = _export_capture(model, args, kwargs)
    except Exception as e:
        ex_err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise CaptureError(f"could not capture {type(model).__name__}: {fx_part}torch.export failed ({ex_err})"
                           f"{_cache_hint(ex_err)}") from e
    if ctx is not None:
        ctx.capture = f"torch.export (non-strict, {note})" + (f"; fx failed: {fx_err[:160]}" if fx_err else "")
    return gm


def _cache_hint(err: str) -> str:
    if "Cache" not in err:
        return ""
    return ("; the model returns a KV-cache object that torch.export cannot output: pass use_cache=False in the "
            "example inputs")


_BOUND_FIX = []


def fix_dynamo_bound_methods() -> bool:
    """Make dynamo (torch 2.13) rebuild ``fn.__get__(obj)`` correctly when ``fn`` is not ``obj``'s attribute.

    Dynamo names such a bound method by the source ``obj.<fn.__name__>``, as if ``fn`` were a method of
    ``obj``'s class. RecurrentGemma binds module-level functions onto its cache inside ``forward``
    (``cache.get_mask_sizes = _get_mask_sizes.__get__(cache)``): where the cache is an input, the compiled code
    reads ``cache._get_mask_sizes`` to replay that store and fails with ``AttributeError`` (it would read a
    different method where the class had one of that name). Here such a method is rebuilt as
    ``types.MethodType(fn, obj)`` from ``fn``'s own source (a global) and ``obj``; where ``fn`` has no source, it
    gets none (dynamo then breaks the graph before the store instead of failing). Methods that are ``obj``'s
    attribute under that name (every method of its class) keep their source: nothing else changes.
    Installed once per process; returns whether it is installed (False where dynamo has no such code)."""
    if _BOUND_FIX:
        return _BOUND_FIX[0]
    import types

    try:
        from torch._dynamo.bytecode_transformation import create_call_function
        from torch._dynamo.variables import functions as vf
        orig = vf.UserFunctionVariable.tp_descr_get_impl
        method_var = vf.UserMethodVariable
    except (ImportError, AttributeError):
        _BOUND_FIX.append(False)
        return False

    class BoundMethodVariable(method_var):
        """``fn.__get__(obj)`` for an ``fn`` with a source of its own: rebuilt as ``MethodType(fn, obj)``."""

        def reconstruct(self, codegen) -> None:
            codegen.add_push_null(lambda: codegen.load_import_from("types", "MethodType"))
            codegen(vf.UserFunctionVariable(self.fn, source=self.source_fn))
            codegen(self.obj)
            codegen.extend_output(create_call_function(2, False))

    def tp_descr_get_impl(self, tx, obj, owner):
        out = orig(self, tx, obj, owner)
        value = getattr(obj, "value", None)
        if getattr(out, "source", None) is None or value is None or type(out) is not method_var:
            return out
        try:
            attr = inspect.getattr_static(value, self.fn.__name__, None)
        except Exception:  # noqa: BLE001 (an object that resists static lookup: dynamo's own behaviour)
            return out
        if attr is self.fn or (isinstance(attr, types.MethodType) and attr.__func__ is self.fn
                               and attr.__self__ is value):
            return out
        cls = BoundMethodVariable if self.source is not None else method_var
        return cls(self.fn, obj, source_fn=self.source, source=None)

    tp_descr_get_impl.__wrapped__ = orig
    vf.UserFunctionVariable.tp_descr_get_impl = tp_descr_get_impl
    _BOUND_FIX.append(True)
    return True
