"""Tile sizes of the CUDA forward kernels, for the modules that build CUDA kernels from the template:
:mod:`.cuda` (the forward) and :mod:`.cuda_bwd` (whose dQ kernel tiles the queries as the forward does).
A module of its own, below both, so that neither imports the other."""

from __future__ import annotations

import dataclasses

from .kernels import Variant

__all__ = ["CUDA_BLOCK_Q", "CUDA_BLOCK_K", "cuda_variant"]

CUDA_BLOCK_Q = 64  # threads per block (one query row each)
CUDA_BLOCK_K = 32  # keys per shared-memory tile


def cuda_variant(v: Variant) -> Variant:
    """The variant with the CUDA tile sizes (spion tiles divide the block size)."""
    bq, bk = CUDA_BLOCK_Q, CUDA_BLOCK_K
    if v.mma == "sp":
        from .sparse import SP_BLOCK_Q, sp_block_k

        return dataclasses.replace(v, block_q=SP_BLOCK_Q, block_k=sp_block_k(v.head_dim, v.head_dim_v))
    if v.policy == "spion":
        bq = bk = min(v.block_size, 32)
    if v.policy == "dfss" and bk % v.nm_m:
        bk = v.nm_m
    return dataclasses.replace(v, block_q=bq, block_k=bk)
