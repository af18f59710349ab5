"""The backward for Hopper (sm_90) in Gluon: dense attention, causal or not, the matrix products issued as
asynchronous warp-group MMAs so that the exponentials of a tile run while the tensor cores compute that tile's
``dP`` (``dP^T`` in the dK/dV pass). By default one launch of the warp-specialised kernel (:func:`backward_ws`,
configuration key ``WS``, described above it below); where it cannot run (PyTorch's deterministic algorithms,
a Triton without TMA reductions), a dK/dV pass and a dQ pass.

The template's backward (:mod:`.template`, ``MODE_DKDV``) is written in Triton's tile language, whose
compiler waits for each ``tl.dot`` before the next statement. Here, per block of ``BLOCK_N`` keys (rows of
every product, so that ``P^T`` and ``dS^T`` are the register operands of ``dV`` and ``dK``) and per query
tile of ``BLOCK_M`` rows of every query head of the block's key head (grouped heads):

* the block's key and value rows come once through TMA; query and ``dO`` tiles stream through a ring of
  ``STAGES`` slots (4-D descriptors: rows past ``N`` read as zeros), each slot with its own barrier;
* ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued together; the kernel waits for the first only and
  computes ``P^T = exp2(S^T * scale * log2(e) - lse2)`` while the second runs (``lse2``: the forward's
  ``lse`` in log2 units, ``+inf`` for rows past ``N`` or without keys, so that their ``P`` is 0);
* then ``dS^T = P^T (dP^T - delta)``, ``dV += P^T dO`` and ``dK += dS^T Q``, after which the slot takes
  the tile ``STAGES`` steps on (two blocks fit on an SM by registers, so the scheduler can run one
  block's products while the other computes);
* causal: query tiles before the block's first visible query are skipped, and the mask is applied only
  to the tiles that cross the diagonal;
* the epilogue scales ``dK`` by the softmax scale and writes ``dK`` and ``dV`` through TMA from the key
  and value buffers (rows past ``N`` clipped).

``dQ`` comes from a second pass after this one: :func:`dq_pass` (configuration key ``DQ_GLUON``: per block
of 64 query rows of one head, one warp group, key and value tiles through a TMA ring, ``S = Q K^T`` and
``dP = dO V^T`` issued together and the exponentials computed while the second runs, ``dQ += dS K``; no
atomics, so deterministic), or the template's (``MODE_DQ``). Or, with ``DQ`` (configuration key
``DQ_ATOMIC``), it is added here: each step stores ``dS^T`` to shared memory, computes ``dQ = dS K``
(``DQ_COLS`` columns at a time, the left operand the stored tile transposed) and adds it into a zeroed
float32 buffer with one TMA reduction per tile (``cp.reduce.async.bulk.tensor``; the next tile is written
once the previous reduction has read its buffer). One launch instead of two, and no second ``Q K^T`` and
``dO V^T``; the additions' order varies from run to run, so the backend runs the two passes while
PyTorch's deterministic algorithms are on.

The inputs are those of the template's dK/dV pass after its preprocessing launch (``delta``, ``lse2``). It
runs the inputs the Gluon forward runs (dense: :func:`.hopper.applies`); which calls take it is the backend's
choice (configuration key ``KERNEL="gluon"``; by default the sites of ``configs.GLUON_BWD``, with the
warp-specialised kernel, and with the Gluon dQ pass where the two passes run, where they measured faster than
the template's backward). Gluon kernels have no interpreter: they are
checked on a Hopper GPU (``tests/codegen/test_hopper_gpu.py``) and compiled for sm_90 on any machine
(``tests/codegen/sm90_check.py``).
"""

from __future__ import annotations

import triton
from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import LOG2E
from .hopper import _desc, _mma_layout, _tile_2d, kept_ptx
from .launch import FastLaunch

__all__ = ["dkdv", "dq_pass", "backward_ws", "FUSED_DQ"]

#: whether this Triton's Gluon builds TMA reductions (``cp.reduce.async.bulk.tensor``), which the pass's fused dQ
#: (``DQ_ATOMIC``) adds its tiles with
FUSED_DQ = hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
#: columns of ``dQ`` per product and per TMA reduction in the fused pass (a float32 tile of 16 KiB): at D=128 two
#: in turn, at D=64 one
DQ_COLS = 64


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile ``src`` into the tensor of ``tensor_desc`` at ``coord`` with one TMA
    reduction (asynchronous, like a TMA store: ``tma.store_wait`` before ``src`` is written again). Triton 3.8
    names it ``tma.async_atomic_add``, which is used where it exists."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_reduce_add = getattr(tma, "async_atomic_add", _tma_reduce_add)


@gluon.jit
def _step_tile(it, hk, groups, lo, n_m, BLOCK_M: gl.constexpr):
    """``(h, start_m)`` of step ``it``: query head ``hk * groups + it // (n_m - lo)``, first row of query tile
    ``lo + it % (n_m - lo)``."""
    per_head = n_m - lo
    return hk * groups + it // per_head, (lo + it % per_head) * BLOCK_M


