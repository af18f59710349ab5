"""The attention kernel template: one flash-style forward and one backward for every site (DESIGN §6).

A site is specialised through ``tl.constexpr`` parameters along two axes:

* **tile schedule** (``SCHED``): which key tiles a query tile visits (and, in the dK/dV pass, which
  query tiles a key tile visits). ``SCHED_SPAN``: a contiguous span computed in the kernel, every tile
  when the site has no position predicate, else the tiles that the window around default positions
  (``arange`` plus the causal alignment offset) reaches. ``SCHED_LIST``: per query tile (per key tile in
  the transposed direction) a list of tile indices built on the device by :mod:`.schedule` from O(N)
  tile summaries: position bounds (q/k position vectors), segment ranges, padding, the sorted
  bucket/keep ranges of ``hash`` and ``drop`` and a SPION block pattern. Each entry also says whether
  the §4.1 predicates and the pattern allow the whole tile (then the kernel skips their per-logit
  tests). Padding alone takes the span below ``backend.PAD_LIST_MIN`` entries (validity is then
  tested per logit), so that short kernels do not wait on the lists' launches (a chosen bound).
  ``SCHED_RANGE`` (query tiles of a sorted layout with no other predicate than its ranges: ``hash`` and
  ``drop``, causal or not): the span of key tiles that the tile's rows' ``[lo, hi)`` ranges reach,
  computed in the kernel from the ranges it loads anyway, so that no summaries or lists are built and no
  tile index is read before its keys; a key tile inside every row's range (the ranges' core) skips the
  per-logit range test.
* **entry predicate** (:func:`_entry`): the §4.1 predicates (position window, segments, ``q_valid`` /
  ``k_valid``), the residual ``attn_mask`` and the policy's keep rule (DFSS N:M selection in registers,
  the bucket/keep range of a sorted layout, ``exclude_self``, SPION block membership), all on the
  tile's logits in registers. Nothing ``N x N`` is read except a residual mask the site really has.

* **score modifiers** (DESIGN §4.2, :func:`_modify`, each a constexpr: a site without them compiles the
  kernel it had before): ALiBi, the relative-position bias (a host look-up table per clamped distance)
  and the soft-cap on the raw logits before :func:`_entry`, so that the policy decides on the modified
  logits; the attention sinks join the forward's denominator at the end. Their gradients: the soft-cap's
  factor on ``dS``, ALiBi's and the table's sums in the dK/dV pass (per-tile partials, float32 atomics into
  the table), the sinks' on the host from ``lse`` and ``delta``.

Tokens are addressed in a *row order*: the identity, or for ``hash``/``drop`` the stable sort of
queries and keys by group (:mod:`.layout`), whose permutations the kernels read to gather q/k/v rows
and scatter outputs back, so that no sorted copy is ever made. Every predicate is evaluated on
original indices. A new policy or mask adds a branch to :func:`_entry` and, when it lets tiles be
skipped, a term to :func:`attncomp.codegen.triton.schedule._tile_visit`; no new kernel.

The softmax runs in log2 units (``exp2``), see :mod:`.common`. Kernels:

* :func:`_attention_kernel`, in three modes: the forward (one program per (query tile, batch x query
  head) streaming key tiles, online softmax, writes ``out`` and the natural-log ``lse``), the
  backward's dQ (the same programs), and the backward's dK/dV (one program per (key tile, batch x KV
  head) streaming the query tiles of every query head of its GQA group: no atomics). With
  ``DQ_ATOMIC`` the dK/dV pass also adds each tile's dQ share into a float32 buffer with atomics and
  the dQ launch is skipped: faster where recomputing ``QK^T``/``dP`` costs more than the atomics, but
  not bitwise reproducible, so deterministic mode (PyTorch's) never uses it.
* :func:`_bwd_preprocess`: ``delta = rowsum(dO * O)`` and ``lse`` in log2 units (``+inf`` for rows
  without a kept key, so their recomputed probabilities are 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _dropout_scale, _key_order, _nm24_exp2, _nm_select

__all__ = ["MODE_FWD", "MODE_DQ", "MODE_DKDV", "SCHED_SPAN", "SCHED_LIST", "SCHED_RANGE", "POLICY_DENSE", "POLICY_DFSS",
           "POLICY_SORTED", "POLICY_SPION",
           "POS_NONE", "POS_ARANGE", "POS_VECTOR"]

MODE_FWD = 0
MODE_DQ = 1
MODE_DKDV = 2
SCHED_SPAN = 0
SCHED_LIST = 1
SCHED_RANGE = 2  # query-outer passes of a sorted layout: the span of its rows' ranges (see above)
POLICY_DENSE = 0
POLICY_DFSS = 1
POLICY_SORTED = 2  # hash and drop: a sorted layout with per-query key ranges
POLICY_SPION = 3
POS_NONE = 0    # no position predicate
POS_ARANGE = 1  # default positions: q = i + offset, k = j
POS_VECTOR = 2  # q_pos / k_pos tensors

_NEG = tl.constexpr(float("-inf"))


@triton.jit
def _orig(Perm, offs, valid, PERMUTED: tl.constexpr):
    """Original token indices of row-order positions ``offs`` (0 where not ``valid``)."""
    if PERMUTED:
        return tl.load(Perm + offs, mask=valid, other=0)
    else:
        return offs


@triton.jit
def _load_tile(base, rows, valid, stride, offs_c, NC: tl.constexpr, BC: tl.constexpr, CHECK: tl.constexpr,
               TRANS: tl.constexpr):
    """Rows ``rows`` of a (N, NC) matrix with unit column stride: ``(len(rows), BC)``, or its
    transpose with ``TRANS``. ``CHECK`` masks the rows that are not ``valid``."""
    if TRANS:
        ptrs = base + rows[None, :].to(tl.int64) * stride + offs_c[:, None]
        if CHECK:
            return tl.load(ptrs, mask=valid[None, :] & (offs_c[:, None] < NC), other=0.0)
        elif NC != BC:
            return tl.load(ptrs, mask=offs_c[:, None] < NC, other=0.0)
        else:
            return tl.load(ptrs)
    else:
        ptrs = base + rows[:, None].to(tl.int64) * stride + offs_c[None, :]
        if CHECK:
            return tl.load(ptrs, mask=valid[:, None] & (offs_c[None, :] < NC), other=0.0)
        elif NC != BC:
            return tl.load(ptrs, mask=offs_c[None, :] < NC, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store_tile(base, rows, valid, stride, offs_c, x, NC: tl.constexpr, BC: tl.constexpr, CHECK: tl.constexpr):
    ptrs = base + rows[:, None].to(tl.int64) * stride + offs_c[None, :]
    x = x.to(base.dtype.element_ty)
    if CHECK:
        tl.store(ptrs, x, mask=valid[:, None] & (offs_c[None, :] < NC))
    elif NC != BC:
        tl.store(ptrs, x, mask=offs_c[None, :] < NC)
    else:
        tl.store(ptrs, x)


@triton.jit
def _tok_vals(idx, valid, b, Pos, s_pos, Seg, s_seg, Val, s_val, off,
              POS: tl.constexpr, SEG: tl.constexpr, VAL: tl.constexpr):
    """Per-token predicate values of original indices ``idx``: position, segment id (both int32:
    positions and window bounds are taken to lie within +-2**30, segment ids to fit 32 bits; 64-bit
    compares per logit would cost more than the rest of the predicate) and validity. Values of
    predicates the site lacks are placeholders the compiler drops."""
    if POS == 2:
        p = tl.load(Pos + b.to(tl.int64) * s_pos + idx, mask=valid, other=0).to(tl.int32)
    else:
        p = idx.to(tl.int32) + off
    if SEG:
        sg = tl.load(Seg + b.to(tl.int64) * s_seg + idx, mask=valid, other=0).to(tl.int32)
    else:
        sg = p
    if VAL:
        v = tl.load(Val + b.to(tl.int64) * s_val + idx, mask=valid, other=0) != 0
    else:
        v = valid
    return p, sg, v


@triton.jit
def _query_side(QPerm, Lo, Hi, row0, offs_m, mval, b, QPos, s_qpos, QSeg, s_qseg, QVal, s_qval, pos_off,
                PERMUTED: tl.constexpr, POS: tl.constexpr, SEG: tl.constexpr, QVAL: tl.constexpr):
    """Original indices, predicate values and (sorted layouts) kept key ranges of row-order
    queries ``offs_m`` of the (batch, head) row starting at ``row0``."""
    qi = _orig(QPerm + row0, offs_m, mval, PERMUTED)
    qp, qs, qv = _tok_vals(qi, mval, b, QPos, s_qpos, QSeg, s_qseg, QVal, s_qval, pos_off, POS, SEG, QVAL)
    if PERMUTED:
        lo = tl.load(Lo + row0 + offs_m, mask=mval, other=0)
        hi = tl.load(Hi + row0 + offs_m, mask=mval, other=0)
    else:
        lo = offs_m
        hi = offs_m
    return qi, qp, qs, qv, lo, hi


@triton.jit
def _pos_partial(m0, m1, n0, n1, off, left, right, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, PERMUTED: tl.constexpr):
    """Whether the window around default positions may exclude an entry of the tile of queries
    ``m0..m1`` and keys ``n0..n1`` (always with position vectors or a sorted layout, whose row
    order is not the position order)."""
    if POS == 2 or PERMUTED:
        return True
    elif POS == 1:
        part = n0 != n0
        if HAS_LEFT:
            part = part | (n0 < m1 + off - left)
        if HAS_RIGHT:
            part = part | (n1 > m0 + off + right)
        return part
    else:
        return False


@triton.jit
def _inner_tiles(List, Cnt, b, h, outer, slb, slh, slt, scb, sch, span_lo, span_hi, SCHED: tl.constexpr):
    """``(list row, t_lo, t_hi)``: the inner tiles of an outer tile are list entries ``[0, count)``,
    or the span ``[span_lo, span_hi)`` itself."""
    if SCHED == 1:
        lrow = List + b.to(tl.int64) * slb + h.to(tl.int64) * slh + outer.to(tl.int64) * slt
        return lrow, 0, tl.load(Cnt + b.to(tl.int64) * scb + h.to(tl.int64) * sch + outer)
    else:
        return List, span_lo, span_hi


@triton.jit
def _inner_tile(lrow, t, outer_first, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                INNER_KEYS: tl.constexpr, SCHED: tl.constexpr, POS: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, PERMUTED: tl.constexpr, TOKENS: tl.constexpr):
    """The ``t``-th inner tile of an outer tile starting at ``outer_first``: its first token and
    whether its entries need the §4.1 tests (from the list entry, or the window's span; a span
    with per-token validity, ``TOKENS``, tests every tile)."""
    if SCHED == 1:
        entry = tl.load(lrow + t)
        if INNER_KEYS:
            start = (entry >> 1) * BLOCK_N
        else:
            start = (entry >> 1) * BLOCK_M
        check = (entry & 1) == 0
    else:
        if INNER_KEYS:
            start = t * BLOCK_N
        else:
            start = t * BLOCK_M
        if TOKENS:
            check = True
        else:
            if INNER_KEYS:
                check = _pos_partial(outer_first, outer_first + BLOCK_M - 1, start, start + BLOCK_N - 1, off, left,
                                     right, POS, HAS_LEFT, HAS_RIGHT, PERMUTED)
            else:
                check = _pos_partial(start, start + BLOCK_M - 1, outer_first, outer_first + BLOCK_N - 1, off, left,
                                     right, POS, HAS_LEFT, HAS_RIGHT, PERMUTED)
    return start, check


@triton.jit
def _span(first, last, off, before, after, BLOCK: tl.constexpr, n_tiles,
          POS: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr):
    """Tiles ``[t_lo, t_hi)`` of the other side reachable from tokens ``first..last`` of this side
    when the other side's token ``j`` is allowed iff ``x + off - before <= j <= x + off + after``."""
    t_lo = 0
    t_hi = n_tiles
    if POS == 1:
        if HAS_BEFORE:
            t_lo = tl.maximum(first + off - before, 0) // BLOCK
        if HAS_AFTER:
            t_hi = tl.minimum(tl.cdiv(tl.maximum(last + off + after + 1, 0), BLOCK), n_tiles)
    return t_lo, t_hi


