"""A Hopper (sm_90) forward for dense and DFSS 2:4 attention, causal or not, written in Gluon: TMA rings,
asynchronous warp-group MMAs, and the softmax of one key tile computed while the tensor cores run the
previous tile's ``P @ V``.

The template (:mod:`.template`) is written in Triton's tile language, whose compiler issues each
``tl.dot`` and then waits for it: the softmax of a key tile and the matrix products never run at the
same time in one warp group. Here the schedule is explicit (Gluon: explicit layouts, shared memory,
barriers and warp-group MMAs), per query tile of ``BLOCK_M`` rows:

* the query tile and the first ``STAGES`` key and value tiles are requested through TMA (4-D
  descriptors: rows past ``N`` and features past ``D`` read as zeros), each ring slot with its own
  barrier;
* key tile ``j``: ``S = Q K_j^T`` is issued, then ``O += P_{j-1} V_{j-1}``; the kernel waits for ``S``
  only, computes the online softmax of tile ``j`` (``exp2`` of the scaled logits, the running max and
  sum) while ``P V`` runs, then waits for it, rescales ``O`` and refills the freed slots;
* tiles that need no mask (inside ``N`` and, when causal, below the diagonal) run a loop without one;
  the diagonal and the last partial tile run the masked loop; the first tile is masked always;
* the epilogue writes ``O / l`` through TMA (rows past ``N`` clipped) and the natural-log ``lse``.

DFSS 2:4 (``NM``): the selection runs on the logits tile in registers before the softmax. Each key and
value tile is read as one TMA box per group member (and 128-byte feature chunk) of a ``(B, H, N/4, 4,
D)`` view, so that column ``r * G + g`` of ``Q K^T`` holds member ``r`` of group ``g`` and the four
members of a group sit in one thread's registers (the template gets the same from its key order,
``common._key_order``); ``P @ V`` reads the value rows in the same order.

The warp-specialised kernel (:func:`_attn_fwd_ws`, configuration key ``WS``) runs the same loop in two or
three consumer warp groups, each on 64 rows of a 128- or 192-query tile, fed by a producer warp that owns
every TMA copy (the rings' slots are released by every consumer before the producer refills them), with
the registers moved to the consumers (``setmaxnreg``); ``PINGPONG`` makes two consumers take turns
issuing their matrix products, ``P_F32`` makes two consumers carry a tile's probabilities to the next step's
``P @ V`` in 32 bits (:func:`_p_carried`), and ``KEEP_PTX`` writes the DFSS selection as PTX compares that
combine their predicates (:func:`_keep24`) instead of min/max and selects (:func:`.common._keep4`).

It computes what the template's forward computes for a site whose policy keeps every entry or is DFSS
2:4, with no mask tensor, no predicate vectors and no dropout: ``out`` and ``lse`` of DESIGN.md §4. Which sites it
serves and when it runs is the backend's choice (:func:`applies`, ``configs``).

Gluon kernels have no interpreter: they are compiled and checked on a Hopper GPU
(``tests/codegen/test_hopper_gpu.py``) and compiled for sm_90 on any machine
(``tests/codegen/sm90_check.py --gluon``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import LOG2E, _join4, _keep4, _split4
from .launch import FastLaunch

__all__ = ["applies", "forward", "launch_args", "kernel_for", "HEAD_DIMS"]

#: head dims the kernel is built for (the smem ring and the register budget are sized for them)
HEAD_DIMS = (64, 128)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
_DESC_DTYPES = {**_GL_DTYPES, torch.float32: gl.float32}  # (the backward's float32 dQ buffer)


@gluon.constexpr_function
def _mma_layout(num_warps, n):
    """The register layout of a warp-group MMA result with ``n`` columns on ``num_warps`` warps (rows split
    across the warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _tile_2d(buf, ROWS: gl.constexpr, COLS: gl.constexpr):
    """A ``[1, 1, ROWS, COLS]`` TMA block in shared memory seen as the ``[ROWS, COLS]`` MMA operand."""
    return buf.reshape([ROWS, COLS])


@gluon.jit
def _kv_tile(buf, slot, ROWS: gl.constexpr, COLS: gl.constexpr, NM: gl.constexpr):
    """Ring slot ``slot`` of a key or value ring as the ``[ROWS, COLS]`` MMA operand (DFSS: the
    slot's boxes, placed by :func:`_load_kv`, seen as one tile of the same swizzle)."""
    if NM:
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], buf.dtype)
        slots: gl.constexpr = buf.shape[0] * buf.shape[3] * buf.shape[5] // (ROWS * COLS)
        return buf._reinterpret(buf.dtype, [slots, ROWS, COLS], layout).index(slot)
    else:
        return buf.index(slot).reshape([ROWS, COLS])