@gluon.jit
def _ring_load(desc1, desc2, buf1, buf2, bar, slot, b, h, row, pred):
    """Requests the tiles of ``desc1`` and ``desc2`` at row ``row`` of head ``(b, h)`` into ring slot ``slot``
    (one barrier for both); nothing where ``pred`` is false (past the last step)."""
    mbarrier.expect(bar.index(slot), desc1.block_type.nbytes + desc2.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc1, [b, h, row, 0], bar.index(slot), buf1.index(slot), pred=pred)
    tma.async_copy_global_to_shared(desc2, [b, h, row, 0], bar.index(slot), buf2.index(slot), pred=pred)


@gluon.jit
def _load_step(q_desc, do_desc, q_buf, do_buf, bar, slot, it, b, hk, groups, lo, n_m, total,
               BLOCK_M: gl.constexpr):
    """Requests the query and ``dO`` tiles of the dK/dV pass's step ``it`` (:func:`_step_tile`) into ring slot
    ``slot``; nothing past the last step."""
    h, start_m = _step_tile(it, hk, groups, lo, n_m, BLOCK_M)
    _ring_load(q_desc, do_desc, q_buf, do_buf, bar, slot, b, h, start_m, it < total)


@gluon.jit
def _pass_buffers(fixed1, fixed2, ring1, ring2, STAGES: gl.constexpr):
    """Shared memory of a pass: one tile each of descriptors ``fixed1`` and ``fixed2`` (read once), ``STAGES``
    ring slots of ``ring1`` and ``ring2`` tiles, a barrier for the fixed pair and one per slot (initialised)."""
    dtype: gl.constexpr = fixed1.dtype
    f1 = gl.allocate_shared_memory(dtype, fixed1.block_type.shape, fixed1.layout)
    f2 = gl.allocate_shared_memory(dtype, fixed2.block_type.shape, fixed2.layout)
    r1 = gl.allocate_shared_memory(dtype, [STAGES] + ring1.block_type.shape, ring1.layout)
    r2 = gl.allocate_shared_memory(dtype, [STAGES] + ring2.block_type.shape, ring2.layout)
    fixed_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar.index(i), count=1)
    return f1, f2, r1, r2, fixed_bar, bar


