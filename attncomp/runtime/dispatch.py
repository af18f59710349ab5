"""Choose the backend that runs a spec on given tensors, per call.

``auto`` runs the fastest correct kernel (DESIGN.md §6):

* sites whose policy keeps every allowed entry (``dense``, ``et``) and calls without dropout are
  exact softmax attention, so PyTorch's SDPA kernels may run them (``attncomp.codegen.sdpa``):
  on a CPU its CPU flash kernel always (the reference materialises N×N); on CUDA the faster of
  SDPA and attncomp's Triton kernel for the site's predicates per shape bucket (pow2 of Nq, Nk, D;
  dtype; predicate kind) and GPU: the autotune store's entry under :data:`DENSE_CHOICE`
  (:func:`dense_choice_key`), else the table shipped for the GPU model (:mod:`.choice_tables`), else
  measured once and kept in the store, only where measuring is allowed (a compile with
  ``mode="max-autotune"`` in this process, or ``ATTNCOMP_AUTOTUNE=1``: no first call of a default compile
  measures), and never while a CUDA graph is being captured or while ``torch.cuda.get_sync_debug_mode()``
  is set (timing synchronises): such a call takes the stored choice, the shipped table's, else SDPA;
* other sites on CUDA tensors with Triton importable and supporting the spec: the sequence-length
  rule below picks the fused (flash-style, on-the-fly) Triton kernel or the split form;
* elsewhere the reference backend (exact).

:func:`describe_choice` says in words what ``auto`` runs for a spec on a device and why. A named
backend is used as asked; if it cannot run the spec, a clear error says why (nothing silently
falls back to different numerics). Backend choice does no device synchronisation; the per-call
decision is memoised per (spec, device, dtype, sizes, predicate kind, dropout).

Sequence-length rule (E.T. §3.2). The fused kernel re-reads K and V once per query tile; past some
key length the split form (separate ``QK^T`` GEMM, softmax, ``AV`` GEMM, materialising the scores:
the reference backend, whose matmuls run on cuBLAS) is faster. The crossover depends on the policy,
head dim, dtype and GPU, so it is measured, stored by the runtime's autotune store under
``autotune.lookup(SEQ_RULE, {"policy", "head_dim", "dtype", "arch"})`` (:func:`seq_rule_key`; the
store adds library versions and the GPU) and applied per call with the call's key length ``Nk``:

* no stored value: fused for every ``Nk`` (the kernel needs no measurement to be correct);
* ``{"split_above": T}``: fused when ``Nk <= T``, split when ``Nk > T``;
* ``{"timings": [{"n": N, "fused": ms, "split": ms}, ...]}``: ``T`` is the largest measured ``N``
  below the first one where the split form was faster (fused everywhere if it never was);
* optional ``"fused"``/``"split"`` name the backends (default ``"triton"``/``"reference"``); a split
  backend that cannot run the spec falls back to the fused one (both are exact).

Both forms compute the same function to within their dtype's rounding (the Triton kernels' float32
dot runs as tf32); only speed differs.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

import torch

from ..codegen import get_backend
from . import choice_tables, env
from ..spec import AttentionSpec, dtype_name

log = logging.getLogger(__name__)

__all__ = ["select_backend", "triton_available", "SEQ_RULE", "seq_rule_key", "seq_rule", "choose_form",
           "describe_rule", "record_seq_rule", "clear_rule_cache", "DENSE_CHOICE", "dense_choice_key",
           "dense_choice", "record_dense_choice", "describe_choice", "predicate_kind", "inline_choice",
           "INLINE_CHOICE", "MEASURING_MODES"]

#: autotune-store name under which sequence-length rules are kept
SEQ_RULE = "seq_len_rule"
#: autotune-store name of the measured SDPA-vs-Triton choice for keep-everything sites on CUDA
DENSE_CHOICE = "dense_kernel_choice"
#: autotune-store name of the measured choice for compiled keep-everything sites on CUDA: SDPA's kernel
#: traced into the graph against the op on Triton, per call with host time (:func:`inline_choice`)
INLINE_CHOICE = "dense_inline_choice"

_rule_cache: Dict[tuple, Optional[Dict[str, Any]]] = {}
_choice_cache: Dict[tuple, Optional[str]] = {}
_auto_memo: Dict[tuple, Any] = {}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def seq_rule_key(policy: str, head_dim: int, dtype, arch: str) -> Dict[str, Any]:
    """The store key of a sequence-length rule (the store adds library versions and the GPU)."""
    dt = dtype if isinstance(dtype, str) or dtype is None else dtype_name(dtype)
    return {"policy": policy, "head_dim": int(head_dim), "dtype": dt, "arch": arch}


def _memo_key(key: Dict[str, Any]) -> tuple:
    # the store lives under $ATTNCOMP_CACHE_DIR: a different directory is a different store
    return (os.environ.get("ATTNCOMP_CACHE_DIR", ""),) + tuple(sorted(key.items()))


def _autotune_lookup(name: str, key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    try:
        from . import autotune
    except ImportError:
        return None
    try:
        return autotune.lookup(name, key)
    except Exception as e:  # a damaged store never breaks a call: the fused kernel is always correct
        log.warning("attncomp: could not read the sequence-length rule %s: %s", key, e)
        return None


def seq_rule(policy: str, head_dim: int, dtype, arch: str) -> Optional[Dict[str, Any]]:
    """The stored rule for (policy, D, dtype, arch), normalised to ``{"split_above": T, ...}`` or None."""
    key = seq_rule_key(policy, head_dim, dtype, arch)
    mk = _memo_key(key)
    if mk not in _rule_cache:
        _rule_cache[mk] = _normalise(_autotune_lookup(SEQ_RULE, key))
    return _rule_cache[mk]


def clear_rule_cache() -> None:
    """Forget this process's copies of stored rules and choices (the store keeps them)."""
    _rule_cache.clear()
    _choice_cache.clear()
    _auto_memo.clear()
    _arch_cache.clear()
    _name_cache.clear()
    choice_tables.clear()


