"""Context-parallel (ring) attention over ``torch.distributed``.

Each rank of a process group holds a shard of the sequence (dim 2 of q, k, v) and gets back its
shard of the output. K/V shards rotate around the ring with point-to-point sends (started before
the block that uses the current shard is computed, so transfer overlaps compute); every block is one
call of ``attncomp::attention``, and the partial outputs of a query shard merge exactly by
log-sum-exp (the op returns ``lse`` per query row)::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The merged output and ``lse`` accumulate in the op's ``lse`` dtype (:func:`~attncomp.opspec.lse_dtype`:
float64 for float64 inputs, else float32), each merge in the widest dtype of its operands, and the
backward recomputes in float64 from them for float64 inputs: a float64 ring equals a single-process
float64 call to float64 rounding.

The backward (:class:`_RingAttention`) rotates K/V once more, with the dK/dV accumulators of each
K/V shard travelling with it (FlashAttention-2 style: every block's probabilities are recomputed
from the *global* ``lse`` and ``delta = rowsum(dO * O)`` of the merged output), so no rank ever
holds more than two K/V shards or anything ``N x N`` beyond one block.

Layouts (``N`` total positions, ``W`` ranks, ``n = N / W`` per rank):

* ``"contiguous"``: rank ``r`` holds positions ``[r n, (r+1) n)``;
* ``"balanced"``: the sequence is cut into ``2W`` chunks of ``c = n / 2``; rank ``r`` holds chunk
  ``r`` then chunk ``2W - 1 - r`` (head and tail), so that under ``is_causal`` every rank computes the
  same number of blocks.

Under ``is_causal`` blocks entirely above the diagonal are skipped: with ``"balanced"`` each rank
computes one diagonal block and then ``W - 1`` half blocks.

Policies: ``dense`` (and ``et``, dense attention), ``dfss`` (key groups of ``M`` start at key 0
of the sequence; shards, or chunks for ``"balanced"``, must be multiples of ``M`` so that no group
straddles a shard boundary), ``hash`` (buckets are per token: given shards, or angular LSH computed on
the shard, which equals the global LSH; ``exclude_self`` applies to the block where a rank meets its
own keys) and ``drop`` (keep masks are sharded like the sequence: given shards, or drawn from
``draw_seed``, default the policy's seed, over the *global* sequence and sliced, so the draw equals a
single-process call's).
``spion`` is refused: its block pattern and diagonal rule are indexed by global tiles, which the per
block op calls do not see.

``torch.distributed.tensor.experimental.context_parallel`` cannot dispatch to ``attncomp::attention``:
it monkey-patches ``torch.nn.functional.scaled_dot_product_attention`` to wrap q, k, v as sequence-sharded
DTensors and handles only ATen's SDPA kernels (flash, efficient, cuDNN) in its DTensor dispatch table. A
graph compiled by attncomp calls ``attncomp::attention`` on plain local tensors, so under that context
manager the op would compute shard-local attention. Call :func:`context_parallel_attention` in the
model instead (its output is the same function of the sequence as the op's); it runs eagerly
(``torch.compiler.disable``), so a model calling it can still be compiled, the ring running between
the compiled regions.

Data parallelism needs one thing from ``attncomp.compile``: after the call it makes on
``example_inputs`` (a forward that no backward follows), :func:`_restore_fsdp` puts ``fully_shard``-ed
modules back between iterations, their sharded parameters registered again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .opspec import lse_dtype
from .policy import DFSS, Drop, Hash, get_policy, keep_mask, lsh_buckets
from .spec import AttentionSpec, dtype_name

__all__ = ["context_parallel_attention", "shard_sequence", "gather_sequence", "sequence_positions", "LAYOUTS"]

LAYOUTS = ("contiguous", "balanced")
_POLICIES = ("dense", "et", "dfss", "hash", "drop")
_POLICY_TENSORS = {"hash": ("q_buckets", "k_buckets"), "drop": ("q_keep", "k_keep")}


# ---------------------------------------------------------------------------------------------
# Layouts: which global positions a rank holds.

def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")


def _segments(n_local: int, rank: int, world: int, layout: str) -> List[Tuple[int, int]]:
    """The ``(start, length)`` position ranges of rank ``rank``'s shard, in shard order."""
    _check_layout(layout)
    if layout == "contiguous":
        return [(rank * n_local, n_local)]
    if n_local % 2:
        raise ValueError(f"layout 'balanced' needs an even shard length (two chunks per rank), got {n_local}")
    c = n_local // 2
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def sequence_positions(n_local: int, rank: int, world: int, layout: str = "contiguous", device=None) -> Tensor:
    """Global positions (int64 ``(n_local,)``) of the tokens rank ``rank`` holds under ``layout``."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in _segments(n_local, rank, world, layout)])


def shard_sequence(x: Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 2) -> Tensor:
    """Rank ``rank``'s shard of the full tensor ``x`` along ``dim`` (length divisible by ``world``,
    or by ``2 * world`` for ``"balanced"``)."""
    _check_layout(layout)
    n = x.shape[dim]
    parts = world * (2 if layout == "balanced" else 1)
    if n % parts:
        raise ValueError(f"sequence length {n} must be divisible by {parts} for layout {layout!r} over {world} ranks")
    segs = _segments(n // world, rank, world, layout)
    return torch.cat([x.narrow(dim, s, m) for s, m in segs], dim=dim)


def gather_sequence(x: Tensor, group=None, layout: str = "contiguous", dim: int = 2) -> Tensor:
    """The full tensor from every rank's shard along ``dim`` (an all-gather, then positions put back
    in order). Not differentiable."""
    world, rank, _ = _group_info(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    n = x.shape[dim]
    full = [None] * (world * (2 if layout == "balanced" else 1))
    for r, p in enumerate(parts):
        off = 0
        for s, m in _segments(n, r, world, layout):
            full[s // m] = p.narrow(dim, off, m)
            off += m
    return torch.cat(full, dim=dim)


# ---------------------------------------------------------------------------------------------
# Process group and ring communication.

def _group_info(group) -> Tuple[int, int, List[int]]:
    """``(world, rank, global ranks of the group's members)``; a single process without an
    initialised default group counts as a group of one."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0, [0]
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    members = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    return world, rank, members


class _Ring:
    """Send tensors to the next rank and receive the previous rank's, asynchronously."""

    def __init__(self, group, world: int, rank: int, members: List[int]):
        self.group = group
        self.next = members[(rank + 1) % world]
        self.prev = members[(rank - 1) % world]

    def start(self, tensors: List[Tensor]):
        sends = [_wire(t) for t in tensors]
        recvs = [torch.empty_like(s) for s in sends]
        ops = [dist.P2POp(dist.isend, s, self.next, self.group) for s in sends]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recvs]
        reqs = dist.batch_isend_irecv(ops)
        return _Pending(reqs, recvs, [t.dtype for t in tensors], sends)