@gluon.jit
def _ring_products(a1, a2, buf1, buf2, bar, j, STAGES: gl.constexpr, layout: gl.constexpr):
    """Waits for ring slot ``j % STAGES`` to hold tile ``j``, then issues ``a1 t1^T`` and ``a2 t2^T``
    (asynchronous, results in ``layout``), ``t1`` and ``t2`` the slot's tiles of ``buf1`` and ``buf2``.
    Returns ``(t1, t2, token1, token2)``: the dK/dV pass streams queries and ``dO`` against its keys and
    values, the dQ pass keys and values against its queries and ``dO``."""
    ROWS: gl.constexpr = buf1.shape[3]
    M: gl.constexpr = a1.shape[0]
    D: gl.constexpr = a1.shape[1]
    slot = j % STAGES
    mbarrier.wait(bar.index(slot), (j // STAGES) & 1)
    t1 = _tile_2d(buf1.index(slot), ROWS, D)
    t2 = _tile_2d(buf2.index(slot), ROWS, D)
    tok1 = warpgroup_mma(a1, t1.permute((1, 0)), gl.zeros([M, ROWS], gl.float32, layout), use_acc=False, is_async=True)
    tok2 = warpgroup_mma(a2, t2.permute((1, 0)), gl.zeros([M, ROWS], gl.float32, layout), use_acc=False, is_async=True)
    return t1, t2, tok1, tok2


@gluon.jit
def _probs(st_tok, dpt_tok, it, lse2_ptr, delta_ptr, rows, b, hk, Hq, groups, lo, n_m, n_q, off, start_n, qk_scale,
           CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, st_layout: gl.constexpr, NM: gl.constexpr = False):
    """``(P^T, dS^T)`` of step ``it`` from its issued ``S^T`` and ``dP^T`` products: waits for the first,
    exponentiates (masked where the tile crosses the diagonal) while the second runs, then waits for it.
    DFSS 2:4 (``NM``; rows in :func:`_nm_keys` order): the logits masked first, then the members each group keeps
    (:func:`_nm24_rows`) exponentiated, the others 0."""
    BLOCK_N: gl.constexpr = rows.shape[0]
    h, start_m = _step_tile(it, hk, groups, lo, n_m, BLOCK_M)
    cols = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    row = (b * Hq + h).to(gl.int64) * n_q + cols
    lse2 = gl.load(lse2_ptr + row, mask=cols < n_q, other=float("inf"))
    delta = gl.load(delta_ptr + row, mask=cols < n_q, other=0.0)
    st = warpgroup_mma_wait(1, deps=(st_tok, ))
    if NM:
        if CAUSAL:
            if start_m + off < start_n + BLOCK_N - 1:  # the tile crosses the diagonal
                st = gl.where(gl.expand_dims(cols, 0) + off >= _nm_keys(st, start_n, st_layout), st, float("-inf"))
        pt = gl.exp2(_nm24_rows(st, st_layout) * qk_scale - gl.expand_dims(lse2, 0))
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if start_m + off < start_n + BLOCK_N - 1:  # the tile crosses the diagonal
                pt = gl.where(gl.expand_dims(cols, 0) + off >= gl.expand_dims(rows, 1), pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
    return pt, pt * (dpt - gl.expand_dims(delta, 0))


@gluon.constexpr_function
def _ds_layout(shape, dtype):
    """The shared layout of the ``dS^T`` tile the fused dQ product reads (transposed) as its left operand."""
    return gl.NVMMASharedLayout.get_default_for(shape, dtype)


@gluon.jit
def _dq_add(dq, dq_buf, dq_desc, b, h, start_m, col, sm_scale):
    """Adds ``dq * sm_scale`` (a float32 tile of ``dq_desc``'s block) into the dQ buffer at query row ``start_m``,
    column ``col`` of head ``(b, h)`` through ``dq_buf`` with one TMA reduction (rows past ``N`` clipped),
    once the previous reduction has read the buffer."""
    tma.store_wait(pendings=0)
    _tile_2d(dq_buf, dq.shape[0], dq.shape[1]).store(dq * sm_scale)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [b, h, start_m, col], dq_buf)


@gluon.jit
def _bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse2_ptr, delta_ptr, Hq, groups, n_q, n_k,
              off, qk_scale, sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr,
              num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype

    start_n = gl.program_id(0) * BLOCK_N
    bhk = gl.program_id(1)
    Hk = Hq // groups
    b = bhk // Hk
    hk = bhk % Hk

    st_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(num_warps, HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, st_layout)
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]  # (the module's DQ_COLS)
    dq_layout: gl.constexpr = _mma_layout(num_warps, DQ_COLS)

    k_buf, v_buf, q_buf, do_buf, kv_bar, bar = _pass_buffers(k_desc, v_desc, q_desc, do_desc, STAGES)
    if DQ:  # dS^T for the dQ product, and the float32 tile each dQ reduction reads
        ds_buf = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], _ds_layout([BLOCK_N, BLOCK_M], dtype))
        dq_buf = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    fence_async_shared()

    # the query tiles a key of the block can be seen from (causal: from the first query at or past it)
    n_m = gl.cdiv(n_q, BLOCK_M)
    lo = 0
    if CAUSAL:
        lo = gl.minimum(gl.maximum(start_n - off, 0) // BLOCK_M, n_m)
    total = groups * (n_m - lo)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, start_n, 0], kv_bar, k_buf)
    tma.async_copy_global_to_shared(v_desc, [b, hk, start_n, 0], kv_bar, v_buf)
    for i in gl.static_range(STAGES):
        _load_step(q_desc, do_desc, q_buf, do_buf, bar, i, i, b, hk, groups, lo, n_m, total, BLOCK_M)

    k_s = _tile_2d(k_buf, BLOCK_N, HEAD_D)
    v_s = _tile_2d(v_buf, BLOCK_N, HEAD_D)
    rows = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)

    for it in range(total):
        slot = it % STAGES
        q_s, do_s, st_tok, dpt_tok = _ring_products(k_s, v_s, q_buf, do_buf, bar, it, STAGES, st_layout)
        pt, dst = _probs(st_tok, dpt_tok, it, lse2_ptr, delta_ptr, rows, b, hk, Hq, groups, lo, n_m, n_q, off, start_n,
                         qk_scale, CAUSAL, BLOCK_M, st_layout)
        ds = dst.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_s, dk, is_async=True)
        if DQ:  # dQ = dS K, DQ_COLS columns at a time, from dS^T in shared memory
            ds_buf.store(ds)
            fence_async_shared()
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_s.slice(0, DQ_COLS, dim=1),
                               gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        else:
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        # the slot is read: it takes step it + STAGES
        _load_step(q_desc, do_desc, q_buf, do_buf, bar, slot, it + STAGES, b, hk, groups, lo, n_m, total, BLOCK_M)
        if DQ:
            h, start_m = _step_tile(it, hk, groups, lo, n_m, BLOCK_M)
            _dq_add(dq, dq_buf, dq_desc, b, h, start_m, 0, sm_scale)
            for c in gl.static_range(1, HEAD_D // DQ_COLS):
                dq = warpgroup_mma(ds_buf.permute((1, 0)), k_s.slice(c * DQ_COLS, DQ_COLS, dim=1),
                                   gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                _dq_add(dq, dq_buf, dq_desc, b, h, start_m, c * DQ_COLS, sm_scale)

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(i))
    # (every product that read K and V is done: their buffers take dK and dV)
    k_s.store((dk * sm_scale).to(dtype))
    v_s.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, start_n, 0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, start_n, 0], v_buf)
    tma.store_wait(pendings=0)


_kernel = FastLaunch(_bwd_dkdv)


