"""Sparsification policies: frozen, hashable descriptions of which attention entries are kept.

A policy never computes attention itself. It says which of the *allowed* entries (DESIGN.md §4) are
kept; backends implement that rule, and ``attncomp/codegen/reference.py`` is its exact statement.
Policies are part of every :class:`~attncomp.spec.AttentionSpec` and so of every cache key.

Per-token auxiliary tensors (hash buckets, keep masks) are either given by the caller or derived
here with counter-based hashing in plain integer tensor arithmetic, so that every backend and every
device (CPU, CUDA, a Triton kernel) derives bit-identical values from the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Type, Union

import torch

__all__ = [
    "Policy",
    "Dense",
    "DFSS",
    "Hash",
    "Drop",
    "SPION",
    "ET",
    "POLICIES",
    "get_policy",
    "uniform_hash",
    "lsh_buckets",
    "lsh_side",
    "keep_mask",
]

_VALID_M = (2, 4, 8, 16)
_VALID_BLOCK = (16, 32, 64, 128)


@dataclass(frozen=True)
class Policy:
    """Base class. ``name`` is the registry key; subclasses validate their parameters."""

    name: ClassVar[str] = "base"
    #: tensors the policy consumes, by op argument name
    aux: ClassVar[Tuple[str, ...]] = ()

    def params(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, **self.params()}

    def describe(self) -> str:
        p = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({p})" if p else self.name

    def resolved(self, dtype: torch.dtype) -> "Policy":
        """The policy with dtype-dependent defaults filled in."""
        return self

    def keeps_all(self) -> bool:
        """Whether the policy keeps every allowed entry whatever the tensors hold (exact attention):
        such sites may run any exact attention kernel, SDPA's included."""
        return False

    def reads_key_index(self) -> bool:
        """Whether the keep rule depends on where a key sits among the keys (its index), not only on
        the logits and the tokens' contents: N:M groups counted from key 0, keep draws per position, a
        block pattern, a query's own key. A KV cache that drops the keys before a sliding window shifts those
        indices, so a decoding step over it would not compute the full forward's rows."""
        return False


@dataclass(frozen=True)
class Dense(Policy):
    """Keep every allowed entry: exact attention."""

    name: ClassVar[str] = "dense"

    def keeps_all(self) -> bool:
        return True


@dataclass(frozen=True)
class DFSS(Policy):
    """N:M pruning of the logits per query row (DFSS, seed 000).

    Keys are split into groups of ``m`` consecutive keys from key 0 (a last partial group counts);
    within a group, among the allowed keys, the ``n`` largest logits are kept, ties keeping the lower
    key index. ``None`` means 2:4 for fp16/bf16 and 1:2 for fp32/fp64.
    """

    name: ClassVar[str] = "dfss"
    n: Optional[int] = None
    m: Optional[int] = None

    def __post_init__(self):
        if (self.n is None) != (self.m is None):
            raise ValueError(f"DFSS needs both n and m or neither (got n={self.n}, m={self.m})")
        if self.m is not None:
            if not isinstance(self.m, int) or self.m not in _VALID_M:
                raise ValueError(f"DFSS m must be one of {_VALID_M}, got {self.m!r}")
            if not isinstance(self.n, int) or not 1 <= self.n < self.m:
                raise ValueError(f"DFSS n must satisfy 1 <= n < m={self.m}, got {self.n!r}")

    def reads_key_index(self) -> bool:
        return True

    def resolved(self, dtype: torch.dtype) -> "DFSS":
        if self.m is not None:
            return self
        if dtype in (torch.float16, torch.bfloat16):
            return DFSS(2, 4)
        return DFSS(1, 2)