@gluon.jit
def _load_kv(desc, b, hk, start, bar, buf, slot, pred, NM: gl.constexpr, HEAD_D: gl.constexpr):
    """Requests the key or value tile from key ``start`` into ring slot ``slot`` (barrier ``bar``).
    DFSS (``NM``): boxes of the ``(B, H, N/4, 4, D)`` view, box ``(c, r)`` the ``r``-th member of every
    group in the tile, features ``[c * DC, (c + 1) * DC)`` (``DC``: one 128-byte swizzle row), placed
    as the tile's NVMMA layout places them (column chunk, then row): a group's members land in one
    thread's columns of ``Q K^T``."""
    if NM:
        DC: gl.constexpr = desc.block_type.shape[4]
        for c in gl.static_range(HEAD_D // DC):
            for r in gl.static_range(4):
                tma.async_copy_global_to_shared(desc, [b, hk, start // 4, r, c * DC], bar,
                                                buf.index((slot * (HEAD_D // DC) + c) * 4 + r), pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [b, hk, start, 0], bar, buf.index(slot), pred=pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, cols, qk_scale, n_k, off, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                  NM: gl.constexpr):
    """Online softmax of one tile of raw logits ``s``: the new running max (log2 units), the rescale
    factor of what was summed before, the probabilities and the new running sum. The scale is folded
    into the exponent (one fused multiply-add per logit before its ``exp2``)."""
    if MASK:
        keep = gl.expand_dims(cols, 0) < n_k
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + off)
        s = gl.where(keep, s, float("-inf"))
    if NM:
        m_new, p, p_sum = _nm24_softmax(s, m_i, qk_scale, NM)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        p_sum = gl.sum(p, 1)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_sum
    return m_new, alpha, p, l_i


def kept_ptx(out: str, x: str, hi: str, lo: str, cmp: str, pred: str) -> str:
    """PTX that sets ``out`` to ``x`` where ``x cmp lo`` and (``x cmp hi`` or predicate ``pred``), else to
    ``-inf`` (predicates ``p1``, ``p2`` declared by the caller): a 2:4 member kept when at most one of two others
    beats it (``lo``/``hi``: their min/max) and, if one does, ``pred`` says the third does not."""
    return (f"setp.{cmp}.or.f32 p2, {x}, {hi}, {pred};\n"
            f"setp.{cmp}.and.f32 p1, {x}, {lo}, p2;\n"
            f"selp.f32 {out}, {x}, 0fFF800000, p1;\n")


# (_keep24's PTX: outputs $0-$3 the members, $4 the group max; inputs $5-$8 the four logits)
_KEEP24_PTX = gl.constexpr(
    "{\n.reg .pred p01, p23, p1, p2;\n.reg .f32 hi01, lo01, hi23, lo23;\n"
    "max.f32 hi01, $5, $6;\nmin.f32 lo01, $5, $6;\nmax.f32 hi23, $7, $8;\nmin.f32 lo23, $7, $8;\n"
    "max.f32 $4, hi01, hi23;\nsetp.ge.f32 p01, $5, $6;\nsetp.ge.f32 p23, $7, $8;\n"
    + kept_ptx("$0", "$5", "hi23", "lo23", "ge", "p01") + kept_ptx("$1", "$6", "hi23", "lo23", "ge", "!p01")
    + kept_ptx("$2", "$7", "hi01", "lo01", "gt", "p23") + kept_ptx("$3", "$8", "hi01", "lo01", "gt", "!p23") + "}")


@gluon.jit
def _keep24(x0, x1, x2, x3):
    """The four members of a 2:4 group with ``-inf`` for the two not kept (:func:`.common._keep4`'s rule), and
    the group's max. Member 0 is kept when at most one of members 2 and 3 beats it (``x0 >= min(x2, x3)``) and,
    where one does, member 1 does not (``x0 >= x1``); member 1 likewise with ``x1 > x0``; members 2 and 3
    against 0 and 1 strictly (both precede them), then each other. In PTX (:func:`kept_ptx`), so that the
    compares combine their predicates themselves: one compare per pair is shared by its two members."""
    return gl.inline_asm_elementwise(_KEEP24_PTX, "=f,=f,=f,=f,=f,f,f,f,f", [x0, x1, x2, x3],
                                     dtype=(gl.float32, ) * 5, is_pure=True, pack=1)


@gluon.jit
def _nm24_softmax(s, m_i, qk_scale, NM: gl.constexpr):
    """``(m_new, p, rowsum(p))`` of the online softmax with DFSS 2:4 on a tile of raw logits whose
    columns hold keys in :func:`_nm_cols` order (column ``r * G + g``: member ``r`` of the tile's group
    ``g``, ``G`` groups): the four members of a group sit in one thread's registers, so the selection
    moves no data (the template's :func:`.common._split4`, :func:`.common._keep4` and
    :func:`.common._join4` on the ``(BLOCK_M, G, 4)`` view). A member is kept when at most one member
    beats it (``j`` beats ``r`` when ``x_j > x_r``, or equal with ``j < r``); the others become ``-inf``
    before the exponentials. Each keep decision is consumed by the select next to it: boolean tiles
    kept alive across the tile (the template's fused form, which exponentiates only the kept two)
    compiled here to predicates moved through registers and ran slower. A group's largest logit is
    always kept, so the row maximum is taken over the groups' maxima. ``NM == 2`` (``KEEP_PTX``): the
    selection in PTX (:func:`_keep24`), else with :func:`.common._keep4`."""
    BLOCK_M: gl.constexpr = s.shape[0]
    G: gl.constexpr = s.shape[1] // 4
    x0, x1, x2, x3 = _split4(gl.permute(gl.reshape(s, [BLOCK_M, 4, G]), [0, 2, 1]), BLOCK_M, G)
    if NM == 2:
        y0, y1, y2, y3, gmax = _keep24(x0, x1, x2, x3)
    else:
        NEG: gl.constexpr = float("-inf")
        k0, k1, k2, k3 = _keep4(x0, x1, x2, x3, 2)
        y0 = gl.where(k0, x0, NEG)
        y1 = gl.where(k1, x1, NEG)
        y2 = gl.where(k2, x2, NEG)
        y3 = gl.where(k3, x3, NEG)
        gmax = gl.maximum(gl.maximum(x0, x1), gl.maximum(x2, x3))
    m_new = gl.maximum(m_i, gl.convert_layout(gl.max(gmax, 1), m_i.type.layout) * qk_scale)
    y = gl.reshape(gl.permute(_join4(y0, y1, y2, y3, BLOCK_M, G), [0, 2, 1]), [BLOCK_M, 4 * G])
    y = gl.convert_layout(y, s.type.layout)
    p = gl.exp2(y * qk_scale - gl.expand_dims(m_new, 1))
    p_sum = gl.sum(p, 1)
    return m_new, p, p_sum


@gluon.jit
def _nm_cols(BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The key (within a tile) that each column of a DFSS logits tile holds: column ``r * G + g`` holds
    key ``4 g + r`` (the four TMA boxes of a key tile, one per member ``r``, each ``G`` groups)."""
    c = gl.arange(0, BLOCK_N, layout=layout)
    return 4 * (c % (BLOCK_N // 4)) + c // (BLOCK_N // 4)


@gluon.jit
def _key_range(n_k, start_m, off, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """``(hi, n_full)`` of the query tile from ``start_m``: key tiles ``[0, hi)`` are visited (all, or up
    to the diagonal), ``[0, n_full)`` need no mask for any of its rows (at least the first is masked)."""
    hi = gl.cdiv(n_k, BLOCK_N)
    n_full = n_k // BLOCK_N
    if CAUSAL:
        hi = gl.minimum(hi, gl.cdiv(start_m + BLOCK_M + off, BLOCK_N))
        n_full = gl.minimum(n_full, (start_m + off + 1) // BLOCK_N)
    return hi, gl.maximum(n_full, 1)


@gluon.jit
def _write_out(o, m_i, l_i, q, q_tile, o_desc, lse_ptr, b, h, bh, row0, rows, n_q, row_o: gl.constexpr):
    """The epilogue: ``O / l`` written through TMA from the query rows' buffer ``q_tile`` (``q``: its MMA
    view; rows past ``N`` clipped) and the natural-log ``lse`` of ``rows``."""
    o = o / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    q.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_tile)
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634
    gl.store(lse_ptr + bh.to(gl.int64) * n_q + rows, lse, mask=rows < n_q)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, o_desc, lse_ptr, Hq, groups, n_q, n_k, off, qk_scale,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, NM: gl.constexpr,
              num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    # DFSS (NM): key and value tiles come as boxes of BLOCK_N / 4 keys (see _load_kv)
    BOXES: gl.constexpr = 4 * (HEAD_D // k_desc.block_type.shape[4]) if NM else 1
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2] * (4 if NM else 1)
    dtype: gl.constexpr = q_desc.dtype

    # the long (causal) query tiles first
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // groups
    start_m = pid_m * BLOCK_M

    s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(num_warps, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_buf = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    # DFSS: four boxes per ring slot, one after the other
    k_buf = gl.allocate_shared_memory(dtype, [STAGES * BOXES] + k_desc.block_type.shape, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [V_STAGES * BOXES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    hi, n_full = _key_range(n_k, start_m, off, BLOCK_M, BLOCK_N, CAUSAL)

    kv_bytes: gl.constexpr = k_desc.block_type.nbytes * BOXES
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_buf)
    for i in gl.static_range(STAGES):
        mbarrier.expect(k_bar.index(i), kv_bytes, pred=i < hi)
        _load_kv(k_desc, b, hk, i * BLOCK_N, k_bar.index(i), k_buf, i, i < hi, NM, HEAD_D)
    for i in gl.static_range(V_STAGES):
        mbarrier.expect(v_bar.index(i), kv_bytes, pred=i < hi)
        _load_kv(v_desc, b, hk, i * BLOCK_N, v_bar.index(i), v_buf, i, i < hi, NM, HEAD_D)

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    if NM:
        cols0 = _nm_cols(BLOCK_N, col_s)
    else:
        cols0 = gl.arange(0, BLOCK_N, layout=col_s)
    q = _tile_2d(q_buf, BLOCK_M, HEAD_D)

    # tile 0, masked
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q, _kv_tile(k_buf, 0, BLOCK_N, HEAD_D, NM).permute((1, 0)),
                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, rows, cols0, qk_scale, n_k, off, True, CAUSAL, NM)
    p_cur = gl.convert_layout(p.to(dtype), p_layout)
    o = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    refill = STAGES < hi
    mbarrier.expect(k_bar.index(0), kv_bytes, pred=refill)
    _load_kv(k_desc, b, hk, STAGES * BLOCK_N, k_bar.index(0), k_buf, 0, refill, NM, HEAD_D)

    for j in range(1, n_full):
        m_i, l_i, o, p_cur = _kv_step(j, q, k_buf, v_buf, k_bar, v_bar, k_desc, v_desc, m_i, l_i, o, p_cur,
                                      rows, cols0 + j * BLOCK_N, b, hk, hi, qk_scale, n_k, off,
                                      False, CAUSAL, NM, STAGES, V_STAGES, BLOCK_M, BLOCK_N, HEAD_D, s_layout, row_o,
                                      p_layout)
    for j in range(n_full, hi):
        m_i, l_i, o, p_cur = _kv_step(j, q, k_buf, v_buf, k_bar, v_bar, k_desc, v_desc, m_i, l_i, o, p_cur,
                                      rows, cols0 + j * BLOCK_N, b, hk, hi, qk_scale, n_k, off,
                                      True, CAUSAL, NM, STAGES, V_STAGES, BLOCK_M, BLOCK_N, HEAD_D, s_layout, row_o,
                                      p_layout)

    # the last tile's P @ V
    last = hi - 1
    mbarrier.wait(v_bar.index(last % V_STAGES), (last // V_STAGES) & 1)
    o = warpgroup_mma(p_cur, _kv_tile(v_buf, last % V_STAGES, BLOCK_N, HEAD_D, NM), o)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
    for i in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bar.index(i))
    mbarrier.invalidate(q_bar)

    _write_out(o, m_i, l_i, q, q_buf, o_desc, lse_ptr, b, h, bh, start_m, rows, n_q, row_o)


@gluon.jit
def _kv_step(j, q, k_buf, v_buf, k_bar, v_bar, k_desc, v_desc, m_i, l_i, o, p_cur, rows, cols, b, hk, hi,
             qk_scale, n_k, off, MASK: gl.constexpr, CAUSAL: gl.constexpr, NM: gl.constexpr, STAGES: gl.constexpr,
             V_STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, s_layout: gl.constexpr, row_o: gl.constexpr,
             p_layout: gl.constexpr):
    """Key tile ``j``: ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` issued together, the softmax of
    ``S_j`` while the second runs, then ``O`` rescaled and the freed ring slots refilled."""
    sk = j % STAGES
    sv = (j - 1) % V_STAGES
    mbarrier.wait(k_bar.index(sk), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q, _kv_tile(k_buf, sk, BLOCK_N, HEAD_D, NM).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    mbarrier.wait(v_bar.index(sv), ((j - 1) // V_STAGES) & 1)
    o_tok = warpgroup_mma(p_cur, _kv_tile(v_buf, sv, BLOCK_N, HEAD_D, NM), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    # K_j is read: its slot takes key tile j + STAGES
    nxt = j + STAGES
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes * (4 * (HEAD_D // k_desc.block_type.shape[4]) if NM else 1)
    mbarrier.expect(k_bar.index(sk), kv_bytes, pred=nxt < hi)
    _load_kv(k_desc, b, hk, nxt * BLOCK_N, k_bar.index(sk), k_buf, sk, nxt < hi, NM, HEAD_D)
    m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, rows, cols, qk_scale, n_k, off, MASK, CAUSAL, NM)
    o, p_cur = warpgroup_mma_wait(0, deps=(o_tok, p_cur))
    # V_{j-1} is read: its slot takes value tile j - 1 + V_STAGES
    nv = j - 1 + V_STAGES
    mbarrier.expect(v_bar.index(sv), kv_bytes, pred=nv < hi)
    _load_kv(v_desc, b, hk, nv * BLOCK_N, v_bar.index(sv), v_buf, sv, nv < hi, NM, HEAD_D)
    o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    p_cur = gl.convert_layout(p.to(p_cur.dtype), p_layout)
    return m_i, l_i, o, p_cur


# -- the warp-specialised forward (configuration key ``WS``) ----------------------------------------
# Per block of ``BLOCK_M = NUM_WG * M_WG`` queries (``M_WG`` = 64, ``NUM_WG`` 2 or 3): a producer warp
# fills each consumer's query rows and the key and value rings through TMA; ``NUM_WG`` consumer warp
# groups, one per ``M_WG`` rows of the query tile, each run the loop of :func:`_kv_step` (the softmax of
# tile ``j`` while ``P_{j-1} V_{j-1}`` runs), sharing the rings: a slot is refilled once every consumer
# released it (its ``empty`` barrier counts ``NUM_WG`` arrivals). With ``PINGPONG`` (two consumers) they
# take turns issuing their matrix products (a barrier per consumer, passed after each issue), so that one
# warp group's softmax runs while the tensor cores serve the other's products. Registers go where the
# work is (``setmaxnreg``, ``_WS_REGS``): 240 per consumer thread with two, 160-168 with three, 24 per
# producer thread.


@gluon.jit
def _ws_load(q_desc, k_desc, v_desc, q_buf, k_buf, v_buf, q_bar, k_ready, k_empty, v_ready, v_empty, b, h, hk,
             start_m, hi, NM: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """The producer: every consumer's query rows, then key tile ``j`` and value tile ``j`` for ``j < hi``,
    each into its ring slot once every consumer released what the slot held."""
    M_WG: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BOXES: gl.constexpr = 4 * (HEAD_D // k_desc.block_type.shape[4]) if NM else 1
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2] * (4 if NM else 1)
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes * BOXES
    NUM_WG: gl.constexpr = q_buf.shape[0]
    for w in gl.static_range(NUM_WG):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + w * M_WG, 0], q_bar.index(w), q_buf.index(w))
    for j in range(hi):
        sk = j % STAGES
        mbarrier.wait(k_empty.index(sk), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(sk), kv_bytes)
        _load_kv(k_desc, b, hk, j * BLOCK_N, k_ready.index(sk), k_buf, sk, True, NM, HEAD_D)
        sv = j % V_STAGES
        mbarrier.wait(v_empty.index(sv), ((j // V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(sv), kv_bytes)
        _load_kv(v_desc, b, hk, j * BLOCK_N, v_ready.index(sv), v_buf, sv, True, NM, HEAD_D)


@gluon.jit
def _ws_turn(turn, WG: gl.constexpr, t, PINGPONG: gl.constexpr):
    """Waits for consumer ``WG``'s turn ``t`` to issue matrix products (with ``PINGPONG``)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), t & 1)


@gluon.jit
def _ws_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Hands the turn to the other consumer (with ``PINGPONG``)."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _ws_release(bar):
    """Releases a ring slot that this warp group's finished MMAs read: one arrival for the group (the
    slot's ``empty`` barrier expects one per consumer), after every warp of the group has waited for
    its MMAs."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _ws_consume(o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, WG: gl.constexpr,
                CAUSAL: gl.constexpr, NM: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                PINGPONG: gl.constexpr, P_F32: gl.constexpr):
    """Consumer ``WG``: rows ``[start_m + WG * M_WG, start_m + (WG + 1) * M_WG)`` of the query tile;
    ``smem``: the buffers and barriers the partitions share."""
    q_buf, k_buf, v_buf, q_bar, k_ready, k_empty, v_ready, v_empty, turn = smem
    M_WG: gl.constexpr = o_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = o_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_buf.shape[3] * (4 if NM else 1)
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(4, HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = start_m + WG * M_WG
    rows = row0 + gl.arange(0, M_WG, layout=row_s)
    if NM:
        cols0 = _nm_cols(BLOCK_N, col_s)
    else:
        cols0 = gl.arange(0, BLOCK_N, layout=col_s)
    q = _tile_2d(q_buf.index(WG), M_WG, HEAD_D)

    # tile 0, masked: S_0 alone
    mbarrier.wait(q_bar.index(WG), 0)
    mbarrier.wait(k_ready.index(0), 0)
    _ws_turn(turn, WG, 0, PINGPONG)
    s_tok = warpgroup_mma(q, _kv_tile(k_buf, 0, BLOCK_N, HEAD_D, NM).permute((1, 0)),
                          gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    _ws_pass(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    _ws_release(k_empty.index(0))
    m_i = gl.full([M_WG], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([M_WG], gl.float32, row_s)
    m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, rows, cols0, qk_scale, n_k, off, True, CAUSAL, NM)
    p_cur = _p_carried(p, p_layout, dtype, P_F32)
    o = gl.zeros([M_WG, HEAD_D], gl.float32, o_layout)

    for j in range(1, n_full):
        m_i, l_i, o, p_cur = _ws_step(j, q, k_buf, v_buf, k_ready, k_empty, v_ready, v_empty, turn, m_i, l_i, o,
                                      p_cur, rows, cols0 + j * BLOCK_N, qk_scale, n_k, off, WG, False, CAUSAL, NM,
                                      STAGES, V_STAGES, PINGPONG, s_layout, row_o, p_layout, P_F32)
    # (the masked steps carry the product's operand: their masks need the registers)
    p_cur = _p_operand(p_cur, p_layout, dtype)
    for j in range(n_full, hi):
        m_i, l_i, o, p_cur = _ws_step(j, q, k_buf, v_buf, k_ready, k_empty, v_ready, v_empty, turn, m_i, l_i, o,
                                      p_cur, rows, cols0 + j * BLOCK_N, qk_scale, n_k, off, WG, True, CAUSAL, NM,
                                      STAGES, V_STAGES, PINGPONG, s_layout, row_o, p_layout, False)

    # the last tile's P @ V
    last = hi - 1
    sv = last % V_STAGES
    mbarrier.wait(v_ready.index(sv), (last // V_STAGES) & 1)
    _ws_turn(turn, WG, hi, PINGPONG)
    p_op = _p_operand(p_cur, p_layout, dtype)
    o_tok = warpgroup_mma(p_op, _kv_tile(v_buf, sv, BLOCK_N, HEAD_D, NM), o, is_async=True)
    _ws_pass(turn, WG, PINGPONG)
    o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))

    # (this consumer's query buffer holds its output tile: no MMA reads it any more)
    _write_out(o, m_i, l_i, q, q_buf.index(WG), o_desc, lse_ptr, b, h, bh, row0, rows, n_q, row_o)


@gluon.jit
def _ws_step(j, q, k_buf, v_buf, k_ready, k_empty, v_ready, v_empty, turn, m_i, l_i, o, p_cur, rows, cols, qk_scale,
             n_k, off, WG: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, NM: gl.constexpr,
             STAGES: gl.constexpr, V_STAGES: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr,
             row_o: gl.constexpr, p_layout: gl.constexpr, P_F32: gl.constexpr):
    """A consumer's key tile ``j`` (:func:`_kv_step`'s schedule; the producer refills the slots)."""
    M_WG: gl.constexpr = q.shape[0]
    HEAD_D: gl.constexpr = q.shape[1]
    BLOCK_N: gl.constexpr = k_buf.shape[3] * (4 if NM else 1)
    sk = j % STAGES
    sv = (j - 1) % V_STAGES
    mbarrier.wait(k_ready.index(sk), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(sv), ((j - 1) // V_STAGES) & 1)
    _ws_turn(turn, WG, j, PINGPONG)
    s_tok = warpgroup_mma(q, _kv_tile(k_buf, sk, BLOCK_N, HEAD_D, NM).permute((1, 0)),
                          gl.zeros([M_WG, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    p_op = _p_operand(p_cur, p_layout, q.dtype)
    o_tok = warpgroup_mma(p_op, _kv_tile(v_buf, sv, BLOCK_N, HEAD_D, NM), o, is_async=True)
    _ws_pass(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    _ws_release(k_empty.index(sk))
    m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, rows, cols, qk_scale, n_k, off, MASK, CAUSAL, NM)
    o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
    _ws_release(v_empty.index(sv))
    o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return m_i, l_i, o, _p_carried(p, p_layout, q.dtype, P_F32)


@gluon.jit
def _p_carried(p, p_layout: gl.constexpr, dtype: gl.constexpr, P_F32: gl.constexpr):
    """The probabilities of a tile as carried to the next step's ``P @ V``: as computed (``P_F32``), or as the
    product's operand. Carried in 16 bits, they stay separate half-registers across the loop and ptxas packs
    them for the product with a byte permute per register (32 per step at 64 x 128); carried in 32 bits, their
    conversion right before the product packs them in place. That costs 32 registers over the loop's edge,
    which three consumer warp groups (160 registers a thread) cannot spare, nor the masked steps (the
    causal kernels spilled): those carry the operand."""
    if P_F32:
        return p
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _p_operand(p_cur, p_layout: gl.constexpr, dtype: gl.constexpr):
    """The ``A`` operand of ``P @ V`` from what :func:`_p_carried` carried."""
    if p_cur.dtype == dtype:
        return p_cur
    else:
        return gl.convert_layout(p_cur.to(dtype), p_layout)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, lse_ptr, Hq, groups, n_q, n_k, off, qk_scale,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, NM: gl.constexpr,
                 PINGPONG: gl.constexpr, NUM_WG: gl.constexpr, CONSUMER_REGS: gl.constexpr, P_F32: gl.constexpr,
                 num_warps: gl.constexpr):
    M_WG: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = NUM_WG * M_WG
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BOXES: gl.constexpr = 4 * (HEAD_D // k_desc.block_type.shape[4]) if NM else 1
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2] * (4 if NM else 1)
    dtype: gl.constexpr = q_desc.dtype

    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the long (causal) query tiles first
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // groups
    start_m = pid_m * BLOCK_M

    q_buf = gl.allocate_shared_memory(dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    k_buf = gl.allocate_shared_memory(dtype, [STAGES * BOXES] + k_desc.block_type.shape, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [V_STAGES * BOXES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    fence_async_shared()
    if PINGPONG:  # the first consumer takes the first turn
        mbarrier.arrive(turn.index(0), count=1)

    hi, n_full = _key_range(n_k, start_m, off, BLOCK_M, BLOCK_N, CAUSAL)  # (for every consumer's rows)

    # (turns: two consumers only)
    smem = (q_buf, k_buf, v_buf, q_bar, k_ready, k_empty, v_ready, v_empty, turn)
    if NUM_WG == 2:
        gl.warp_specialize([
            (_ws_consume, (o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, 0, CAUSAL,
                           NM, STAGES, V_STAGES, PINGPONG, P_F32)),
            (_ws_consume, (o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, 1, CAUSAL,
                           NM, STAGES, V_STAGES, PINGPONG, P_F32)),
            (_ws_load, (q_desc, k_desc, v_desc, q_buf, k_buf, v_buf, q_bar, k_ready, k_empty, v_ready, v_empty, b, h,
                        hk, start_m, hi, NM, STAGES, V_STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_ws_consume, (o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, 0, CAUSAL,
                           NM, STAGES, V_STAGES, False, P_F32)),
            (_ws_consume, (o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, 1, CAUSAL,
                           NM, STAGES, V_STAGES, False, P_F32)),
            (_ws_consume, (o_desc, lse_ptr, smem, bh, b, h, start_m, n_q, n_k, off, qk_scale, hi, n_full, 2, CAUSAL,
                           NM, STAGES, V_STAGES, False, P_F32)),
            (_ws_load, (q_desc, k_desc, v_desc, q_buf, k_buf, v_buf, q_bar, k_ready, k_empty, v_ready, v_empty, b, h,
                        hk, start_m, hi, NM, STAGES, V_STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_off: int, nm24: bool = False,
            scale: float = 1.0) -> Optional[str]:
    """Why the kernel cannot run these inputs (DFSS 2:4 with ``nm24``), or ``None`` where it can.
    Whether TMA can read the tensors (alignment, strides) is the caller's check
    (``backend._tma_aligned``)."""
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (float16 or bfloat16)"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (the kernel is built for {HEAD_DIMS}, Dv = D)"
    if pos_off < 0:
        return "causal with more queries than keys"
    if q.shape[1] % k.shape[1]:
        return "query heads not a multiple of key heads"
    if nm24 and k.shape[2] % 4:
        return f"DFSS with {k.shape[2]} keys (a multiple of 4: groups read as a (N/4, 4) view)"
    if nm24 and not scale > 0:  # the selection ranks the raw logits
        return f"DFSS with scale {scale} (> 0)"
    return None


_LAYOUTS: dict = {}


def _desc(t: torch.Tensor, rows: int, groups: bool = False, cols: Optional[int] = None,
          members: int = 1) -> TensorDescriptor:
    """A TMA descriptor of a ``(B, H, N, D)`` tensor in ``[1, 1, rows, D]`` blocks, or with ``groups``
    of its ``(B, H, N/4, 4, D)`` view (``N`` a multiple of 4) in ``[1, 1, rows / 4, members, D]`` blocks
    (``members`` members of ``rows / 4`` groups of four keys), or with ``cols`` in ``[1, 1, rows, cols]`` blocks, built
    without the constructor's checks, which cost more host time than the launch: the caller checked the
    tensor (``backend._tma_aligned``); the first descriptor of each block shape and dtype is built
    checked."""
    B, H, N, D = t.shape
    sb, sh, sn, sd = t.stride()
    if groups:  # boxes one 128-byte swizzle row wide (hopper._load_kv)
        dc = min(D, 128 // t.element_size())
        shape, strides, block = [B, H, N // 4, 4, D], [sb, sh, 4 * sn, sn, sd], [1, 1, rows // 4, members, dc]
    else:
        shape, strides, block = [B, H, N, D], [sb, sh, sn, sd], [1, 1, rows, cols or D]
    key = (tuple(block), t.dtype)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, _DESC_DTYPES[t.dtype])
        TensorDescriptor(t, shape, strides, block, layout)  # checked once
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = t, shape, strides, block, layout, "zero"
    return d


_kernel = FastLaunch(_attn_fwd)
_kernel_ws = FastLaunch(_attn_fwd_ws)
#: per number of consumer warp groups of the warp-specialised kernel: registers per thread at entry
#: (the consumers and the producer warp, padded to a group, share the SM's 64K) and per consumer
#: thread after ``setmaxnreg`` (the producer's group keeps 24)
_WS_REGS = {2: (168, 240), 3: (128, 160)}


def kernel_for(cfg: dict) -> FastLaunch:
    """The launcher of the kernel that ``cfg`` runs: warp-specialised (key ``WS``) or not."""
    return _kernel_ws if cfg.get("WS") else _kernel


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, pos_off: int,
            out: torch.Tensor, lse: torch.Tensor, cfg: dict, nm24: bool = False) -> None:
    """Writes ``out`` (``(B, Hq, Nq, D)``, any TMA-readable strides) and ``lse`` (``(B, Hq, Nq)``
    float32, contiguous) of dense attention, or of DFSS 2:4 with ``nm24`` (:func:`applies` says when),
    causal with query ``i`` at position ``i + pos_off``, under the launch configuration ``cfg``
    (``configs.GLUON_FWD``'s keys)."""
    if cfg.get("WS") and (cfg["BLOCK_M"] not in (128, 192) or (cfg.get("PINGPONG", True) and cfg["BLOCK_M"] != 128)):
        raise ValueError(f"the warp-specialised Gluon forward runs query tiles of 128 or 192 (two or three consumer "
                         f"warp groups of 64; turns with two), not BLOCK_M={cfg['BLOCK_M']}"
                         f"{' with PINGPONG' if cfg.get('PINGPONG', True) else ''}")
    grid, args = launch_args(q, k, v, scale, pos_off, out, lse, cfg, nm24)
    stages, v_stages = cfg["STAGES"], cfg.get("V_STAGES", cfg["STAGES"])
    nm = (2 if cfg.get("KEEP_PTX") else 1) if nm24 else 0
    if cfg.get("WS"):
        wg = cfg["BLOCK_M"] // 64
        maxnreg, regs = _WS_REGS[wg]
        _kernel_ws[grid](*args, CAUSAL=causal, STAGES=stages, V_STAGES=v_stages, NM=nm,
                         PINGPONG=bool(cfg.get("PINGPONG", True)), NUM_WG=wg, CONSUMER_REGS=regs,
                         P_F32=bool(cfg.get("P_F32")), num_warps=4,
                         maxnreg=maxnreg)
    else:
        _kernel[grid](*args, CAUSAL=causal, STAGES=stages, V_STAGES=v_stages, NM=nm, num_warps=cfg["num_warps"])


def launch_args(q, k, v, scale: float, pos_off: int, out, lse, cfg: dict, nm24: bool) -> tuple:
    """``(grid, args)`` of :func:`forward`'s launch: its positional arguments (the descriptors of q, k,
    v and out, then lse and the sizes). A launch plan repeats them with a call's own tensors
    (``backend._GluonPlan``). The warp-specialised kernel reads each half of a query tile apart."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows = 64 if cfg.get("WS") else bm
    grid = (triton.cdiv(Nq, bm), B * Hq)
    return grid, (_desc(q, rows), _desc(k, bn, nm24), _desc(v, bn, nm24), _desc(out, rows), lse, Hq, Hq // Hk, Nq,
                  Nk, pos_off, scale * LOG2E)