class _Pending:
    def __init__(self, reqs, recvs, dtypes, sends):
        self.reqs, self.recvs, self.dtypes = reqs, recvs, dtypes
        self._sends = sends  # kept alive until the transfer completes

    def wait(self) -> List[Tensor]:
        for r in self.reqs:
            r.wait()
        self._sends = None
        return [r.to(d) if r.dtype != d else r for r, d in zip(self.recvs, self.dtypes)]


def _wire(t: Tensor) -> Tensor:
    # bool tensors travel as uint8 (not every backend sends bool)
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()


# ---------------------------------------------------------------------------------------------
# Block schedule.

@dataclass(frozen=True)
class _Block:
    q: slice       # rows of the local query shard
    k: slice       # rows of the K/V shard held at this step
    causal: bool   # top-left causal inside the block (the local diagonal block)
    same: bool     # the K/V shard is this rank's own (local index i == j means the same position)


_ALL = slice(None)


def _plan(rank: int, src: int, n: int, layout: str, causal: bool) -> List[_Block]:
    """The op calls rank ``rank`` makes against the K/V shard of rank ``src``."""
    same = src == rank
    if not causal:
        return [_Block(_ALL, _ALL, False, same)]
    if same:
        # positions increase along every shard in both layouts: local top-left causal is exact
        return [_Block(_ALL, _ALL, True, True)]
    if layout == "contiguous":
        return [_Block(_ALL, _ALL, False, False)] if src < rank else []
    h = n // 2
    if src < rank:  # its head chunk precedes both of ours, its tail chunk follows both
        return [_Block(_ALL, slice(0, h), False, False)]
    return [_Block(slice(h, n), _ALL, False, False)]  # only our tail chunk sees its two chunks