@dataclass(frozen=True)
class Hash(Policy):
    """Keep (i, j) iff query i and key j fall in the same hash bucket (SCFA, seed 002).

    Buckets come from the caller (``q_buckets``/``k_buckets``) or from angular LSH with one random
    rotation per KV head, shared by its queries and keys, fixed by ``seed``.
    """

    name: ClassVar[str] = "hash"
    aux: ClassVar[Tuple[str, ...]] = ("q_buckets", "k_buckets")
    n_buckets: int = 16
    exclude_self: bool = False
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.n_buckets, int) or self.n_buckets < 2 or self.n_buckets % 2:
            raise ValueError(f"Hash n_buckets must be an even integer >= 2, got {self.n_buckets!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"Hash seed must be an int, got {self.seed!r}")

    def reads_key_index(self) -> bool:
        return self.exclude_self  # buckets come from the contents; only j != i reads an index


@dataclass(frozen=True)
class Drop(Policy):
    """Keep (i, j) iff query i and key j are both kept (SCFA's QK-drop, seed 002).

    Keep masks come from the caller (``q_keep``/``k_keep``) or are drawn per call with drop rates
    ``q_rate``/``k_rate`` from ``seed`` (a new draw every training step, reproducible).
    """

    name: ClassVar[str] = "drop"
    aux: ClassVar[Tuple[str, ...]] = ("q_keep", "k_keep")
    q_rate: float = 0.5
    k_rate: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for nm in ("q_rate", "k_rate"):
            r = getattr(self, nm)
            if not isinstance(r, (int, float)) or not 0.0 <= float(r) < 1.0:
                raise ValueError(f"Drop {nm} must be in [0, 1), got {r!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"Drop seed must be an int, got {self.seed!r}")

    def reads_key_index(self) -> bool:
        return True


@dataclass(frozen=True)
class SPION(Policy):
    """Block-sparse attention with a block pattern per layer (SPION, seed 003).

    ``block_pattern`` of shape ``(Hq or 1, ceil(Nq/Bs), ceil(Nk/Bs))`` keeps block (i//Bs, j//Bs);
    diagonal blocks are always kept. Without a given pattern the flood fill derives one.

    Pattern generation and the training procedure (:mod:`attncomp.spion`): ``variant`` ``"spion"``
    (filter + flood fill), ``"spion-f"`` (no filter) or ``"spion-c"`` (filter + top blocks, ``density``
    the fraction kept); ``alpha``: the transition threshold of Alg. 2 (``None``: switch only through
    ``attncomp.spion.calibrate``/``set_patterns``), tested every ``interval`` training steps (the
    "epoch" of Alg. 2: its maps are averaged); ``per_head``: one pattern per query head.
    """

    name: ClassVar[str] = "spion"
    aux: ClassVar[Tuple[str, ...]] = ("block_pattern",)
    block_size: int = 64
    filter_size: int = 31
    threshold: float = 0.9
    variant: str = "spion"
    density: Optional[float] = None
    alpha: Optional[float] = None
    per_head: bool = False
    interval: int = 50

    def __post_init__(self):
        if self.block_size not in _VALID_BLOCK:
            raise ValueError(f"SPION block_size must be one of {_VALID_BLOCK}, got {self.block_size!r}")
        if not isinstance(self.filter_size, int) or self.filter_size < 1 or self.filter_size % 2 == 0:
            raise ValueError(f"SPION filter_size must be a positive odd int, got {self.filter_size!r}")
        if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool) \
                or not 0.0 < float(self.threshold) < 1.0:
            raise ValueError(f"SPION threshold must be in (0, 1), got {self.threshold!r}")
        if self.variant not in ("spion", "spion-c", "spion-f"):
            raise ValueError(f"SPION variant must be one of ('spion', 'spion-c', 'spion-f'), got {self.variant!r}")
        if self.density is not None and (isinstance(self.density, bool) or not isinstance(self.density, (int, float))
                                         or not 0.0 < float(self.density) <= 1.0):
            raise ValueError(f"SPION density must be in (0, 1] or None, got {self.density!r}")
        if self.variant == "spion-c" and self.density is None:
            raise ValueError("SPION variant 'spion-c' needs density (the fraction of blocks kept)")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or float(self.alpha) <= 0.0):
            raise ValueError(f"SPION alpha must be a positive number or None, got {self.alpha!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"SPION per_head must be a bool, got {self.per_head!r}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"SPION interval must be a positive int, got {self.interval!r}")

    def reads_key_index(self) -> bool:
        return True


@dataclass(frozen=True)
class ET(Policy):
    """Dense attention with the E.T. rewrites (seed 004): scale reordering and W_V·W_O folding.

    ``fold_wv_wo``: ``"auto"`` lets the cost model decide, ``True`` forces, ``False`` forbids.
    """

    name: ClassVar[str] = "et"
    reorder_scale: bool = True
    fold_wv_wo: Union[bool, str] = "auto"

    def keeps_all(self) -> bool:
        return True

    def __post_init__(self):
        if self.fold_wv_wo not in (True, False, "auto"):
            raise ValueError(f"ET fold_wv_wo must be True, False or 'auto', got {self.fold_wv_wo!r}")
        if not isinstance(self.reorder_scale, bool):
            raise ValueError(f"ET reorder_scale must be a bool, got {self.reorder_scale!r}")


POLICIES: Dict[str, Type[Policy]] = {c.name: c for c in (Dense, DFSS, Hash, Drop, SPION, ET)}