def _normalise(value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not value:
        return None
    rule = {k: value[k] for k in ("fused", "split") if k in value}
    if value.get("split_above") is not None:
        rule["split_above"] = int(value["split_above"])
    elif value.get("timings"):
        rows = sorted(value["timings"], key=lambda r: int(r["n"]))
        above = None
        for i, r in enumerate(rows):
            if float(r["split"]) < float(r["fused"]):
                above = int(rows[i - 1]["n"]) if i else 0
                break
        if above is None:
            return None
        rule["split_above"] = above
    else:
        return None
    return rule


def choose_form(rule: Optional[Dict[str, Any]], n_keys: int) -> str:
    """``"fused"`` or ``"split"`` for a call with ``n_keys`` keys under ``rule``."""
    if rule is None or rule.get("split_above") is None:
        return "fused"
    return "split" if int(n_keys) > int(rule["split_above"]) else "fused"


def describe_rule(rule: Optional[Dict[str, Any]]) -> str:
    if rule is None:
        return "fused (triton) for every sequence length (no stored measurement)"
    f, s = rule.get("fused", "triton"), rule.get("split", "reference")
    return f"fused ({f}) for Nk <= {rule['split_above']}, split ({s}: QK^T, softmax, AV) above"


def record_seq_rule(policy: str, head_dim: int, dtype, arch: str, value: Dict[str, Any]) -> None:
    """Store a measured rule (``{"split_above": T}`` or ``{"timings": [...]}``) for later calls."""
    from . import autotune

    if _normalise(value) is None and not value.get("timings"):
        raise ValueError(f"a sequence-length rule is {{'split_above': int}} or {{'timings': [...]}}, got {value!r}")
    key = seq_rule_key(policy, head_dim, dtype, arch)
    autotune.record(SEQ_RULE, key, value)
    _rule_cache.pop(_memo_key(key), None)


_arch_cache: Dict[Any, str] = {}


def _gpu_arch(q: torch.Tensor) -> Optional[str]:
    if not q.is_cuda:
        return None
    arch = _arch_cache.get(q.device)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = _arch_cache[q.device] = f"sm_{major}{minor}"
    return arch


def _supports(be, spec: AttentionSpec, q: torch.Tensor, preds=None) -> Optional[str]:
    # ``preds`` goes to backends only when present, so that older backends keep their signature
    return be.supports(spec, q) if preds is None else be.supports(spec, q, preds=preds)


def _runs(be, spec: AttentionSpec, q: torch.Tensor, v: Optional[torch.Tensor], preds=None) -> bool:
    if _supports(be, spec, q, preds) is not None:
        return False
    # a folded site (W_V·W_O) has a value head dim other than q's; the backend must take both
    return v is None or v.shape[-1] == q.shape[-1] or _supports(be, spec, v, preds) is None


# -- keep-everything sites: SDPA against attncomp's kernel -------------------------------------

def predicate_kind(spec: AttentionSpec, preds=None, nq: Optional[int] = None, nk: Optional[int] = None,
                   mask: bool = False) -> str:
    """The mask class that decides which kernel is fastest: ``none``, ``causal`` (SDPA's top-left
    ``is_causal`` alone), ``causal+mask``, or ``mask`` (anything SDPA takes as a dense mask)."""
    from ..codegen.sdpa import top_left_causal_only

    if nq is not None and nk is not None and top_left_causal_only(spec, nq, nk, preds):
        causal_only = not (preds is not None and preds.any())
        return "causal" if causal_only and not mask else "causal+mask"
    if spec.uses_positions() or (preds is not None and preds.any()) or mask:
        return "mask"
    return "none"


def dense_choice_key(nq: int, nk: int, head_dim: int, dtype, kind: str, arch: str, groups: int = 1) -> Dict[str, Any]:
    """The store key of a measured SDPA-vs-Triton choice (sizes by power of two)."""
    from .autotune import shape_bucket

    dt = dtype if isinstance(dtype, str) or dtype is None else dtype_name(dtype)
    return {"nq": shape_bucket(nq), "nk": shape_bucket(nk), "head_dim": int(head_dim), "dtype": dt,
            "kind": kind, "arch": arch, "gqa": int(groups) > 1}


#: rounds of timed calls per candidate, interleaved (each round times every candidate in turn, so a clock or
#: thermal drift during the measurement moves them alike), and calls per round; the median round decides
_ROUNDS = 7
_REPS = 3


def _time_candidates(names, spec, q, k, v, attn_mask, preds) -> Dict[str, float]:
    """Milliseconds of forward + backward per candidate backend on these inputs (CUDA events): every candidate
    warmed up twice, then :data:`_ROUNDS` interleaved rounds of :data:`_REPS` calls, the median round's time."""
    runs = {}
    for nm in names:
        be = get_backend(nm)
        qq, kk, vv = (t.detach() for t in (q, k, v))
        kw = {} if preds is None else {"preds": preds}

        def run(be=be, qq=qq, kk=kk, vv=vv, kw=kw):
            out, lse = be.forward(spec, qq, kk, vv, attn_mask, None, None, None, 0.0, 0, **kw)
            be.backward(spec, qq, kk, vv, attn_mask, None, None, None, 0.0, 0, out, lse, out, **kw)

        try:
            run()
            run()
        except Exception as e:  # a candidate that fails is not chosen
            log.warning("attncomp: timing %s for %s failed: %s", nm, spec.describe(), e)
            continue
        runs[nm] = run
    rounds: Dict[str, list] = {nm: [] for nm in runs}
    torch.cuda.synchronize(q.device)
    for _ in range(_ROUNDS):
        for nm, run in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_REPS):
                run()
            end.record()
            torch.cuda.synchronize(q.device)
            rounds[nm].append(start.elapsed_time(end) / _REPS)
    return {nm: sorted(ts)[len(ts) // 2] for nm, ts in rounds.items() if ts}


def dense_choice(key: Dict[str, Any]) -> Optional[str]:
    """The stored winner (``"sdpa"`` or ``"triton"``) for a :func:`dense_choice_key`, or None."""
    mk = ("dense",) + _memo_key(key)
    if mk not in _choice_cache:
        val = _autotune_lookup(DENSE_CHOICE, key)
        _choice_cache[mk] = _winner(val)
    return _choice_cache[mk]


def _winner(val: Optional[Dict[str, Any]]) -> Optional[str]:
    if not val:
        return None
    if val.get("best"):
        return str(val["best"])
    t = val.get("timings") or {}
    ok = {k: float(x) for k, x in t.items() if x is not None}
    return min(ok, key=ok.get) if ok else None


def record_dense_choice(key: Dict[str, Any], timings: Dict[str, float]) -> str:
    """Store measured times ``{"sdpa": ms, "triton": ms}`` for a key; returns the winner."""
    from . import autotune

    best = _winner({"timings": timings})
    if best is None:
        raise ValueError(f"no usable timing in {timings!r}")
    autotune.record(DENSE_CHOICE, key, {"best": best, "timings": timings})
    _choice_cache[("dense",) + _memo_key(key)] = best
    return best


def _dense_on_cuda(spec, q, k, v, attn_mask, preds, arch: str, kind: str):
    """SDPA or Triton for a keep-everything CUDA call: the stored winner, else the winner in the table
    shipped for this GPU (:mod:`.choice_tables`), else measure now (once) where measuring is allowed, else SDPA."""
    cands = []
    for nm in ("sdpa", "triton"):
        try:
            be = get_backend(nm)
        except (ImportError, ValueError):
            continue
        if nm == "triton" and not triton_available():
            continue
        if _runs(be, spec, q, v, preds):
            cands.append(nm)
    if not cands:
        return None, "no fused kernel runs this call"
    if len(cands) == 1:
        return cands[0], f"only {cands[0]} runs this call"
    key = dense_choice_key(q.shape[-2], k.shape[-2], q.shape[-1], q.dtype, kind, arch, q.shape[1] // k.shape[1])
    best = dense_choice(key)
    why = "measured faster for this shape bucket"
    if best not in cands:
        shipped = choice_tables.lookup(DENSE_CHOICE, key, _gpu_name(q))
        if _winner(shipped) in cands:
            return _winner(shipped), f"faster for this shape bucket {_in_table(shipped)}"
        hold = _no_measuring()
        if hold is not None:  # nothing stored and no timing allowed now: the static default, not remembered
            best = "sdpa" if "sdpa" in cands else cands[0]
            return best, f"not measured {hold}: the default"
        times = _time_candidates(cands, spec, q, k, v, attn_mask, preds)
        if not times:
            return cands[0], "timing failed; first candidate"
        best = record_dense_choice(key, times)
        why = f"measured now: {', '.join(f'{n} {t:.3g} ms' for n, t in sorted(times.items()))}"
    return best, why


def _no_measuring() -> Optional[str]:
    """Why timing kernels is not allowed now (it synchronises the device), or None: outside
    ``mode="max-autotune"`` (:func:`.env.measuring_allowed`), a CUDA graph is being captured, or a sync
    debug mode is set."""
    if not env.measuring_allowed():
        return "outside mode='max-autotune' (ATTNCOMP_AUTOTUNE=1 allows it)"
    try:
        if torch.cuda.is_current_stream_capturing():
            return "during CUDA graph capture"
        if torch.cuda.get_sync_debug_mode() != 0:
            return "with torch.cuda.get_sync_debug_mode() set"
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA in this build: nothing to time either
        return None
    return None


# -- the choice --------------------------------------------------------------------------------

def _auto(spec: AttentionSpec, q: torch.Tensor, n_keys: int, v: Optional[torch.Tensor] = None,
          preds=None, dropout_p: Optional[float] = None, k: Optional[torch.Tensor] = None,
          attn_mask: Optional[torch.Tensor] = None) -> Tuple[Any, str]:
    be, form, _ = _auto_explained(spec, q, n_keys, v, preds, dropout_p, k, attn_mask)
    return be, form


def _auto_explained(spec, q, n_keys, v=None, preds=None, dropout_p=None, k=None, attn_mask=None):
    """``(backend, form, why)`` for an ``auto`` call."""
    p = spec.dropout_p if dropout_p is None else dropout_p
    arch = _gpu_arch(q)
    if p == 0 and keeps_all(spec):
        try:
            sd = get_backend("sdpa")
        except (ImportError, ValueError):
            sd = None
        if arch is None:
            if sd is not None and _runs_sdpa(sd, spec, q, v, preds):
                return sd, "sdpa", "keeps every allowed entry, no dropout: SDPA's CPU kernel"
        elif k is not None:
            kind = predicate_kind(spec, preds, q.shape[-2], n_keys, attn_mask is not None)
            name, why = _dense_on_cuda(spec, q, k, v, attn_mask, preds, arch, kind)
            if name is not None:
                return get_backend(name), name, f"keeps every allowed entry: {name} ({why})"
    if arch is None:
        from ..codegen.tvm.auto import cpu_choice  # imports no tvm: checks that it is installed

        tv = cpu_choice(spec, q, n_keys, v, preds)
        if tv is not None:
            return tv[0], "tvm", tv[1]
    if arch is None or not triton_available():
        return get_backend("reference"), "reference", ("no CUDA tensors: the exact reference" if arch is None
                                                       else "no Triton: the exact reference")
    rule = seq_rule(spec.policy.name, q.shape[-1], q.dtype, arch)
    form = choose_form(rule, n_keys)
    names = {"fused": (rule or {}).get("fused", "triton"), "split": (rule or {}).get("split", "reference")}
    for f in ((form, "fused") if form == "split" else ("fused",)):
        try:
            be = get_backend(names[f])
        except (ImportError, ValueError):
            continue
        if _runs(be, spec, q, v, preds):
            return be, f, f"{f} ({names[f]}): {describe_rule(rule)}"
    return get_backend("reference"), "reference", "no fused kernel runs this site: the exact reference"


#: compile modes (Inductor's, as given to :func:`attncomp.compile`) under which the compiler may time
#: kernels: :func:`inline_choice` measures the buckets that nothing measured yet
MEASURING_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def inline_choice(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, preds=None,
                  dropout_p: float = 0.0, attn_mask: Optional[torch.Tensor] = None,
                  mode: Optional[str] = None, device_only: bool = False) -> Tuple[bool, str]:
    """Whether a compiled site with these (fake or real) tensors runs SDPA's kernel traced into its
    graph (``attncomp/passes/inline_sdpa.py``), and why (or why not). The pass asks; the runtime
    decides, and times kernels only when the compile's ``mode`` is one of :data:`MEASURING_MODES`.

    On a CPU: every keep-everything call without dropout. On a GPU: SDPA where Triton cannot run
    the call; otherwise, per shape bucket (:func:`dense_choice_key`; with ``device_only``, for graphs
    replayed as CUDA graphs, which issue no host work between kernels, the bucket of device time
    alone, kept apart), the first of

    1. the autotune store: SDPA's kernel stored as faster than Triton's (:data:`DENSE_CHOICE`: the op
       would run SDPA then); else the stored winner of SDPA traced against the op on Triton
       (:data:`INLINE_CHOICE`);
    2. under ``mode="max-autotune"`` (or ``"max-autotune-no-cudagraphs"``): that comparison measured now
       (:func:`_inline_times`: per call, host time included, where a model with small attention calls
       waits on the host; device time alone with ``device_only``) and stored; symbolic sizes are
       measured at their hints (the sizes of the first call);
    3. the store's Triton kernel as the faster one (:data:`DENSE_CHOICE`): the op;
    4. the table shipped for this GPU model (:mod:`attncomp.runtime.choice_tables`, measured on the
       project's H100 and H200), read as the store is in 1 and 3;
    5. the default rule: SDPA's kernel, traced. It is what the op runs where it may not measure
       (:func:`_dense_on_cuda`), and traced it runs without the op's host path.

    Nothing but 2 times a kernel; only 2 writes to the store.
    """
    if dropout_p or spec.dropout_p:
        return False, "dropout (attncomp's draws differ from SDPA's)"
    if not keeps_all(spec):
        return False, f"policy {spec.policy.name!r} does not keep every allowed entry"
    if spec.backend not in ("auto", "sdpa"):
        return False, f"backend {spec.backend!r} asked"
    try:
        sd = get_backend("sdpa")
    except (ImportError, ValueError):
        return False, "no SDPA backend registered"
    if not (hasattr(sd, "inline_plan") and hasattr(sd, "inline_forward")) or not _runs_sdpa(sd, spec, q, v, preds):
        return False, "SDPA's kernel does not run this call"
    if spec.backend == "sdpa":
        return True, "sdpa (as asked)"
    arch = _gpu_arch(q)
    if arch is None:
        return True, "SDPA's CPU kernel (every CPU call of a keep-everything site without dropout)"
    if not triton_available():
        return True, "no Triton: SDPA's kernel"
    try:
        tr = get_backend("triton")
    except (ImportError, ValueError):
        return True, "no Triton backend: SDPA's kernel"
    if not _runs(tr, spec, q, v, preds):
        return True, "Triton does not run this call: SDPA's kernel"
    sizes = [_hint(x) for x in q.shape] + [_hint(x) for x in k.shape]
    if None in sizes:
        return False, "sizes without a hint: SDPA against Triton is chosen per call"
    B, hq, nq, d, _, hk, nk, _ = sizes
    kind = predicate_kind(spec, preds, nq, nk, attn_mask is not None)
    key = dense_choice_key(nq, nk, d, q.dtype, kind, arch, hq // hk)
    dense = dense_choice(key)
    if dense == "sdpa":
        return True, "SDPA's kernel measured faster than Triton's for this shape bucket (autotune store)"
    per = "per call on the device (CUDA graphs)" if device_only else "per call"
    ikey = dict(key, cuda_graphs=True) if device_only else key
    val = _autotune_lookup(INLINE_CHOICE, ikey)
    if _winner(val) is None and mode in MEASURING_MODES:
        hold = _no_measuring()
        if hold is not None:
            return False, f"SDPA traced against the op on Triton not measured {hold}"
        times = _inline_times(spec, q, k, v, preds, attn_mask, (B, hq, nq, d, hk, nk, _hint(v.shape[-1]) or d),
                              device_only)
        if not times:
            return False, "timing SDPA against the op on Triton failed"
        val = {"best": _winner({"timings": times}), "timings": times}
        from . import autotune

        autotune.record(INLINE_CHOICE, ikey, val)
    if _winner(val) is not None:
        return _inline_answer(val, per)
    if dense == "triton":
        return False, "Triton's kernel measured faster than SDPA's for this shape bucket (autotune store)"
    gpu = _gpu_name(q)
    shipped = choice_tables.lookup(DENSE_CHOICE, key, gpu)
    dense = _winner(shipped)
    table = _in_table(shipped)
    if dense == "sdpa":
        return True, f"SDPA's kernel faster than Triton's for this shape bucket {table}"
    inline = choice_tables.lookup(INLINE_CHOICE, ikey, gpu)
    if _winner(inline) is not None:
        return _inline_answer(inline, per, shipped=True)
    if dense == "triton":
        return False, f"Triton's kernel faster than SDPA's for this shape bucket {table}"
    return True, (f"the default rule (nothing measured {per} for this shape bucket; the compile's mode is not "
                  "'max-autotune'): SDPA's kernel, traced")


def _inline_answer(val: Dict[str, Any], per: str, shipped: bool = False) -> Tuple[bool, str]:
    """The answer of a stored (or, ``shipped``, a table's) measurement of SDPA traced against the op."""
    figures = _figures(val) + (f"; {val['row']}" if val.get("row") else "")
    how, where = ("", " in the table shipped for this GPU") if shipped else ("measured ", "")
    if _winner(val) == "sdpa":
        return True, f"SDPA's kernel, traced, {how}faster {per} than the op on Triton{where} ({figures})"
    return False, f"the op on Triton {how}faster {per} than SDPA's kernel traced{where} ({figures})"


def _in_table(entry: Optional[Dict[str, Any]]) -> str:
    """Where a shipped table's entry comes from, in words: its timings and the measured row."""
    return f"in the table shipped for this GPU ({_figures(entry)}; {(entry or {}).get('row')})"


def _figures(val: Optional[Dict[str, Any]]) -> str:
    t = (val or {}).get("timings") or {}
    return ", ".join(f"{n} {float(x):.3g} ms" for n, x in sorted(t.items()) if x is not None)


def _gpu_name(q: torch.Tensor) -> Optional[str]:
    """The name of q's GPU (``torch.cuda.get_device_name``), or None."""
    if not q.is_cuda:
        return None
    name = _name_cache.get(q.device)
    if name is None:
        try:
            name = _name_cache[q.device] = torch.cuda.get_device_name(q.device)
        except (RuntimeError, AssertionError):
            return None
    return name


_name_cache: Dict[Any, str] = {}


def _hint(x) -> Optional[int]:
    """A size as an int: its value, or a symbolic size's hint (the sizes it was traced with)."""
    if isinstance(x, int):
        return x
    hint = getattr(getattr(x, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else None


def _inline_times(spec, q, k, v, preds, attn_mask, sizes, device_only: bool = False) -> Dict[str, float]:
    """Milliseconds per call, calls back to back (host and device time together, as a compiled
    graph issues them; with ``device_only`` the device's time alone, as a CUDA graph replays them),
    at ``sizes`` ``(B, Hq, Nq, D, Hk, Nk, Dv)`` on new real tensors of q's dtype and device: SDPA's
    kernel with its mask built beforehand (a traced site's compiled code builds it in one fused kernel
    of its own) against ``attncomp::attention`` on Triton (its host path included). Where the
    predicates or the mask are present, they allow every entry."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..codegen.reference import default_positions
    from ..codegen.sdpa import prepared_forward
    from ..opspec import ARG_INDEX, PRED_NAMES

    B, hq, nq, d, hk, nk, dv = sizes
    times: Dict[str, float] = {}
    with unset_fake_temporarily(), torch.no_grad():
        dev, dt = q.device, q.dtype
        qq = torch.randn(B, hq, nq, d, device=dev, dtype=dt)
        kk = torch.randn(B, hk, nk, d, device=dev, dtype=dt)
        vv = torch.randn(B, hk, nk, dv, device=dev, dtype=dt)
        mask = None
        if attn_mask is not None:
            mask = (torch.ones if attn_mask.dtype == torch.bool else torch.zeros)(
                tuple(_hint(x) or 1 for x in attn_mask.shape), dtype=attn_mask.dtype, device=dev)
        real = None
        if preds is not None and preds.any():
            qpos, kpos = default_positions(spec, nq, nk, dev)
            made = {"q_pos": qpos, "k_pos": kpos, "q_seg": torch.zeros(B, nq, dtype=torch.int64, device=dev),
                    "k_seg": torch.zeros(B, nk, dtype=torch.int64, device=dev),
                    "q_valid": torch.ones(B, nq, dtype=torch.bool, device=dev),
                    "k_valid": torch.ones(B, nk, dtype=torch.bool, device=dev)}
            real = type(preds)(*(None if t is None else made[n] for n, t in zip(PRED_NAMES, preds)))
        args = [None] * len(ARG_INDEX)
        for name, val in (("q", qq), ("k", kk), ("v", vv), ("attn_mask", mask), ("dropout_p", 0.0), ("seed", 0),
                          ("spec", spec.replace(backend="triton").to_json())):
            args[ARG_INDEX[name]] = val
        for name, t in zip(PRED_NAMES, real or ()):
            args[ARG_INDEX[name]] = t
        runs = {"sdpa": prepared_forward(spec, qq, kk, vv, mask, real),
                "triton": lambda: torch.ops.attncomp.attention(*args)}
        for nm, run in runs.items():
            try:
                times[nm] = _per_call_ms(run, dev, device_only=device_only)
            except Exception as e:  # a candidate that fails is not chosen
                log.warning("attncomp: timing %s for %s failed: %s", nm, spec.describe(), e)
    return times


def _per_call_ms(run, device, budget_ms: float = 50.0, device_only: bool = False) -> float:
    """Milliseconds per call of ``run`` issued back to back (CUDA events), after warm-up calls. With
    ``device_only`` the device first spins for longer than the host takes to issue every call, so
    that the events time the kernels alone, back to back (as a CUDA graph's replay runs them)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    run()
    end.record()
    issue_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    reps = max(5, min(50, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    if device_only:  # ~3e6 cycles per ms: more than the issue time at any clock up to 3 GHz
        torch.cuda._sleep(int(3e6 * issue_ms * (reps + 2)) + 1_000_000)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def _runs_sdpa(sd, spec, q, v, preds) -> bool:
    if _supports(sd, spec, q, preds) is not None:
        return False
    return v is None or v.shape[-1] == q.shape[-1]


def keeps_all(spec: AttentionSpec) -> bool:
    return bool(spec.policy.keeps_all())


def _tvm_auto_env():
    """The value of ``ATTNCOMP_TVM_AUTO`` (raw; None when unset): part of the CPU choice's memo key."""
    return env.raw("ATTNCOMP_TVM_AUTO")


_provisional = [0]  # provisional choices returned so far


def selection_state() -> tuple:
    """What a backend choice reads besides the call (the backend registry, the TVM switch) and how many
    provisional choices were made: a call whose state differs before and after its selection got a
    provisional choice (memos keyed by the state then keep nothing of it)."""
    return id(get_backend), _tvm_auto_env(), _provisional[0]


def select_backend(spec: AttentionSpec, q: torch.Tensor, k: Optional[torch.Tensor] = None,
                   v: Optional[torch.Tensor] = None, preds=None, dropout_p: Optional[float] = None,
                   attn_mask: Optional[torch.Tensor] = None):
    """The backend object that runs ``spec`` on these tensors.

    ``k`` gives the key length for the sequence-length rule (else q's length is used); ``v`` lets
    ``auto`` skip a backend that cannot take the value head dim; ``preds`` (a
    :class:`~attncomp.spec.Predicates` or None) and the call's ``dropout_p`` (default: the spec's)
    decide whether SDPA's kernels may run it.
    """
    name = spec.backend
    if preds is not None and not preds.any():
        preds = None
    if name == "auto":
        # memoised per spec, dtype, device, sizes and what is present (the choice reads nothing else;
        # on CUDA also which predicates, the mask and the head counts, which decide SDPA against Triton)
        p = spec.dropout_p if dropout_p is None else dropout_p
        qs = q.shape
        ks = qs if k is None else k.shape
        cuda = _gpu_arch(q) is not None
        # keyed by the spec's identity (specs come from a parse cache; hashing one costs more than
        # the rest of the lookup), checked against the spec kept with the entry
        mk = (id(spec), q.dtype, q.device, qs[-2], ks[-2], qs[-1], None if v is None else v.shape[-1],
              preds is None, p > 0, id(get_backend), _tvm_auto_env(),
              (qs[1], ks[1], None if attn_mask is None else attn_mask.dtype,
               None if preds is None else tuple(t is not None for t in preds)) if cuda else None)
        ent = _auto_memo.get(mk)
        if ent is None or ent[0] is not spec or ent[1] is not get_backend:
            be, _, why = _auto_explained(spec, q, ks[-2], v, preds, dropout_p, k, attn_mask)
            if "not measured" in why:  # a provisional dense choice (timing not allowed now): not kept
                _provisional[0] += 1
                return be
            if len(_auto_memo) > 4096:
                _auto_memo.clear()
            ent = _auto_memo[mk] = (spec, get_backend, be)
        return ent[2]
    be = get_backend(name)
    reason = _supports(be, spec, q, preds)
    if reason is None and name == "sdpa":
        reason = be.supports_call(spec, q, k, v, spec.dropout_p if dropout_p is None else dropout_p, preds)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} cannot run this site ({spec.describe(preds)}): {reason}")
    return be


def describe_choice(spec: AttentionSpec, device, dtype=None, preds=None, n_keys: Optional[int] = None) -> str:
    """What ``backend="auto"`` runs for ``spec`` on ``device`` and why, in words (for reports).

    Without tensors the answer is the rule; ``dtype``/``preds``/``n_keys`` narrow it when known."""
    device = torch.device(device)
    if spec.backend != "auto":
        return f"{spec.backend} (as asked)"
    if spec.modifiers():
        # SDPA's kernels apply no score modifier; the others say in supports() which they apply
        return (f"a backend whose kernels apply the score modifiers ({spec.describe_modifiers()}), as its "
                "supports() says; else the exact reference, which applies them all (SDPA's kernels apply none)")
    dropout = spec.dropout_p > 0
    every = keeps_all(spec)
    if device.type != "cuda":
        if every and not dropout:
            return ("sdpa: SDPA's CPU flash kernel (the policy keeps every allowed entry, no dropout; "
                    "predicates as is_causal or one mask built from the per-token vectors)")
        if every:
            return ("sdpa in eval mode (no dropout); with dropout the exact reference "
                    "(SDPA's dropout draws differ from attncomp's)")
        return (f"tvm where apache-tvm is installed and Nq*Nk >= 256*256 (not float64; ATTNCOMP_TVM_AUTO=0 turns "
                f"it off), else reference: the exact reference (policy {spec.policy.name})")
    if not triton_available():
        return "sdpa (no Triton)" if every and not dropout else "reference (no Triton)"
    if every and not dropout:
        return ("the faster of SDPA (flash / memory-efficient) and attncomp's Triton kernel per shape bucket "
                "(pow2 Nq, Nk, D; dtype; predicate kind): from the autotune store, else the table shipped for "
                "this GPU model, else measured once on this GPU and kept in the store")
    arch = None
    try:
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    except Exception:
        pass
    d = spec.head_dim
    if arch is not None and d is not None and (dtype or spec.torch_dtype()) is not None:
        rule = seq_rule(spec.policy.name, d, dtype or spec.torch_dtype(), arch)
        return f"triton or split per key length: {describe_rule(rule)}"
    return ("triton: the fused kernel when Nk is at most the measured threshold, the split form above it "
            "(fused for every Nk when nothing is measured)")
