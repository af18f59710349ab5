"""What the ``attncomp::attention`` op and the code below it agree on: argument positions, the spec
string's parsing, the output layout and the ``lse`` dtype, call signatures for per-call memos, and which
bucket tensors the op derived itself.

The op (:mod:`attncomp.ops`) calls the runtime's backend selection, which imports the backends; the
backends and the runtime need these conventions, so they live here, below all of them, and import
only the spec and the policies. :mod:`attncomp.ops` re-exports the public names for its callers.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import Tensor

from .policy import Hash
from .spec import AttentionSpec, Modifiers, Predicates

__all__ = ["ARG_INDEX", "PRED_NAMES", "MOD_NAMES", "resolved", "parsed", "half_given_aux", "output_strides",
           "output_like", "laid_out", "lse_dtype", "bounded_put", "tensor_sig", "call_signature", "bucket_range",
           "mark_buckets"]

#: the predicate tensors, in op-argument order (the fields of :class:`~attncomp.spec.Predicates`)
PRED_NAMES = Predicates._fields
#: the score modifiers' tensors, in op-argument order (the fields of :class:`~attncomp.spec.Modifiers`)
MOD_NAMES = Modifiers._fields
#: position of each argument of ``attncomp::attention``
ARG_INDEX = {n: i for i, n in enumerate(("q", "k", "v", "attn_mask", "q_aux", "k_aux", "block_pattern")
                                        + PRED_NAMES + ("spec", "dropout_p", "seed") + MOD_NAMES)}


# -- the spec string ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def resolved(spec_json: str, dtype: torch.dtype) -> AttentionSpec:
    """The call's spec (parsed once per spec string and dtype): the dtype and the dtype-dependent
    policy defaults filled in where the compiler could not know them."""
    s = AttentionSpec.from_json(spec_json)
    if s.dtype is None or s.policy.resolved(dtype) != s.policy:
        s = s.replace(dtype=str(dtype).replace("torch.", ""), policy=s.policy.resolved(dtype))
    return s


@functools.lru_cache(maxsize=1024)
def parsed(spec_json: str) -> AttentionSpec:
    """The spec of a spec string, parsed once."""
    return AttentionSpec.from_json(spec_json)


def half_given_aux(policy) -> ValueError:
    """The error for a call that gives one of a hash/drop site's two policy tensors but not the other."""
    names = "q_buckets and k_buckets" if isinstance(policy, Hash) else "q_keep and k_keep"
    return ValueError(f"policy {policy.name!r} needs {names} (both, or neither to derive them)")


# -- the output layout --------------------------------------------------------------------------

def output_strides(B, H, N, dv) -> tuple:
    """The strides of the op's ``(B, H, N, dv)`` output: the heads inner in memory, i.e. the
    transpose of a contiguous ``(B, N, H, dv)`` tensor (the layout SDPA's GPU kernels give for q from a
    model's projections). A model's ``out.transpose(1, 2).contiguous()`` (or ``reshape``) before its
    output projection then copies nothing. The layout depends on no input's strides: compiled graphs
    may lay q out differently at run time than when they were traced."""
    return (N * H * dv, dv, H * dv, 1)


def output_like(q: Tensor, dv: int) -> Tensor:
    """The op's output buffer for q (:func:`output_strides`)."""
    B, H, N, _ = q.shape
    return q.new_empty_strided((B, H, N, dv), output_strides(B, H, N, dv))


def laid_out(out: Tensor) -> Tensor:
    """``out`` in :func:`output_like`'s layout (what the op's fake promises compiled graphs); a
    backend's other layout is copied."""
    if out.stride() == output_strides(*out.shape):
        return out
    return output_like(out, out.shape[-1]).copy_(out)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the op's ``lse`` for inputs of ``dtype``: float64 for float64 inputs, float32 for every
    other (float16, bfloat16, float32: what the kernels accumulate in and write). The fake implementation
    reports it, every backend that takes float64 writes it, and the ring merge of
    :mod:`attncomp.distributed` accumulates in it; float64 runs carry no float32 rounding through ``lse``.
    A backend that cannot compute in float64 (Triton) refuses float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- per-call memos -----------------------------------------------------------------------------

def bounded_put(memo: dict, key, value, limit: int) -> None:
    """``memo[key] = value``, the oldest entry dropped first when ``memo`` holds ``limit`` (the per-call
    memos of the op and the backends: sizes in their keys, so a decode loop adds one per step)."""
    if len(memo) >= limit:
        memo.pop(next(iter(memo)))
    memo[key] = value


def tensor_sig(t: Optional[Tensor]):
    """What a launch specialises on of one tensor (None for an absent one)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15 == 0)


def call_signature(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], preds: Optional[tuple],
                   dropout_p: float) -> tuple:
    """What a kernel launch specialises on of a call's tensors: sizes, strides, dtypes, the device and
    16-byte alignment of q, k and v, the same of the mask and of each predicate tensor (``preds``: a
    tuple of tensors or None), and the dropout rate. Per-call memos (launch plans) are keyed by it."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            q.data_ptr() & 15 == 0, k.data_ptr() & 15 == 0, v.data_ptr() & 15 == 0, tensor_sig(attn_mask),
            None if preds is None else tuple(map(tensor_sig, preds)), float(dropout_p))


# -- bucket tensors the op derived ----------------------------------------------------------------
# id -> (weak reference, version, n_buckets) of the bucket tensors that
# :func:`attncomp.ops.materialize_aux` derived, so with ids known to lie in [0, n_buckets). The Triton
# backend sorts such ids by counting (no range check on the device).
_derived_buckets: dict = {}


def mark_buckets(t: Tensor, n: int) -> None:
    """Note that ``t`` holds bucket ids in ``[0, n)`` (derived by the op, as it is now)."""
    try:
        ver = t._version
    except RuntimeError:  # inference tensors track no version: left unmarked
        return
    key = id(t)
    _derived_buckets[key] = (weakref.ref(t, lambda _r, key=key: _derived_buckets.pop(key, None)), ver, n)


def bucket_range(t: Optional[Tensor]) -> Optional[int]:
    """``n`` when ``t`` is a bucket tensor that :func:`attncomp.ops.materialize_aux` derived (ids in
    ``[0, n)``) and that nothing has written to since; else None (ids of any range). Reads no tensor data."""
    ent = _derived_buckets.get(id(t))
    if ent is None or ent[0]() is not t:
        return None
    try:
        return ent[2] if t._version == ent[1] else None
    except RuntimeError:
        return None
