"""Host-side tensors of the score modifiers (DESIGN.md §4.2) for the fused backends (Triton, TVM).

Both read the relative-position bias from a look-up table per clamped distance (:func:`rel_lut`) and
return the modifier tensors' gradients through :func:`mod_grads` from what their dK/dV pass writes
(ALiBi's partial sums, the table's per-distance sums) and from ``lse`` and ``delta`` (the sinks').
Torch ops on the tensors' device only: no read to the host.
"""

from __future__ import annotations

import functools

import torch

from ..spec import AttentionSpec, Modifiers, rel_bucket
from .reference import cacheable

__all__ = ["rel_lut", "lut_buckets", "mod_grads"]


def rel_lut(spec: AttentionSpec, table: torch.Tensor, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The relative-position bias as the kernels read it: ``(2 * max_distance + 1, Hq)`` in ``dtype``, row
    ``r + max_distance`` holding ``table[bucket(r), :]`` for ``r`` in ``[-max_distance, max_distance]``. T5's
    bucket is constant beyond ``max_distance`` on either side, so a kernel clamps ``k_pos - q_pos`` to that
    range and reads the row: no logarithm in the kernel (whose rounding could differ from the model's and
    move a distance into the next bucket). A gather on the device: no read to the host."""
    return table.to(device=device, dtype=dtype)[lut_buckets(spec, device)].contiguous()


def lut_buckets(spec: AttentionSpec, device) -> torch.Tensor:
    """``bucket(r)`` for ``r`` in ``[-max_distance, max_distance]`` (int64), cached per device where a
    cache may keep it (:func:`.reference.cacheable`)."""
    args = (spec.rel_buckets, spec.rel_max_distance, spec.rel_bidirectional, torch.device(device))
    return _lut_buckets_of(*args) if cacheable(device) else _lut_buckets_of.__wrapped__(*args)


@functools.lru_cache(maxsize=64)
def _lut_buckets_of(n_buckets: int, max_distance: int, bidirectional: bool, device: torch.device) -> torch.Tensor:
    r = torch.arange(-max_distance, max_distance + 1, device=device)
    return rel_bucket(r, n_buckets, max_distance, bidirectional)


def mod_grads(spec: AttentionSpec, mods: Modifiers, lse, delta, dslopes, dlut) -> Modifiers:
    """The gradients of the modifier tensors from the dK/dV pass's buffers (``dslopes``: ALiBi's partial sums
    ``(B, Hq, any)``, summed here over dims 0 and 2; ``dlut``: ``(2 * max_distance + 1, Hq)``, summed here per
    bucket) and, for the sinks, from ``lse`` and ``delta = rowsum(dO * O)``: ``dsink[h] = -sum_i exp(sink[h] -
    lse_i) * delta_i`` (the sink's probability times the row's ``-delta``). Torch ops on the device, no read to
    the host. Sums are float32, or float64 where ``dlut``/``delta`` are."""
    ds = dt = dk = None
    if mods.alibi_slopes is not None:
        ds = dslopes.sum(dim=(0, 2)).to(mods.alibi_slopes.dtype).reshape(mods.alibi_slopes.shape)
    if mods.rel_table is not None:
        tab = mods.rel_table
        acc = torch.float64 if dlut.dtype == torch.float64 else torch.float32
        dt = torch.zeros(tab.shape, dtype=acc, device=tab.device)
        dt = dt.index_add_(0, lut_buckets(spec, dlut.device), dlut.to(acc)).to(tab.dtype)
    if mods.sinks is not None:
        acc = torch.float64 if delta.dtype == torch.float64 else torch.float32
        sk = mods.sinks.reshape(1, -1, 1).to(acc)
        dk = (-(torch.exp(sk - lse.to(acc)) * delta).sum(dim=(0, 2))).to(mods.sinks.dtype).reshape(mods.sinks.shape)
    return Modifiers(ds, dt, dk)
