"""The ``attncomp::attention`` custom op: the single IR node every matched site becomes.

Schema::

    attncomp::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? q_aux,
                        Tensor? k_aux, Tensor? block_pattern, Tensor? q_pos, Tensor? k_pos,
                        Tensor? q_seg, Tensor? k_seg, Tensor? q_valid, Tensor? k_valid,
                        str spec, float dropout_p, int seed, Tensor? alibi_slopes=None,
                        Tensor? rel_table=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)

``spec`` is the canonical JSON of an :class:`~attncomp.spec.AttentionSpec`. ``q_aux``/``k_aux``
are the policy's per-token tensors (hash buckets or keep masks). Both may be left out (compiled
graphs do): the op then derives them, forward and backward alike, from what the call holds: hash
buckets from q, k and the policy's fixed seed; drop's keep masks from the call's ``seed`` (streams
of their own, disjoint from dropout's draws of the same seed), so one seed per call gives both
passes the same draw. A backend with ``derives_aux = True`` (Triton: fused with its counting sort)
does it itself; for every other one the op calls :func:`materialize_aux` first. The Python entry
point :func:`attention` draws keep masks before the call (``draw_seed``) and passes them. ``lse``
is the log-sum-exp of the kept logits per query row (``-inf`` for a row with no kept key), float32, or
float64 for float64 inputs (:func:`~attncomp.opspec.lse_dtype`, which the fake reports too); backends
use it for the backward, and context-parallel attention merges blocks by it.
``alibi_slopes``/``rel_table``/``sinks`` are the tensors of the score modifiers of DESIGN.md §4.2
(see :class:`~attncomp.spec.Modifiers`), present iff the spec names the modifier; last and optional, so
graphs built before them still call the op. Backends receive them as one ``mods`` keyword argument and
return their gradients from the backward (``attncomp::attention_backward_mods``, which the op's autograd
records for specs with modifiers; ``sinks`` and ``rel_table`` are learnable, and so may the slopes be).
``q_pos``..``k_valid`` are the structured-mask predicates of DESIGN.md §4.1 (see
:class:`~attncomp.spec.Predicates`); backends receive them as one ``preds`` keyword argument.
:data:`ARG_INDEX` gives each argument's position, for passes that build or read op nodes.

The host path never synchronises with the device: checks that would read tensor data run only
under ``ATTNCOMP_DEBUG=1``; spec parsing and backend choice are cached per spec, dtype and device.
It is also short: on plain CPU/CUDA tensors the op's own autograd kernel runs the implementation
directly, and an eager backward calls the backward's implementation directly (traced calls, under
a mode or on fake/functional tensors, go through the dispatcher as registered).

The op has a fake implementation (shapes only) and autograd, so graphs that contain it run forward
and backward, and export with ``torch.export``.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

# the conventions the backends share with the op live below them (attncomp.opspec); the op's callers
# may keep importing them from here
from .opspec import (ARG_INDEX, MOD_NAMES, PRED_NAMES, bounded_put, bucket_range, call_signature, half_given_aux,
                     laid_out, lse_dtype, mark_buckets, output_like, output_strides, parsed, resolved, tensor_sig)
from .policy import Drop, Hash, SPION, ceil_div, keep_mask, lsh_buckets, lsh_side, seed_mix
from .spec import AttentionSpec, Modifiers, Predicates

__all__ = ["attention", "check_inputs", "check_predicates", "materialize_aux", "bucket_range", "site_dropout",
           "next_seed", "training_mode", "ARG_INDEX", "PRED_NAMES", "MOD_NAMES", "check_modifiers", "output_strides",
           "lsh"]

log = logging.getLogger(__name__)


def _debug() -> bool:
    return os.environ.get("ATTNCOMP_DEBUG", "") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Input validation (shared by the functional API and the op).

def _shape(t) -> Tuple:
    # keep symbolic sizes symbolic: int() would fix batch/sequence to constants under torch.export
    return tuple(t.shape)


def check_inputs(spec: AttentionSpec, q, k, v, attn_mask=None, q_aux=None, k_aux=None,
                 block_pattern=None, enable_gqa: bool = True, policy_tensors: bool = True,
                 preds: Optional[Predicates] = None, only_policy_tensors: bool = False) -> None:
    """Raise ``ValueError`` naming the expected shape/dtype for any input that does not fit
    (``policy_tensors=False``: only q, k, v, the mask and the predicates; ``only_policy_tensors``:
    only the policy's tensors, q, k, v having been checked). Reads shapes and dtypes only, never
    tensor data (no device synchronisation); ``ATTNCOMP_DEBUG=1`` adds data checks."""
    if only_policy_tensors:
        _check_policy_tensors(spec, q, k, q_aux, k_aux, block_pattern)
        return
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{nm} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{nm} must have shape (B, H, N, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{nm} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Nq, D = _shape(q)
    Bk, Hk, Nk, Dk = _shape(k)
    if Bk != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {Bk}, v {v.shape[0]}")
    if Dk != D:
        raise ValueError(f"k must have head dim {D} like q, got {tuple(k.shape)}")
    if _shape(v)[1:3] != (Hk, Nk):
        raise ValueError(f"v must have shape ({B}, {Hk}, {Nk}, Dv) like k, got {tuple(v.shape)}")
    if Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    if Hq != Hk and not enable_gqa:
        raise ValueError(f"q has {Hq} heads but k/v have {Hk}: pass enable_gqa=True for grouped-query attention")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise ValueError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        full = (B, Hq, Nq, Nk)
        ms = _shape(attn_mask)
        if len(ms) > 4 or any(a not in (1, b) for a, b in zip(ms[::-1], full[::-1])):
            raise ValueError(f"attn_mask of shape {ms} does not broadcast to (B, Hq, Nq, Nk) = {full}")
    if preds is not None:
        check_predicates(preds, B, Nq, Nk, q.device)
    if not policy_tensors:
        return
    _check_policy_tensors(spec, q, k, q_aux, k_aux, block_pattern)


def _check_policy_tensors(spec: AttentionSpec, q, k, q_aux, k_aux, block_pattern) -> None:
    B, Hq, Nq = _shape(q)[:3]
    Hk, Nk = _shape(k)[1:3]
    pol = spec.policy
    if isinstance(pol, Hash):
        _check_token(q_aux, "q_buckets", (B, Hq, Nq), "integer")
        _check_token(k_aux, "k_buckets", (B, Hk, Nk), "integer")
        if _debug():  # reads the ids: a device synchronisation, so only when debugging
            for t, nm in ((q_aux, "q_buckets"), (k_aux, "k_buckets")):
                if t.numel() and (int(t.max().item()) >= 2 ** 31 or int(t.min().item()) < -(2 ** 31)):
                    raise ValueError(f"{nm} ids must fit in int32")
    elif isinstance(pol, Drop):
        _check_token(q_aux, "q_keep", (B, Hq, Nq), "bool")
        _check_token(k_aux, "k_keep", (B, Hk, Nk), "bool")
    elif q_aux is not None or k_aux is not None:
        raise ValueError(f"policy {pol.name!r} takes no bucket or keep tensors")
    if isinstance(pol, SPION):
        bs = pol.block_size
        exp = (ceil_div(Nq, bs), ceil_div(Nk, bs))
        if block_pattern is None:
            raise ValueError("policy 'spion' needs a block_pattern")
        bp = _shape(block_pattern)
        if len(bp) != 3 or bp[0] not in (1, Hq) or bp[1:] != exp:
            raise ValueError(f"block_pattern must have shape ({Hq} or 1, {exp[0]}, {exp[1]}) for block size {bs}, got {bp}")
        if block_pattern.dtype != torch.bool:
            raise ValueError(f"block_pattern must be bool, got {block_pattern.dtype}")
    elif block_pattern is not None:
        raise ValueError(f"policy {pol.name!r} takes no block_pattern")


def check_predicates(preds: Predicates, B, Nq, Nk, device=None) -> None:
    """Shapes and dtypes of the predicate tensors (DESIGN.md §4.1): ``q_pos``/``q_seg``/``q_valid``
    ``(B or 1, Nq)``, ``k_pos``/``k_seg``/``k_valid`` ``(B or 1, Nk)``; positions and segments integer,
    validity bool; segments both or neither."""
    if not isinstance(preds, Predicates):
        raise ValueError(f"preds must be attncomp.spec.Predicates, got {type(preds).__name__}")
    if (preds.q_seg is None) != (preds.k_seg is None):
        raise ValueError("give both q_seg and k_seg (segment ids of queries and keys), or neither")
    for nm, t in zip(PRED_NAMES, preds):
        if t is None:
            continue
        n = Nq if nm.startswith("q_") else Nk
        kind = "bool" if nm.endswith("_valid") else "integer"
        if not isinstance(t, Tensor):
            raise ValueError(f"{nm} must be a {kind} tensor of shape (B or 1, {n}), got {type(t).__name__}")
        ok = (t.dtype == torch.bool) if kind == "bool" else (not t.is_floating_point() and not t.is_complex()
                                                             and t.dtype != torch.bool)
        if not ok:
            raise ValueError(f"{nm} must be a {kind} tensor of shape (B or 1, {n}), got dtype {t.dtype}")
        shp = _shape(t)
        if len(shp) != 2 or shp[0] not in (1, B) or shp[1] != n:
            raise ValueError(f"{nm} must have shape ({B} or 1, {n}), got {shp}")
        if device is not None and t.device != device:
            raise ValueError(f"{nm} is on {t.device}, q on {device}: predicate tensors must be on q's device")


def check_modifiers(spec: AttentionSpec, mods: Optional[Modifiers], Hq) -> None:
    """The score modifiers' tensors against the spec (DESIGN.md §4.2): each present iff the spec names its
    modifier; ``alibi_slopes``/``sinks`` float ``(Hq,)``, ``rel_table`` float ``(rel_buckets, Hq)``."""
    mods = mods if mods is not None else Modifiers()
    want = {"alibi_slopes": spec.alibi, "rel_table": spec.rel_buckets is not None, "sinks": spec.sinks}
    for nm, t in zip(MOD_NAMES, mods):
        if want[nm] != (t is not None):
            what = {"alibi_slopes": "ALiBi", "rel_table": "a relative-position bias", "sinks": "attention sinks"}[nm]
            raise ValueError(f"{nm} is given but the spec has no {what}" if t is not None
                             else f"the spec has {what} but no {nm} was given")
        if t is None:
            continue
        shape = (spec.rel_buckets, Hq) if nm == "rel_table" else (Hq,)
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{nm} must be a float tensor of shape {shape}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if _shape(t) != tuple(shape):
            raise ValueError(f"{nm} must have shape {tuple(shape)}, got {_shape(t)}")


def _check_token(t, name: str, shape, kind: str) -> None:
    if t is None:
        raise ValueError(f"{name} is required: expected a {kind} tensor of shape {shape}")
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a {kind} tensor of shape {tuple(shape)}, got {type(t).__name__}")
    ok = (t.dtype == torch.bool) if kind == "bool" else (not t.is_floating_point() and t.dtype != torch.bool)
    if not ok:
        raise ValueError(f"{name} must be a {kind} tensor of shape {shape}, got dtype {getattr(t, 'dtype', type(t))}")
    if _shape(t) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_shape(t)}")


# ---------------------------------------------------------------------------------------------
# Per-call state of compiled modules: training mode (dropout, fresh drop draws) and seeds.

_training = contextvars.ContextVar("attncomp_training", default=None)
_step = itertools.count()


class training_mode:
    """Context manager set by compiled modules: whether sites run in training mode."""

    def __init__(self, training: bool):
        self.training = training

    def __enter__(self):
        self._tok = _training.set(self.training)

    def __exit__(self, *exc):
        _training.reset(self._tok)


@torch.fx.wrap
def site_dropout(p: float) -> float:
    """The dropout rate a site applies now: its rate in training mode, 0 in eval mode."""
    t = _training.get()
    return p if (t is None or t) else 0.0


@torch.fx.wrap
def next_seed(base: int = 0) -> int:
    """A fresh seed per training call; ``base`` in eval mode (reproducible inference). Outside a
    compiled module's call (the torch.compile route) the mode is unknown and counts as training,
    as for :func:`site_dropout`."""
    if _training.get() is not False:
        return (int(base) + 0x9E37 * next(_step)) & 0x7FFFFFFF
    return int(base)


def materialize_aux(spec: AttentionSpec, q, k, q_aux=None, k_aux=None, seed: Optional[int] = None):
    """Derive the policy's per-token tensors that the caller did not give."""
    pol = spec.policy
    if isinstance(pol, Hash):
        if (q_aux is None) != (k_aux is None):
            raise ValueError("give both q_buckets and k_buckets, or neither")
        if q_aux is None:
            with torch.no_grad():
                q_aux, k_aux = lsh_buckets(q.detach(), k.detach(), pol.n_buckets, pol.seed)
            mark_buckets(q_aux, pol.n_buckets)
            mark_buckets(k_aux, pol.n_buckets)
    elif isinstance(pol, Drop):
        s = pol.seed if seed is None else seed
        B, Hq, Nq = q.shape[:3]
        Hk, Nk = k.shape[1:3]
        if q_aux is None:
            # queries shorter than keys are the last Nq positions (decoding with a KV cache)
            q_aux = keep_mask((B, Hq, Nq), pol.q_rate, s, 0, q.device, offset=Nk - Nq if Nq < Nk else 0)
        if k_aux is None:
            k_aux = keep_mask((B, Hk, Nk), pol.k_rate, s, 1, q.device)
    return q_aux, k_aux


# ---------------------------------------------------------------------------------------------
# The op.

def _derive_aux(s: AttentionSpec, be, q: Tensor, k: Tensor, q_aux, k_aux, seed: int):
    """The policy tensors for a backend that does not derive them itself (see the module docstring):
    hash buckets from q and k, drop's keep masks from the call's ``seed``."""
    if ((q_aux is None or k_aux is None) and isinstance(s.policy, (Hash, Drop))
            and not getattr(be, "derives_aux", False)):
        if q_aux is not None or k_aux is not None:
            raise half_given_aux(s.policy)
        return materialize_aux(s, q, k, seed=seed)
    return q_aux, k_aux


def _resolve(s: AttentionSpec, q: Tensor) -> AttentionSpec:
    """Fill in what the compiler could not know: the dtype and the dtype-dependent policy defaults."""
    if s.dtype is None or s.policy.resolved(q.dtype) != s.policy:
        s = s.replace(dtype=str(q.dtype).replace("torch.", ""), policy=s.policy.resolved(q.dtype))
    return s


def _preds(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid) -> Optional[Predicates]:
    if q_pos is None and k_pos is None and q_seg is None and k_seg is None and q_valid is None and k_valid is None:
        return None
    return Predicates(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)


# -- launch plans at the op ---------------------------------------------------------------------------
# A backend may keep a launch plan for a call (the Triton backend: the template's dense and DFSS
# forwards that build nothing per call, the Gluon forward, and the recorded hash/drop forwards, which
# alone take calls with policy tensors (``takes_aux``); the SDPA backend: every forward it runs).
# The op keeps the plan a call took under the call's own key (the spec string, the tensors' signature,
# what backend selection reads besides), so that a repeated call goes from here to the plan without
# parsing, selecting or checking again. The plan itself checks what else it depends on
# (plan.call returns None when that changed) and the call then takes the full path.
_CALLS: dict = {}
_MAX_CALLS = 1024


def _selection_state() -> tuple:
    global _select_env
    if _select_env is None:
        from .runtime.dispatch import selection_state as _select_env
    return _select_env()


def _call_key(spec: str, q, k, v, attn_mask, q_valid, k_valid, dropout_p, seed, q_aux=None, k_aux=None) -> tuple:
    preds = None if q_valid is None and k_valid is None else (q_valid, k_valid)
    s = seed_mix(seed)  # by what kernels specialise an integer on (1, multiple of 16): one plan per class
    return (spec, _selection_state(), call_signature(q, k, v, attn_mask, preds, dropout_p), s == 1, s & 15 == 0,
            tensor_sig(q_aux), tensor_sig(k_aux))


_select = None
_select_env = None


def _backend_for(spec: AttentionSpec, q: Tensor, k: Tensor, v: Tensor, preds=None, dropout_p: float = 0.0,
                 attn_mask: Optional[Tensor] = None):
    global _select
    if _select is None:  # the runtime is imported on first use, not with the op
        from .runtime.dispatch import select_backend as _select
    return _select(spec, q, k, v, preds=preds, dropout_p=dropout_p, attn_mask=attn_mask)


def _pkw(preds) -> dict:
    # backends take ``preds`` as a keyword; it is passed only when a predicate tensor is present
    return {} if preds is None else {"preds": preds}


def _attention_impl(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], q_aux: Optional[Tensor],
                    k_aux: Optional[Tensor], block_pattern: Optional[Tensor], q_pos: Optional[Tensor],
                    k_pos: Optional[Tensor], q_seg: Optional[Tensor], k_seg: Optional[Tensor],
                    q_valid: Optional[Tensor], k_valid: Optional[Tensor], spec: str, dropout_p: float,
                    seed: int, alibi_slopes: Optional[Tensor] = None, rel_table: Optional[Tensor] = None,
                    sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    key = state = None
    aux = q_aux is not None or k_aux is not None  # (policy tensors: only plans that take them, see below)
    mods = None
    if alibi_slopes is not None or rel_table is not None or sinks is not None:
        # no launch plan takes modifier tensors: such calls take the full path
        mods = Modifiers(alibi_slopes, rel_table, sinks)
    elif block_pattern is None and q_pos is None and k_pos is None and q_seg is None and k_seg is None:
        if _CALLS:  # (no key is built while no backend has given a plan: the reference alone, say)
            key = _call_key(spec, q, k, v, attn_mask, q_valid, k_valid, dropout_p, seed, q_aux, k_aux)
            plan = _CALLS.get(key)
            if plan is not None:
                res = (plan.call(q, k, v, attn_mask, q_valid, k_valid, seed, q_aux=q_aux, k_aux=k_aux) if aux
                       else plan.call(q, k, v, attn_mask, q_valid, k_valid, seed))
                if res is not None:
                    return res
        state = _selection_state() if key is None else key[1]
    s = resolved(spec, q.dtype)
    preds = _preds(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
    be = _backend_for(s, q, k, v, preds, dropout_p, attn_mask)
    if q_aux is None or k_aux is None:
        q_aux, k_aux = _derive_aux(s, be, q, k, q_aux, k_aux, seed)
    if mods is not None or s.modifiers():
        check_modifiers(s, mods, q.shape[1])
        out, lse = be.forward(s, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, mods=mods,
                              **_pkw(preds))
        return laid_out(out), lse
    out, lse = be.forward(s, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, **_pkw(preds))
    out = laid_out(out)
    if state is not None:
        taken = getattr(be, "taken_plan", None)
        plan = taken() if taken is not None else None
        if aux and not getattr(plan, "takes_aux", False):
            plan = None
        if plan is not None and state == _selection_state():  # the choice was a kept one (see selection_state)
            if key is None:
                key = _call_key(spec, q, k, v, attn_mask, q_valid, k_valid, dropout_p, seed, q_aux, k_aux)
            bounded_put(_CALLS, key, plan, _MAX_CALLS)
    return out, lse


# -- LSH buckets of one side, as an op ----------------------------------------------------------------------
def _lsh_impl(x: Tensor, kv_heads: int, n_buckets: int, seed: int) -> Tensor:
    with torch.no_grad():
        return lsh_side(x.detach(), kv_heads, n_buckets, seed)


#: ``hash``'s buckets of one side's vectors (:func:`attncomp.policy.lsh_side`) as one node of a graph: a KV cache
#: that keeps its keys' buckets (:mod:`attncomp.kvcache`) computes those of the keys it appends with it, and
#: :mod:`attncomp.passes.sparsify` recognises it there
lsh = torch.library.custom_op("attncomp::lsh", mutates_args=())(_lsh_impl)


@lsh.register_fake
def _(x, kv_heads, n_buckets, seed):
    return x.new_empty(x.shape[:3], dtype=torch.int32)


_attention_op = torch.library.custom_op("attncomp::attention", mutates_args=())(_attention_impl)


@_attention_op.register_fake
def _(q, k, v, attn_mask, q_aux, k_aux, block_pattern, q_pos, k_pos, q_seg, k_seg, q_valid, k_valid, spec,
      dropout_p, seed, alibi_slopes=None, rel_table=None, sinks=None):
    B, Hq, Nq, _ = q.shape
    out = output_like(q, v.shape[-1])
    lse = q.new_empty((B, Hq, Nq), dtype=lse_dtype(q.dtype))
    return out, lse


def _attention_backward_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                             q_aux: Optional[Tensor], k_aux: Optional[Tensor], block_pattern: Optional[Tensor],
                             q_pos: Optional[Tensor], k_pos: Optional[Tensor], q_seg: Optional[Tensor],
                             k_seg: Optional[Tensor], q_valid: Optional[Tensor], k_valid: Optional[Tensor],
                             out: Tensor, lse: Tensor, spec: str, dropout_p: float, seed: int,
                             need_mask_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    s = resolved(spec, q.dtype)
    preds = _preds(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
    be = _backend_for(s, q, k, v, preds, dropout_p, attn_mask)
    if q_aux is None or k_aux is None:
        q_aux, k_aux = _derive_aux(s, be, q, k, q_aux, k_aux, seed)
    dq, dk, dv, dm = be.backward(s, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                                 out, lse, grad_out, need_mask_grad=need_mask_grad, **_pkw(preds))
    if need_mask_grad and dm is None:
        from .codegen import get_backend

        if q_aux is None or k_aux is None:
            q_aux, k_aux = _derive_aux(s, None, q, k, q_aux, k_aux, seed)
        dm = get_backend("reference").backward(s, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p,
                                               seed, out, lse, grad_out, need_mask_grad=True, preds=preds)[3]
    if dm is None:
        dm = q.new_empty((0,))
    else:
        dm = _reduce_to(dm, attn_mask.shape).to(attn_mask.dtype)
    return _layout_like(dq, q), _layout_like(dk, k), _layout_like(dv, v), dm


_attention_backward_op = torch.library.custom_op("attncomp::attention_backward",
                                                 mutates_args=())(_attention_backward_impl)


def _untraced(tensors) -> bool:
    """Whether a backward runs eagerly on plain tensors: grad mode off (no double backward), no
    dispatch mode (fake tensors, functionalisation, proxies: AOT autograd, export, compiled autograd)
    and no tensor subclass or functorch wrapper. Such a backward calls the op's implementation
    directly (the dispatcher's checks cost as much as the rest of the host path); every other one
    records ``attncomp::attention_backward``."""
    if torch.is_grad_enabled() or _dispatch_modes():
        return False
    for t in tensors:
        if t is not None and (type(t) is not Tensor or _wrapped(t)):
            return False
    return True


_dispatch_modes = torch._C._len_torch_dispatch_stack
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _layout_like(g: Tensor, t: Tensor) -> Tensor:
    """``g`` with the strides the fake implementation promises (``empty_like(t)``): compiled graphs
    assert them, and backends return their own layouts."""
    if t.is_contiguous() and g.stride() == t.stride():  # empty_like copies a dense tensor's strides
        return g
    out = torch.empty_like(t)
    if out.stride() == g.stride():
        return g
    return out.copy_(g)


def _reduce_to(g: Tensor, shape) -> Tensor:
    while g.dim() > len(shape):
        g = g.sum(0)
    for d, n in enumerate(shape):
        if n == 1 and g.shape[d] != 1:
            g = g.sum(d, keepdim=True)
    return g.contiguous()


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, attn_mask, q_aux, k_aux, block_pattern, q_pos, k_pos, q_seg, k_seg, q_valid, k_valid,
      out, lse, spec, dropout_p, seed, need_mask_grad):
    dm = attn_mask.new_empty(attn_mask.shape) if need_mask_grad else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm


def _attention_backward_mods_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                                  q_aux: Optional[Tensor], k_aux: Optional[Tensor], block_pattern: Optional[Tensor],
                                  q_pos: Optional[Tensor], k_pos: Optional[Tensor], q_seg: Optional[Tensor],
                                  k_seg: Optional[Tensor], q_valid: Optional[Tensor], k_valid: Optional[Tensor],
                                  out: Tensor, lse: Tensor, spec: str, dropout_p: float, seed: int,
                                  need_mask_grad: bool, alibi_slopes: Optional[Tensor], rel_table: Optional[Tensor],
                                  sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                    Tensor]:
    """The backward of a site with score modifiers: ``(dq, dk, dv, dmask, dslopes, dtable, dsinks)``,
    an empty tensor for each one that has no gradient."""
    s = resolved(spec, q.dtype)
    preds = _preds(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
    mods = Modifiers(alibi_slopes, rel_table, sinks)
    be = _backend_for(s, q, k, v, preds, dropout_p, attn_mask)
    if q_aux is None or k_aux is None:
        q_aux, k_aux = _derive_aux(s, be, q, k, q_aux, k_aux, seed)
    dq, dk, dv, dm, dmods = be.backward(s, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, out,
                                        lse, grad_out, need_mask_grad=need_mask_grad, mods=mods, **_pkw(preds))
    dm = q.new_empty((0,)) if not need_mask_grad or dm is None else _reduce_to(dm, attn_mask.shape).to(attn_mask.dtype)
    dmods = [q.new_empty((0,)) if g is None else g.contiguous() for g in dmods]
    return (_layout_like(dq, q), _layout_like(dk, k), _layout_like(dv, v), dm) + tuple(dmods)


_attention_backward_mods_op = torch.library.custom_op("attncomp::attention_backward_mods",
                                                      mutates_args=())(_attention_backward_mods_impl)


@_attention_backward_mods_op.register_fake
def _(grad_out, q, k, v, attn_mask, q_aux, k_aux, block_pattern, q_pos, k_pos, q_seg, k_seg, q_valid, k_valid,
      out, lse, spec, dropout_p, seed, need_mask_grad, alibi_slopes, rel_table, sinks):
    dm = attn_mask.new_empty(attn_mask.shape) if need_mask_grad else q.new_empty((0,))
    dmods = tuple(q.new_empty((0,)) if t is None else torch.empty_like(t) for t in (alibi_slopes, rel_table, sinks))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm) + dmods


_N_TENSORS = ARG_INDEX["spec"]
_N_MODS = len(MOD_NAMES)


def _setup_context(ctx, inputs, output):
    tensors = inputs[:_N_TENSORS]
    spec, dropout_p, seed = inputs[_N_TENSORS:_N_TENSORS + 3]
    mods = tuple(inputs[_N_TENSORS + 3:]) + (None,) * (_N_TENSORS + 3 + _N_MODS - len(inputs))
    out, lse = output
    attn_mask = tensors[3]
    ctx.save_for_backward(*tensors, out, lse, *mods)
    ctx.spec, ctx.dropout_p, ctx.seed = spec, dropout_p, seed
    ctx.need_mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
    # (soft-capping alone has no tensor: the spec decides which backward runs)
    ctx.has_mods = any(t is not None for t in mods) or bool(parsed(spec).modifiers())


def _backward(ctx, grad_out, grad_lse):
    saved = ctx.saved_tensors
    tensors, out, lse = saved[:_N_TENSORS], saved[_N_TENSORS], saved[_N_TENSORS + 1]
    mods = saved[_N_TENSORS + 2:]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    q, k, v, attn_mask = tensors[:4]
    grad_out = grad_out.contiguous()
    if ctx.has_mods:
        traced = not _untraced((grad_out, out, lse) + tuple(tensors) + tuple(mods))
        bw = _attention_backward_mods_op if traced else _attention_backward_mods_impl
        dq, dk, dv, dm, *dmods = bw(grad_out, *tensors, out, lse, ctx.spec, ctx.dropout_p, ctx.seed,
                                    ctx.need_mask_grad, *mods)
        dmods = tuple(None if t is None or not t.requires_grad else g for g, t in zip(dmods, mods))
        return ((dq, dk, dv, (dm if ctx.need_mask_grad else None)) + (None,) * (_N_TENSORS - 4 + 3)
                + dmods)
    bw = _attention_backward_impl if _untraced((grad_out, out, lse) + tuple(tensors)) else _attention_backward_op
    dq, dk, dv, dm = bw(grad_out, *tensors, out, lse, ctx.spec, ctx.dropout_p, ctx.seed, ctx.need_mask_grad)
    # no gradient for the policy tensors, the predicates, or the spec/dropout/seed
    return ((dq, dk, dv, (dm if ctx.need_mask_grad else None)) + (None,) * (_N_TENSORS - 4 + 3)
            + (None,) * (len(saved) - _N_TENSORS - 2))


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The op's autograd node: what ``register_autograd`` above builds, minus the per-call rebuilding
    of the schema's argument list (``torch.library`` fills in defaults, which this schema has none
    of, by converting every argument of the schema on each call: more host time than the rest of
    the forward). The registration above stays the op's declared autograd."""

    @staticmethod
    def forward(ctx, keyset, *args):
        output = _below_autograd(keyset, args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return (None,) + _backward(ctx, grad_out, grad_lse)


def _autograd_kernel(keyset, *args):
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return _AttentionFunction.apply(keyset, *args)
    return _below_autograd(keyset, args)


def _below_autograd(keyset, args, impl=None, direct_impl=None, op=None):
    """The op (``impl``; its overload ``op``, default the attention op's) below autograd. Dense
    CPU/CUDA tensors with nothing else to dispatch to (no mode, fake or functional tensor, vmap, meta)
    run the implementation directly: the dispatcher's path to it adds a check that outputs do not
    alias inputs (they never do) and costs a third of the host path. Every other call redispatches."""
    below = keyset & _AFTER_AUTOGRAD
    raw = below.raw_repr()
    direct = _DIRECT.get(raw)
    if direct is None:
        direct = _DIRECT[raw] = below.remove(_INPLACE_OR_VIEW).highestPriorityTypeId() in _DENSE_KEYS
    if direct:
        # outside dynamo's frame evaluation the implementation runs as is; inside it (eager code of
        # a compiled function, e.g. after a graph break) with dynamo disabled, as torch.library runs it
        if _eval_frame_callback() is None:
            return (impl or _attention_impl)(*args)
        return (direct_impl or _direct_impl)(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return (op or _ATTENTION).redispatch(below, *args)


_ATTENTION = torch.ops.attncomp.attention.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_DENSE_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_DIRECT: dict = {}
# as torch.library runs implementations: never traced by dynamo (a graph break runs the op eagerly)
_direct_impl = torch._disable_dynamo(_attention_impl)
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
_LIB = torch.library.Library("attncomp", "IMPL")  # kept: the registration lives as long as the library object


def _override(kernel, key: str, lib_op: str = "attention", **kw) -> bool:
    """Register ``kernel`` for the dispatch key ``key`` of the op, ahead of what ``torch.library``
    registered. Registered for the CPU and CUDA keys (``AutogradCPU`` rather than the ``Autograd``
    alias that ``register_autograd`` uses: a backend's own key wins over the alias, and torch 2.11
    refuses to re-register a key that Python already holds). Other devices keep torch.library's
    kernels, which compute the same thing with more host time. False where torch refuses."""
    try:
        with warnings.catch_warnings():
            # replacing the kernel that custom_op installed is the intent
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            _LIB.impl(lib_op, kernel, key, **kw)
        return True
    except RuntimeError as e:
        if "already a kernel registered" not in str(e):
            raise
        return False


FAST_HOST_PATH = all([_override(_autograd_kernel, "AutogradCPU", with_keyset=True),
                      _override(_autograd_kernel, "AutogradCUDA", with_keyset=True)])
# CPU and CUDA calls that do get here through the dispatcher (inference mode skips autograd; traced
# calls redispatch) run the implementation without torch.library's alias check in between
if FAST_HOST_PATH:
    _override(_direct_impl, "CPU")
    _override(_direct_impl, "CUDA")


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, *, spec: AttentionSpec,
              q_aux: Optional[Tensor] = None, k_aux: Optional[Tensor] = None,
              block_pattern: Optional[Tensor] = None, dropout_p: float = 0.0, seed: int = 0,
              draw_seed: Optional[int] = None, q_pos: Optional[Tensor] = None, k_pos: Optional[Tensor] = None,
              q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None, q_valid: Optional[Tensor] = None,
              k_valid: Optional[Tensor] = None, preds: Optional[Predicates] = None) -> Tensor:
    """Run one attention site: derive missing policy tensors, then call ``attncomp::attention``.

    The predicate tensors come as keywords or as one :class:`~attncomp.spec.Predicates` ``preds``
    (not both)."""
    if preds is not None:
        if any(t is not None for t in (q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)):
            raise ValueError("give the predicate tensors either as keywords or as preds, not both")
        q_pos, k_pos, q_seg, k_seg, q_valid, k_valid = preds
    q_aux, k_aux = materialize_aux(spec, q, k, q_aux, k_aux, draw_seed)
    out, _ = torch.ops.attncomp.attention(q, k, v, attn_mask, q_aux, k_aux, block_pattern, q_pos, k_pos, q_seg,
                                          k_seg, q_valid, k_valid, spec.to_json(), float(dropout_p), int(seed))
    return out


def is_attention_node(node) -> bool:
    """Whether an fx node calls ``attncomp::attention`` (overload or packet)."""
    return node.op == "call_function" and node.target in (torch.ops.attncomp.attention.default,
                                                          torch.ops.attncomp.attention)


@torch.fx.wrap
def policy_aux(spec_json: str, q: Tensor, k: Tensor, draw_seed: Optional[int] = None):
    """The policy's per-token tensors of a site (LSH buckets, or keep masks drawn from ``draw_seed``),
    as a pair ``(q_aux, k_aux)``: one ``attncomp::policy_aux`` op, opaque to tracers (Inductor runs it
    as it is rather than tracing the derivation's cached rotation or seeds). Compiled sites no longer
    call it (the op derives both itself, see the module docstring); it serves callers who want the
    tensors, and graphs exported before that, which still hold it."""
    return torch.ops.attncomp.policy_aux(q, k, spec_json, -1 if draw_seed is None else draw_seed)


# what a drop site's keep draws run on, per call key (spec, selection state, q/k signature): the
# backend's own draw (``draw_keep``) with the resolved spec, or None for torch ops
_DRAWS: dict = {}


def _policy_aux_impl(q: Tensor, k: Tensor, spec: str, seed: int) -> Tuple[Tensor, Tensor]:
    s = parsed(spec)
    if isinstance(s.policy, Drop):
        # a backend that draws keep masks with its own kernels (Triton: fused with the sort, whose
        # layout the site's calls then reuse) draws them; else torch ops below
        key = (spec, _selection_state(), call_signature(q, k, k, None, None, 0.0))
        hit = _DRAWS.get(key)
        if hit is None:
            s = resolved(spec, q.dtype)
            # (k stands in for v: the choice reads v's head dim only where SDPA may run, which drop never does)
            hit = (s, getattr(_backend_for(s, q, k, k), "draw_keep", None))
            if key[1] == _selection_state():  # (a choice that is kept, see runtime.dispatch.selection_state)
                bounded_put(_DRAWS, key, hit, _MAX_CALLS)
        s, draw = hit
        if draw is not None:
            with torch.no_grad():
                a, b = draw(s, q.detach(), k.detach(), None if seed < 0 else seed)
            return a, b
    with torch.no_grad():
        a, b = materialize_aux(s, q.detach(), k.detach(), None, None, None if seed < 0 else seed)
    if a is None:  # a policy without per-token tensors
        a, b = q.new_empty((0,), dtype=torch.int32), k.new_empty((0,), dtype=torch.int32)
    return a.contiguous(), b.contiguous()


_policy_aux_op = torch.library.custom_op("attncomp::policy_aux", mutates_args=())(_policy_aux_impl)


@_policy_aux_op.register_fake
def _(q, k, spec, seed):
    pol = parsed(spec).policy
    dt = torch.bool if isinstance(pol, Drop) else torch.int32
    if not isinstance(pol, (Hash, Drop)):
        return q.new_empty((0,), dtype=torch.int32), k.new_empty((0,), dtype=torch.int32)
    return q.new_empty(q.shape[:3], dtype=dt), k.new_empty(k.shape[:3], dtype=dt)


def _policy_aux_autograd(keyset, *args):
    # no gradient flows through the policy tensors (int and bool): the op runs below autograd, with
    # the attention op's short path to the implementation
    return _below_autograd(keyset, args, _policy_aux_impl, _direct_policy_aux, _POLICY_AUX)


_POLICY_AUX = torch.ops.attncomp.policy_aux.default
_direct_policy_aux = torch._disable_dynamo(_policy_aux_impl)
if FAST_HOST_PATH:
    for _key in ("CPU", "CUDA"):
        _override(_policy_aux_autograd, "Autograd" + _key, with_keyset=True, lib_op="policy_aux")
        _override(_direct_policy_aux, _key, lib_op="policy_aux")
