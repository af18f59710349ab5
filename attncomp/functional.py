"""``attncomp.functional.attention``: a drop-in for ``F.scaled_dot_product_attention`` with policies."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from . import ops
from .policy import Policy, get_policy
from .spec import AttentionSpec, dtype_name

__all__ = ["attention"]


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
              policy: Union[str, Policy] = "dfss", backend: str = "auto",
              q_buckets: Optional[Tensor] = None, k_buckets: Optional[Tensor] = None,
              q_keep: Optional[Tensor] = None, k_keep: Optional[Tensor] = None,
              block_pattern: Optional[Tensor] = None, seed: Optional[int] = None) -> Tensor:
    """Attention with the semantics of DESIGN.md §4.

    Arguments as in ``torch.nn.functional.scaled_dot_product_attention`` (q ``(B, Hq, Nq, D)``, k
    ``(B, Hk, Nk, D)``, v ``(B, Hk, Nk, Dv)``, bool or additive float ``attn_mask``, top-left
    ``is_causal``), plus the policy that decides which allowed entries are kept, and its tensors:
    ``q_buckets``/``k_buckets`` (int, ``(B, Hq, Nq)``/``(B, Hk, Nk)``) for ``hash``,
    ``q_keep``/``k_keep`` (bool, same shapes) for ``drop``, ``block_pattern`` for ``spion``.
    A query row with no kept key returns zeros. ``seed`` fixes dropout; by default it is drawn from
    torch's generator, so ``torch.manual_seed`` makes calls reproducible.
    """
    pol = get_policy(policy)
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as scaled_dot_product_attention)")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if pol.name == "hash":
        q_aux, k_aux = q_buckets, k_buckets
        others = (q_keep, k_keep)
    elif pol.name == "drop":
        q_aux, k_aux = q_keep, k_keep
        others = (q_buckets, k_buckets)
    else:
        q_aux = k_aux = None
        others = (q_buckets, k_buckets, q_keep, k_keep)
    if any(t is not None for t in others):
        raise ValueError(f"policy {pol.name!r} does not take the bucket/keep tensors given")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    mask_kind = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
    spec = AttentionSpec(causal=bool(is_causal), mask_kind=mask_kind, scale=None if scale is None else float(scale),
                         dropout_p=float(dropout_p), dtype=dtype_name(q.dtype), head_dim=int(q.shape[-1]),
                         gqa_groups=int(q.shape[1]) // max(1, int(k.shape[1])), policy=pol.resolved(q.dtype),
                         backend=backend)
    # shapes first, so that deriving buckets or keep masks never runs on inputs that do not fit
    ops.check_inputs(spec, q, k, v, attn_mask, enable_gqa=enable_gqa, policy_tensors=False)
    q_aux, k_aux = ops.materialize_aux(spec, q, k, q_aux, k_aux)
    ops.check_inputs(spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, enable_gqa=enable_gqa)
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
    return ops.attention(q, k, v, attn_mask, spec=spec, q_aux=q_aux, k_aux=k_aux, block_pattern=block_pattern,
                         dropout_p=float(dropout_p), seed=int(seed or 0))
