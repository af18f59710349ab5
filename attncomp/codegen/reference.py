"""Reference backend: the exact semantics of DESIGN.md §4 in plain PyTorch.

This is the test oracle for every kernel and the default backend where no GPU is present. It
materialises the full ``(B, Hq, Nq, Nk)`` logits, so it is meant for correctness, not speed.

Rules implemented here (one place, so every backend is checked against the same statement):

* logits ``s = scale * q·k + bias``; fp16/bf16 inputs are computed in float32, others in their own dtype;
* allowed: bool mask True, float mask not ``-inf``, and the structured predicates of DESIGN.md §4.1
  (:func:`predicate_mask`): the position window ``q_pos[i] - left <= k_pos[j] <= q_pos[i] + right``
  with ``right`` capped at 0 when causal (default positions ``arange``, the query positions shifted
  by ``Nk - Nq`` for ``causal_align="bottom_right"``), equal segment ids, ``k_valid[j]`` and
  ``q_valid[i]``, all combined with AND;
* kept: allowed, and the policy's rule (N:M per group of ``m`` keys with lower-index ties, bucket
  equality, keep masks, block pattern with diagonal blocks);
* score modifiers (DESIGN.md §4.2, :func:`modified_logits`), on ``s = scale * q·k`` in this order:
  ALiBi ``+ slope[h] * (k_pos[j] - q_pos[i])``, the relative-position bias ``+ table[bucket(k_pos[j] -
  q_pos[i]), h]``, soft-capping ``cap * tanh(s / cap)``; then the float mask is added, the policy decides
  on the result, the predicates apply; positions are the predicates' (default ``arange`` as above);
* ``out = softmax(kept logits) @ v``; ``lse`` in :func:`~attncomp.opspec.lse_dtype` (float64 for float64
  inputs, else float32); a row with no kept key gives zeros and ``lse = -inf``; with
  attention sinks the denominator gains ``exp(sink[h])`` (``lse`` includes it: a row with no kept key
  has ``lse = sink[h]``, and still outputs zeros);
* dropout (when ``dropout_p > 0``) zeroes probabilities where ``uniform_hash(seed, idx) < dropout_p``,
  ``idx`` the row-major index in ``(B, Hq, Nq, Nk)``, and scales the rest by ``1/(1-p)``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from ..opspec import lse_dtype
from ..policy import DFSS, Drop, Hash, SPION, uniform_hash
from ..spec import AttentionSpec, Modifiers, Predicates, rel_bucket

__all__ = ["attention", "keep_mask", "logits", "modified_logits", "modifier_bias", "dropout_keep", "predicate_mask", "default_positions", "tracing"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)


def tracing() -> bool:
    """Whether torch ops run under a dispatch mode now (fake tensors, functionalisation, a tracer's
    proxies, or a user's mode): tensors made now must not enter a cache that real calls read. The
    mode that records a call's launches (``codegen/triton/record.py``) runs real ops: not counted."""
    n = torch._C._len_torch_dispatch_stack()
    return n > 1 or (n == 1 and not getattr(torch._C._get_dispatch_stack_at(0), "records_launches", False))


def cacheable(device) -> bool:
    """Whether a tensor made now on ``device`` may enter a cache that later calls read. Not while a
    dispatch mode traces (:func:`tracing`), nor on a CUDA device while a CUDA graph is captured or work
    runs on a stream other than the default one: CUDA graph trees (Inductor's ``mode="reduce-overhead"``)
    warm up on a stream of their own with memory from the graph's private pool, and a tensor kept from
    then is one that the graph does not track (it refuses to replay). Such calls build their tensors
    afresh; the caches fill on the default stream."""
    if tracing():
        return False
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda":
        return True
    if torch._C._cuda_isCurrentStreamCapturing():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    # the raw handles (torch.cuda.current_stream/default_stream build Stream objects: 4-8 us each on an H100 host)
    default = _DEFAULT_STREAMS.get(idx)
    if default is None:
        default = _DEFAULT_STREAMS[idx] = torch.cuda.default_stream(idx).cuda_stream
    return torch._C._cuda_getCurrentRawStream(idx) == default


_DEFAULT_STREAMS: dict = {}  # device index -> raw handle of its default stream


def default_positions(spec: AttentionSpec, nq: int, nk: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q_pos, k_pos)`` as ``(1, Nq)``/``(1, Nk)`` int64 when the caller gives none: ``arange``, the
    queries shifted by ``Nk - Nq`` under bottom-right alignment (the last query sees the last key)."""
    off = (nk - nq) if spec.causal_align == "bottom_right" else 0
    device = torch.device(device)
    if not cacheable(device):
        return _positions.__wrapped__(nq, off, device), _positions.__wrapped__(nk, 0, device)
    return _positions(nq, off, device), _positions(nk, 0, device)


@functools.lru_cache(maxsize=256)
def _positions(n: int, offset: int, device: torch.device) -> torch.Tensor:
    # cached per size and device (read only): no per-call arange on the host path
    return (torch.arange(n, device=device, dtype=torch.int64) + offset)[None]


def predicate_mask(spec: AttentionSpec, nq: int, nk: int, device, preds: Optional[Predicates] = None,
                   positions: bool = True) -> Optional[torch.Tensor]:
    """The bool ``(B or 1, 1, Nq, Nk)`` conjunction of the structured predicates (causal, window,
    segments, padding) of ``spec`` and ``preds``, or ``None`` when nothing restricts the keys.
    ``positions=False`` leaves the position bound out (a caller that applies it otherwise)."""
    preds = preds if preds is not None else Predicates.none()
    allowed = None

    def conj(a, b):
        return b if a is None else a & b

    left, right = spec.bounds() if positions else (None, None)
    if left is not None or right is not None:
        dq, dk = default_positions(spec, nq, nk, device)
        qp = (preds.q_pos if preds.q_pos is not None else dq).to(device=device, dtype=torch.int64)[:, None, :, None]
        kp = (preds.k_pos if preds.k_pos is not None else dk).to(device=device, dtype=torch.int64)[:, None, None, :]
        if right is not None:
            allowed = conj(allowed, kp <= qp + right)
        if left is not None:
            allowed = conj(allowed, kp >= qp - left)
    if preds.q_seg is not None and preds.k_seg is not None:
        allowed = conj(allowed, preds.q_seg.to(device)[:, None, :, None] == preds.k_seg.to(device)[:, None, None, :])
    if preds.k_valid is not None:
        allowed = conj(allowed, preds.k_valid.to(device=device, dtype=torch.bool)[:, None, None, :])
    if preds.q_valid is not None:
        allowed = conj(allowed, preds.q_valid.to(device=device, dtype=torch.bool)[:, None, :, None])
    if allowed is not None:
        allowed = allowed.expand(allowed.shape[0], 1, nq, nk)
    return allowed


def modifier_bias(spec: AttentionSpec, nq: int, nk: int, device, dtype, preds: Optional[Predicates] = None,
                  mods: Optional[Modifiers] = None) -> Optional[torch.Tensor]:
    """The additive modifiers of ``spec`` (ALiBi and the relative-position bias) as one float
    ``(B or 1, Hq, Nq, Nk)`` tensor in ``dtype``, or None when the spec has neither. Differentiable in
    the slopes and the table. Used by the reference and by compile-time checks of recognised modifiers."""
    if not spec.alibi and spec.rel_buckets is None:
        return None
    mods = mods if mods is not None else Modifiers()
    preds = preds if preds is not None else Predicates.none()
    dq, dk = default_positions(spec, nq, nk, device)
    qp = (preds.q_pos if preds.q_pos is not None else dq).to(device=device, dtype=torch.int64)
    kp = (preds.k_pos if preds.k_pos is not None else dk).to(device=device, dtype=torch.int64)
    rel = kp[:, None, None, :] - qp[:, None, :, None]  # (B or 1, 1, Nq, Nk)
    bias = None
    if spec.alibi:
        if mods.alibi_slopes is None:
            raise ValueError("the spec has ALiBi but no alibi_slopes were given")
        bias = mods.alibi_slopes.to(device=device, dtype=dtype).reshape(1, -1, 1, 1) * rel.to(dtype)
    if spec.rel_buckets is not None:
        if mods.rel_table is None:
            raise ValueError("the spec has a relative-position bias but no rel_table was given")
        b = rel_bucket(rel[:, 0], spec.rel_buckets, spec.rel_max_distance, spec.rel_bidirectional)
        rb = mods.rel_table.to(device=device, dtype=dtype)[b]  # (B or 1, Nq, Nk, Hq)
        rb = rb.permute(0, 3, 1, 2)
        bias = rb if bias is None else bias + rb
    return bias


def modified_logits(spec: AttentionSpec, s: torch.Tensor, preds: Optional[Predicates] = None,
                    mods: Optional[Modifiers] = None) -> torch.Tensor:
    """``s = scale * q·k`` ``(B, Hq, Nq, Nk)`` with the spec's score modifiers applied, in their order
    (module docstring); sinks are not a logit of any key and are left to the softmax."""
    bias = modifier_bias(spec, s.shape[-2], s.shape[-1], s.device, s.dtype, preds, mods)
    if bias is not None:
        s = s + bias
    if spec.softcap is not None:
        c = float(spec.softcap)
        s = torch.tanh(s / c) * c
    return s


def logits(spec: AttentionSpec, q, k, attn_mask=None, preds: Optional[Predicates] = None,
           mods: Optional[Modifiers] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(s, allowed)``: float logits ``(B, Hq, Nq, Nk)`` (score modifiers applied, the float
    mask added) and the bool allowed mask."""
    ct = _compute_dtype(q.dtype)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
    kk = _expand_kv(k, Hq).to(ct)
    s = torch.matmul(q.to(ct), kk.transpose(-1, -2)) * scale
    s = modified_logits(spec, s, preds, mods)
    allowed = torch.ones((1, 1, Nq, Nk), dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask.to(ct)
            s = s + bias
            allowed = allowed & (bias != float("-inf"))
    pm = predicate_mask(spec, Nq, Nk, q.device, preds)
    if pm is not None:
        allowed = allowed & pm
    allowed = allowed.expand(B, Hq, Nq, Nk)
    return s, allowed


def _nm_keep(s: torch.Tensor, allowed: torch.Tensor, n: int, m: int) -> torch.Tensor:
    B, H, Nq, Nk = s.shape
    g = -(-Nk // m)
    pad = g * m - Nk
    neg = torch.finfo(s.dtype).min
    sm = torch.where(allowed, s, torch.full_like(s, float("-inf")))
    # allowed entries always rank above disallowed ones, even at -inf-like magnitudes
    sm = torch.where(allowed & torch.isneginf(sm), torch.full_like(s, neg), sm)
    if pad:
        sm = torch.nn.functional.pad(sm, (0, pad), value=float("-inf"))
        allowed = torch.nn.functional.pad(allowed, (0, pad), value=False)
    sg = sm.reshape(B, H, Nq, g, m)
    # stable descending sort: among equal logits the lower key index comes first
    order = torch.sort(sg, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=s.device).expand_as(order))
    keep = (rank < n).reshape(B, H, Nq, g * m) & allowed
    return keep[..., :Nk]


def keep_mask(spec: AttentionSpec, s, allowed, q_aux=None, k_aux=None, block_pattern=None) -> torch.Tensor:
    """The kept entries ``(B, Hq, Nq, Nk)`` for the spec's policy (DESIGN.md §4 table)."""
    pol = spec.policy
    B, Hq, Nq, Nk = s.shape
    if isinstance(pol, DFSS):
        r = pol.resolved(_dtype_of(spec, s))
        return _nm_keep(s, allowed, r.n, r.m)
    if isinstance(pol, Hash):
        qb, kb = q_aux, _expand_kv(k_aux, Hq)
        keep = allowed & (qb[..., :, None] == kb[..., None, :])
        if pol.exclude_self:
            i = torch.arange(Nq, device=s.device)[:, None]
            j = torch.arange(Nk, device=s.device)[None, :]
            keep = keep & (i != j)
        return keep
    if isinstance(pol, Drop):
        kk = _expand_kv(k_aux, Hq)
        return allowed & q_aux[..., :, None] & kk[..., None, :]
    if isinstance(pol, SPION):
        bs = pol.block_size
        bi = torch.arange(Nq, device=s.device) // bs
        bj = torch.arange(Nk, device=s.device) // bs
        pat = block_pattern.to(torch.bool)[:, bi][:, :, bj]  # (Hq or 1, Nq, Nk)
        diag = bi[:, None] == bj[None, :]
        return allowed & (pat[None] | diag)
    return allowed


def _dtype_of(spec: AttentionSpec, s: torch.Tensor) -> torch.dtype:
    return spec.torch_dtype() or s.dtype


def dropout_keep(seed: int, p: float, shape, device) -> torch.Tensor:
    """Bool ``shape`` mask of probabilities that survive dropout (see module docstring)."""
    idx = torch.arange(math.prod(shape), device=device, dtype=torch.int64).view(shape)
    return uniform_hash(seed, idx) >= p


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    *,
    spec: AttentionSpec,
    q_aux: Optional[torch.Tensor] = None,
    k_aux: Optional[torch.Tensor] = None,
    block_pattern: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    preds: Optional[Predicates] = None,
    mods: Optional[Modifiers] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact attention under ``spec``; returns ``(out, lse)``, ``lse`` ``(B, Hq, Nq)`` in
    :func:`~attncomp.opspec.lse_dtype` of q's dtype.

    Differentiable with ordinary autograd (the op's reference backward recomputes through it), in the
    modifier tensors ``mods`` too.
    """
    if spec.policy.name == "dfss" and spec.dtype is None:
        spec = spec.replace(dtype=str(q.dtype).replace("torch.", ""))
    s, allowed = logits(spec, q, k, attn_mask, preds, mods)
    keep = keep_mask(spec, s, allowed, q_aux, k_aux, block_pattern)
    ninf = torch.full_like(s, float("-inf"))
    sk = torch.where(keep, s, ninf)
    m = sk.amax(dim=-1, keepdim=True)
    sink = None
    if spec.sinks:
        if mods is None or mods.sinks is None:
            raise ValueError("the spec has attention sinks but no sinks were given")
        sink = mods.sinks.to(device=s.device, dtype=s.dtype).reshape(1, -1, 1, 1)
        m = torch.maximum(m, sink.expand_as(m))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    p = torch.where(keep, torch.exp(sk - m), torch.zeros_like(s))
    l = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        # the sink joins the denominator and attends to nothing: a row with no kept key still sums to 0
        ls = torch.exp(sink - m)
        lse = m + torch.log(l + ls)
        p = p / (l + ls)
        vv = _expand_kv(v, q.shape[1]).to(p.dtype)
        if dropout_p > 0.0:
            dk = dropout_keep(seed, dropout_p, p.shape, p.device)
            p = torch.where(dk, p / (1.0 - dropout_p), torch.zeros_like(p))
        out = torch.matmul(p, vv).to(q.dtype)
        return out, lse.squeeze(-1).to(lse_dtype(q.dtype))
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    p = p / safe_l
    if dropout_p > 0.0:
        dk = dropout_keep(seed, dropout_p, p.shape, p.device)
        p = torch.where(dk, p / (1.0 - dropout_p), torch.zeros_like(p))
    vv = _expand_kv(v, q.shape[1]).to(p.dtype)
    out = torch.matmul(p, vv).to(q.dtype)
    lse = torch.where(l > 0, m + torch.log(safe_l), torch.full_like(l, float("-inf")))
    return out, lse.squeeze(-1).to(lse_dtype(q.dtype))


def _sum_groups(x: torch.Tensor, hk: int) -> torch.Tensor:
    B, H, N, D = x.shape
    return x if H == hk else x.view(B, hk, H // hk, N, D).sum(2)


def attention_backward_mods(q, k, v, attn_mask, grad_out, *, spec: AttentionSpec, mods: Modifiers, q_aux=None,
                            k_aux=None, block_pattern=None, dropout_p: float = 0.0, seed: int = 0,
                            need_mask_grad: bool = False, preds: Optional[Predicates] = None):
    """Analytic gradients of :func:`attention` for a spec with score modifiers (the policy's selection
    held fixed, as in :func:`attention_backward`; no autograd, so it runs inside the op's backward as
    recorded). Returns ``(dq, dk, dv, dbias | None, dmods)``, ``dmods`` a :class:`Modifiers` of the
    gradients of the slopes, the table and the sinks (None where absent); ``dbias`` ``(B, Hq, Nq, Nk)``.

    With ``ds`` the gradient of the softmax's logits (``p * (dp - rowsum(p * dp))``, the sink's column
    having no value, so ``dp = 0`` there): the float mask gets ``ds``; through the soft-cap
    ``ds * (1 - tanh(s / c)^2)`` reaches the additive modifiers and ``q·k``; the slopes get its sum
    times ``k_pos - q_pos``, the table its sum per bucket, each sink ``-sum(p_sink * rowsum(p * dp))``."""
    mods = mods if mods is not None else Modifiers()
    if spec.policy.name == "dfss" and spec.dtype is None:
        spec = spec.replace(dtype=dtype_name_of(q))
    D = q.shape[-1]
    B, Hq, Nq, _ = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
    s, allowed = logits(spec, q, k, attn_mask, preds, mods)
    ct = s.dtype
    keep = keep_mask(spec, s, allowed, q_aux, k_aux, block_pattern)
    sk = torch.where(keep, s, torch.full_like(s, float("-inf")))
    m = sk.amax(dim=-1, keepdim=True)
    sink = None
    if spec.sinks:
        sink = mods.sinks.to(device=s.device, dtype=ct).reshape(1, -1, 1, 1)
        m = torch.maximum(m, sink.expand_as(m))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.where(keep, torch.exp(sk - m), torch.zeros_like(s))
    l = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        ls = torch.exp(sink - m)
        p, p_sink = p / (l + ls), ls / (l + ls)
    else:
        p = p / torch.where(l > 0, l, torch.ones_like(l))
    do = grad_out.to(ct)
    vv = _expand_kv(v, Hq).to(ct)
    dk_mask = None
    if dropout_p > 0.0:
        dk_mask = dropout_keep(seed, dropout_p, p.shape, p.device).to(ct) / (1.0 - dropout_p)
    pd = p if dk_mask is None else p * dk_mask
    dv = _sum_groups(torch.matmul(pd.transpose(-1, -2), do), Hk)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    if dk_mask is not None:
        dp = dp * dk_mask
    delta = (dp * p).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dmask = ds if need_mask_grad else None
    if spec.softcap is not None:
        c = float(spec.softcap)
        # s (less the float mask) is c * tanh(s1 / c): the derivative 1 - tanh^2 from it
        capped = s - attn_mask.to(ct) if attn_mask is not None and attn_mask.dtype != torch.bool else s
        ds = ds * (1.0 - (capped / c) ** 2)
        ds = torch.where(keep, ds, torch.zeros_like(ds))
    dslopes = dtable = dsinks = None
    if spec.alibi or spec.rel_buckets is not None:
        dq_, dk_ = default_positions(spec, Nq, Nk, q.device)
        pr = preds if preds is not None else Predicates.none()
        qp = (pr.q_pos if pr.q_pos is not None else dq_).to(device=q.device, dtype=torch.int64)
        kp = (pr.k_pos if pr.k_pos is not None else dk_).to(device=q.device, dtype=torch.int64)
        rel = kp[:, None, :] - qp[:, :, None]  # (B or 1, Nq, Nk)
        if spec.alibi:
            dslopes = (ds * rel[:, None].to(ct)).sum(dim=(0, 2, 3)).to(mods.alibi_slopes.dtype)
        if spec.rel_buckets is not None:
            bk = rel_bucket(rel, spec.rel_buckets, spec.rel_max_distance, spec.rel_bidirectional)
            bk = bk.expand(B, Nq, Nk).reshape(-1)
            dtable = torch.zeros((spec.rel_buckets, Hq), dtype=ct, device=q.device)
            dtable.index_add_(0, bk, ds.permute(0, 2, 3, 1).reshape(-1, Hq))
            dtable = dtable.to(mods.rel_table.dtype)
    if sink is not None:
        dsinks = -(p_sink * delta).sum(dim=(0, 2, 3)).to(mods.sinks.dtype)
    dq = torch.matmul(ds, _expand_kv(k, Hq).to(ct)) * scale
    dkk = _sum_groups(torch.matmul(ds.transpose(-1, -2), q.to(ct)), Hk) * scale
    return (dq.to(q.dtype), dkk.to(k.dtype), dv.to(v.dtype), dmask,
            Modifiers(dslopes if mods.alibi_slopes is not None else None,
                      dtable if mods.rel_table is not None else None,
                      dsinks if mods.sinks is not None else None))


def dtype_name_of(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def attention_backward(q, k, v, attn_mask, grad_out, *, spec: AttentionSpec, q_aux=None, k_aux=None,
                       block_pattern=None, dropout_p: float = 0.0, seed: int = 0, need_mask_grad: bool = False,
                       preds: Optional[Predicates] = None):
    """Analytic gradients of :func:`attention` (the policy's selection is held fixed, so gradients
    flow only through kept entries). Returns ``(dq, dk, dv, dbias | None)``; ``dbias`` has the full
    ``(B, Hq, Nq, Nk)`` shape. Specs with score modifiers: :func:`attention_backward_mods`."""
    if spec.modifiers():
        raise ValueError(f"a spec with score modifiers ({spec.describe_modifiers()}) takes "
                         "attention_backward_mods and its modifier tensors")
    if spec.policy.name == "dfss" and spec.dtype is None:
        spec = spec.replace(dtype=str(q.dtype).replace("torch.", ""))
    D = q.shape[-1]
    Hq, Hk = q.shape[1], k.shape[1]
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
    s, allowed = logits(spec, q, k, attn_mask, preds)
    keep = keep_mask(spec, s, allowed, q_aux, k_aux, block_pattern)
    sk = torch.where(keep, s, torch.full_like(s, float("-inf")))
    m = sk.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.where(keep, torch.exp(sk - m), torch.zeros_like(s))
    l = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    ct = p.dtype
    do = grad_out.to(ct)
    vv = _expand_kv(v, Hq).to(ct)
    if dropout_p > 0.0:
        dk_mask = dropout_keep(seed, dropout_p, p.shape, p.device).to(ct) / (1.0 - dropout_p)
    else:
        dk_mask = None
    pd = p if dk_mask is None else p * dk_mask
    dv = _sum_groups(torch.matmul(pd.transpose(-1, -2), do), Hk)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    if dk_mask is not None:
        dp = dp * dk_mask
    ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, _expand_kv(k, Hq).to(ct)) * scale
    dkk = _sum_groups(torch.matmul(ds.transpose(-1, -2), q.to(ct)), Hk) * scale
    return dq.to(q.dtype), dkk.to(k.dtype), dv.to(v.dtype), (ds if need_mask_grad else None)


class ReferenceBackend:
    """Backend object for the runtime's dispatch: exact, any device, any float dtype."""

    name = "reference"

    def supports(self, spec: AttentionSpec, q: torch.Tensor, preds: Optional[Predicates] = None) -> Optional[str]:
        return None

    #: applies every score modifier of DESIGN.md §4.2 (forward and backward)
    modifiers = ("alibi", "relative bias", "softcap", "sinks")

    def forward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, preds=None,
                mods=None):
        with torch.no_grad():
            return attention(q, k, v, attn_mask, spec=spec, q_aux=q_aux, k_aux=k_aux,
                             block_pattern=block_pattern, dropout_p=dropout_p, seed=seed, preds=preds, mods=mods)

    def backward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                 out, lse, grad_out, need_mask_grad=False, preds=None, mods=None):
        """``(dq, dk, dv, dmask | None)``; with ``mods`` (a spec with score modifiers) a fifth element,
        the :class:`Modifiers` of their gradients."""
        if spec.modifiers():
            return attention_backward_mods(q, k, v, attn_mask, grad_out, spec=spec, mods=mods or Modifiers(),
                                           q_aux=q_aux, k_aux=k_aux, block_pattern=block_pattern,
                                           dropout_p=dropout_p, seed=seed, need_mask_grad=need_mask_grad,
                                           preds=preds)
        return attention_backward(q, k, v, attn_mask, grad_out, spec=spec, q_aux=q_aux, k_aux=k_aux,
                                  block_pattern=block_pattern, dropout_p=dropout_p, seed=seed,
                                  need_mask_grad=need_mask_grad, preds=preds)