@triton.jit
def _entry(
    qk, m2, n2, qi2, kj2, qp2, qs2, qv2, lo2, hi2, kp2, ks2, kv2, b, h, pred_check, n_first,
    Mask, smb, smh, smm, smn, Pat, sph, spr, spc, Nq, Nk, win_left, win_right, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_K: tl.constexpr,
    POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
    POS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SEG: tl.constexpr,
    QVAL: tl.constexpr, KVAL: tl.constexpr, SPION_BS: tl.constexpr, TRANSPOSED: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    """The logits tile with every rule of DESIGN §4/§4.1 applied: ``-inf`` where not kept.

    ``qk`` is the raw ``q·k`` tile, queries by keys, or keys by queries when ``TRANSPOSED``; the
    ``*2`` arguments are broadcastable to it: row-order indices ``m2``/``n2``, original indices
    ``qi2``/``kj2``, and the per-token values of :func:`_tok_vals` and the sorted ranges.
    ``pred_check`` (a scalar) is false for tiles that every §4.1 predicate, a SPION pattern and a sorted
    layout's ranges allow entirely (the schedule knows them: their position, segment, padding, block and
    range tests are skipped);
    ``n_first`` is the tile's first key (row order). With ``PRESCALE`` the result is in log2 units; without
    it, raw ``q·k`` (the caller applies the scale inside its ``exp2`` multiply-add).
    """
    if PRESCALE:
        s = qk * qk_scale
    else:
        s = qk
    if MASK_KIND != 0:
        mptr = Mask + b.to(tl.int64) * smb + h.to(tl.int64) * smh + qi2.to(tl.int64) * smm + kj2.to(tl.int64) * smn
        inb = (m2 < Nq) & (n2 < Nk)
        if MASK_KIND == 1:
            s = tl.where(tl.load(mptr, mask=inb, other=0) != 0, s, _NEG)
        else:
            s = s + tl.load(mptr, mask=inb, other=0.0).to(tl.float32) * 1.4426950408889634
    if CHECK_K:
        s = tl.where(n2 < Nk, s, _NEG)
    if POS != 0 or SEG or QVAL or KVAL:
        if pred_check:
            if POS != 0:
                if HAS_LEFT:
                    s = tl.where(kp2 >= qp2 - win_left, s, _NEG)
                if HAS_RIGHT:
                    s = tl.where(kp2 <= qp2 + win_right, s, _NEG)
            if SEG:
                s = tl.where(qs2 == ks2, s, _NEG)
            if QVAL:
                s = tl.where(qv2, s, _NEG)
            if KVAL:
                s = tl.where(kv2, s, _NEG)
    if POLICY == 2:
        if pred_check:  # false where the tile lies inside every row's range (schedule)
            s = tl.where((n2 >= lo2) & (n2 < hi2), s, _NEG)
    if EXCLUDE_SELF:
        s = tl.where(qi2 != kj2, s, _NEG)
    if POLICY == 3:
        if pred_check:  # false where every block the tile overlaps is kept (schedule)
            bi = qi2 // SPION_BS
            if BLOCK_N <= SPION_BS:
                # the key tile lies in one block column: one pattern read per query row
                bj = n_first // SPION_BS
                pptr = Pat + h.to(tl.int64) * sph + bi.to(tl.int64) * spr + bj.to(tl.int64) * spc
                blk = tl.load(pptr, mask=m2 < Nq, other=0) != 0
            else:
                bj = kj2 // SPION_BS
                pptr = Pat + h.to(tl.int64) * sph + bi.to(tl.int64) * spr + bj.to(tl.int64) * spc
                blk = tl.load(pptr, mask=(m2 < Nq) & (n2 < Nk), other=0) != 0
            s = tl.where(blk | (bi == bj), s, _NEG)
    if POLICY == 1:
        if TRANSPOSED:
            s = tl.trans(_nm_select(tl.trans(s), BLOCK_M, BLOCK_N, NM_N, NM_M))
        else:
            s = _nm_select(s, BLOCK_M, BLOCK_N, NM_N, NM_M)
    return s


@triton.jit
def _tanh(x):
    """``tanh`` in float32 from ``exp2`` (Triton has no ``tanh`` that runs under its interpreter too):
    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (no overflow), and below ``|x| = 1/8``, where that
    cancels, its odd Taylor polynomial to ``x^7`` (the next term is under 2e-10 there)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * -0.05396825396825397)))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _modify(qk, qp2, kp2, h, Slopes, Lut, sm_scale, softcap, rel_md, Hq,
            ALIBI: tl.constexpr, REL: tl.constexpr, SOFTCAP: tl.constexpr):
    """The score modifiers of DESIGN §4.2 on a raw ``q·k`` tile, in their order: ``s = sm_scale * q·k``,
    ALiBi's ``+ slope[h] * rel`` and the relative-position bias ``+ lut[clamp(rel) + rel_md, h]``
    (``rel = k_pos - q_pos``; the host's look-up table holds ``table[bucket(r), h]`` for ``r`` in
    ``[-rel_md, rel_md]``, the bucket being constant beyond), then the soft-cap ``c * tanh(s / c)``.
    Returns ``(s in log2 units, t = tanh(s / c), rel)`` (``t``/``rel``: placeholders where absent)."""
    s = qk * sm_scale
    rel = kp2 - qp2
    if ALIBI:
        s = s + tl.load(Slopes + h).to(tl.float32) * rel.to(tl.float32)
    if REL:
        idx = tl.minimum(tl.maximum(rel, -rel_md), rel_md) + rel_md
        s = s + tl.load(Lut + idx.to(tl.int64) * Hq + h)
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    else:
        t = s
    return s * 1.4426950408889634, t, rel


@triton.jit
def _bq(x, TRANS: tl.constexpr):
    """A per-query vector broadcast along the query axis of a (transposed) tile."""
    if TRANS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _bk(x, TRANS: tl.constexpr):
    """A per-key vector broadcast along the key axis of a (transposed) tile."""
    if TRANS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit(do_not_specialize=["seed", "pos_off", "win_left", "win_right"])
def _attention_kernel(
    Q, K, V, O, DO, Lse, Delta, DQ, DK, DV, Desc0, Desc1,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
    sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    QPerm, KPerm, Lo, Hi, QPos, KPos, QSeg, KSeg, QVal, KVal, Mask, Pat, List, Cnt,
    s_qpos, s_kpos, s_qseg, s_kseg, s_qval, s_kval, smb, smh, smm, smn, sph, spr, spc, slb, slh, slt, scb, sch,
    pos_off, win_left, win_right, Hq, Nq, Nk, qk_scale, sm_scale, seed, dropout_p, inv_keep,
    Slopes, Lut, Sinks, DSlopes, DLut, softcap, rel_md,
    GROUPS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
    CHECK_Q: tl.constexpr, CHECK_K: tl.constexpr, POLICY: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr,
    EXCLUDE_SELF: tl.constexpr, DROPOUT: tl.constexpr, PRESCALE: tl.constexpr, POS: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SEG: tl.constexpr, QVAL: tl.constexpr, KVAL: tl.constexpr,
    SPION_BS: tl.constexpr, SCHED: tl.constexpr, MODE: tl.constexpr, NATURAL: tl.constexpr,
    TMA: tl.constexpr = False, DQ_ATOMIC: tl.constexpr = False, NM_EXP: tl.constexpr = False,
    KV_SORTED: tl.constexpr = False, ALIBI: tl.constexpr = False, REL: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False, MPOS: tl.constexpr = False,
):
    """The template's one kernel. ``MODE``: ``MODE_FWD`` (``out``, ``lse``), ``MODE_DQ`` (the
    backward's ``dq`` from ``DO``, ``Lse`` in log2 units and ``Delta``): one program per (query tile,
    batch x query head) streaming key tiles; ``MODE_DKDV``: one program per (key tile, batch x KV
    head) streaming the query tiles of every query head of its GQA group, summed without atomics.

    In the dK/dV mode tiles are keys by queries (``S^T``) so that ``P^T`` and ``dS^T`` feed the tensor
    cores from registers; with ``NATURAL`` they are queries by keys, the orientation in which a
    row-wise selection (DFSS) sees a group's members in one thread.

    With ``TMA`` the streamed tiles come through the tensor descriptors ``Desc0``/``Desc1`` (Hopper's TMA
    unit: ``(B, H, N, D)`` tensors, blocks of ``(1, 1, tile, BLOCK_D)``, zero-filled past ``N`` and the head
    dim) instead of per-thread address loads: K and V in the forward and dQ modes (key tiles in row order:
    no sorted layout, no N:M key order), Q and dO in the dK/dV mode (no sorted layout). With ``NM_EXP``
    (forward, 2:4 DFSS) the selection runs fused with the exponentials (:func:`.common._nm24_exp2`: only the
    two kept logits of a group are exponentiated) instead of in :func:`_entry`. With ``KV_SORTED`` (forward
    and dQ of a sorted layout) ``K``/``V`` are copies in sorted order, read at the tile's own rows (and,
    with ``TMA``, through descriptors of the copies) instead of gathered through the permutation: a
    ``drop`` forward's (``Layout.kv``: its kept keys, then zero rows for the tiles that reach past them).

    With ``DQ_ATOMIC`` the dK/dV mode also computes dQ: each tile's ``dS^T K * sm_scale`` is added with
    float32 atomics to the buffer at ``DQ`` (strides ``sdq*``, rows in original query order), so that
    the backward needs no dQ launch (which would recompute ``QK^T``, ``P`` and ``dP``). With
    ``DQ_ATOMIC == 2`` ``DQ`` is a TMA descriptor of that buffer (``(B, Hq, Nq, D)``, blocks of ``(1, 1,
    BLOCK_M, BLOCK_D)``; query rows in order) and each tile's share is one bulk reduction
    (``cp.reduce.async.bulk``) instead of per-element atomics. The order of the additions varies from
    run to run: not deterministic (see backend.attention_backward).

    Score modifiers (``ALIBI``, ``REL``, ``SOFTCAP``, ``SINKS``; the tensors ``Slopes (Hq,)``, ``Lut (2 *
    rel_md + 1, Hq)`` float32, ``Sinks (Hq,)``, the cap ``softcap``): see :func:`_modify`; positions are the
    predicates' (``MPOS``: vectors that no window reads) or the defaults. The dK/dV mode writes ALiBi's
    gradient as one partial sum per (batch, query head, key tile) to ``DSlopes`` and adds each logit's
    gradient into ``DLut`` (float32, zeroed) with atomics: its order varies from run to run.
    """
    PERMUTED: tl.constexpr = POLICY == 2
    # NM_EXP (forward, 2:4 only): the selection is fused with the exponentials instead of applied in _entry
    ENTRY_POLICY: tl.constexpr = 0 if NM_EXP else POLICY
    # the logit modifiers (their result is in log2 units: the tiles are prescaled, PRESCALE), and the
    # positions they read: the predicates' vectors also where no window reads them (MPOS)
    MODS: tl.constexpr = ALIBI or REL or SOFTCAP
    TPOS: tl.constexpr = 2 if MPOS else POS
    if PRESCALE:
        sc = 1.0
    else:
        sc = qk_scale
    if MODE == 2:
        T: tl.constexpr = not NATURAL
        ktile = tl.program_id(0)
        bhk = tl.program_id(1)
        Hk = Hq // GROUPS
        b = bhk // Hk
        hk = bhk % Hk
        offs_n = ktile * BLOCK_N + _key_order(BLOCK_N, NM_M)
        nval = offs_n < Nk
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        kj = _orig(KPerm + bhk.to(tl.int64) * Nk, offs_n, nval, PERMUTED)
        k = _load_tile(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh, kj, nval, skn, offs_d, HEAD_D, BLOCK_D,
                       CHECK_K, False)
        v = _load_tile(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh, kj, nval, svn, offs_dv, HEAD_DV, BLOCK_DV,
                       CHECK_K, False)
        kp, ks, kv = _tok_vals(kj, nval, b, KPos, s_kpos, KSeg, s_kseg, KVal, s_kval, 0, TPOS, SEG, KVAL)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        # queries i reach key j iff i + off - left <= j <= i + off + right
        m_lo, m_hi = _span(ktile * BLOCK_N, tl.minimum(ktile * BLOCK_N + BLOCK_N, Nk) - 1, -pos_off, win_right, win_left,
                           BLOCK_M, tl.cdiv(Nq, BLOCK_M), POS, HAS_RIGHT, HAS_LEFT)
        for g in range(GROUPS):
            h = hk * GROUPS + g
            bh = b * Hq + h
            row0 = bh.to(tl.int64) * Nq
            q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_base = DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
            lrow, t_lo, t_hi = _inner_tiles(List, Cnt, b, h, ktile, slb, slh, slt, scb, sch, m_lo, m_hi, SCHED)
            dslope = tl.zeros([BLOCK_N], dtype=tl.float32)  # ALiBi: this key tile's share of dslope[h]
            for t in range(t_lo, t_hi):
                start_m, pred_check = _inner_tile(lrow, t, ktile * BLOCK_N, pos_off, win_left, win_right, BLOCK_M,
                                                  BLOCK_N, False, SCHED, POS, HAS_LEFT, HAS_RIGHT, PERMUTED,
                                                  QVAL | KVAL)
                offs_m = start_m + offs_m0
                mval = offs_m < Nq
                qi, qp, qs, qv, lo, hi = _query_side(QPerm, Lo, Hi, row0, offs_m, mval, b, QPos, s_qpos, QSeg, s_qseg,
                                                     QVal, s_qval, pos_off, PERMUTED, TPOS, SEG, QVAL)
                if TMA:
                    q = tl.reshape(Desc0.load([b, h, start_m, 0]), (BLOCK_M, BLOCK_D))
                    if T:
                        q = tl.trans(q)
                    do = tl.reshape(Desc1.load([b, h, start_m, 0]), (BLOCK_M, BLOCK_DV))
                else:
                    q = _load_tile(q_base, qi, mval, sqm, offs_d, HEAD_D, BLOCK_D, CHECK_Q, T)
                    do = _load_tile(do_base, qi, mval, sdom, offs_dv, HEAD_DV, BLOCK_DV, CHECK_Q, False)
                lse2 = tl.load(Lse + row0 + qi, mask=mval, other=float("inf"))
                di = tl.load(Delta + row0 + qi, mask=mval, other=0.0)
                if NATURAL:
                    qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
                else:
                    qk = _dot(k, q, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
                if MODS:
                    qk, tc, rel = _modify(qk, _bq(qp, T), _bk(kp, T), h, Slopes, Lut, sm_scale, softcap, rel_md, Hq,
                                          ALIBI, REL, SOFTCAP)
                    esc = 1.0
                else:
                    tc = qk
                    rel = qk
                    esc = qk_scale
                s = _entry(qk, _bq(offs_m, T), _bk(offs_n, T), _bq(qi, T), _bk(kj, T), _bq(qp, T), _bq(qs, T),
                           _bq(qv, T), _bq(lo, T), _bq(hi, T), _bk(kp, T), _bk(ks, T), _bk(kv, T), b, h, pred_check,
                           ktile * BLOCK_N,
                           Mask, smb, smh, smm, smn, Pat, sph, spr, spc, Nq, Nk, win_left, win_right, esc,
                           BLOCK_M, BLOCK_N, MASK_KIND, CHECK_K, POLICY, NM_N, NM_M, EXCLUDE_SELF, POS, HAS_LEFT,
                           HAS_RIGHT, SEG, QVAL, KVAL, SPION_BS, T, PRESCALE)
                p = tl.math.exp2(s * sc - _bq(lse2, T))
                if NATURAL:
                    dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
                else:
                    dp = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
                if DROPOUT:
                    scl = _dropout_scale(seed, _bq(((row0 + qi) * Nk).to(tl.uint32), T), _bk(kj, T), dropout_p, inv_keep)
                    pd = p * scl
                    dp = dp * scl
                else:
                    pd = p
                ds = p * (dp - _bq(di, T))
                if SOFTCAP:  # through c * tanh(s / c): the gradient of the logit before the cap
                    ds = ds * (1.0 - tc * tc)
                if ALIBI:
                    if NATURAL:
                        dslope += tl.sum(ds * rel.to(tl.float32), 0)
                    else:
                        dslope += tl.sum(ds * rel.to(tl.float32), 1)
                if REL:  # each logit's gradient to its entry of the host's look-up table (summed per bucket there)
                    idx = tl.minimum(tl.maximum(rel, -rel_md), rel_md) + rel_md
                    tl.atomic_add(DLut + idx.to(tl.int64) * Hq + h, ds,
                                  mask=_bq(mval, T) & _bk(nval, T) & (ds != 0.0), sem="relaxed")
                if NATURAL:
                    dv = _dot(tl.trans(pd.to(do.dtype)), do, dv)
                    dk = _dot(tl.trans(ds.to(q.dtype)), q, dk)
                else:
                    dv = _dot(pd.to(do.dtype), do, dv)
                    dk = _dot(ds.to(q.dtype), tl.trans(q), dk)
                if DQ_ATOMIC:
                    # this tile's share of dQ (queries by D), added to the float32 buffer at DQ
                    if NATURAL:
                        dq = _dot(ds.to(k.dtype), k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32))
                    else:
                        dq = _dot(tl.trans(ds.to(k.dtype)), k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32))
                    if DQ_ATOMIC == 2:
                        # one bulk reduction through TMA (``DQ`` is a descriptor of the buffer): rows past
                        # Nq and columns past the head dim fall outside it and are dropped
                        DQ.atomic_add([b, h, start_m, 0], tl.reshape(dq * sm_scale, (1, 1, BLOCK_M, BLOCK_D)))
                    else:
                        dq_ptrs = (DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
                                   + qi[:, None].to(tl.int64) * sdqm + offs_d[None, :])
                        tl.atomic_add(dq_ptrs, dq * sm_scale, mask=mval[:, None] & (offs_d[None, :] < HEAD_D),
                                      sem="relaxed")
            if ALIBI:  # one partial sum per (batch, head, key tile), summed on the host: no atomics
                tl.store(DSlopes + (b * Hq + h).to(tl.int64) * tl.num_programs(0) + ktile, tl.sum(dslope, 0))
        _store_tile(DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh, kj, nval, sdkn, offs_d, dk * sm_scale,
                    HEAD_D, BLOCK_D, CHECK_K)
        _store_tile(DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh, kj, nval, sdvn, offs_dv, dv,
                    HEAD_DV, BLOCK_DV, CHECK_K)
    else:
        # heavy (late) query tiles first: under causal they have the most key tiles
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        hk = h // GROUPS
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mval = offs_m < Nq
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row0 = bh.to(tl.int64) * Nq
        qi, qp, qs, qv, lo, hi = _query_side(QPerm, Lo, Hi, row0, offs_m, mval, b, QPos, s_qpos, QSeg, s_qseg,
                                             QVal, s_qval, pos_off, PERMUTED, TPOS, SEG, QVAL)
        q = _load_tile(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh, qi, mval, sqm, offs_d, HEAD_D, BLOCK_D,
                       CHECK_Q, False)
        kperm = KPerm + (b * (Hq // GROUPS) + hk).to(tl.int64) * Nk
        k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        if DROPOUT:
            drop_row = ((row0 + qi) * Nk).to(tl.uint32)
        else:
            drop_row = qi.to(tl.uint32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MODE == 1:
            do = _load_tile(DO + b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh, qi, mval, sdom, offs_dv, HEAD_DV,
                            BLOCK_DV, CHECK_Q, False)
            lse2 = tl.load(Lse + row0 + qi, mask=mval, other=float("inf"))
            di = tl.load(Delta + row0 + qi, mask=mval, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        n_lo, n_hi = _span(tile * BLOCK_M, tl.minimum(tile * BLOCK_M + BLOCK_M, Nq) - 1, pos_off, win_left, win_right,
                           BLOCK_N, tl.cdiv(Nk, BLOCK_N), POS, HAS_LEFT, HAS_RIGHT)
        if SCHED == 2:
            # the key tiles the rows' ranges reach (none where every range is empty), and their core:
            # the keys every row of the tile keeps
            has = mval & (lo < hi)
            n_lo = tl.min(tl.where(has, lo, Nk), 0) // BLOCK_N
            n_hi = tl.cdiv(tl.max(tl.where(has, hi, 0), 0), BLOCK_N)
            core_lo = tl.max(tl.where(mval, lo, 0), 0)
            core_hi = tl.min(tl.where(mval, hi, Nk), 0)
        lrow, t_lo, t_hi = _inner_tiles(List, Cnt, b, h, tile, slb, slh, slt, scb, sch, n_lo, n_hi, SCHED)
        for t in range(t_lo, t_hi):
            start_n, pred_check = _inner_tile(lrow, t, tile * BLOCK_M, pos_off, win_left, win_right, BLOCK_M, BLOCK_N,
                                              True, SCHED, POS, HAS_LEFT, HAS_RIGHT, PERMUTED, QVAL | KVAL)
            if SCHED == 2:
                pred_check = (start_n < core_lo) | (start_n + BLOCK_N > core_hi)
            offs_n = start_n + _key_order(BLOCK_N, NM_M)
            nval = offs_n < Nk
            kj = _orig(kperm, offs_n, nval, PERMUTED)
            if KV_SORTED:
                krow = offs_n
            else:
                krow = kj
            if TMA:
                kT = tl.trans(tl.reshape(Desc0.load([b, hk, start_n, 0]), (BLOCK_N, BLOCK_D)))
            else:
                kT = _load_tile(k_base, krow, nval, skn, offs_d, HEAD_D, BLOCK_D, CHECK_K, True)
            kp, ks, kv = _tok_vals(kj, nval, b, KPos, s_kpos, KSeg, s_kseg, KVal, s_kval, 0, TPOS, SEG, KVAL)
            qk = _dot(q, kT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
            if MODS:
                qk, tc, rel = _modify(qk, qp[:, None], kp[None, :], h, Slopes, Lut, sm_scale, softcap, rel_md, Hq,
                                      ALIBI, REL, SOFTCAP)
                esc = 1.0
            else:
                tc = qk
                esc = qk_scale
            s = _entry(qk,
                       offs_m[:, None], offs_n[None, :], qi[:, None], kj[None, :], qp[:, None], qs[:, None], qv[:, None],
                       lo[:, None], hi[:, None], kp[None, :], ks[None, :], kv[None, :], b, h, pred_check, start_n,
                       Mask, smb, smh, smm, smn, Pat, sph, spr, spc, Nq, Nk, win_left, win_right, esc,
                       BLOCK_M, BLOCK_N, MASK_KIND, CHECK_K, ENTRY_POLICY, NM_N, NM_M, EXCLUDE_SELF, POS, HAS_LEFT,
                       HAS_RIGHT, SEG, QVAL, KVAL, SPION_BS, False, PRESCALE)
            if MODE == 1:
                if TMA:
                    vT = tl.trans(tl.reshape(Desc1.load([b, hk, start_n, 0]), (BLOCK_N, BLOCK_DV)))
                else:
                    vT = _load_tile(v_base, krow, nval, svn, offs_dv, HEAD_DV, BLOCK_DV, CHECK_K, True)
                p = tl.math.exp2(s * sc - lse2[:, None])
                dp = _dot(do, vT, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
                if DROPOUT:
                    dp = dp * _dropout_scale(seed, drop_row[:, None], kj[None, :], dropout_p, inv_keep)
                ds = p * (dp - di[:, None])
                if SOFTCAP:
                    ds = ds * (1.0 - tc * tc)
                acc = _dot(ds.to(kT.dtype), tl.trans(kT), acc)
            else:
                # (with NM_EXP ``s`` is not yet selected: a group's largest logit is always kept, so
                # the row maximum is the same)
                m_new = tl.maximum(m_i, tl.max(s, 1) * sc)
                # a row with nothing kept so far keeps m = -inf; subtract 0 instead to avoid inf - inf
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_sub)
                if NM_EXP:
                    p, p_sum = _nm24_exp2(s, sc, m_sub, BLOCK_M, BLOCK_N)
                else:
                    p = tl.math.exp2(s * sc - m_sub[:, None])
                    p_sum = tl.sum(p, 1)
                l_i = l_i * alpha + p_sum
                acc = acc * alpha[:, None]
                if DROPOUT:
                    p = p * _dropout_scale(seed, drop_row[:, None], kj[None, :], dropout_p, inv_keep)
                if TMA:
                    v = tl.reshape(Desc1.load([b, hk, start_n, 0]), (BLOCK_N, BLOCK_DV))
                else:
                    v = _load_tile(v_base, krow, nval, svn, offs_dv, HEAD_DV, BLOCK_DV, CHECK_K, False)
                acc = _dot(p.to(v.dtype), v, acc)
                m_i = m_new

        if MODE == 1:
            _store_tile(DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh, qi, mval, sdqm, offs_d, acc * sm_scale,
                        HEAD_D, BLOCK_D, CHECK_Q)
        elif SINKS:
            # the sink's logit joins the denominator (and attends to nothing): a row with no kept key
            # outputs 0 and has lse = sink
            sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_f)
            l_f = l_i * alpha + tl.math.exp2(sink - m_f)
            tl.store(Lse + row0 + qi, (m_f + tl.math.log2(l_f)) * 0.6931471805599453, mask=mval)
            _store_tile(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh, qi, mval, som, offs_dv,
                        acc * (alpha / l_f)[:, None], HEAD_DV, BLOCK_DV, CHECK_Q)
        else:
            empty = l_i == 0.0
            l_safe = tl.where(empty, 1.0, l_i)
            lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
            tl.store(Lse + row0 + qi, lse, mask=mval)
            _store_tile(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh, qi, mval, som, offs_dv, acc / l_safe[:, None],
                        HEAD_DV, BLOCK_DV, CHECK_Q)


@triton.jit
def _bwd_preprocess(
    Out, DO, Lse, Delta, Lse2,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    Hq, Nq,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    off_bh = tl.program_id(1)
    b = off_bh // Hq
    h = off_bh % Hq
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mval = offs_m < Nq
    o = _load_tile(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh, offs_m, mval, stride_om, offs_dv,
                   HEAD_DV, BLOCK_DV, True, False)
    do = _load_tile(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh, offs_m, mval, stride_dom,
                    offs_dv, HEAD_DV, BLOCK_DV, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = off_bh.to(tl.int64) * Nq + offs_m
    tl.store(Delta + row, delta, mask=mval)
    lse = tl.load(Lse + row, mask=mval, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Lse2 + row, lse2, mask=mval)