def dkdv(q, k, v, grad_out, lse2, delta, dk, dv, scale: float, causal: bool, pos_off: int, cfg: dict,
         dq32=None) -> None:
    """Writes ``dk`` and ``dv`` (``(B, Hk, Nk, D)``, TMA-writable) of dense attention from the template's
    preprocessed ``lse2`` and ``delta`` (``(B, Hq, Nq)`` float32, contiguous), causal with query ``i`` at
    position ``i + pos_off``, under ``cfg`` (``BLOCK_M`` queries per step, ``BLOCK_N`` keys per block,
    ``STAGES`` ring slots; one warp group per block of 64 keys). With ``dq32`` (``q``'s shape, float32,
    contiguous, zeroed) the pass also adds ``dQ`` into it, ``DQ_COLS`` columns per product and TMA reduction
    (the order of the additions varies from run to run)."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if bn != 64 or cfg.get("num_warps", 4) != 4:
        raise ValueError(f"the Gluon dK/dV pass runs blocks of 64 keys on one warp group (BLOCK_N=64, num_warps=4), "
                         f"not BLOCK_N={bn} with {cfg.get('num_warps')} warps")
    if dq32 is not None and not FUSED_DQ:
        raise ValueError("this Triton's Gluon builds no TMA reductions: the dK/dV pass cannot add dQ")
    if dq32 is not None and (D % DQ_COLS or bm != 64):
        raise ValueError(f"the fused dQ takes 64-query steps and a head dim that is a multiple of {DQ_COLS}, "
                         f"not BLOCK_M={bm}, D={D}")
    grid = (triton.cdiv(Nk, bn), B * Hk)
    dk_d, dv_d = _desc(dk, bn), _desc(dv, bn)
    dq_d = dv_d if dq32 is None else _desc(dq32, bm, cols=DQ_COLS)  # (unread without DQ)
    _kernel[grid](_desc(q, bm), _desc(k, bn), _desc(v, bn), _desc(grad_out, bm), dk_d, dv_d, dq_d, lse2, delta, Hq,
                  Hq // Hk, Nq, Nk, pos_off, scale * LOG2E, scale, CAUSAL=causal, STAGES=cfg["STAGES"],
                  DQ=dq32 is not None, num_warps=4)


@gluon.jit
def _bwd_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2_ptr, delta_ptr, Hq, groups, n_q, n_k, off, qk_scale,
            sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype

    start_m = gl.program_id(0) * BLOCK_M
    bh = gl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // groups

    s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N)
    acc_layout: gl.constexpr = _mma_layout(num_warps, HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_buf, do_buf, k_buf, v_buf, q_bar, bar = _pass_buffers(q_desc, do_desc, k_desc, v_desc, STAGES)
    fence_async_shared()

    # the key tiles the block's queries see (causal: up to the last query's position)
    hi = n_k
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + BLOCK_M + off, 0), n_k)
    n_steps = gl.cdiv(hi, BLOCK_N)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_buf)
    tma.async_copy_global_to_shared(do_desc, [b, h, start_m, 0], q_bar, do_buf)
    for i in gl.static_range(STAGES):
        _ring_load(k_desc, v_desc, k_buf, v_buf, bar, i, b, hk, i * BLOCK_N, i < n_steps)

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    row = (b * Hq + h).to(gl.int64) * n_q + rows
    lse2 = gl.expand_dims(gl.load(lse2_ptr + row, mask=rows < n_q, other=float("inf")), 1)
    delta = gl.expand_dims(gl.load(delta_ptr + row, mask=rows < n_q, other=0.0), 1)
    q_s = _tile_2d(q_buf, BLOCK_M, HEAD_D)
    do_s = _tile_2d(do_buf, BLOCK_M, HEAD_D)
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(q_bar, 0)

    for j in range(n_steps):
        slot = j % STAGES
        k_s, v_s, s_tok, dp_tok = _ring_products(q_s, do_s, k_buf, v_buf, bar, j, STAGES, s_layout)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - lse2)
        if CAUSAL:
            if (j + 1) * BLOCK_N - 1 > start_m + off:  # the tile crosses the diagonal
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
                p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + off, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds = p * (dp - delta)
        # (key rows past N read as zeros: their dS adds nothing)
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_s, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        _ring_load(k_desc, v_desc, k_buf, v_buf, bar, slot, b, hk, (j + STAGES) * BLOCK_N, j + STAGES < n_steps)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(i))
    q_s.store((dq * sm_scale).to(dtype))  # (every product that read Q is done)
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, start_m, 0], q_buf)
    tma.store_wait(pendings=0)


_dq_kernel = FastLaunch(_bwd_dq)


def dq_pass(q, k, v, grad_out, lse2, delta, dq, scale: float, causal: bool, pos_off: int, cfg) -> None:
    """Writes ``dq`` (``q``'s shape, TMA-writable) of dense attention from the preprocessed ``lse2`` and
    ``delta``, as the template's dQ pass does: per block of ``cfg[0]`` queries (one warp group), key and value
    tiles of ``cfg[1]`` rows through a ring of ``cfg[2]`` slots, ``S`` and ``dP`` issued together and the
    exponentials computed while ``dP`` runs, then ``dQ += dS K``."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    bm, bn, stages = cfg
    if bm != 64:
        raise ValueError(f"the Gluon dQ pass runs blocks of 64 queries on one warp group, not {bm}")
    grid = (triton.cdiv(Nq, bm), B * Hq)
    _dq_kernel[grid](_desc(q, bm), _desc(k, bn), _desc(v, bn), _desc(grad_out, bm), _desc(dq, bm), lse2, delta, Hq,
                     Hq // Hk, Nq, Nk, pos_off, scale * LOG2E, scale, CAUSAL=causal, STAGES=stages, num_warps=4)


# -- the warp-specialised backward (configuration key ``WS``) ---------------------------------------------------
# Per block of ``2 * M_WG`` keys (``M_WG`` = 64) of one key head: a producer warp loads the block's key and value
# rows once and streams the query and ``dO`` tiles of every step (as :func:`_bwd_dkdv` orders them) through a ring;
# two consumer warp groups, one per 64 keys, each run the dK/dV pass's step on their rows, store their ``dS^T`` in
# shared memory and, once both have, compute their share of the step's ``dQ = dS K`` over all ``2 * M_WG`` keys
# (D=128: one 64-column half each; D=64: the whole tile, the groups taking turns by step) and add it into the
# float32 dQ buffer with one TMA reduction. One launch, ``dQ`` added once per 128 keys, registers where the work is
# (``setmaxnreg``: 240 per consumer thread, 24 per producer thread).
#
# DFSS 2:4 (``NM``): a group's four keys must be ranked within a column of ``S^T``, whose rows (keys) the MMA
# layout spreads over threads: a thread holds rows ``q`` and ``q + 8`` of its warp's 16, the thread ``lane ^ 4``
# rows ``q ^ 1`` and ``q ^ 1 + 8``. Key and value rows are therefore read in the order of :func:`_nm_keys` (TMA
# boxes of two members of four groups, ``(B, H, N/4, 4, D)`` view), which puts each group's four members on those
# four rows; each thread swaps its two logits per column with its partner (one ``shfl.bfly`` each) and decides
# its own two members only (:func:`_keep_pair`: what :func:`.common._keep4` keeps). dK and dV rows go back through
# the same boxes; dQ sums over the keys in any order.


#: keys per consumer warp group of the warp-specialised backward (``_WS_KEYS``: the same, for the kernels)
WS_KEYS = 64
_WS_KEYS = gl.constexpr(WS_KEYS)


@gluon.jit
def _ws_arrive(bar):
    """One arrival of a warp group at ``bar``, after every warp of the group got there."""
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _nm_keys(st, start, layout: gl.constexpr):
    """The key that each logit of a DFSS ``S^T`` tile (``st``: a warp group's rows from key ``start``, in
    ``layout``) belongs to, as a tile of ``st``'s shape: in each slab of 16 rows, row ``8 p + 2 a + m`` holds
    member ``2 p + m`` of the slab's group ``a`` (key ``4 a + 2 p + m``), so that the members of a group sit in
    rows ``q``, ``q + 8`` (one thread) and ``q ^ 1``, ``q ^ 1 + 8`` (its partner ``lane ^ 4``). Computed per
    element of the whole tile: the same arithmetic on a vector of rows broadcast over the queries gave odd
    queries their even neighbour's keys (H100 and H200, Triton 3.6)."""
    r = _row_index(st, layout)
    w = r % 16
    return start + r - w + 4 * ((w % 8) // 2) + 2 * (w // 8) + w % 2


@gluon.jit
def _row_index(st, layout: gl.constexpr):
    """The row of each element of ``st`` (in ``layout``), as a tile of its shape."""
    M: gl.constexpr = st.shape[0]
    BM: gl.constexpr = st.shape[1]
    return gl.expand_dims(gl.arange(0, M, layout=gl.SliceLayout(1, layout)), 1) + gl.zeros([M, BM], gl.int32, layout)


@gluon.jit
def _swap_lane4(x):
    """The value the thread ``lane ^ 4`` holds in the same register (``S^T`` row ``q ^ 1``, same column)."""
    return gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 31, -1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _keep_pair(a, b, c, d, odd):
    """A thread's two members of a 2:4 group, ``a`` (member ``m``) and ``b`` (member ``m + 2``), with ``-inf`` for
    the one not kept, from the partner's ``c`` (member ``1 - m``) and ``d`` (member ``3 - m``); ``odd``: ``m``.
    Whatever ``m`` is, ``a`` precedes ``b`` and ``d``, and ``c`` precedes ``b``; ties between ``a`` and ``c`` (``b``
    and ``d``) go to the even member. So ``a`` is kept when at most one of ``b``, ``d`` beats it (``a >= min(b, d)``)
    and, where one does (``a < max(b, d)``), ``c`` does not (``a > c``, or ``a == c`` with ``m`` even); ``b``
    likewise against ``a`` and ``c`` (strictly: both precede it), then ``d``. In PTX, so that the conditions stay
    predicates combined by the compares themselves (written as Boolean tensors they compiled to chains of
    selects)."""
    return gl.inline_asm_elementwise(_KEEP_PAIR_PTX, "=f,=f,f,f,f,f,r", [a, b, c, d, odd],
                                     dtype=(gl.float32, gl.float32), is_pure=True, pack=1)


def _member_ptx(out: str, x: str, tie: str, others: tuple, cmp: str) -> str:
    """:func:`_keep_pair`'s PTX for one member ``x``: kept when ``x cmp`` both of ``others`` or ``x cmp`` one
    and ``x`` beats ``tie`` (greater, or equal on an even thread: predicate ``pe``)."""
    return (f"max.f32 hi, {others[0]}, {others[1]};\nmin.f32 lo, {others[0]}, {others[1]};\n"
            f"setp.eq.and.f32 p3, {x}, {tie}, pe;\nsetp.gt.or.f32 p3, {x}, {tie}, p3;\n"
            + kept_ptx(out, x, "hi", "lo", cmp, "p3"))


# (_keep_pair's PTX: outputs $0 = a's, $1 = b's; inputs a $2, b $3, c $4, d $5, odd $6)
_KEEP_PAIR_PTX = gl.constexpr("{\n.reg .pred pe, p1, p2, p3;\n.reg .f32 hi, lo;\nsetp.eq.b32 pe, $6, 0;\n"
                              + _member_ptx("$0", "$2", "$4", ("$3", "$5"), "ge")
                              + _member_ptx("$1", "$3", "$5", ("$2", "$4"), "gt") + "}")


@gluon.jit
def _nm24_rows(st, layout: gl.constexpr):
    """DFSS 2:4 on a tile of raw (masked) logits ``st`` (``S^T`` in ``layout``: keys in :func:`_nm_keys` order by
    queries): the members each group keeps, ``-inf`` for the others (the forward's selection: a member is kept
    when at most one member beats it, ``j`` beating ``r`` when ``x_j > x_r`` or equal with ``j < r``)."""
    M: gl.constexpr = st.shape[0]
    BM: gl.constexpr = st.shape[1]
    ri = _row_index(st, layout)
    # rows q and q + 8 of each slab (one thread's): members m and m + 2 of its group, m = q % 2
    a, b = gl.split(gl.permute(gl.reshape(st, [M // 16, 2, 8, BM]), [0, 2, 3, 1]))
    ra, rb = gl.split(gl.permute(gl.reshape(ri, [M // 16, 2, 8, BM]), [0, 2, 3, 1]))
    c = _swap_lane4(a)  # member 1 - m
    d = _swap_lane4(b)  # member 3 - m
    ya, yb = _keep_pair(a, b, c, d, ra % 2)
    y = gl.reshape(gl.permute(gl.join(ya, yb), [0, 3, 1, 2]), [M, BM])
    return gl.convert_layout(y, layout)


@gluon.jit
def _kv_boxes(desc, b, hk, start, bar, buf, w, HEAD_D: gl.constexpr, NM: gl.constexpr, STORE: gl.constexpr):
    """Reads (``STORE``: writes) warp group ``w``'s 64 key or value rows from key ``start`` into (from) its tile of
    ``buf``: one TMA box, or for DFSS (``NM``) the boxes of :func:`_nm_keys`'s order (two members of four groups
    and one 128-byte feature chunk each, placed as the tile's layout places them: column chunk, then row)."""
    if NM:
        DC: gl.constexpr = desc.block_type.shape[4]
        NB: gl.constexpr = 8 * (HEAD_D // DC)
        for c in gl.static_range(HEAD_D // DC):
            for s in gl.static_range(4):
                for p in gl.static_range(2):
                    box = buf.index(w * NB + (c * 4 + s) * 2 + p)
                    coord = [b, hk, start // 4 + 4 * s, 2 * p, c * DC]
                    if STORE:
                        tma.async_copy_shared_to_global(desc, coord, box)
                    else:
                        tma.async_copy_global_to_shared(desc, coord, bar, box)
    else:
        if STORE:
            tma.async_copy_shared_to_global(desc, [b, hk, start, 0], buf.index(w))
        else:
            tma.async_copy_global_to_shared(desc, [b, hk, start, 0], bar, buf.index(w))


@gluon.jit
def _ws_tile(buf, w, M_WG: gl.constexpr, HEAD_D: gl.constexpr, NM: gl.constexpr):
    """Warp group ``w``'s ``[M_WG, HEAD_D]`` key or value tile of ``buf`` (DFSS: its boxes seen as one tile)."""
    if NM:
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M_WG, HEAD_D], buf.dtype)
        return buf._reinterpret(buf.dtype, [2, M_WG, HEAD_D], layout).index(w)
    else:
        return _tile_2d(buf.index(w), M_WG, HEAD_D)


@gluon.jit
def _ws_dq(ds_all, k0, k1, col, COLS: gl.constexpr, layout: gl.constexpr):
    """Issues ``dQ[:, col:col + COLS] = dS K[:, col:col + COLS]`` of a step over both groups' keys: ``ds_all`` is
    ``dS^T`` (keys by queries), ``k0`` and ``k1`` the two groups' key tiles; one product per group's keys
    (asynchronous, two commit groups)."""
    M_WG: gl.constexpr = k0.shape[0]
    BLOCK_M: gl.constexpr = ds_all.shape[1]
    dq = warpgroup_mma(ds_all.slice(0, M_WG, dim=0).permute((1, 0)), k0.slice(col, COLS, dim=1),
                       gl.zeros([BLOCK_M, COLS], gl.float32, layout), use_acc=False, is_async=True)
    return warpgroup_mma(ds_all.slice(M_WG, M_WG, dim=0).permute((1, 0)), k1.slice(col, COLS, dim=1), dq,
                         is_async=True)


@gluon.jit
def _ws_bwd_load(q_desc, k_desc, v_desc, do_desc, smem, b, hk, start_n, groups, lo, n_m, total, HEAD_D: gl.constexpr,
                 NM: gl.constexpr):
    """The producer: both consumers' key and value rows, then the query and ``dO`` tiles of step ``it`` into ring
    slot ``it % STAGES`` once both consumers released what the slot held."""
    k_buf, v_buf, q_buf, do_buf, ds_buf, dq_buf, kv_bar, ready, empty, ds_bar, fin_bar = smem
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    STAGES: gl.constexpr = q_buf.shape[0]
    M_WG: gl.constexpr = _WS_KEYS
    mbarrier.expect(kv_bar, 2 * M_WG * HEAD_D * 2 * k_desc.dtype.primitive_bitwidth // 8)
    for w in gl.static_range(2):
        _kv_boxes(k_desc, b, hk, start_n + w * M_WG, kv_bar, k_buf, w, HEAD_D, NM, False)
        _kv_boxes(v_desc, b, hk, start_n + w * M_WG, kv_bar, v_buf, w, HEAD_D, NM, False)
    for it in range(total):
        slot = it % STAGES
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        _load_step(q_desc, do_desc, q_buf, do_buf, ready, slot, it, b, hk, groups, lo, n_m, total, BLOCK_M)


@gluon.jit
def _ws_bwd_consume(dk_desc, dv_desc, dq_desc, lse2_ptr, delta_ptr, smem, b, hk, Hq, groups, lo, n_m, n_q, total, off,
                    start_n, qk_scale, sm_scale, WG: gl.constexpr, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr,
                    NM: gl.constexpr):
    """Consumer ``WG``: keys ``[start_n + WG * M_WG, start_n + (WG + 1) * M_WG)`` of the block; ``smem``: the
    buffers and barriers the partitions share."""
    k_buf, v_buf, q_buf, do_buf, ds_buf, dq_buf, kv_bar, ready, empty, ds_bar, fin_bar = smem
    M_WG: gl.constexpr = _WS_KEYS
    BLOCK_M: gl.constexpr = q_buf.shape[3]
    STAGES: gl.constexpr = q_buf.shape[0]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    dtype: gl.constexpr = k_buf.dtype
    st_layout: gl.constexpr = _mma_layout(4, BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(4, HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dq_layout: gl.constexpr = _mma_layout(4, DQ_COLS)
    row_s: gl.constexpr = gl.SliceLayout(1, st_layout)

    k_s = _ws_tile(k_buf, WG, M_WG, HEAD_D, NM)
    v_s = _ws_tile(v_buf, WG, M_WG, HEAD_D, NM)
    k0 = _ws_tile(k_buf, 0, M_WG, HEAD_D, NM)
    k1 = _ws_tile(k_buf, 1, M_WG, HEAD_D, NM)
    start_w = start_n + WG * M_WG
    rows = start_w + gl.arange(0, M_WG, layout=row_s)  # (DFSS: the rows hold keys in _nm_keys order)
    dk = gl.zeros([M_WG, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([M_WG, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)

    for it in range(total):
        slot = it % STAGES
        q_s, do_s, st_tok, dpt_tok = _ring_products(k_s, v_s, q_buf, do_buf, ready, it, STAGES, st_layout)
        pt, dst = _probs(st_tok, dpt_tok, it, lse2_ptr, delta_ptr, rows, b, hk, Hq, groups, lo, n_m, n_q, off, start_w,
                         qk_scale, CAUSAL, BLOCK_M, st_layout, NM)
        ds = dst.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_s, dk, is_async=True)
        # this group's dS^T into the step's half of the shared tile (two tiles in turn: the other group may
        # still read the previous step's), then wait for the other group's
        d = it % 2
        ds_all = ds_buf.index(d)
        ds_all.slice(WG * M_WG, M_WG, dim=0).store(ds)
        fence_async_shared()
        _ws_arrive(ds_bar.index(d))
        mbarrier.wait(ds_bar.index(d), (it // 2) & 1)
        h, start_m = _step_tile(it, hk, groups, lo, n_m, BLOCK_M)
        if HEAD_D == DQ_COLS:  # the whole dQ tile, the two groups in turn
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            _ws_arrive(empty.index(slot))
            if it % 2 == WG:
                dq = _ws_dq(ds_all, k0, k1, 0, DQ_COLS, dq_layout)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                _dq_add(dq, dq_buf.index(WG), dq_desc, b, h, start_m, 0, sm_scale)
        else:  # this group's DQ_COLS columns of it
            dq = _ws_dq(ds_all, k0, k1, WG * DQ_COLS, DQ_COLS, dq_layout)
            dv, dk = warpgroup_mma_wait(2, deps=(dv, dk))
            _ws_arrive(empty.index(slot))
            dq = warpgroup_mma_wait(0, deps=(dq, ))
            _dq_add(dq, dq_buf.index(WG), dq_desc, b, h, start_m, WG * DQ_COLS, sm_scale)

    # both groups are past their last dQ product (which reads every key row): the key and value buffers take
    # dK and dV
    _ws_arrive(fin_bar)
    mbarrier.wait(fin_bar, 0)
    k_s.store((dk * sm_scale).to(dtype))
    v_s.store(dv.to(dtype))
    fence_async_shared()
    _kv_boxes(dk_desc, b, hk, start_w, fin_bar, k_buf, WG, HEAD_D, NM, True)
    _kv_boxes(dv_desc, b, hk, start_w, fin_bar, v_buf, WG, HEAD_D, NM, True)
    tma.store_wait(pendings=0)


@gluon.jit
def _bwd_ws(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse2_ptr, delta_ptr, Hq, groups, n_q, n_k,
            off, qk_scale, sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, NM: gl.constexpr,
            CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    M_WG: gl.constexpr = _WS_KEYS
    # per warp group's key tile: one box, or (DFSS) two members of four groups per 128-byte feature chunk
    BOXES: gl.constexpr = 8 * (HEAD_D // k_desc.block_type.shape[4]) if NM else 1
    dtype: gl.constexpr = q_desc.dtype

    # (the blocks of one head in turn, so that the blocks running together share their query and dO tiles in
    # L2: every head's first blocks first measured 1.2-1.3x slower, causal, H100)
    start_n = gl.program_id(0) * (2 * M_WG)
    bhk = gl.program_id(1)
    Hk = Hq // groups
    b = bhk // Hk
    hk = bhk % Hk

    k_buf = gl.allocate_shared_memory(dtype, [2 * BOXES] + k_desc.block_type.shape, k_desc.layout)
    v_buf = gl.allocate_shared_memory(dtype, [2 * BOXES] + v_desc.block_type.shape, v_desc.layout)
    q_buf = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_buf = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_buf = gl.allocate_shared_memory(dtype, [2, 2 * M_WG, BLOCK_M], _ds_layout([2 * M_WG, BLOCK_M], dtype))
    dq_buf = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(fin_bar, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
    fence_async_shared()

    # the query tiles a key of the block can be seen from (causal: from the first query at or past its first key)
    n_m = gl.cdiv(n_q, BLOCK_M)
    lo = 0
    if CAUSAL:
        lo = gl.minimum(gl.maximum(start_n - off, 0) // BLOCK_M, n_m)
    total = groups * (n_m - lo)

    smem = (k_buf, v_buf, q_buf, do_buf, ds_buf, dq_buf, kv_bar, ready, empty, ds_bar, fin_bar)
    gl.warp_specialize([
        (_ws_bwd_consume, (dk_desc, dv_desc, dq_desc, lse2_ptr, delta_ptr, smem, b, hk, Hq, groups, lo, n_m, n_q, total,
                           off, start_n, qk_scale, sm_scale, 0, CAUSAL, HEAD_D, NM)),
        (_ws_bwd_consume, (dk_desc, dv_desc, dq_desc, lse2_ptr, delta_ptr, smem, b, hk, Hq, groups, lo, n_m, n_q, total,
                           off, start_n, qk_scale, sm_scale, 1, CAUSAL, HEAD_D, NM)),
        (_ws_bwd_load, (q_desc, k_desc, v_desc, do_desc, smem, b, hk, start_n, groups, lo, n_m, total, HEAD_D, NM)),
    ], [4, 1], [CONSUMER_REGS, 24])


_ws_kernel = FastLaunch(_bwd_ws)
#: registers per thread at entry (two consumer warp groups and the producer warp, padded to a group) and per
#: consumer thread after ``setmaxnreg`` (the producer's keeps 24)
WS_REGS = (168, 240)


def backward_ws(q, k, v, grad_out, lse2, delta, dk, dv, dq32, scale: float, causal: bool, pos_off: int,
                stages: int = 2, nm24: bool = False) -> None:
    """Writes ``dk`` and ``dv`` (``(B, Hk, Nk, D)``, TMA-writable) and adds ``dQ`` into ``dq32`` (``q``'s shape,
    float32, contiguous, zeroed) of dense attention, or of DFSS 2:4 with ``nm24`` (``Nk`` a multiple of 4,
    ``scale > 0``: :func:`.hopper.applies`), in one launch, from the preprocessed ``lse2`` and ``delta``: the
    warp-specialised kernel (per block of 128 keys, two consumer warp groups and a producer warp; query and
    ``dO`` tiles of 64 rows through a ring of ``stages`` slots). The order of the additions into ``dq32`` varies
    from run to run. D 64 or 128."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    if D not in (DQ_COLS, 2 * DQ_COLS):
        raise ValueError(f"the warp-specialised Gluon backward runs head dims {DQ_COLS} and {2 * DQ_COLS}, not {D}")
    if not FUSED_DQ:
        raise ValueError("this Triton's Gluon builds no TMA reductions: the warp-specialised backward cannot add dQ")
    if nm24 and Nk % 4:
        raise ValueError(f"DFSS with {Nk} keys (a multiple of 4: groups read as a (N/4, 4) view)")
    bm = 64
    grid = (triton.cdiv(Nk, 2 * WS_KEYS), B * Hk)
    maxnreg, regs = WS_REGS
    kv = dict(groups=True, members=2) if nm24 else {}
    rows = 16 if nm24 else WS_KEYS  # (DFSS: boxes of four groups)
    _ws_kernel[grid](_desc(q, bm), _desc(k, rows, **kv), _desc(v, rows, **kv), _desc(grad_out, bm),
                     _desc(dk, rows, **kv), _desc(dv, rows, **kv), _desc(dq32, bm, cols=DQ_COLS), lse2, delta, Hq,
                     Hq // Hk, Nq, Nk, pos_off, scale * LOG2E, scale, CAUSAL=causal, STAGES=stages, NM=nm24,
                     CONSUMER_REGS=regs, num_warps=4, maxnreg=maxnreg)
