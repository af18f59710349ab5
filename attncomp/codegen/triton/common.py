"""Triton building blocks shared by the forward and backward attention kernels.

The softmax runs in log2 units, ``exp2(q·k * scale * log2(e) + bias * log2(e) - m)``, so that the
scale costs one fused multiply-add per logit (without a float mask the tiles hold raw ``q·k`` and
the scale is applied inside that multiply-add). A logit that is not kept is ``-inf``; the single
place where predicates, masks and the policy's rule are applied is ``template._entry``.

The DFSS selection (:func:`_nm_select`) runs on the logits tile in registers, right after the
``QK^T`` product and before the online softmax, as the epilogue the DFSS paper describes: nothing
is written to memory. To keep the ``M`` members of a group in one thread's registers, key tiles are
loaded in the order given by :func:`_key_order` (see there); softmax and ``P @ V`` do not depend on
the order of keys inside a tile, as long as K and V rows are loaded in the same order.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ...policy import seed_mix

__all__ = [
    "MASK_NONE",
    "MASK_BOOL",
    "MASK_FLOAT",
    "LOG2E",
]

# Mask kinds as kernel constants (``tl.constexpr``): one compiled variant per kind.
MASK_NONE = 0
MASK_BOOL = 1
MASK_FLOAT = 2

LOG2E = 1.4426950408889634

def _interpreter_descriptor_reduce() -> None:
    """Triton 3.6's CPU interpreter emulates TMA descriptor loads and stores but not their bulk
    reductions (``desc.atomic_add``, the backward's ``DQ_ATOMIC=2``): add the addition it lacks, as the
    element atomics over the descriptor's block (positions past the tensor's shape dropped, as TMA does)."""
    try:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - an interpreter without these modules has nothing to patch
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or hasattr(builder, "create_descriptor_reduce"):
        return

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduction {kind} under the interpreter")
        ptrs, mask = desc.materialize_pointers(indices)
        if not isinstance(mask, interpreter.TensorHandle):  # a numpy array before triton 3.9
            mask = interpreter.TensorHandle(mask, tl.int1)
        op = ir.ATOMIC_OP.FADD if value.dtype.scalar.is_floating() else ir.ATOMIC_OP.ADD
        return self.create_atomic_rmw(op, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU)

    builder.create_descriptor_reduce = create_descriptor_reduce


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpreter_descriptor_reduce()

# Triton's CPU interpreter multiplies bfloat16 tiles as raw 16-bit integers; it gets float32 copies
# (exact: products of bfloat16 values are exact in float32, as on the tensor cores).
_INTERPRET_UPCAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b`` with float32 accumulation."""
    if _INTERPRET_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _key_order(BLOCK_N: tl.constexpr, NM_M: tl.constexpr):
    """Key offsets (within a tile) of the tile's ``BLOCK_N`` columns, for N:M groups of ``NM_M``.

    Column ``c`` is read as ``(u, h, t, e)`` with ``c = ((u * NM_M/2 + h) * 4 + t) * 2 + e`` and holds
    key ``(4u + t) * NM_M + 2h + e``: member ``2h + e`` of group ``4u + t``. On NVIDIA tensor cores the
    accumulator gives each thread pairs of adjacent columns ``(e)`` from every eighth column
    ``(h, u)``, with the four threads of a quad covering ``t``; so the members of one group
    (varying ``h`` and ``e``) sit in one thread and the selection needs no data exchange. For
    ``NM_M == 2`` (and for policies without groups) this is the identity.
    """
    c = tl.arange(0, BLOCK_N)
    if NM_M <= 2:
        return c
    else:
        H: tl.constexpr = NM_M // 2
        e = c % 2
        t = (c // 2) % 4
        h = (c // 8) % H
        u = c // (8 * H)
        return (u * 4 + t) * NM_M + h * 2 + e


@triton.jit
def _nm_groups(s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NM_M: tl.constexpr):
    """``s`` (``BLOCK_M x BLOCK_N``, columns in :func:`_key_order`) viewed as ``(BLOCK_M, groups, NM_M)``
    with the member axis in one thread's registers (the view moves no data)."""
    H: tl.constexpr = NM_M // 2
    x = tl.reshape(s, (BLOCK_M, BLOCK_N // (4 * NM_M), H, 4, 2))
    x = tl.permute(x, (0, 1, 3, 2, 4))
    return tl.reshape(x, (BLOCK_M, BLOCK_N // NM_M, NM_M))


@triton.jit
def _nm_tile(y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NM_M: tl.constexpr):
    """The inverse of :func:`_nm_groups`: a ``(BLOCK_M, groups, NM_M)`` view back to the tile."""
    H: tl.constexpr = NM_M // 2
    y = tl.reshape(y, (BLOCK_M, BLOCK_N // (4 * NM_M), 4, H, 2))
    y = tl.permute(y, (0, 1, 3, 2, 4))
    return tl.reshape(y, (BLOCK_M, BLOCK_N))


@triton.jit
def _split4(x, BLOCK_M: tl.constexpr, G: tl.constexpr):
    """The four members ``x0..x3`` (each ``(BLOCK_M, G)``) of a ``(BLOCK_M, G, 4)`` group view."""
    xe0, xe1 = tl.split(tl.reshape(x, (BLOCK_M, G, 2, 2)))
    x0, x2 = tl.split(xe0)
    x1, x3 = tl.split(xe1)
    return x0, x1, x2, x3


@triton.jit
def _join4(y0, y1, y2, y3, BLOCK_M: tl.constexpr, G: tl.constexpr):
    """The inverse of :func:`_split4`."""
    return tl.reshape(tl.join(tl.join(y0, y2), tl.join(y1, y3)), (BLOCK_M, G, 4))


@triton.jit
def _keep4(x0, x1, x2, x3, NM_N: tl.constexpr):
    """Which of four members are kept: member r is kept iff fewer than ``NM_N`` members beat it (j
    beats r: x_j > x_r, or x_j == x_r and j < r). Each condition is that count written with min/max
    of the others, so a group costs a few min/max and compares and no predicate juggling."""
    hi01 = tl.maximum(x0, x1)
    lo01 = tl.minimum(x0, x1)
    hi23 = tl.maximum(x2, x3)
    lo23 = tl.minimum(x2, x3)
    if NM_N == 1:  # nobody beats it
        k0 = tl.maximum(x1, hi23) <= x0
        k1 = (x0 < x1) & (hi23 <= x1)
        k2 = (hi01 < x2) & (x3 <= x2)
        k3 = tl.maximum(hi01, x2) < x3
    elif NM_N == 2:  # at most one member beats it
        k0 = tl.maximum(lo23, tl.minimum(x1, hi23)) <= x0  # second largest of x1, x2, x3
        k1 = tl.where(x0 >= x1, hi23, lo23) <= x1
        k2 = tl.where(x3 > x2, hi01, lo01) < x2
        k3 = tl.maximum(lo01, tl.minimum(hi01, x2)) < x3  # second largest of x0, x1, x2
    else:  # N == 3: not all three beat it
        k0 = tl.minimum(x1, lo23) <= x0
        k1 = (x0 < x1) | (lo23 <= x1)
        k2 = (lo01 < x2) | (x3 <= x2)
        k3 = tl.minimum(lo01, x2) < x3
    return k0, k1, k2, k3


@triton.jit
def _nm_select(s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr):
    """Keep, per row of ``s`` (``BLOCK_M x BLOCK_N``, columns in :func:`_key_order`), the ``NM_N``
    largest logits of every group of ``NM_M`` keys; the others become ``-inf``.

    Member ``a`` beats member ``b`` if its logit is larger, or equal with a lower key index; a
    member is kept when fewer than ``NM_N`` members beat it. ``-inf`` (not allowed) members are
    never kept in effect: they lose to every allowed member and a kept ``-inf`` weighs 0.

    The tile is viewed as ``(BLOCK_M, groups, NM_M)`` with the member axis in one thread's
    registers, so splitting it into per-member tensors moves no data. ``M = 2`` needs one compare
    per group and ``M = 4`` a handful of min/max and compares (:func:`_keep4`); larger groups count
    the members that beat each one.
    """
    G: tl.constexpr = BLOCK_N // NM_M
    NEG: tl.constexpr = float("-inf")
    x = _nm_groups(s, BLOCK_M, BLOCK_N, NM_M)
    if NM_M == 2:
        x0, x1 = tl.split(x)
        c01 = x0 >= x1  # member 0 beats member 1 (ties go to the lower index)
        y = tl.join(tl.where(c01, x0, NEG), tl.where(c01, NEG, x1))
    elif NM_M == 4:
        x0, x1, x2, x3 = _split4(x, BLOCK_M, G)
        k0, k1, k2, k3 = _keep4(x0, x1, x2, x3, NM_N)
        y = _join4(tl.where(k0, x0, NEG), tl.where(k1, x1, NEG), tl.where(k2, x2, NEG), tl.where(k3, x3, NEG),
                   BLOCK_M, G)
    else:
        # count the members that beat each member; the member axis is extracted with a masked
        # sum over registers (x + -0.0 == x exactly, -inf included)
        lane = tl.arange(0, NM_M)[None, None, :]
        rank = tl.zeros((BLOCK_M, G, NM_M), dtype=tl.int32)
        for t in tl.static_range(NM_M):
            xt = tl.sum(tl.where(lane == t, x, -0.0), axis=2)[:, :, None]
            beats = (xt > x) | ((xt == x) & (lane > t))
            rank += beats.to(tl.int32)
        y = tl.where(rank < NM_N, x, NEG)
    keep = _nm_tile(y, BLOCK_M, BLOCK_N, NM_M) != NEG
    # apply the decision to the input tile (not the reshaped copy): the result keeps the layout of
    # the matrix product, so nothing downstream is converted or computed twice
    return tl.where(keep, s, NEG)


@triton.jit
def _nm24_exp2(s, sc, m_sub, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(p, rowsum(p))`` for a 2:4 selection fused with the softmax's exponentials: ``p`` is
    ``exp2(s * sc - m_sub)`` where :func:`_nm_select` keeps the logit and 0 elsewhere, but only the
    two kept members of each group are exponentiated (half the ``exp2`` of the tile). ``s`` holds
    the tile's allowed logits before the selection (``-inf`` where not allowed); exactly two members
    of every group are kept (ties go to the lower index), so they are the first and the last kept.
    """
    G: tl.constexpr = BLOCK_N // 4
    x0, x1, x2, x3 = _split4(_nm_groups(s, BLOCK_M, BLOCK_N, 4), BLOCK_M, G)
    k0, k1, k2, k3 = _keep4(x0, x1, x2, x3, 2)
    first = tl.where(k0, x0, tl.where(k1, x1, x2))
    last = tl.where(k3, x3, tl.where(k2, x2, x1))
    m2 = m_sub[:, None]
    ea = tl.math.exp2(first * sc - m2)
    eb = tl.math.exp2(last * sc - m2)
    p = _join4(tl.where(k0, ea, 0.0), tl.where(k1, tl.where(k0, eb, ea), 0.0),
               tl.where(k2, tl.where(k3, ea, eb), 0.0), tl.where(k3, eb, 0.0), BLOCK_M, G)
    return _nm_tile(p, BLOCK_M, BLOCK_N, 4), tl.sum(ea, 1) + tl.sum(eb, 1)


@triton.jit
def _uniform_hash(seed, idx):
    """Uniform float32 in [0, 1) from ``(seed, idx)``: bit for bit ``attncomp.policy.uniform_hash``.

    ``seed`` is the host's pre-mixed 32-bit seed, ``idx`` the uint32 low bits of the element index;
    products wrap modulo 2**32 as in the reference's masked int64 arithmetic.
    """
    x = idx ^ seed.to(tl.uint32)
    x = x * tl.full(idx.shape, 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full(idx.shape, 0xC2B2AE35, tl.uint32)
    x = x ^ (x >> 16)
    x = x * tl.full(idx.shape, 0x27D4EB2F, tl.uint32)
    x = x ^ (x >> 15)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _dropout_scale(seed, row_base, kj, dropout_p, inv_keep):
    """``1/(1-p)`` where the probability survives dropout, 0 where it is dropped.

    ``row_base`` is ``((b*Hq + h)*Nq + i) * Nk`` as uint32 (broadcast along the query axis),
    ``kj`` the key index; the element index is their sum modulo 2**32.
    """
    idx = row_base + kj.to(tl.uint32)
    u = _uniform_hash(seed, idx)
    return tl.where(u >= dropout_p, inv_keep, 0.0)


# ---------------------------------------------------------------------------------------------
# Host-side integer helpers (plain Python: triton.next_power_of_2/cdiv are slower JIT-callable wrappers)

def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_block(n: int) -> int:
    """The power-of-two block (at least 16, the smallest tl.dot size) that covers ``n``."""
    return max(16, next_pow2(n))


def window_bound(w, none: int = 0) -> int:
    """A window side as a kernel integer (``none`` when unbounded), clipped to ``+-2**30``: a bound
    past every position means the same and keeps the position arithmetic of the kernels in range."""
    if w is None:
        return none
    return max(-(1 << 30), min(int(w), 1 << 30))


def seed_word(seed: int) -> int:
    """The mixed seed of ``attncomp.policy.uniform_hash`` as a signed 32-bit kernel argument (what
    :func:`_uniform_hash` takes; one integer class for every seed)."""
    s = seed_mix(seed)
    return s - (1 << 32) if s >= (1 << 31) else s