@dataclass(frozen=True)
class _Config:
    spec: AttentionSpec
    layout: str
    causal: bool
    group: object
    world: int
    rank: int
    members: Tuple[int, ...]

    def block_spec(self, b: _Block) -> AttentionSpec:
        s = self.spec.replace(causal=b.causal)
        pol = s.policy
        if isinstance(pol, Hash) and pol.exclude_self and not b.same:
            s = s.replace(policy=get_policy(pol, exclude_self=False))
        return s


def _aux_slice(t: Optional[Tensor], sl: slice) -> Optional[Tensor]:
    return None if t is None else t[:, :, sl]


# ---------------------------------------------------------------------------------------------
# One block: forward through the op, backward from the global lse.

def _no_preds() -> tuple:
    """``None`` for the op's optional predicate tensors (``q_pos`` ... ``k_valid``), as many as its
    schema has: the blocks here need none (their causal structure is top-left or absent)."""
    names = [a.name for a in torch.ops.attncomp.attention.default._schema.arguments]
    return (None,) * sum(n in names for n in ("q_pos", "k_pos", "q_seg", "k_seg", "q_valid", "k_valid"))


def _block_forward(spec: AttentionSpec, q, k, v, q_aux, k_aux):
    return torch.ops.attncomp.attention(q, k, v, None, q_aux, k_aux, None, *_no_preds(), spec.to_json(), 0.0, 0)


#: backends whose backward recomputes each probability from the ``lse`` it is given and takes
#: ``delta`` from the ``out`` it is given (FlashAttention-2 style): given the global ones, they return
#: a block's share of the global gradient
_LSE_BACKWARDS = ("triton",)


def _flash_device(q: Tensor) -> bool:
    # on a CPU the exact formula is used (Triton runs there only through its interpreter)
    return q.is_cuda


def _lse_backend(spec: AttentionSpec, q, k, v) -> Optional[str]:
    """The flash-style backend that can run this block's backward, or ``None``."""
    if not _flash_device(q):
        return None
    from .codegen import get_backend

    for name in ([spec.backend] if spec.backend != "auto" else []) + list(_LSE_BACKWARDS):
        if name not in _LSE_BACKWARDS:
            continue
        try:
            be = get_backend(name)
            if be.supports(spec, q) is None:
                return name
        except Exception:  # not installed, or cannot run here: the exact formula below runs instead
            continue
    return None


def _block_backward(spec: AttentionSpec, q, k, v, q_aux, k_aux, out, lse, dout):
    """``(dq, dk, dv)`` of one block's share of the global attention: probabilities
    ``exp(s - lse)`` with the global ``lse`` of each query row, ``delta = rowsum(dO * O)`` of the
    merged output. On a GPU a flash-style backend (:data:`_LSE_BACKWARDS`) runs it through
    ``attncomp::attention_backward``; elsewhere (the reference and SDPA backends recompute a
    block-local softmax in their backward) the same formula runs here on the reference's logits and
    keep rule, so the policy's selection is exactly the reference's."""
    name = _lse_backend(spec, q, k, v)
    if name is not None:  # (float16/bfloat16/float32 inputs only: its lse is float32)
        dq, dk, dv, _ = torch.ops.attncomp.attention_backward(
            dout.contiguous(), q, k, v, None, q_aux, k_aux, None, *_no_preds(), out.contiguous(),
            lse.float().contiguous(), spec.replace(backend=name).to_json(), 0.0, 0, False)
        return dq, dk, dv
    return _formula_backward(spec, q, k, v, q_aux, k_aux, out, lse, dout)


#: most logits (batch x heads x rows x keys) the exact block backward holds at once: rows are
#: processed in chunks under it
_BWD_CHUNK_ELEMS = 1 << 26