def get_policy(policy: Union[str, Policy, None] = "dense", **params) -> Policy:
    """Map a name (``"dense"``, ``"dfss"``, ``"hash"``, ``"drop"``, ``"spion"``, ``"et"``) or a
    :class:`Policy` instance to a policy. Extra keyword arguments become the policy's parameters."""
    if policy is None:
        policy = "dense"
    if isinstance(policy, Policy):
        if not params:
            return policy
        try:
            return dataclasses.replace(policy, **params)
        except TypeError as e:
            fields = [f.name for f in dataclasses.fields(policy)]
            raise ValueError(f"bad parameters for policy {policy.name!r}: {e}; valid parameters: {fields}") from None
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[policy.lower()]
    try:
        return cls(**params)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(cls)]
        raise ValueError(f"bad parameters for policy {cls.name!r}: {e}; valid parameters: {fields}") from None


def policy_from_json(d: Dict[str, Any]) -> Policy:
    d = dict(d)
    return get_policy(d.pop("name"), **d)


# ---------------------------------------------------------------------------------------------
# Counter-based randomness shared by every backend.

_M32 = 0xFFFFFFFF


def seed_mix(seed: int) -> int:
    """The 32-bit word a seed enters :func:`uniform_hash` as (every backend's kernels take it)."""
    return (int(seed) * 0x9E3779B1 + 0x7F4A7C15) & _M32


def uniform_hash(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from a 32-bit integer hash of ``(seed, index)``.

    Only 32-bit wrapping multiply, xor and shift are used (emulated here in int64 and masked), so a
    Triton kernel computing the same formula on uint32 gets the same bits. ``index`` is int64; its low
    32 bits are used.
    """
    x = (index.to(torch.int64) & _M32) ^ seed_mix(seed)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x27D4EB2F) & _M32
    x = x ^ (x >> 15)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


#: the hash index of token ``pos`` of row ``b * H + h`` is ``row * KEEP_ROW_STRIDE + pos``: a draw depends
#: on the token's absolute position, not on the length of the call (decoding with a KV cache keeps or
#: drops a key the same way at every step); distinct for rows below 65536 and positions below 65537
KEEP_ROW_STRIDE = 65537


def keep_mask(shape: Tuple[int, int, int], rate: float, seed: int, stream: int, device=None,
              offset: int = 0) -> torch.Tensor:
    """Bool ``(B, H, N)`` keep mask: each token kept with probability ``1 - rate``, decided by a hash
    of ``(seed, stream, b * H + h, offset + n)`` (``offset``: the absolute position of token 0).

    ``stream`` separates the query draw (0) from the key draw (1) under one seed.
    """
    B, H, N = shape
    pos = torch.arange(N, device=device, dtype=torch.int64) + offset
    rows = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1)
    idx = rows * KEEP_ROW_STRIDE + pos
    # keep draws use their own stream of seeds (odd multipliers), disjoint from dropout's plain seeds
    u = uniform_hash(_stream_seed(seed, stream), idx)
    return u >= rate


def _stream_seed(seed: int, stream: int) -> int:
    return (int(seed) * 0x2545F491 + 0x6A09E667 * (stream + 1)) & 0xFFFFFFFF


@functools.lru_cache(maxsize=256)
def _rotation(head_dim: int, n_buckets: int, n_heads: int, seed: int, device, dtype) -> torch.Tensor:
    # cached per device: built once on the host and copied, never per call
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    r = torch.randn(n_heads, head_dim, n_buckets // 2, generator=g, dtype=torch.float64)
    return r.to(device=device, dtype=dtype)


def lsh_side(x: torch.Tensor, kv_heads: int, n_buckets: int, seed: int) -> torch.Tensor:
    """Angular LSH buckets of one side's vectors ``x`` ``(B, H, N, D)``: ``argmax([xR, -xR])`` of the
    L2-normalised vectors, with the rotation ``R`` of the KV head each of the ``H`` heads belongs to (``H //
    kv_heads`` heads per KV head). A vector's bucket depends on the vector alone. Returns int32 ``(B, H, N)``."""
    H, D = x.shape[1], x.shape[-1]
    ct = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    rot = _rotation(D, n_buckets, kv_heads, seed, x.device, ct)
    if H != kv_heads:
        rot = rot.repeat_interleave(H // kv_heads, dim=0)
    xr = torch.einsum("bhnd,hdc->bhnc", torch.nn.functional.normalize(x.to(ct), dim=-1), rot)
    return torch.cat([xr, -xr], dim=-1).argmax(dim=-1).to(torch.int32)


def lsh_buckets(q: torch.Tensor, k: torch.Tensor, n_buckets: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Angular LSH buckets (:func:`lsh_side`): one rotation per KV head shared by the queries of its group and
    its keys. Returns int32 ``(B, Hq, Nq)`` and ``(B, Hk, Nk)``."""
    Hk = k.shape[1]
    return lsh_side(q, Hk, n_buckets, seed), lsh_side(k, Hk, n_buckets, seed)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
