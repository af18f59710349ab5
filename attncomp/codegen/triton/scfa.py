"""Host side of the ``hash`` and ``drop`` kernels (Sparse Causal Flash Attention, seed 002).

What it does, per (batch, head):

1. Group ids: the hash buckets as given; for ``drop`` 0 for kept tokens, 1 for dropped queries and
   2 for dropped keys (so a dropped query shares a group with no key, and the stable sort below is
   exactly the compaction "kept tokens first, in order").
2. A stable sort of queries (per query head) and keys (per KV head) by group id, keeping the
   original positions (the permutations). When the ids span at most :data:`MAX_COUNTING_GROUPS`
   values (always for ``drop``; for ``hash`` after one read of the ids' min/max) it is a counting
   sort in Triton (per-chunk histograms, a scan, a stable scatter: six small launches); otherwise
   ``torch.sort(stable=True)``.
3. Per sorted query ``m`` the interval ``[lo, hi)`` of sorted keys it keeps: its group's keys, only
   those at original positions ``<= i`` under ``is_causal`` (a prefix of the group, since the sort
   is stable). The interval is exact (bucket equality and causality on original positions), so the
   kernels mask with two integer compares and skip every key tile outside ``[min lo, max hi)`` of a
   query tile (SCFA Alg. 1-2's first/last tile, at key granularity). The counting sort writes the
   intervals in its scatter pass; the ``torch.sort`` path uses ``searchsorted`` on the composite
   key ``group * M + position``. For the backward also, per sorted key and query head, the interval
   ``[qlo, qhi)`` of sorted queries that keep it (built on first use).
4. The kernels (:mod:`.scfa_kernels`) gather q/k/v rows through the permutations and write out,
   lse, dq, dk, dv straight to original positions, so the scatter back costs no extra pass.

``exclude_self``, ``attn_mask`` (bool or float, broadcast to ``(B, Hq, Nq, Nk)``) and dropout act on
original positions inside the kernels. Entry points follow the contract of
:class:`attncomp.codegen.reference.ReferenceBackend` (``(out, lse)`` and ``(dq, dk, dv, None)``;
a float mask's gradient is left to the caller, as the op does).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from triton.runtime.errors import OutOfResources

from ...policy import Drop, Hash
from ...spec import AttentionSpec
from . import scfa_kernels as K
from .configs import interpret_mode
from .common import cdiv as _cdiv, next_pow2 as _next_pow2, pow2_block as _pow2

__all__ = [
    "supports",
    "hash_attention_forward",
    "hash_attention_backward",
    "drop_attention_forward",
    "drop_attention_backward",
    "scfa_forward",
    "scfa_backward",
    "scfa_attention",
    "build_layout",
    "make_layout",
    "Layout",
    "MAX_COUNTING_GROUPS",
    "set_config",
]

log = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_M32 = 0xFFFFFFFF


def _empty(shape, dtype, device) -> torch.Tensor:
    """Output allocation (tests replace it to poison outputs and catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def supports(spec: AttentionSpec, q: torch.Tensor) -> Optional[str]:
    """``None`` when these kernels run ``spec`` on tensors like ``q``, else the reason."""
    if spec.policy.name not in ("hash", "drop"):
        return f"the SCFA kernels run the 'hash' and 'drop' policies, not {spec.policy.name!r}"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    if not (q.is_cuda or interpret_mode()):
        return "needs CUDA tensors (or TRITON_INTERPRET=1)"
    if q.shape[-1] > 256:
        return f"head dim {q.shape[-1]} > 256"
    return None


# ---------------------------------------------------------------------------------------------
# Layout: sort, permutations and kept intervals.


@dataclass
class Layout:
    """Sorted order of one call's queries and keys and the kept intervals (see module docstring).
    All int32; ``q_perm``/``lo``/``hi``: ``(B, Hq, Nq)``, ``k_perm``: ``(B, Hk, Nk)``,
    ``qlo``/``qhi``: ``(B, Hq, Nk)`` (built on first use, by the backward)."""

    q_perm: torch.Tensor
    k_perm: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    causal: bool
    _backward: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    qlo: Optional[torch.Tensor] = None
    qhi: Optional[torch.Tensor] = None

    def backward_intervals(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.qlo is None:
            self.qlo, self.qhi = self._backward()
        return self.qlo, self.qhi


def _per_query_head(x: torch.Tensor, hq: int) -> torch.Tensor:
    B, hk, n = x.shape
    if hk == hq:
        return x
    return x[:, :, None, :].expand(B, hk, hq // hk, n).reshape(B, hq, n).contiguous()


#: group-id ranges up to this size use the counting sort; wider ones torch.sort
MAX_COUNTING_GROUPS = 1024


def build_layout(q_groups: torch.Tensor, k_groups: torch.Tensor, causal: bool,
                 group_range: Optional[Tuple[int, int]] = None, method: str = "auto") -> Layout:
    """Stably sort queries ``(B, Hq, Nq)`` and keys ``(B, Hk, Nk)`` by group id and compute each sorted
    query's kept interval of sorted keys (and, lazily, each sorted key's interval of sorted queries).

    ``group_range = (min_id, max_id)`` when known (saves a device-to-host read); ``method``:
    ``"count"`` (Triton counting sort, ids spanning at most :data:`MAX_COUNTING_GROUPS`),
    ``"sort"`` (``torch.sort`` + ``searchsorted``, any ids) or ``"auto"``.
    """
    triton_ok = interpret_mode() or q_groups.is_cuda
    if method == "sort" or not triton_ok or q_groups.numel() == 0 or k_groups.numel() == 0:
        return _layout_by_sort(q_groups, k_groups, causal)
    if group_range is None:
        mm = torch.stack([*torch.aminmax(q_groups), *torch.aminmax(k_groups)]).tolist()
        group_range = (min(mm[0], mm[2]), max(mm[1], mm[3]))
    lo_id, hi_id = int(group_range[0]), int(group_range[1])
    if hi_id - lo_id + 1 > MAX_COUNTING_GROUPS:
        if method == "count":
            raise ValueError(f"group ids span {hi_id - lo_id + 1} values; the counting sort takes at most "
                             f"{MAX_COUNTING_GROUPS}")
        return _layout_by_sort(q_groups, k_groups, causal)
    return _layout_by_count(q_groups, k_groups, causal, lo_id, hi_id - lo_id + 1)


def _layout_by_count(qg: torch.Tensor, kg: torch.Tensor, causal: bool, g_off: int, R: int) -> Layout:
    B, Hq, Nq = qg.shape
    Hk, Nk = kg.shape[1], kg.shape[2]
    dev = qg.device
    qg, kg = qg.contiguous(), kg.contiguous()
    # 32-token chunks: the in-chunk rank is a 32x32 compare held in registers (128-token chunks
    # made those kernels spill and run ten times longer on an H200)
    CHUNK = 32
    R_P2 = _next_pow2(max(R, 2))
    CB = max(1, min(256, 2048 // R_P2))
    i32 = torch.int32

    def side(g, rows, n):
        nch = _cdiv(n, CHUNK)
        hist = torch.empty((rows, nch, R_P2), dtype=i32, device=dev)
        K.layout_hist_kernel[(nch, rows)](g, hist, n, nch, g_off, CHUNK=CHUNK, R_P2=R_P2, num_warps=1)
        startpos, excl = torch.empty_like(hist), torch.empty_like(hist)
        start = torch.empty((rows, R_P2), dtype=i32, device=dev)
        count = torch.empty_like(start)
        K.layout_scan_kernel[(rows,)](hist, startpos, excl, start, count, nch, CB=CB, R_P2=R_P2)
        return nch, startpos, excl, start, count

    nq, q_sp, q_ex, q_st, q_ct = side(qg, B * Hq, Nq)
    nk, k_sp, k_ex, k_st, k_ct = side(kg, B * Hk, Nk)
    q_perm = torch.empty((B, Hq, Nq), dtype=i32, device=dev)
    lo, hi = torch.empty_like(q_perm), torch.empty_like(q_perm)
    K.layout_query_kernel[(nq, B * Hq)](qg, q_sp, kg, k_st, k_ct, k_ex, q_perm, lo, hi,
                                        Nq, Nk, nq, nk, Hq, Hk, g_off,
                                        CAUSAL=causal, CHUNK=CHUNK, R_P2=R_P2, num_warps=2)
    k_perm = torch.empty((B, Hk, Nk), dtype=i32, device=dev)

    def key_pass(kp, qlo, qhi, write_perm, write_q):
        K.layout_key_kernel[(nk, B * Hk)](kg, k_sp, qg, q_st, q_ct, q_ex, kp, qlo, qhi,
                                          Nq, Nk, nq, nk, Hq, Hk, g_off,
                                          CAUSAL=causal, WRITE_PERM=write_perm, WRITE_Q=write_q,
                                          CHUNK=CHUNK, R_P2=R_P2, num_warps=2)

    key_pass(k_perm, k_perm, k_perm, True, False)

    def backward():
        qlo = torch.empty((B, Hq, Nk), dtype=i32, device=dev)
        qhi = torch.empty_like(qlo)
        key_pass(k_perm, qlo, qhi, False, True)
        return qlo, qhi

    return Layout(q_perm, k_perm, lo, hi, causal, backward)


def _layout_by_sort(q_groups: torch.Tensor, k_groups: torch.Tensor, causal: bool) -> Layout:
    """The same layout through ``torch.sort`` (stable) and ``searchsorted`` on the composite key
    ``group * M + position`` (``M = max(Nq, Nk)``); any integer ids."""
    Nq, Nk = q_groups.shape[-1], k_groups.shape[-1]
    M = max(Nq, Nk, 1)
    qg, q_perm = torch.sort(q_groups, dim=-1, stable=True)
    kg, k_perm = torch.sort(k_groups, dim=-1, stable=True)
    qg, kg = qg.to(torch.int64), kg.to(torch.int64)
    qc = qg * M + q_perm
    kc = kg * M + k_perm
    kc_q = _per_query_head(kc, q_groups.shape[1])
    lo = torch.searchsorted(kc_q, qg * M, out_int32=True)
    if causal:
        hi = torch.searchsorted(kc_q, qc, right=True, out_int32=True)
    else:
        hi = torch.searchsorted(kc_q, (qg + 1) * M, out_int32=True)

    def backward():
        Hq = qc.shape[1]
        kcq, kgq = _per_query_head(kc, Hq), _per_query_head(kg, Hq)
        first = kcq if causal else kgq * M
        return (torch.searchsorted(qc, first, out_int32=True),
                torch.searchsorted(qc, (kgq + 1) * M, out_int32=True))

    return Layout(q_perm.to(torch.int32), k_perm.to(torch.int32), lo, hi, causal, backward)


def _groups(spec: AttentionSpec, q_aux: torch.Tensor, k_aux: torch.Tensor):
    """Group ids of queries and keys, and their range when known without reading the device."""
    if isinstance(spec.policy, Drop):
        # kept tokens share group 0; dropped queries (1) and dropped keys (2) meet no one
        return (~q_aux.bool()).to(torch.int8), (~k_aux.bool()).to(torch.int8) * 2, (0, 2)
    return q_aux, k_aux, None


def make_layout(spec: AttentionSpec, q_aux: torch.Tensor, k_aux: torch.Tensor) -> Layout:
    """The layout of one call of ``spec`` (hash buckets or keep masks as given to the op)."""
    if q_aux is None or k_aux is None:
        names = "q_buckets and k_buckets" if spec.policy.name == "hash" else "q_keep and k_keep"
        raise ValueError(f"policy {spec.policy.name!r} needs {names} (attncomp.ops.materialize_aux derives them)")
    qg, kg, rng = _groups(spec, q_aux, k_aux)
    return build_layout(qg, kg, spec.causal, group_range=rng)


# A few recent layouts, so that the backward of a call (which gets the same bucket/keep tensors)
# does not sort again. Keyed by the tensors' identity *and* version; the entry holds the tensors,
# so their memory cannot be reused by others while cached.
_LAYOUT_CACHE: "dict" = {}
_LAYOUT_CACHE_SIZE = 4


def _tensor_key(t: torch.Tensor):
    return (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def _layout_for(spec: AttentionSpec, q_aux, k_aux, causal: bool) -> Layout:
    if q_aux is None or k_aux is None:
        return make_layout(spec, q_aux, k_aux)  # raises, naming the missing tensors
    try:
        key = (spec.policy.name, causal, _tensor_key(q_aux), _tensor_key(k_aux))
    except RuntimeError:  # inference tensors track no version: nothing to key a cache on
        return make_layout(spec, q_aux, k_aux)
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        return hit[2]
    lay = make_layout(spec, q_aux, k_aux)
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_SIZE:
        _LAYOUT_CACHE.pop(next(iter(_LAYOUT_CACHE)))
    _LAYOUT_CACHE[key] = (q_aux, k_aux, lay)
    return lay


# ---------------------------------------------------------------------------------------------
# Launch configurations.

_CFG_ENV = "ATTNCOMP_SCFA_CONFIG"  # e.g. ATTNCOMP_SCFA_CONFIG_FWD=128,64,8,3

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by kernel and padded head dim, 16-bit inputs; the
# fastest of a sweep on an H200 (benchmarks/scfa.py --sweep: hash 16 buckets + drop 0.5, N=16384).
_GPU_CONFIGS = {
    ("fwd", 64): (64, 64, 4, 3),
    ("fwd", 128): (128, 128, 8, 3),
    ("fwd", 256): (64, 64, 8, 2),
    ("dkdv", 64): (64, 64, 4, 3),
    ("dkdv", 128): (64, 128, 8, 3),
    ("dkdv", 256): (32, 64, 8, 2),
    ("dq", 64): (64, 64, 4, 3),
    ("dq", 128): (64, 64, 4, 3),
    ("dq", 256): (64, 64, 8, 2),
}
# float32 tiles take twice the shared memory
_GPU_CONFIGS_FP32 = {
    ("fwd", 128): (64, 64, 4, 2),
    ("fwd", 256): (32, 32, 4, 2),
    ("dkdv", 128): (32, 64, 8, 2),
    ("dkdv", 256): (32, 32, 4, 2),
    ("dq", 128): (64, 32, 4, 2),
    ("dq", 256): (32, 32, 4, 2),
}
_TUNED: dict = {}


def set_config(kind: str, head_dim: int, config: Optional[Tuple[int, int, int, int]]) -> None:
    """Use ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) for kernel ``kind`` ('fwd', 'dkdv',
    'dq') at padded head dim ``head_dim`` (16-bit inputs) in this process; ``None`` restores the default."""
    if kind not in ("fwd", "dkdv", "dq"):
        raise ValueError(f"kind must be one of 'fwd', 'dkdv', 'dq', got {kind!r}")
    if config is None:
        _TUNED.pop((kind, head_dim), None)
    else:
        _TUNED[(kind, head_dim)] = tuple(int(x) for x in config)


def _config(kind: str, d: int, itemsize: int = 2):
    if interpret_mode():
        return (16, 16, 4, 1)
    env = os.environ.get(f"{_CFG_ENV}_{kind.upper()}")
    if env:
        return tuple(int(x) for x in env.split(","))
    d = 64 if d <= 64 else 128 if d <= 128 else 256
    if itemsize > 2:
        return _GPU_CONFIGS_FP32.get((kind, d), _GPU_CONFIGS_FP32[(kind, 128)])
    return _TUNED.get((kind, d), _GPU_CONFIGS[(kind, d)])


def _mask_args(attn_mask: Optional[torch.Tensor], shape, dummy: torch.Tensor):
    if attn_mask is None:
        return dummy, (0, 0, 0, 0), 0
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    m = m.expand(shape)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), tuple(m.stride()), 1
    return m, tuple(m.stride()), 2


def _seed_word(seed: int) -> int:
    s = (int(seed) * 0x9E3779B1 + 0x7F4A7C15) & _M32
    return s - (1 << 32) if s >= (1 << 31) else s  # as int32 (one kernel variant); cast to uint32 in the kernel


def _scale(spec: AttentionSpec, d: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(d)


def _check(spec, q, k, v):
    reason = supports(spec, q)
    if reason is None and max(k.shape[-1], v.shape[-1]) > 256:
        reason = f"head dim {max(k.shape[-1], v.shape[-1])} > 256"
    if reason is not None:
        raise RuntimeError(f"SCFA kernels cannot run this call: {reason}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _launch(launch, kind: str, d: int, itemsize: int) -> None:
    """``launch(BLOCK_M, BLOCK_N, num_warps, num_stages)`` with the configured tiles; if the GPU lacks
    the shared memory or registers they need (an attention mask adds pipelined tiles), smaller ones."""
    bm, bn, w, st = _config(kind, d, itemsize)
    tries = [(bm, bn, w, st), (bm, bn, w, 2), (max(16, bm // 2), bn, w, 2), (max(16, bm // 2), max(16, bn // 2), 4, 2),
             (32, 32, 4, 1)]
    seen = []
    for cfg in tries:
        if cfg in seen:
            continue
        seen.append(cfg)
        try:
            launch(*cfg)
            return
        except OutOfResources:
            if cfg == tries[-1]:
                raise
            log.info("SCFA %s kernel: %s does not fit, trying smaller tiles", kind, cfg)


# ---------------------------------------------------------------------------------------------
# Forward / backward.


def _forward(spec: AttentionSpec, q, k, v, attn_mask, q_aux, k_aux, dropout_p: float, seed: int,
             layout: Optional[Layout] = None):
    _check(spec, q, k, v)
    B, Hq, Nq, D = q.shape
    Hk, Nk, DV = k.shape[1], k.shape[2], v.shape[-1]
    out = _empty((B, Hq, Nq, DV), q.dtype, q.device)
    lse = _empty((B, Hq, Nq), torch.float32, q.device)
    if Nq == 0 or B * Hq == 0:
        return out, lse
    if Nk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    lay = layout if layout is not None else _layout_for(spec, q_aux, k_aux, spec.causal)
    mask, mstr, mkind = _mask_args(attn_mask, (B, Hq, Nq, Nk), q)
    BD, BDV = _pow2(D), _pow2(DV)
    p = float(dropout_p)

    def launch(BM, BN, warps, stages):
        K.scfa_fwd_kernel[(_cdiv(Nq, BM), B * Hq)](
            q, k, v, out, lse, lay.q_perm, lay.k_perm, lay.lo, lay.hi, mask,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mstr,
            _scale(spec, D) * 1.4426950408889634, _seed_word(seed), p, 1.0 / (1.0 - p),
            Hq, Hk, Nq, Nk, D, DV,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, BLOCK_DV=BDV,
            EXCLUDE_SELF=bool(getattr(spec.policy, "exclude_self", False)), MASK_KIND=mkind, DROPOUT=p > 0.0,
            num_warps=warps, num_stages=stages,
        )

    _launch(launch, "fwd", max(BD, BDV), q.element_size())
    return out, lse


def _backward(spec: AttentionSpec, q, k, v, attn_mask, q_aux, k_aux, dropout_p: float, seed: int,
              out, lse, grad_out, layout: Optional[Layout] = None):
    _check(spec, q, k, v)
    B, Hq, Nq, D = q.shape
    Hk, Nk, DV = k.shape[1], k.shape[2], v.shape[-1]
    dq, dk, dv = _empty(q.shape, q.dtype, q.device), _empty(k.shape, k.dtype, k.device), _empty(v.shape, v.dtype, v.device)
    if Nq == 0 or Nk == 0 or B * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None
    lay = layout if layout is not None else _layout_for(spec, q_aux, k_aux, spec.causal)
    qlo, qhi = lay.backward_intervals()
    mask, mstr, mkind = _mask_args(attn_mask, (B, Hq, Nq, Nk), q)
    BD, BDV = _pow2(D), _pow2(DV)
    p = float(dropout_p)
    scale = _scale(spec, D)
    common = dict(EXCLUDE_SELF=bool(getattr(spec.policy, "exclude_self", False)), MASK_KIND=mkind,
                  DROPOUT=p > 0.0)
    lse = lse.contiguous()

    delta = _empty((B, Hq, Nq), torch.float32, q.device)
    PM = 16 if interpret_mode() else 64
    K.scfa_bwd_preprocess_kernel[(_cdiv(Nq, PM), B * Hq)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), Hq, Nq, DV,
        BLOCK_M=PM, BLOCK_DV=BDV)

    scalars = (scale * 1.4426950408889634, scale, _seed_word(seed), p, 1.0 / (1.0 - p), Hq, Hk, Nq, Nk, D, DV)

    def launch_dkdv(BM, BN, warps, stages):
        K.scfa_bwd_dkdv_kernel[(_cdiv(Nk, BN), B * Hk)](
            q, k, v, grad_out, dk, dv, lse, delta, lay.q_perm, lay.k_perm, qlo, qhi, mask,
            *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(), *mstr,
            *scalars, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, BLOCK_DV=BDV, **common,
            num_warps=warps, num_stages=stages,
        )

    def launch_dq(BM, BN, warps, stages):
        K.scfa_bwd_dq_kernel[(_cdiv(Nq, BM), B * Hq)](
            q, k, v, grad_out, dq, lse, delta, lay.q_perm, lay.k_perm, lay.lo, lay.hi, mask,
            *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(), *mstr,
            *scalars, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, BLOCK_DV=BDV, **common,
            num_warps=warps, num_stages=stages,
        )

    _launch(launch_dkdv, "dkdv", max(BD, BDV), q.element_size())
    _launch(launch_dq, "dq", max(BD, BDV), q.element_size())
    return dq, dk, dv, None


def _need(spec: AttentionSpec, cls, what: str):
    if not isinstance(spec.policy, cls):
        raise ValueError(f"{what} needs a {cls.name!r} spec, got policy {spec.policy.name!r}")


def hash_attention_forward(spec: AttentionSpec, q, k, v, attn_mask, q_buckets, k_buckets, dropout_p=0.0, seed=0):
    """``hash`` policy forward: ``(out, lse)`` as :meth:`ReferenceBackend.forward`."""
    _need(spec, Hash, "hash_attention_forward")
    return _forward(spec, q, k, v, attn_mask, q_buckets, k_buckets, dropout_p, seed)


def hash_attention_backward(spec: AttentionSpec, q, k, v, attn_mask, q_buckets, k_buckets, dropout_p, seed,
                            out, lse, grad_out, need_mask_grad=False):
    """``hash`` policy backward: ``(dq, dk, dv, None)`` (a float mask's gradient is not computed here)."""
    _need(spec, Hash, "hash_attention_backward")
    return _backward(spec, q, k, v, attn_mask, q_buckets, k_buckets, dropout_p, seed, out, lse, grad_out)


def drop_attention_forward(spec: AttentionSpec, q, k, v, attn_mask, q_keep, k_keep, dropout_p=0.0, seed=0):
    """``drop`` policy forward: ``(out, lse)``; dropped and stranded queries give 0 and ``-inf``."""
    _need(spec, Drop, "drop_attention_forward")
    return _forward(spec, q, k, v, attn_mask, q_keep, k_keep, dropout_p, seed)


def drop_attention_backward(spec: AttentionSpec, q, k, v, attn_mask, q_keep, k_keep, dropout_p, seed,
                            out, lse, grad_out, need_mask_grad=False):
    """``drop`` policy backward: ``(dq, dk, dv, None)``."""
    _need(spec, Drop, "drop_attention_backward")
    return _backward(spec, q, k, v, attn_mask, q_keep, k_keep, dropout_p, seed, out, lse, grad_out)


def scfa_forward(spec: AttentionSpec, q, k, v, attn_mask, q_aux, k_aux, dropout_p=0.0, seed=0):
    """Forward of a ``hash`` or ``drop`` spec (dispatch by ``spec.policy.name``): ``(out, lse)``."""
    if spec.policy.name == "hash":
        return hash_attention_forward(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed)
    return drop_attention_forward(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed)


def scfa_backward(spec: AttentionSpec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed, out, lse, grad_out,
                  need_mask_grad=False):
    """Backward of a ``hash`` or ``drop`` spec: ``(dq, dk, dv, None)``."""
    fn = hash_attention_backward if spec.policy.name == "hash" else drop_attention_backward
    return fn(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed, out, lse, grad_out, need_mask_grad)


# ---------------------------------------------------------------------------------------------
# Autograd glue: a direct differentiable entry (benchmarks, experiments) that keeps the layout
# of the forward for the backward.


class _SCFAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, q_aux, k_aux, spec, dropout_p, seed):
        lay = make_layout(spec, q_aux, k_aux)
        out, lse = _forward(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed, layout=lay)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn_mask, ctx.layout, ctx.spec, ctx.dropout_p, ctx.seed = attn_mask, lay, spec, dropout_p, seed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, _ = _backward(ctx.spec, q, k, v, ctx.attn_mask, None, None, ctx.dropout_p, ctx.seed,
                                  out, lse, grad_out, layout=ctx.layout)
        return dq, dk, dv, None, None, None, None, None, None


def scfa_attention(q, k, v, q_aux, k_aux, *, policy="hash", is_causal=False, attn_mask=None, scale=None,
                   dropout_p: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Differentiable ``hash``/``drop`` attention on the SCFA kernels, without the op layer.

    ``q_aux``/``k_aux``: buckets (int) for ``hash``, keep masks (bool) for ``drop``.
    ``policy`` may be a name or a :class:`~attncomp.policy.Policy`.
    """
    from ...policy import get_policy

    spec = AttentionSpec(causal=bool(is_causal), mask_kind="none" if attn_mask is None else
                         ("bool" if attn_mask.dtype == torch.bool else "float"),
                         scale=scale, dropout_p=float(dropout_p), policy=get_policy(policy))
    return _SCFAFunction.apply(q, k, v, attn_mask, q_aux, k_aux, spec, float(dropout_p), int(seed))
