"""``attncomp.functional.attention``: a drop-in for ``F.scaled_dot_product_attention`` with policies."""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from .policy import Policy, get_policy
from .spec import AttentionSpec, Modifiers, Predicates, dtype_name

__all__ = ["attention"]


def _fresh_seed() -> int:
    # drawn from torch's CPU generator (so torch.manual_seed makes calls reproducible): a host-side
    # scalar, never a read of device memory
    return int(torch.randint(0, 2 ** 31 - 1, (1,), device="cpu").item())


def _window(window) -> Tuple[Optional[int], Optional[int]]:
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair of ints or None (unbounded), got {window!r}")
    out = []
    for w in window:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise ValueError(f"window must be a (left, right) pair of ints or None (unbounded), got {window!r}")
        out.append(w)
    return out[0], out[1]


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
              policy: Union[str, Policy] = "dfss", backend: str = "auto",
              q_buckets: Optional[Tensor] = None, k_buckets: Optional[Tensor] = None,
              q_keep: Optional[Tensor] = None, k_keep: Optional[Tensor] = None,
              block_pattern: Optional[Tensor] = None, seed: Optional[int] = None, *,
              q_pos: Optional[Tensor] = None, k_pos: Optional[Tensor] = None,
              window: Optional[Tuple[Optional[int], Optional[int]]] = None, causal_align: str = "top_left",
              q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None,
              q_valid: Optional[Tensor] = None, k_valid: Optional[Tensor] = None,
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
              rel_table: Optional[Tensor] = None, rel_max_distance: int = 128, rel_bidirectional: bool = True,
              sinks: Optional[Tensor] = None) -> Tensor:
    """Attention with the semantics of DESIGN.md §4 and §4.1.

    Arguments as in ``torch.nn.functional.scaled_dot_product_attention`` (q ``(B, Hq, Nq, D)``, k
    ``(B, Hk, Nk, D)``, v ``(B, Hk, Nk, Dv)``, bool or additive float ``attn_mask``, top-left
    ``is_causal``), plus the policy that decides which allowed entries are kept, and its tensors:
    ``q_buckets``/``k_buckets`` (int, ``(B, Hq, Nq)``/``(B, Hk, Nk)``) for ``hash``,
    ``q_keep``/``k_keep`` (bool, same shapes) for ``drop``, ``block_pattern`` for ``spion``.

    Structured masks (no N×N tensor): ``window=(left, right)`` allows key j for query i iff
    ``q_pos[i] - left <= k_pos[j] <= q_pos[i] + right`` (``None`` = unbounded side); ``is_causal``
    caps ``right`` at 0. Positions ``q_pos (B or 1, Nq)``/``k_pos (B or 1, Nk)`` default to
    ``arange``, with the queries shifted by ``Nk - Nq`` when ``causal_align="bottom_right"`` (decode
    with a KV cache). ``q_seg``/``k_seg`` (int, both or neither) allow equal segment ids only (packed
    documents); ``k_valid`` (bool) allows valid keys only; a query with ``q_valid`` False outputs
    zeros. Everything given combines with AND, ``is_causal`` with ``attn_mask`` included.

    Score modifiers (DESIGN.md §4.2), applied to ``s = scale * q·k`` in this order, before the float
    ``attn_mask`` is added and before the policy decides: ``alibi_slopes (Hq,)`` adds
    ``slope[h] * (k_pos[j] - q_pos[i])``; ``rel_table (n_buckets, Hq)`` adds ``rel_table[bucket(k_pos[j] -
    q_pos[i]), h]`` with T5's buckets (``n_buckets`` from the table, ``rel_max_distance``,
    ``rel_bidirectional``); ``softcap`` replaces s by ``softcap * tanh(s / softcap)``. ``sinks (Hq,)``
    adds ``exp(sinks[h])`` to each softmax denominator (a logit that attends to nothing, GPT-OSS). The
    table, the sinks and the slopes receive gradients.

    A query row with no kept key returns zeros. ``seed`` fixes dropout; by default it is drawn from
    torch's generator, so ``torch.manual_seed`` makes calls reproducible.
    """
    pol = get_policy(policy)
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
    left, right = _window(window)
    mask_kind = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
    spec = _spec(bool(is_causal), mask_kind, None if scale is None else float(scale), float(dropout_p), q.dtype,
                 int(q.shape[-1]), int(q.shape[1]) // max(1, int(k.shape[1])), pol, backend, left, right, causal_align)
    mods = Modifiers(alibi_slopes, rel_table, sinks)
    if softcap is not None or mods.any():
        if rel_table is not None and (not isinstance(rel_table, Tensor) or rel_table.dim() != 2):
            raise ValueError("rel_table must be a float tensor of shape (n_buckets, Hq), got "
                             f"{tuple(getattr(rel_table, 'shape', ())) or type(rel_table).__name__}")
        spec = _with_modifiers(spec, None if softcap is None else float(softcap), alibi_slopes is not None,
                               None if rel_table is None else int(rel_table.shape[0]),
                               None if rel_table is None else rel_max_distance, bool(rel_bidirectional),
                               sinks is not None)
        ops.check_modifiers(spec, mods, q.shape[1])
    preds = Predicates(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
    # shapes first, so that deriving buckets or keep masks never runs on inputs that do not fit
    ops.check_inputs(spec, q, k, v, attn_mask, enable_gqa=enable_gqa, policy_tensors=False, preds=preds)
    q_aux, k_aux = ops.materialize_aux(spec, q, k, q_aux, k_aux)
    ops.check_inputs(spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, enable_gqa=enable_gqa,
                     only_policy_tensors=True)
    if dropout_p > 0 and seed is None:
        seed = _fresh_seed()
    if mods.any():
        out, _ = torch.ops.attncomp.attention(q, k, v, attn_mask, q_aux, k_aux, block_pattern, *preds, spec.to_json(),
                                              float(dropout_p), int(seed or 0), *mods)
        return out
    out, _ = torch.ops.attncomp.attention(q, k, v, attn_mask, q_aux, k_aux, block_pattern, *preds, spec.to_json(),
                                          float(dropout_p), int(seed or 0))
    return out


@functools.lru_cache(maxsize=1024)
def _with_modifiers(spec, softcap, alibi, rel_buckets, rel_max_distance, rel_bidirectional, sinks) -> AttentionSpec:
    return spec.replace(softcap=softcap, alibi=alibi, rel_buckets=rel_buckets, rel_max_distance=rel_max_distance,
                        rel_bidirectional=rel_bidirectional if rel_buckets is not None else True, sinks=sinks)


@functools.lru_cache(maxsize=1024)
def _spec(causal, mask_kind, scale, dropout_p, dtype, head_dim, groups, pol, backend, left, right, align
          ) -> AttentionSpec:
    # one spec per call signature: building and validating it is host time spent on every call
    return AttentionSpec(causal=causal, mask_kind=mask_kind, scale=scale, dropout_p=dropout_p, dtype=dtype_name(dtype),
                         head_dim=head_dim, gqa_groups=groups, policy=pol.resolved(dtype), backend=backend,
                         window_left=left, window_right=right, causal_align=align)
