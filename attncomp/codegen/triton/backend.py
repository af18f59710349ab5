"""Host side of the Triton backend: checks, argument preparation and kernel launches.

:class:`TritonBackend` has the interface of ``attncomp.codegen.reference.ReferenceBackend``
(``supports``, ``forward``, ``backward``) and computes the same function (DESIGN.md §4) with the
fused kernels of :mod:`.forward` and :mod:`.backward`. Policies it runs: ``dense``, ``et`` (dense
numerics) and ``dfss``; for the others :meth:`TritonBackend.supports` gives the reason.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from triton.runtime.errors import OutOfResources

from ...policy import DFSS
from ...spec import AttentionSpec
from . import configs
from .backward import _bwd_dkdv, _bwd_dq, _bwd_preprocess
from .common import LOG2E, MASK_BOOL, MASK_FLOAT, MASK_NONE, POLICY_DENSE, POLICY_DFSS
from .common import cdiv as _cdiv, next_pow2 as _next_pow2, pow2_block as _pow2
from .forward import _attn_fwd

__all__ = ["TritonBackend", "attention_forward", "attention_backward"]

_POLICIES = {"dense": POLICY_DENSE, "et": POLICY_DENSE, "dfss": POLICY_DFSS}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256


#: the configuration of the latest forward and backward launch (read by benchmarks and reports)
last_configs: dict = {}
# configuration chosen per call signature in this process (see _Plan.signature)
_config_memo: dict = {}


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output and workspace buffer comes from here (tests swap it for a NaN-filling one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Plan:
    """Everything about one call that the kernels need, derived once from the spec and tensors."""

    def __init__(self, spec: AttentionSpec, q, k, v, attn_mask, dropout_p: float, seed: int):
        self.B, self.Hq, self.Nq, self.D = (int(s) for s in q.shape)
        self.Hk, self.Nk, self.Dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[-1])
        self.groups = self.Hq // self.Hk
        self.dtype = q.dtype
        self.scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(self.D)
        self.causal = bool(spec.causal)
        pol = spec.policy
        self.policy = _POLICIES[pol.name]
        if isinstance(pol, DFSS):
            r = pol.resolved(spec.torch_dtype() or q.dtype)
            self.nm_n, self.nm_m = r.n, r.m
        else:
            self.nm_n, self.nm_m = 1, 1
        self.dropout_p = float(dropout_p)
        self.dropout = self.dropout_p > 0.0
        self.seed_mixed = (int(seed) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
        self.inv_keep = 1.0 / (1.0 - self.dropout_p) if self.dropout else 1.0
        self.block_d, self.block_dv = _pow2(self.D), _pow2(self.Dv)

        if attn_mask is None:
            self.mask_kind, self.mask, self.mask_strides = MASK_NONE, q, (0, 0, 0, 0)
        else:
            m = attn_mask
            while m.dim() < 4:
                m = m.unsqueeze(0)
            if m.dtype == torch.bool:
                self.mask_kind, m = MASK_BOOL, m.view(torch.uint8)
            else:
                self.mask_kind = MASK_FLOAT
            # broadcast dimensions read the same element: stride 0
            self.mask_strides = tuple(0 if m.shape[i] == 1 else m.stride(i) for i in range(4))
            self.mask = m

    def common_meta(self, block_q: int, block_k: int) -> dict:
        return dict(
            GROUPS=self.groups, HEAD_D=self.D, HEAD_DV=self.Dv, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
            CAUSAL=self.causal, MASK_KIND=self.mask_kind,
            CHECK_Q=self.Nq % block_q != 0, CHECK_K=self.Nk % block_k != 0,
            POLICY=self.policy, NM_N=self.nm_n, NM_M=self.nm_m, DROPOUT=self.dropout,
            PRESCALE=self.mask_kind == MASK_FLOAT or not self.scale > 0.0,
        )

    def signature(self, device) -> tuple:
        """What the choice of launch configuration depends on (a dict key)."""
        return (self.D, self.Dv, self.dtype, self.causal, self.mask_kind, self.policy, self.nm_n, self.nm_m,
                self.dropout, self.groups, _next_pow2(self.Nq), _next_pow2(self.Nk), str(device))

    def tune_key(self, device) -> dict:
        arch = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return {
            "D": self.D, "Dv": self.Dv, "dtype": str(self.dtype), "causal": self.causal,
            "mask": self.mask_kind, "policy": self.policy, "nm": [self.nm_n, self.nm_m],
            "dropout": self.dropout, "groups": self.groups,
            # sequence lengths by power of two: one tuning per size class
            "nq": _next_pow2(self.Nq), "nk": _next_pow2(self.Nk), "arch": arch,
        }


def attention_forward(spec: AttentionSpec, q, k, v, attn_mask=None, dropout_p: float = 0.0, seed: int = 0,
                      config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of DESIGN.md §4 through the fused forward kernel."""
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    plan = _Plan(spec, q, k, v, attn_mask, dropout_p, seed)
    B, Hq, Nq, Nk = plan.B, plan.Hq, plan.Nq, plan.Nk
    out = _empty((B, Hq, Nq, plan.Dv), q.dtype, q.device)
    lse = _empty((B, Hq, Nq), torch.float32, q.device)
    if Nq == 0 or B * Hq == 0:
        return out, lse
    if Nk == 0:
        return out.zero_(), lse.fill_(float("-inf"))

    def launch(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        grid = (_cdiv(Nq, bm), B * Hq)
        _attn_fwd[grid](
            q, k, v, plan.mask, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            *plan.mask_strides,
            Hq, Nq, Nk, plan.scale * LOG2E, plan.seed_mixed, plan.dropout_p, plan.inv_keep,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **plan.common_meta(bm, bn),
        )

    _run_tuned("fwd", plan, q, launch, configs.fwd_candidates, config)
    return out, lse


def attention_backward(spec: AttentionSpec, q, k, v, attn_mask, out, lse, grad_out, dropout_p: float = 0.0,
                       seed: int = 0, config: Optional[dict] = None):
    """``(dq, dk, dv)`` of :func:`attention_forward`'s ``out`` for ``grad_out``."""
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    out, grad_out = _last_contiguous(out), _last_contiguous(grad_out)
    plan = _Plan(spec, q, k, v, attn_mask, dropout_p, seed)
    B, Hq, Hk, Nq, Nk = plan.B, plan.Hq, plan.Hk, plan.Nq, plan.Nk
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(v.shape, v.dtype, v.device)
    if Nq == 0 or Nk == 0 or B * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = _empty((B, Hq, Nq), torch.float32, q.device)
    lse2 = _empty((B, Hq, Nq), torch.float32, q.device)
    lse = lse.contiguous()

    pre_bm = 16 if configs.interpret_mode() else 64
    _bwd_preprocess[(_cdiv(Nq, pre_bm), B * Hq)](
        out, grad_out, lse, delta, lse2,
        out.stride(0), out.stride(1), out.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        Hq, Nq, HEAD_DV=plan.Dv, BLOCK_DV=plan.block_dv, BLOCK_M=pre_bm,
        num_warps=1 if configs.interpret_mode() else 4,
    )
    scalars = (plan.scale * LOG2E, plan.scale, plan.seed_mixed, plan.dropout_p, plan.inv_keep)

    def launch(cfg):
        bm, bn, w, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
        # orientation of the dK/dV tiles (see backward._dkdv_tiles): queries by keys by default
        # for a row-wise selection, keys by queries otherwise
        natural = bool(cfg.get("NATURAL", plan.policy == POLICY_DFSS))
        _bwd_dkdv[(_cdiv(Nk, bn), B * Hk)](
            q, k, v, plan.mask, grad_out, dk, dv, lse2, delta,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            *plan.mask_strides,
            Hk, Nq, Nk, *scalars,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, NATURAL=natural, **plan.common_meta(bm, bn),
        )
        # dQ: its own tiles when the config names them ("DQ": [queries, keys, warps, stages]),
        # else the dK/dV shape transposed (large query tile, small key tile)
        qm, qn, qw, qs = cfg.get("DQ") or (bn, bm, w, st)
        _bwd_dq[(_cdiv(Nq, qm), B * Hq)](
            q, k, v, plan.mask, grad_out, dq, lse2, delta,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            *plan.mask_strides,
            Hq, Nq, Nk, *scalars,
            BLOCK_M=qm, BLOCK_N=qn, num_warps=qw, num_stages=qs, **plan.common_meta(qm, qn),
        )

    _run_tuned("bwd", plan, q, launch, configs.bwd_candidates, config)
    return dq, dk, dv


def _run_tuned(kind: str, plan, q, launch, candidates_fn, config: Optional[dict] = None) -> None:
    """Launch with ``config``, or with the remembered/tuned one for this call signature."""
    if config is None:
        sig = (kind, configs.tuning_enabled()) + plan.signature(q.device)
        config = _config_memo.get(sig)
        if config is not None:
            launch(config)
        else:
            cands = candidates_fn(plan.D, plan.Dv, q.dtype, plan.nm_m)
            config = configs.choose(f"triton_attention_{kind}", plan.tune_key(q.device), cands,
                                    _bencher(launch) if q.is_cuda else None)
            config = _config_memo[sig] = _launch_with_fallback(launch, config, cands)
    else:
        launch(config)
    last_configs[kind] = config


def _launch_with_fallback(launch, config, candidates):
    """Launch ``config``; if the GPU lacks the shared memory or registers it needs (an attention
    mask adds its own pipelined tiles), take the next candidate instead. Returns the config used."""
    order = [config] + [c for c in candidates if c != config]
    for i, cfg in enumerate(order):
        try:
            launch(cfg)
            return cfg
        except OutOfResources:
            if i == len(order) - 1:
                raise
    return config


def _bencher(launch):
    def bench(cfg) -> float:
        from triton.testing import do_bench

        return float(do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median"))

    return bench


_SCFA_POLICIES = ("hash", "drop")


class TritonBackend:
    """Fused Triton kernels (forward and backward) for ``dense``, ``et`` and ``dfss`` (flash-style, N:M
    selection in registers) and for ``hash``/``drop`` (sorted or compacted layouts, :mod:`.scfa`)."""

    name = "triton"

    def supports(self, spec: AttentionSpec, q: torch.Tensor) -> Optional[str]:
        pol = spec.policy.name
        if pol in _SCFA_POLICIES:
            from . import scfa

            return scfa.supports(spec, q)
        if pol not in _POLICIES:
            return (f"policy {pol!r} has no Triton kernel yet (Triton runs: {', '.join(sorted(_POLICIES))})")
        if not (q.is_cuda or configs.interpret_mode()):
            return f"needs CUDA tensors (got {q.device.type}; TRITON_INTERPRET=1 runs it on the CPU)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (float16, bfloat16, float32)"
        if q.dim() != 4:
            return f"expects (B, H, N, D) inputs, got {q.dim()} dims"
        if q.shape[-1] > _MAX_HEAD_DIM:
            return f"head dim {q.shape[-1]} > {_MAX_HEAD_DIM}"
        if spec.head_dim is not None and spec.head_dim > _MAX_HEAD_DIM:
            return f"head dim {spec.head_dim} > {_MAX_HEAD_DIM}"
        return None

    def forward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed):
        self._check(spec, q, k, v)
        if spec.policy.name in _SCFA_POLICIES:
            from . import scfa

            return scfa.scfa_forward(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed)
        return attention_forward(spec, q, k, v, attn_mask, dropout_p, seed)

    def backward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                 out, lse, grad_out, need_mask_grad=False):
        # the mask gradient (a full B x H x Nq x Nk tensor) is left to the caller's fallback
        self._check(spec, q, k, v)
        if spec.policy.name in _SCFA_POLICIES:
            from . import scfa

            return scfa.scfa_backward(spec, q, k, v, attn_mask, q_aux, k_aux, dropout_p, seed, out, lse, grad_out,
                                      need_mask_grad)
        dq, dk, dv = attention_backward(spec, q, k, v, attn_mask, out, lse, grad_out, dropout_p, seed)
        return dq, dk, dv, None

    def _check(self, spec, q, k, v) -> None:
        reason = self.supports(spec, q)
        if reason is None and max(k.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
            reason = f"head dim {max(k.shape[-1], v.shape[-1])} > {_MAX_HEAD_DIM}"
        if reason is not None:
            raise RuntimeError(f"Triton backend cannot run this site ({spec.describe()}): {reason}")
