"""Launch configurations (tile shapes, warps, pipeline depth) of the Triton attention kernels.

Candidates are plain module-level lists, filtered per call by head dim, dtype and the N:M group
size (a key tile must hold whole groups, laid out as :func:`common._key_order` expects: a multiple
of ``4 * M`` keys). On CUDA, when the persistent tuning store ``attncomp.runtime.autotune`` is
installed and measuring is allowed (a compile with ``mode="max-autotune"`` in this process, or
``ATTNCOMP_AUTOTUNE=1``), it picks among the candidates by timing them once per key and remembers the
choice on disk; a choice on disk is used in any mode. Otherwise (and with ``ATTNCOMP_TRITON_TUNE=0``) the
first candidate, a default measured per GPU model (H100, H200), is used: no first call tunes. Under ``TRITON_INTERPRET=1`` (CPU tests) one small configuration is used and nothing
is timed. Backward candidates with ``DQ_ATOMIC`` (dQ by float32 atomics in the dK/dV pass) are left
out while PyTorch's deterministic algorithms are enabled.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, List, Optional

import torch

from ...runtime import env

log = logging.getLogger(__name__)

__all__ = ["fwd_candidates", "bwd_candidates", "choose", "interpret_mode"]

Config = Dict[str, int]


def interpret_mode() -> bool:
    return env.get("TRITON_INTERPRET", "0") == "1"


def tuning_enabled() -> tuple:
    """Whether :func:`choose` may time candidates (only where :func:`env.measuring_allowed`: under
    ``mode="max-autotune"`` or ``ATTNCOMP_AUTOTUNE=1``; ``ATTNCOMP_TRITON_TUNE=0`` turns it off even
    there), and which tuning store it would use (read on every call: part of per-call memo keys)."""
    on = env.get("ATTNCOMP_TRITON_TUNE", "1") != "0" and env.measuring_allowed()
    return on, env.raw("ATTNCOMP_CACHE_DIR")


def _cfg(bm, bn, warps, stages) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


# Candidates per head-dim tier (padded head dim <= 64, <= 128, <= 256), the default first; the
# defaults and orders come from timing every candidate on an H200 (bf16, B=4, H=16, N=4096).
# Forward: (query tile, key tile, warps, stages). Shapes that spill registers on sm_90 are left out.
FWD_CONFIGS: Dict[int, List[Config]] = {
    64: [_cfg(128, 64, 8, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 4)],
    128: [_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 2)],
    256: [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2)],
}
# Hopper candidates: key/value tiles through TMA descriptors (``TMA``, where the site allows it, see
# backend.Site.kv_descriptors); timed by the tuning store and ``attention.py --sweep`` next to the
# address-load candidates above. (Triton 3.6's automatic warp specialisation of the key-tile loop
# fails to compile this kernel on sm_90: NVGPUWarpSpecialization pass failure, H100 run.)
FWD_CONFIGS[64] += [dict(_cfg(128, 64, 8, 3), TMA=1), dict(_cfg(128, 64, 4, 3), TMA=1),
                    dict(_cfg(128, 128, 8, 3), TMA=1), dict(_cfg(64, 64, 4, 3), TMA=1)]
FWD_CONFIGS[128] += [dict(_cfg(128, 128, 8, 3), TMA=1), dict(_cfg(128, 64, 8, 3), TMA=1),
                     dict(_cfg(128, 128, 8, 2), TMA=1), dict(_cfg(128, 128, 8, 4), TMA=1)]
# With an N:M selection (more registers per logit) smaller query tiles win.
FWD_CONFIGS_NM: Dict[int, List[Config]] = {
    64: [_cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 4), _cfg(128, 64, 8, 4)],
    128: [_cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 4), _cfg(128, 64, 8, 4)],
    256: [_cfg(64, 64, 4, 2), _cfg(128, 64, 8, 2), _cfg(64, 32, 4, 2)],
}
# Backward: BLOCK_M/BLOCK_N are the query/key tiles of the dK/dV kernel. The dQ kernel takes
# ``DQ`` = (query tile, key tile, warps, stages) when given, else the dK/dV pair transposed.
# ``NATURAL`` picks the orientation of the dK/dV tiles (see backward._dkdv_tiles; default:
# queries by keys for an N:M selection, keys by queries otherwise).
BWD_CONFIGS: Dict[int, List[Config]] = {
    64: [_cfg(64, 64, 4, 3), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 2), dict(_cfg(64, 128, 8, 3), DQ=(128, 64, 8, 3))],
    128: [dict(_cfg(64, 128, 8, 2), DQ=(128, 64, 8, 3)), _cfg(64, 128, 8, 2),
          dict(_cfg(32, 128, 8, 3), DQ=(128, 64, 8, 3)), dict(_cfg(32, 128, 8, 2), DQ=(128, 64, 8, 2)),
          _cfg(64, 64, 4, 2)],
    256: [_cfg(64, 64, 8, 2), _cfg(32, 64, 4, 2), _cfg(32, 32, 4, 2)],
}
BWD_CONFIGS[64] += [dict(_cfg(64, 64, 4, 3), TMA=1), dict(_cfg(64, 128, 8, 3), DQ=(128, 64, 8, 3), TMA=1)]
BWD_CONFIGS[128] += [dict(_cfg(64, 128, 8, 2), DQ=(128, 64, 8, 3), TMA=1),
                     dict(_cfg(64, 128, 8, 2), DQ=(128, 128, 8, 2), TMA=1)]
# ``TMA_Q``: the dK/dV launch streams Q and dO through descriptors too (on the H100, the Hopper-variants benchmark, in git history:
# faster without a mask, slower causal, at D=128 N=16384); the H100's D=128 default (GPU_DEFAULTS)
BWD_CONFIGS[64] += [dict(_cfg(64, 64, 4, 3), TMA=1, TMA_Q=1)]
BWD_CONFIGS[128] += [dict(_cfg(64, 64, 4, 2), TMA=1, TMA_Q=1), dict(_cfg(64, 128, 8, 2), DQ=(128, 64, 8, 3), TMA=1,
                                                                   TMA_Q=1)]
# One backward launch: dQ added with float32 atomics in the dK/dV pass (``DQ_ATOMIC``, see
# backend.attention_backward); timed next to the two-launch candidates (a default only where a GPU entry
# below says so). Not reproducible bit for bit (as SDPA's own flash and efficient backwards), so
# :func:`bwd_candidates` drops them under PyTorch's deterministic mode.
BWD_CONFIGS[64] += [dict(_cfg(64, 128, 8, 2), DQ_ATOMIC=1), dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=1)]
BWD_CONFIGS[128] += [dict(_cfg(64, 128, 8, 2), DQ_ATOMIC=1), dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=1)]
# ``DQ_ATOMIC=2``: the same one launch with each tile's dQ added by one TMA bulk reduction (Hopper; query
# rows in order, else per-element atomics). H100, D=64, N=16384 (the Hopper-variants benchmark, backward alone; in git history): with Q and
# dO through TMA too, 28.9 / 16.7 ms (full / causal) against 30.6 / 16.6 ms for two launches. At D=128 every
# such kernel timed was 1.4-2.2x slower than two launches (most at the register limit and spilling, see
# the benchmark notes in git history): none there.
BWD_CONFIGS[64] += [dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=2, TMA=1, TMA_Q=1), dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=2)]
BWD_CONFIGS_NM: Dict[int, List[Config]] = {
    64: [_cfg(64, 64, 4, 3), dict(_cfg(64, 128, 8, 2), DQ=(128, 64, 8, 3)),
         dict(_cfg(128, 64, 8, 2), DQ=(128, 64, 8, 3)), dict(_cfg(64, 64, 4, 3), NATURAL=0),
         dict(_cfg(64, 128, 8, 3), NATURAL=0, DQ=(128, 64, 8, 3))],
    128: [dict(_cfg(128, 64, 8, 2), DQ=(128, 64, 8, 2)), dict(_cfg(64, 128, 8, 2), NATURAL=0, DQ=(128, 64, 8, 2)),
          dict(_cfg(64, 64, 8, 3), DQ=(128, 64, 8, 2)), dict(_cfg(32, 64, 4, 2), NATURAL=0)],
    256: [_cfg(64, 64, 8, 2), _cfg(32, 64, 4, 2), _cfg(32, 32, 4, 2)],
}
# DFSS, D=64: the one-launch backward saves the dQ launch's second selection; H100, N=16384: 30.0 / 16.7 ms
# (full / causal, with Q and dO through TMA) against 38.5 / 19.8 ms for two launches. Not at D=128 (above).
BWD_CONFIGS_NM[64] += [dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=2, TMA=1, TMA_Q=1), dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=2)]
# two launches with Q and dO through TMA in the dK/dV pass (K and V of an N:M site never are: key order)
BWD_CONFIGS_NM[64] += [dict(_cfg(64, 64, 4, 3), TMA=1, TMA_Q=1)]
BWD_CONFIGS_NM[128] += [dict(_cfg(128, 64, 8, 2), DQ=(128, 64, 8, 2), TMA=1, TMA_Q=1)]


# Per-GPU defaults: the first candidate of a dense-tile kernel (no N:M selection) where tuning is off.
# Picked by ``bench kernels --sweep`` on an H100 (bf16, B=4, H=16, N=16384, D 64/128, the sum of the
# causal and non-causal times; results/sweep_h100.json, in git history); the lists' own first entries are the H200's.
# ("bwd", 128): Q and dO through TMA in the dK/dV pass, 50.0 + 28.9 ms against 53.8 + 28.6 ms without
# (results/sweep_h100_bwd128.json, a later run).
GPU_DEFAULTS: Dict[str, Dict[tuple, Config]] = {
    "h100": {("fwd", 64): _cfg(128, 64, 8, 4), ("fwd", 128): dict(_cfg(128, 128, 8, 3), TMA=1),
             ("bwd", 64): dict(_cfg(64, 64, 4, 3), TMA=1), ("bwd", 128): dict(_cfg(64, 64, 4, 2), TMA=1, TMA_Q=1)},
}
# Per-GPU defaults of the N:M (DFSS) kernels, per (kind, tier, bounded): ``bounded`` where the keys have a
# right bound (causal or a window), which changes what the tiles skip. H100, ``attention.py --sweep
# --policies dfss --dims 64 --ns 16384 --causal 0,1`` (bf16, B=4, H=16): causal forward 128x64w8s3 7.44 ms
# against the list's first (128x64w4s3) 8.14 ms; without a bound the list's first stays (13.61 against
# 14.45 ms); the list's first backward was the fastest in both. Backward (a later run, ``hopper.py``): the
# one launch with dQ by TMA bulk reductions (above), 22 % / 16 % less time; under PyTorch's deterministic
# mode it is no candidate, so the list's first (two launches) runs. D=128 (the same sweep with ``--dims
# 64,128 --passes fwd+bwd``): forward 128x128w8s3 20.44 / 10.14 ms (full / causal) against the list's first
# 24.17 / 12.48; backward without a bound with Q and dO through TMA 65.89 against 67.60 ms (causal: 34.54
# against 33.55, the list's first stays).
_NM_BWD_ONE_LAUNCH = dict(_cfg(64, 64, 4, 3), DQ_ATOMIC=2, TMA=1, TMA_Q=1)
GPU_DEFAULTS_NM: Dict[str, Dict[tuple, Config]] = {
    "h100": {("fwd", 64, True): _cfg(128, 64, 8, 3),
             ("bwd", 64, True): _NM_BWD_ONE_LAUNCH, ("bwd", 64, False): _NM_BWD_ONE_LAUNCH,
             ("fwd", 128, True): _cfg(128, 128, 8, 3), ("fwd", 128, False): _cfg(128, 128, 8, 3),
             ("bwd", 128, False): dict(_cfg(128, 64, 8, 2), DQ=(128, 64, 8, 2), TMA=1, TMA_Q=1)},
    # H200: the H100's one-launch D=64 backward, 0.75-0.79x cuDNN's dense backward against the list's first
    # 0.62-0.68x (the Gluon backward benchmark, ``--policy dfss --dims 64``, bf16, B=4, H=16, N 4096 and 16384; in git history)
    "h200": {("bwd", 64, True): _NM_BWD_ONE_LAUNCH, ("bwd", 64, False): _NM_BWD_ONE_LAUNCH},
}
# Per-GPU defaults of the forward of a sorted layout (``hash``/``drop``: key/value rows gathered through the
# permutation, so address loads only), per (kind, tier, policy). H100, ``attention.py --sweep --policies
# drop,hash --dims 64,128 --ns 16384 --causal 1 --passes fwd`` (bf16, B=4, H=16, range spans): hash 64x64w4s3
# 0.665 / 1.218 ms (D=64 / 128) against 1.212 / 1.375 for the dense defaults; drop 64x64w4s3 1.762 ms at
# D=64 (dense default 2.838), 128x128w8s3 2.955 ms at D=128 (64x64w4s3 3.353). hash at D=128 (the kernel alone,
# ``sorted_kv.py --configs``, a later run): 64x32w4s3 1.125 ms against 64x64w4s3 1.230, a candidate of sorted
# layouts only (FWD_CONFIGS_SORTED).
# ``drop+kv``: drop reading its kept keys from sorted copies (``backend.Site.kv_sorted``), whose rows in order
# TMA can read: the kernel alone (``sorted_kv.py``, copies made apart) 2.486 ms at D=128 with 64x64w4s3
# through TMA against 2.965 gathered with 128x128w8s3, 1.566 against 1.774 ms at D=64 (64x64w4s3 both).
FWD_CONFIGS_SORTED: Dict[int, List[Config]] = {128: [_cfg(64, 32, 4, 3), dict(_cfg(64, 64, 4, 3), TMA=1)]}
GPU_DEFAULTS_SORTED: Dict[str, Dict[tuple, Config]] = {
    "h100": {("fwd", 64, "hash"): _cfg(64, 64, 4, 3), ("fwd", 128, "hash"): _cfg(64, 32, 4, 3),
             ("fwd", 64, "drop"): _cfg(64, 64, 4, 3), ("fwd", 128, "drop"): _cfg(128, 128, 8, 3),
             ("fwd", 64, "drop+kv"): dict(_cfg(64, 64, 4, 3), TMA=1),
             ("fwd", 128, "drop+kv"): dict(_cfg(64, 64, 4, 3), TMA=1)},
}
# The Gluon Hopper forward (:mod:`.hopper`) of dense sites on sm_90 GPUs, per (head dim, causal):
# query tile, key tile, warps, key-ring and value-ring depth, and ``WS`` for the warp-specialised
# kernel (two consumer warp groups of ``BLOCK_M / 2`` queries and a producer warp; ``PINGPONG``: the
# consumers take turns issuing their products). From the Gluon forward benchmark (git history) on an H100 (bf16,
# B=4, H=16, N=16384; the benchmark notes, in git history, "A Gluon forward for Hopper" and "The warp-specialised
# Gluon forward"): at D=128 the warp-specialised 128x128 kernel without turns measured 0.99-1.11x /
# 1.06-1.14x cuDNN (full / causal, over the calls) against 0.87-0.94x for the one-warp-group kernel; with
# turns 1.06x / 1.09x. At D=64 three consumer warp groups (192-query tiles) measured 1.09-1.10x / 1.03-1.06x,
# two 0.91-0.97x / 0.96x, the one-warp-group kernel 0.99x / 0.96-1.01x in the same call. ``P_F32`` (two
# consumers; hopper._p_carried): the probabilities carried to the next step in 32 bits, which saves a byte permute
# per register: dense D=128 N=16384 full 1.08-1.09x against 1.00-1.04x (two H100 calls); causal 1.00-1.05x against
# 1.02-1.06x (measured while the masked steps carried 32 bits too and the kernel spilled 112 bytes), so not there.
_WS = dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=2, WS=True, PINGPONG=False)
GLUON_FWD: Dict[tuple, Config] = {
    (64, False): dict(_WS, BLOCK_M=192),
    (64, True): dict(_WS, BLOCK_M=192),
    (128, False): dict(_WS, P_F32=True),
    (128, True): _WS,
}
# DFSS 2:4 through the same kernels (hopper.py, NM; key/value tiles read as one TMA box per member and
# 128-byte column chunk). The warp-specialised kernel: D=128 0.83-0.84x / 0.84-0.89x dense cuDNN (full /
# causal, N=16384, over the calls) against 0.70-0.74x / 0.77-0.79x for the one-warp-group kernel and
# 0.67x / 0.74x for the template; D=64 (three-deep rings) 0.79-0.82x / 0.79-0.81x against the template's
# 0.69-0.70x (three consumer warp groups spill there: 0.59-0.79x). ``KEEP_PTX`` (hopper._keep24: the selection
# as compares that combine their predicates, one shared per pair of members) with ``P_F32``: at D=128 0.86-0.90x
# against 0.84-0.88x in the same call (713 against 776 SASS instructions per step); at D=64 it measured slower
# causal (0.69-0.74x against 0.69-0.81x), so not there.
GLUON_FWD_DFSS: Dict[tuple, Config] = {
    (64, False): dict(_WS, STAGES=3, V_STAGES=3),
    (64, True): dict(_WS, STAGES=3, V_STAGES=3),
    (128, False): dict(_WS, KEEP_PTX=True, P_F32=True),
    (128, True): dict(_WS, KEEP_PTX=True, P_F32=True),
}
# keys per row below which the template's forward runs instead: from 2048 keys up the Gluon kernel
# measured faster on the H100; at 1024 (D=128) 2.6x slower, before it had the short launch path
GLUON_MIN_KEYS = 2048


# Dense causal sites at D=64 with fewer queries than this: one warp group per block (2-3 blocks per SM)
# balance the causal tiles better than 192-query tiles on one block per SM: at N=4096 the warp-specialised
# kernel measured 0.85x cuDNN, the one-warp-group kernel 0.95-0.99x (H100, attention.py, two calls; at
# N=16384 1.03-1.06x against 0.96-1.01x).
GLUON_FWD_SHORT: Dict[tuple, Config] = {
    (64, True): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=2, V_STAGES=2),
}
GLUON_SHORT_QUERIES = 8192

# The Gluon backward of dense sites on sm_90 GPUs (:mod:`.hopper_bwd`), per (head dim, causal): ``WS``, the
# warp-specialised kernel (one launch: blocks of 128 keys on two consumer warp groups and a producer warp, ``WS``
# ring slots of 64-query tiles, dQ summed over the block's keys and added by TMA reductions). Where it cannot run
# (PyTorch's deterministic algorithms on: the additions' order varies; a Triton without TMA reductions) the two
# passes run: the dK/dV pass (queries per step, keys per block, ring slots), then the Gluon dQ pass ``DQ_GLUON``
# (queries per block, keys per step, ring slots; no atomics). ``DQ``: the template's dQ pass where a configuration
# names neither (queries, keys, warps, stages). ``DQ_ATOMIC`` (dQ added in the dK/dV pass by TMA reductions) is an
# option, not a default. From the Gluon backward benchmark (git history) on an H100 (bf16, B=4, H=16, N 4096 and 16384, medians
# of 2 rounds in turn; in git history), the whole backward against cuDNN's:
# * the warp-specialised kernel, two slots: D=64 0.89-0.95x (full) and 0.92-1.00x (causal); D=128 0.88-0.99x and
#   0.89-0.96x; three slots 0.80-0.94x;
# * the two Gluon passes: D=64 0.82-0.88x (full) and 0.83-0.95x (causal); D=128 0.82-0.87x and 0.82-0.92x;
# * the Gluon dK/dV pass then the template's dQ pass: D=64 0.75-0.84x / 0.81-0.90x, D=128 0.79-0.85x / 0.75-0.84x;
# * dQ added in the dK/dV pass (three slots): D=64 0.81-0.83x / 0.83-0.94x; at D=128 it spills and fits one block
#   per SM (0.51-0.73x);
# * the template's backward: D=64 0.73-0.83x / 0.70-0.81x, D=128 0.80-0.85x / 0.68-0.76x.
GLUON_BWD: Dict[tuple, Config] = {
    (d, causal): dict(KERNEL="gluon", BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4, num_stages=3,
                      DQ=[64, 64, 4, 3] if d == 64 else [128, 64, 8, 3], DQ_GLUON=[64, 64, 2], WS=2)
    for d in (64, 128) for causal in (False, True)
}


# DFSS 2:4 through the warp-specialised backward (hopper_bwd, ``NM``: key rows read so that each group's members
# sit in a thread and its ``lane ^ 4`` partner); the two passes have no selection, so where the kernel cannot
# run (PyTorch's deterministic algorithms) the template's backward does. From the Gluon backward benchmark (git history,
# ``--policy dfss``) (bf16, B=4, H=16, N 4096 and 16384, medians of 2 rounds; in git history), the backward against
# cuDNN's dense backward, the kernel / the template's:
# * D=128 full: 0.72-0.77 / 0.61-0.64 (H100), 0.76-0.78 / 0.65 (H200);
# * D=128 causal: 0.69-0.70 / 0.61-0.67 (H100), 0.70-0.72 / 0.62-0.67 (H200);
# * D=64: 0.66-0.70 / 0.75-0.81 (H100 and H200, the template's one-launch GPU_DEFAULTS_NM backward): not a default.
# With each thread deciding its own two members (hopper_bwd._keep_pair; one H100 call, the previous selection in a
# second process): D=128 0.86-0.87 full, 0.84-0.85 causal; D=64 0.75-0.78 against the template's 0.75-0.78: still
# not a default there.
GLUON_BWD_DFSS: Dict[tuple, Config] = {(128, causal): dict(GLUON_BWD[(128, causal)])
                                        for causal in (False, True)}


def gluon_config(D: int, causal: bool, nm24: bool, n_q: Optional[int] = None) -> Optional[Config]:
    """The Gluon forward's default configuration for a dense (or, with ``nm24``, DFSS 2:4) site of head
    dim ``D`` and ``n_q`` queries (``GLUON_FWD_SHORT`` below ``GLUON_SHORT_QUERIES``), or ``None`` where
    the template keeps such sites."""
    if not nm24 and n_q is not None and n_q < GLUON_SHORT_QUERIES:
        short = GLUON_FWD_SHORT.get((D, causal))
        if short is not None:
            return short
    return (GLUON_FWD_DFSS if nm24 else GLUON_FWD).get((D, causal))


def gluon_enabled() -> bool:
    """Whether dense and DFSS forwards on sm_90 may run the Gluon kernel (``ATTNCOMP_GLUON=0`` turns it
    off)."""
    return env.get("ATTNCOMP_GLUON", "1") != "0"


#: queries from which a ``drop`` forward reads its kept keys from sorted copies (``Layout.kv``, written by
#: the counting sort's scatter launch): each key tile is then read by many query tiles, which the copy's
#: one extra read and write of the kept rows must pay for. A bound chosen, not measured: decode steps
#: (one query tile) stay on the gather
SORTED_KV_MIN_Q = 1024


def sorted_kv_enabled(nq: int) -> bool:
    """Whether a ``drop`` forward of ``nq`` queries reads sorted K/V copies (``ATTNCOMP_SORTED_KV=0`` turns
    them off; ``bench kernels`` measures the default)."""
    return nq >= SORTED_KV_MIN_Q and env.get("ATTNCOMP_SORTED_KV", "1") != "0"


_GPU_TAGS: Dict[int, str] = {}


def gpu_tag(device: torch.device) -> str:
    """``"h100"``, ``"h200"`` or ``""``: the key of :data:`GPU_DEFAULTS` for ``device`` (cached)."""
    if device.type != "cuda" or interpret_mode():
        return ""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    tag = _GPU_TAGS.get(idx)
    if tag is None:
        name = torch.cuda.get_device_name(idx).lower()
        tag = _GPU_TAGS[idx] = next((g for g in ("h100", "h200") if g in name), "")
    return tag


def _gpu_first(cands: List[Config], kind: str, tier: int, nm_m: int, gpu: str, bounded: bool,
               layout: str = "") -> List[Config]:
    if layout and (kind, tier, layout) in GPU_DEFAULTS_SORTED.get(gpu, {}):
        first = GPU_DEFAULTS_SORTED[gpu][(kind, tier, layout)]
    elif nm_m <= 1:
        first = GPU_DEFAULTS.get(gpu, {}).get((kind, tier))
    else:
        first = GPU_DEFAULTS_NM.get(gpu, {}).get((kind, tier, bool(bounded)))
    if first is None or first not in cands:
        return cands
    return [first] + [c for c in cands if c != first]


def _tier(d: int, dv: int) -> int:
    b = max(d, dv)
    return 64 if b <= 64 else (128 if b <= 128 else 256)


def _keys_ok(block_n: int, nm_m: int) -> bool:
    return block_n % max(8, 4 * nm_m) == 0


def _smem_ok(cfg: Config, d: int, dv: int, itemsize: int, limit: int = 227 * 1024) -> bool:
    # K and V tiles of every pipeline stage plus the query tile (Hopper: 227 KiB per block)
    bm, bn, st = cfg["BLOCK_M"], cfg["BLOCK_N"], max(1, cfg["num_stages"])
    return (st * bn * (d + dv) + bm * max(d, dv)) * itemsize <= limit


def interpret_config(nm_m: int) -> Config:
    """The one configuration used under the interpreter: small tiles that still hold whole groups."""
    b = max(16, 4 * nm_m)
    return _cfg(b, b, 1, 1)


def _block_first(cands: List[Config], block: int) -> List[Config]:
    """With a SPION block size, the configurations whose tiles lie inside one block first: a tile
    pair then sits in one block of the pattern, so the schedule visits only kept blocks and the
    kernels skip the per-logit membership test (a larger tile visits the union of its blocks)."""
    if block <= 0:
        return cands

    def spans(c: Config) -> bool:
        qm, qn = (c.get("DQ") or (c["BLOCK_M"], c["BLOCK_N"]))[:2]
        return max(c["BLOCK_M"], c["BLOCK_N"], qm, qn) > block

    return sorted(cands, key=spans)


def fwd_candidates(d: int, dv: int, dtype: torch.dtype, nm_m: int, block: int = 0, gpu: str = "",
                   bounded: bool = False, layout: str = "") -> List[Config]:
    """Forward configurations for head dims ``d``/``dv``, N:M group size ``nm_m`` (1: none), SPION
    block size ``block`` (0: none), GPU (:func:`gpu_tag`), whether the keys have a right bound
    (``bounded``: causal or a window) and the policy of a sorted layout (``layout``: ``"hash"``, ``"drop"``
    or ``"drop+kv"`` (:attr:`.backend.Site.tag`), else ``""``), the default first."""
    if interpret_mode():
        return [interpret_config(nm_m)]
    pool = (FWD_CONFIGS_NM if nm_m > 1 else FWD_CONFIGS)[_tier(d, dv)]
    if layout:
        pool = pool + FWD_CONFIGS_SORTED.get(_tier(d, dv), [])
    item = torch.tensor([], dtype=dtype).element_size()
    out = [c for c in pool if _keys_ok(c["BLOCK_N"], nm_m) and _smem_ok(c, d, dv, item)]
    if not out:  # large groups (M = 16) need 64-key tiles even at large head dims
        out = [_cfg(64, max(64, 4 * nm_m), 4, 1)]
    if dtype == torch.float32:  # 4-byte tiles: halve the key tile
        out = [c for c in out if c["BLOCK_N"] <= 64 and c["BLOCK_M"] <= 128] or out
    return _block_first(_gpu_first(out, "fwd", _tier(d, dv), nm_m, gpu, bounded, layout), block)


def bwd_candidates(d: int, dv: int, dtype: torch.dtype, nm_m: int, block: int = 0, gpu: str = "",
                   bounded: bool = False, layout: str = "") -> List[Config]:
    """Backward configurations, as :func:`fwd_candidates`; while PyTorch's deterministic algorithms are
    enabled, without the ``DQ_ATOMIC`` ones (float32 atomics add dQ in a varying order)."""
    if interpret_mode():
        return [interpret_config(nm_m)]
    pool = (BWD_CONFIGS_NM if nm_m > 1 else BWD_CONFIGS)[_tier(d, dv)]
    if torch.are_deterministic_algorithms_enabled():
        pool = [c for c in pool if not c.get("DQ_ATOMIC")]
    # key tiles: BLOCK_N of the dK/dV kernel, and the dQ kernel's (its DQ entry, else BLOCK_M)
    out = [c for c in pool if _keys_ok(c["BLOCK_N"], nm_m) and _keys_ok((c.get("DQ") or (0, c["BLOCK_M"]))[1], nm_m)]
    if not out:
        out = [_cfg(max(64, 4 * nm_m), max(64, 4 * nm_m), 4, 1)]
    if dtype == torch.float32:
        out = [c for c in out if c["BLOCK_N"] <= 64] or out
    return _block_first(_gpu_first(out, "bwd", _tier(d, dv), nm_m, gpu, bounded, layout), block)


# choices made in this process: a call after the first costs one dict lookup, not a store lookup
_chosen: Dict[str, Config] = {}


def choose(name: str, key: dict, candidates: List[Config], bench: Optional[Callable[[Config], float]]) -> Config:
    """Pick a configuration: the persistent tuning store's choice, timed now only where measuring is allowed."""
    if len(candidates) == 1 or bench is None or interpret_mode():
        return candidates[0]
    if env.get("ATTNCOMP_TRITON_TUNE", "1") == "0":
        return candidates[0]
    measure = env.measuring_allowed()  # else a choice stored on disk, or the default: no timing
    memo = json.dumps([name, key, candidates, os.environ.get("ATTNCOMP_CACHE_DIR", ""), measure], sort_keys=True,
                      default=str)
    if memo in _chosen:
        return _chosen[memo]
    try:
        from ...runtime.autotune import tune
    except ImportError:
        return candidates[0]
    try:
        best = dict(tune(name, key, candidates, bench, measure=measure))
    except Exception as e:  # a broken store must not break attention: fall back to the default
        log.warning("autotuning %s failed (%s); using the default configuration", name, e)
        return candidates[0]
    _chosen[memo] = best
    return best