def _formula_backward(spec: AttentionSpec, q, k, v, q_aux, k_aux, out, lse, dout):
    from .codegen import reference as ref

    B, Hq, nq, _ = q.shape
    Hk, nk = k.shape[1], k.shape[2]
    ct = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    pol = spec.policy
    no_self = isinstance(pol, Hash) and pol.exclude_self
    # the keep rule on chunks of rows: causality and self-exclusion by global row index here
    rule = spec.replace(causal=False, policy=get_policy(pol, exclude_self=False) if no_self else pol)
    kk = (k.repeat_interleave(Hq // Hk, dim=1) if Hq != Hk else k).to(ct)
    vv = (v.repeat_interleave(Hq // Hk, dim=1) if Hq != Hk else v).to(ct)
    dq = torch.empty(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(kk.shape, dtype=ct, device=q.device)
    dv = torch.zeros(vv.shape, dtype=ct, device=q.device)
    rows = max(1, min(nq, _BWD_CHUNK_ELEMS // max(1, B * Hq * nk)))
    j = torch.arange(nk, device=q.device)[None, :]
    for a in range(0, nq, rows):
        b = min(nq, a + rows)
        qc = q[:, :, a:b].to(ct)
        s = torch.matmul(qc, kk.transpose(-1, -2)) * scale
        i = torch.arange(a, b, device=q.device)[:, None]
        allowed = torch.ones((b - a, nk), dtype=torch.bool, device=q.device)
        if spec.causal:
            allowed = allowed & (j <= i)
        if no_self:
            allowed = allowed & (j != i)
        allowed = allowed.expand(B, Hq, b - a, nk)
        keep = ref.keep_mask(rule, s, allowed, None if q_aux is None else q_aux[:, :, a:b], k_aux, None)
        lse_c = lse[:, :, a:b].to(ct)[..., None]
        finite = torch.isfinite(lse_c)
        p = torch.where(keep & finite, torch.exp(s - torch.where(finite, lse_c, torch.zeros_like(lse_c))),
                        torch.zeros_like(s))
        do = dout[:, :, a:b].to(ct)
        delta = (do * out[:, :, a:b].to(ct)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta)
        dv += torch.matmul(p.transpose(-1, -2), do)
        dq[:, :, a:b] = torch.matmul(ds, kk) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qc) * scale
    if Hq != Hk:
        dk = dk.view(B, Hk, Hq // Hk, nk, -1).sum(2)
        dv = dv.view(B, Hk, Hq // Hk, nk, -1).sum(2)
    return dq, dk, dv


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Two partial results of the same query rows merged by log-sum-exp, in the widest dtype of the
    accumulator ``out_a`` and the two ``lse`` (a block's may be narrower than the accumulators)."""
    dt = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), out_a.dtype)
    lse_a, lse_b = lse_a.to(dt), lse_b.to(dt)
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - ref)[..., None]
    wb = torch.exp(lse_b - ref)[..., None]
    return out_a.to(dt) * wa + out_b.to(dt) * wb, lse


# ---------------------------------------------------------------------------------------------
# The ring.

def _ring_forward(cfg: _Config, q, k, v, q_aux, k_aux):
    B, Hq, n, _ = q.shape
    at = lse_dtype(q.dtype)
    out = q.new_zeros((B, Hq, n, v.shape[-1]), dtype=at)
    lse = torch.full((B, Hq, n), float("-inf"), dtype=at, device=q.device)
    ring = _Ring(cfg.group, cfg.world, cfg.rank, list(cfg.members)) if cfg.world > 1 else None
    kv = [k, v] + ([k_aux] if k_aux is not None else [])
    for t in range(cfg.world):
        src = (cfg.rank - t) % cfg.world
        pending = ring.start(kv) if t < cfg.world - 1 else None
        kb, vb = kv[0], kv[1]
        kab = kv[2] if k_aux is not None else None
        for b in _plan(cfg.rank, src, n, cfg.layout, cfg.causal):
            o_b, l_b = _block_forward(cfg.block_spec(b), q[:, :, b.q], kb[:, :, b.k], vb[:, :, b.k],
                                      _aux_slice(q_aux, b.q), _aux_slice(kab, b.k))
            out[:, :, b.q], lse[:, :, b.q] = _merge(out[:, :, b.q], lse[:, :, b.q], o_b, l_b)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(cfg: _Config, q, k, v, q_aux, k_aux, out, lse, dout):
    n = q.shape[2]
    at = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=at, device=q.device)
    dk = torch.zeros(k.shape, dtype=at, device=k.device)
    dv = torch.zeros(v.shape, dtype=at, device=v.device)
    ring = _Ring(cfg.group, cfg.world, cfg.rank, list(cfg.members)) if cfg.world > 1 else None
    kv = [k, v] + ([k_aux] if k_aux is not None else [])
    acc_pending = None
    for t in range(cfg.world):
        src = (cfg.rank - t) % cfg.world
        pending = ring.start(kv) if t < cfg.world - 1 else None
        kb, vb = kv[0], kv[1]
        kab = kv[2] if k_aux is not None else None
        contrib = []
        for b in _plan(cfg.rank, src, n, cfg.layout, cfg.causal):
            g = _block_backward(cfg.block_spec(b), q[:, :, b.q], kb[:, :, b.k], vb[:, :, b.k],
                                _aux_slice(q_aux, b.q), _aux_slice(kab, b.k), out[:, :, b.q], lse[:, :, b.q],
                                dout[:, :, b.q])
            dq[:, :, b.q] += g[0].to(at)
            contrib.append((b.k, g[1], g[2]))
        if acc_pending is not None:  # the accumulators of the K/V shard held now, from the previous rank
            dk, dv = acc_pending.wait()
        for sl, gk, gv in contrib:
            dk[:, :, sl] += gk.to(at)
            dv[:, :, sl] += gv.to(at)
        if ring is not None:
            acc_pending = ring.start([dk, dv])
        if pending is not None:
            kv = pending.wait()
    if acc_pending is not None:  # one last hop brings each shard's accumulators home
        dk, dv = acc_pending.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_aux, k_aux, cfg: _Config):
        with torch.no_grad():
            out, lse = _ring_forward(cfg, q, k, v, q_aux, k_aux)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, q_aux, k_aux, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_aux, k_aux, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _ring_backward(ctx.cfg, q, k, v, q_aux, k_aux, out, lse, dout)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------
# Public entry point.

def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, is_causal: bool = False,
                               policy="dense", layout: str = "contiguous", scale: Optional[float] = None,
                               backend: str = "auto", draw_seed: Optional[int] = None, **policy_tensors) -> Tensor:
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    ``q`` ``(B, Hq, n, D)``, ``k`` ``(B, Hk, n, D)``, ``v`` ``(B, Hk, n, Dv)`` are this rank's shard of
    a sequence of ``N = n * world`` positions in ``layout`` (``"contiguous"`` or ``"balanced"``, see
    the module docstring; :func:`shard_sequence` cuts a full tensor so). Returns this rank's shard of
    ``attncomp.functional.attention(Q, K, V, is_causal=is_causal, policy=policy, scale=scale)`` on the
    full sequence, differentiable with respect to q, k and v.

    ``policy``: ``"dense"``, ``"et"``, ``"dfss"``, ``"hash"``, ``"drop"`` or a policy object.
    ``policy_tensors``: ``q_buckets``/``k_buckets`` (hash) or ``q_keep``/``k_keep`` (drop), each
    this rank's shard ``(B, H, n)`` in the same layout; without them hash buckets come from the
    policy's LSH and keep masks from ``draw_seed`` (default: the policy's seed), drawn over the
    global sequence so that every rank and a single-process call agree. Pass the same fresh
    ``draw_seed`` on every rank at each training step for new keep masks per step.
    """
    pol = get_policy(policy)
    if pol.name not in _POLICIES:
        raise ValueError(f"policy {pol.name!r} is not supported by context-parallel attention "
                         f"(its block pattern is indexed by global tiles); supported: {', '.join(_POLICIES)}")
    _check_layout(layout)
    allowed = _POLICY_TENSORS.get(pol.name, ())
    extra = set(policy_tensors) - set(allowed)
    if extra:
        raise ValueError(f"policy {pol.name!r} takes {' and '.join(allowed) or 'no policy tensors'}, "
                         f"got {', '.join(sorted(extra))}")
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{nm} must be a floating-point tensor of shape (B, H, n, D)")
    B, Hq, n, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[2] != n or v.shape[2] != n or k.shape[3] != D \
            or v.shape[1] != k.shape[1]:
        raise ValueError(f"q, k, v shards must share batch and shard length: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hq % k.shape[1]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    world, rank, members = _group_info(group)
    segs = _segments(n, rank, world, layout)
    pol = pol.resolved(q.dtype)
    if isinstance(pol, DFSS):
        c = segs[0][1]
        if c % pol.m:
            what = "shard length" if layout == "contiguous" else "chunk length (half the shard)"
            raise ValueError(f"policy dfss {pol.n}:{pol.m} needs the {what} to be a multiple of {pol.m} "
                             f"so that no key group straddles a shard boundary, got {c}")
    q_aux, k_aux = _policy_tensors(pol, q, k, n, rank, world, layout, policy_tensors, draw_seed)
    spec = AttentionSpec(causal=False, scale=None if scale is None else float(scale), dtype=dtype_name(q.dtype),
                         head_dim=int(D), gqa_groups=Hq // k.shape[1], policy=pol, backend=backend)
    cfg = _Config(spec, layout, bool(is_causal), group, world, rank, tuple(members))
    return _ring_attention(q, k, v, q_aux, k_aux, cfg)


@torch.compiler.disable
def _ring_attention(q, k, v, q_aux, k_aux, cfg: _Config) -> Tensor:
    # point-to-point communication does not belong in a traced graph: under torch.compile (and in
    # models compiled by attncomp) the ring runs eagerly between the compiled regions
    return _RingAttention.apply(q, k, v, q_aux, k_aux, cfg)


def _policy_tensors(pol, q, k, n, rank, world, layout, given, draw_seed=None):
    B, Hq, Hk = q.shape[0], q.shape[1], k.shape[1]
    if isinstance(pol, Hash):
        qa, ka = given.get("q_buckets"), given.get("k_buckets")
        if (qa is None) != (ka is None):
            raise ValueError("give both q_buckets and k_buckets, or neither")
        if qa is None:
            with torch.no_grad():
                qa, ka = lsh_buckets(q.detach(), k.detach(), pol.n_buckets, pol.seed)
        _check_aux(qa, "q_buckets", (B, Hq, n), integer=True)
        _check_aux(ka, "k_buckets", (B, Hk, n), integer=True)
        return qa.to(torch.int32), ka.to(torch.int32)
    if isinstance(pol, Drop):
        qa, ka = given.get("q_keep"), given.get("k_keep")
        pos = None
        if qa is None or ka is None:
            pos = sequence_positions(n, rank, world, layout, device=q.device)
        seed = pol.seed if draw_seed is None else int(draw_seed)
        if qa is None:
            qa = keep_mask((B, Hq, n * world), pol.q_rate, seed, 0, q.device)[:, :, pos]
        if ka is None:
            ka = keep_mask((B, Hk, n * world), pol.k_rate, seed, 1, q.device)[:, :, pos]
        _check_aux(qa, "q_keep", (B, Hq, n), integer=False)
        _check_aux(ka, "k_keep", (B, Hk, n), integer=False)
        return qa.contiguous(), ka.contiguous()
    return None, None


def _check_aux(t, name, shape, integer: bool) -> None:
    kind = "integer" if integer else "bool"
    ok = isinstance(t, Tensor) and (
        (not t.is_floating_point() and t.dtype != torch.bool) if integer else t.dtype == torch.bool)
    if not ok or tuple(t.shape) != tuple(shape):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be this rank's {kind} shard of shape {tuple(shape)}, got {got}")


# ---------------------------------------------------------------------------------------------
# FSDP2 after a forward that no backward follows (the call ``attncomp.compile`` makes on
# ``example_inputs``).

def _param_ids(module: torch.nn.Module) -> dict:
    """Which tensor object each parameter of ``module`` is, by qualified name."""
    return {n: id(p) for n, p in module.named_parameters(remove_duplicate=False)}


def _restore_fsdp(module: torch.nn.Module, before: dict) -> List[str]:
    """Put the FSDP2 (``fully_shard``) modules of ``module`` back in their state between iterations
    after a forward that no backward follows; return the qualified names of those reset.

    In training FSDP2 reshards a root module's parameters only in its post-backward callback, so a
    forward without backward leaves the root's unsharded parameters registered on the modules:
    ``parameters()`` and ``state_dict()`` would then return plain unsharded tensors instead of the
    sharded DTensors, and an optimizer built from them would update copies that the next all-gather
    overwrites (the root's weights would never change). Each outermost FSDP2 module whose parameters
    are no longer the objects of ``before`` (:func:`_param_ids` taken before the call) gets
    ``reset_iter_state()`` (reshards every group and clears the iteration's bookkeeping), or, where
    that is not available or it is not the root of its FSDP2 tree, ``reshard()`` on each FSDP2 module
    under it. Modules without FSDP2 are left alone."""
    if not dist.is_available():
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    changed = [n for n, i in _param_ids(module).items() if before.get(n) != i]
    if not changed:
        return []
    done: List[str] = []
    outer: List[str] = []
    for name, m in module.named_modules():
        if not isinstance(m, FSDPModule) or any(name.startswith(o + ".") or o == "" for o in outer):
            continue
        outer.append(name)
        if not any(name == "" or n.startswith(name + ".") for n in changed):
            continue
        reset = getattr(m, "reset_iter_state", None)
        try:
            if reset is None:
                raise RuntimeError("no reset_iter_state in this torch")
            reset()
        except RuntimeError:  # a non-root FSDP2 module, or an older FSDP2: reshard group by group
            for sub in m.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()
        done.append(name or type(m).__name__)
    return done
