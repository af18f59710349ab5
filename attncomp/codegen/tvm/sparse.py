"""DFSS forward on sparse tensor cores: ``Q K^T`` on dense ``mma``, N:M selection of each row's
logits, the kept probabilities packed with their 2-bit metadata, ``P V`` on ``mma.sp`` (2:4, f16/bf16).

One thread block (4 warps, 128 threads) per (64-query tile, batch x head); per key tile of ``BK`` keys
(64, or 32 when a head dim exceeds 64, so that the static shared memory stays under 48 KiB):

1. the block stages the key and value tiles in shared memory (operand dtype);
2. warp ``w`` computes the 16 x BK logits of its rows with ``mma.m16n8k16`` (f32 accumulate), applies
   the scale, the residual mask and the entry predicate (:func:`.kernels._allowed`, the same conjuncts
   as every other kernel) and writes them to shared ``S``;
3. two threads per query row (one per half of the key tile) take the row maximum from the halves'
   maxima, run the online softmax and the N:M selection of every group of 4 keys of their half
   (2:4, or 1:2 as two pairs: both are a 2:4 pattern), and write the two kept probabilities (operand
   dtype) to the compressed tile ``Pc`` and their positions to the metadata half-word of each 16 keys
   (``i0 | i1 << 2`` per group, ``i0 < i1``, group ``q`` at bits ``4q .. 4q + 3``: PTX's
   ``mma.sp::ordered_metadata`` encoding);
4. warp ``w`` rescales its accumulators and runs ``mma.sp.m16n8k32`` on (``Pc`` fragment, metadata,
   value fragment), the metadata given by threads 0 and 1 of each quad (sparsity selector 0): thread
   ``4g + p`` holds the 16 bits of keys ``16p .. 16p + 15`` of row ``g`` in its low half and those of
   row ``g + 8`` in its high half (:func:`metadata_location`).

The same generator writes an ``llvm`` build of this schedule (``target="llvm"``): the block's
threads become loops over the 128 threads between barriers, and each warp instruction is replaced by
an emulation (:meth:`_Gen.mma_qk`, :meth:`_Gen.mma_pv`) that rebuilds every lane's packed registers
with the *same* packing
expressions, decodes the metadata and the fragments by PTX's documented layouts, and does the dense
product. That build runs on CPU tensors and is tested against the reference, which checks the
packing, the metadata and the fragment layouts without a GPU.

Pure-Python helpers (:func:`metadata_word`, :func:`fragment_a_sp`, ...) state the same layouts for
tests on hand-made tiles.
"""

from __future__ import annotations

import re
from typing import List, Sequence, Tuple

from . import kernels as K
from .kernels import Variant

__all__ = ["sp_supported", "sp_forward_source", "sp_block_k", "SP_THREADS", "SP_BLOCK_Q", "metadata_word",
           "fragment_a_sp", "fragment_b", "fragment_c", "metadata_location", "compress_row"]

SP_THREADS = 128  # 4 warps
SP_BLOCK_Q = 64  # 16 query rows per warp
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def sp_block_k(head_dim: int, head_dim_v: int) -> int:
    return 64 if max(head_dim, head_dim_v) <= 64 else 32


def sp_supported(v: Variant) -> str:
    """Empty when the sparse tensor-core kernel serves ``v``, else why not."""
    if v.policy != "dfss":
        return "not a dfss site"
    if (v.nm_n, v.nm_m) not in ((2, 4), (1, 2)):
        return f"N:M {v.nm_n}:{v.nm_m} is no 2:4 pattern (2:4 and 1:2 are)"
    if v.dropout:
        return "dropout"
    if v.head_dim % 16 or v.head_dim_v % 8:
        return "head dim not a multiple of 16 (value dim: 8)"
    if max(v.head_dim, v.head_dim_v) > 128:
        return "head dim above 128"
    return ""


# ---------------------------------------------------------------------------------------------
# PTX fragment layouts (ISA 9.7.16.5 / 9.7.16.6), g = lane // 4, t = lane % 4.
# Each function gives, for one register of one lane, the matrix coordinates of its (two) elements.


def fragment_a(lane: int, reg: int) -> List[Tuple[int, int]]:
    """m16n8k16 A (16 x 16, row) and the compressed 16 x 16 A of m16n8k32 ``mma.sp``: four .b32."""
    g, t = lane // 4, lane % 4
    row, col = g + 8 * (reg % 2), 2 * t + 8 * (reg // 2)
    return [(row, col), (row, col + 1)]


fragment_a_sp = fragment_a


def fragment_b(lane: int, reg: int) -> List[Tuple[int, int]]:
    """B (K x 8, col): register ``reg`` holds rows ``2t + 8 reg`` and ``+1`` of column ``g``."""
    g, t = lane // 4, lane % 4
    return [(2 * t + 8 * reg, g), (2 * t + 8 * reg + 1, g)]


def fragment_c(lane: int, i: int) -> Tuple[int, int]:
    """C/D (16 x 8, f32): element ``i`` of the lane."""
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + i % 2


def metadata_location(row: int, group: int) -> Tuple[int, int]:
    """``(lane, first bit)`` of the 4-bit metadata of ``group`` (keys ``4 group .. 4 group + 3``) of
    ``row`` of a 16 x 32 sparse A (m16n8k32 f16/bf16, sparsity selector 0): lanes ``4g`` and ``4g + 1``
    carry keys 0..15 and 16..31, rows ``g`` (low half-word) and ``g + 8`` (high half-word)."""
    return 4 * (row % 8) + group // 4, 16 * (row // 8) + 4 * (group % 4)


def compress_row(keep: Sequence[bool], values: Sequence[float]) -> Tuple[List[float], int]:
    """``(compressed values, metadata word)`` of one 32-wide row with two kept entries per group of 4."""
    if len(keep) != 32:
        raise ValueError("a row of the m16n8k32 A has 32 entries")
    vals: List[float] = []
    word = 0
    for q in range(8):
        idx = [p for p in range(4) if keep[4 * q + p]]
        if len(idx) != 2:
            raise ValueError(f"group {q} keeps {len(idx)} entries, not 2")
        vals += [values[4 * q + idx[0]], values[4 * q + idx[1]]]
        word |= (idx[0] | idx[1] << 2) << (4 * q)
    return vals, word


def metadata_word(keep_rows: Sequence[Sequence[bool]], lane: int) -> int:
    """The metadata register of ``lane`` for a 16 x 32 keep pattern (0 for lanes that give none)."""
    out = 0
    for row in range(16):
        word = compress_row(keep_rows[row], [0.0] * 32)[1]
        for q in range(8):
            ln, bit = metadata_location(row, q)
            if ln == lane:
                out |= ((word >> (4 * q)) & 15) << bit
    return out


# ---------------------------------------------------------------------------------------------
# TIR generator


class _Gen:
    def __init__(self, v: Variant, target: str):
        self.v, self.target = v, target
        self.cpu = target == "llvm"
        self.od = v.operand_dtype or "float16"
        # LLVM has no bfloat16 bit casts: the CPU build keeps bfloat16 operands as their int16 bits
        self.bits = self.cpu and self.od == "bfloat16"
        self.st = "int16" if self.bits else self.od
        self.BK = v.block_k
        self.D, self.Dv = v.head_dim, v.head_dim_v
        self.nacc = (self.Dv // 8) * 4

    def U(self, n) -> str:
        """Loops over fragment registers: unrolled on CUDA (the register arrays stay in registers)."""
        return f"range({n})" if self.cpu else f"T.unroll({n})"

    # packed registers: two operand-dtype elements in one uint32 (low half first)
    def u16(self, x: str) -> str:
        return f"T.Cast(\"uint16\", {x})" if self.bits else f"T.reinterpret(\"uint16\", {x})"

    def pack2(self, x: str, y: str) -> str:
        return (f"T.bitwise_or(T.Cast(\"uint32\", {self.u16(x)}), "
                f"T.shift_left(T.Cast(\"uint32\", {self.u16(y)}), T.uint32(16)))")

    def to_operand(self, x: str) -> str:
        """A float32 expression rounded to the operand dtype (bfloat16 bits on the CPU: round to
        nearest even, as the GPU's conversion does for finite values)."""
        if not self.bits:
            return f"T.Cast(\"{self.od}\", {x})"
        u = f"T.reinterpret(\"uint32\", {x})"
        return (f"T.Cast(\"int16\", T.Cast(\"uint16\", T.shift_right({u} + T.uint32(32767) + "
                f"T.bitwise_and(T.shift_right({u}, T.uint32(16)), T.uint32(1)), T.uint32(16))))")

    def half(self, reg: str, h: str) -> str:
        """Element ``h`` (0 low, 1 high) of a packed register, as float32."""
        bits = f"T.bitwise_and(T.shift_right({reg}, T.Cast(\"uint32\", {h}) * T.uint32(16)), T.uint32(65535))"
        if self.od == "bfloat16":
            return f"T.reinterpret(\"float32\", T.shift_left({bits}, T.uint32(16)))"
        return f"T.Cast(\"float32\", T.reinterpret(\"float16\", T.Cast(\"uint16\", {bits})))"

    # fragment registers, as expressions of (warp w, quad g, thread-in-quad t)
    def frag_a(self, buf, w, g, t, kk, r) -> str:
        """Register ``r`` of a row-major A operand (16 rows of warp ``w``, the 16 columns of step ``kk``)."""
        row, col = f"(16 * {w} + {g} + 8 * (({r}) % 2))", f"({kk} * 16 + 2 * {t} + 8 * (({r}) // 2))"
        return self.pack2(f"{buf}[{row}, {col}]", f"{buf}[{row}, {col} + 1]")

    def frag_q(self, w, g, t, kd, r) -> str:
        return self.frag_a("Qs", w, g, t, kd, r)

    def frag_k(self, g, t, nb, kd, r) -> str:
        key, d = f"({nb} * 8 + {g})", f"({kd} * 16 + 2 * {t} + 8 * ({r}))"
        return self.pack2(f"Ks[{key}, {d}]", f"Ks[{key}, {d} + 1]")

    def frag_p(self, w, g, t, kb, r) -> str:
        return self.frag_a("Pc", w, g, t, kb, r)

    def frag_v(self, g, t, kb, nbv, r) -> str:
        key, col = f"({kb} * 32 + 2 * {t} + 8 * ({r}))", f"({nbv} * 8 + {g})"
        return self.pack2(f"Vs[{key}, {col}]", f"Vs[{key} + 1, {col}]")

    def meta(self, w, g, t, kb) -> str:
        """The metadata register of lane (g, t): the half-words of keys 32 kb + 16t .. + 15 (``MDH``, one
        per 16 keys, group q at bits 4q) of rows g (low) and g + 8 (high); lanes 2 and 3 of a quad give
        none (selector 0)."""
        lo = f"MDH[16 * {w} + {g}, 2 * {kb} + T.min({t}, 1)]"
        hi = f"MDH[16 * {w} + {g} + 8, 2 * {kb} + T.min({t}, 1)]"
        return f"T.if_then_else({t} < 2, T.bitwise_or({lo}, T.shift_left({hi}, T.uint32(16))), T.uint32(0))"

    def acc(self, i: str) -> str:
        return f"ACC[tx, {i}]" if self.cpu else f"ACC[{i}]"

    # the warp instructions
    def mma_qk(self, ind: str, nb: str, kd: str) -> List[str]:
        ty = _PTX_TYPE[self.od]
        if not self.cpu:
            L = [f"{ind}for r in T.unroll(4):", f"{ind}    Af[r] = {self.frag_q('w', 'g', 't', kd, 'r')}",
                 f"{ind}for r in T.unroll(2):", f"{ind}    Bf[r] = {self.frag_k('g', 't', nb, kd, 'r')}",
                 f"{ind}T.ptx.mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32("
                 "Cf[0], Cf[1], Cf[2], Cf[3], Af[0], Af[1], Af[2], Af[3], Bf[0], Bf[1], "
                 "Cf[0], Cf[1], Cf[2], Cf[3])"]
            return L
        # emulation: D[i] += sum_k A[row, k] B[k, col], A and B read back from the lanes that hold them
        a = self.half(self.frag_q("w", "(ri % 8)", "((kk % 8) // 2)", kd, "(ri // 8) + 2 * (kk // 8)"), "kk % 2")
        b = self.half(self.frag_k("ci", "((kk % 8) // 2)", nb, kd, "kk // 8"), "kk % 2")
        return [f"{ind}for i in range(4):",
                f"{ind}    ri = g + 8 * (i // 2)", f"{ind}    ci = 2 * t + i % 2",
                f"{ind}    Wm[0] = Cf[i]",
                f"{ind}    for kk in range(16):",
                f"{ind}        Wm[0] = Wm[0] + {a} * {b}",
                f"{ind}    Cf[i] = Wm[0]"]

    def mma_pv(self, ind: str, kb: str, nbv: str) -> List[str]:
        ty = _PTX_TYPE[self.od]
        if not self.cpu:
            c = ", ".join(self.acc(f"{nbv} * 4 + {i}") for i in range(4))
            return [f"{ind}for r in T.unroll(4):", f"{ind}    Bf[r] = {self.frag_v('g', 't', kb, nbv, 'r')}",
                    f"{ind}T.ptx.mma.sp__ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{ty}.{ty}.f32("
                    f"{c}, Af[0], Af[1], Af[2], Af[3], Bf[0], Bf[1], Bf[2], Bf[3], {c}, Er[0], 0)"]
        # emulation: the metadata of group q of row ri sits in lane 4 (ri % 8) + q // 4 at bit
        # 16 (ri // 8) + 4 (q % 4) (selector 0); the nibble names the two positions its compressed pair
        # stands for
        md = self.meta("w", "(ri % 8)", "(kk // 16)", kb)
        a = self.half(self.frag_p("w", "(ri % 8)", "((cc % 8) // 2)", kb, "(ri // 8) + 2 * (cc // 8)"), "cc % 2")
        b = self.half(self.frag_v("ci", "((kk % 8) // 2)", kb, nbv, "kk // 8"), "kk % 2")
        return [f"{ind}for i in range(4):",
                f"{ind}    ri = g + 8 * (i // 2)", f"{ind}    ci = 2 * t + i % 2",
                f"{ind}    Wm[0] = {self.acc(f'{nbv} * 4 + i')}",
                f"{ind}    for kk in range(32):",
                f"{ind}        nib = T.bitwise_and(T.shift_right({md}, T.Cast(\"uint32\", 16 * (ri // 8) + 4 * (kk // 4 % 4))), "
                "T.uint32(15))",
                f"{ind}        i0 = T.Cast(\"int32\", T.bitwise_and(nib, T.uint32(3)))",
                f"{ind}        i1 = T.Cast(\"int32\", T.shift_right(nib, T.uint32(2)))",
                f"{ind}        cc = 2 * (kk // 4) + T.if_then_else(kk % 4 == i1, 1, 0)",
                f"{ind}        if kk % 4 == i0 or kk % 4 == i1:",
                f"{ind}            Wm[0] = Wm[0] + {a} * {b}",
                f"{ind}    {self.acc(f'{nbv} * 4 + i')} = Wm[0]"]

    # ------------------------------------------------------------------------------------------
    def source(self) -> str:
        v, BK, D, Dv, od = self.v, self.BK, self.D, self.Dv, self.st
        BQ, NT = SP_BLOCK_Q, SP_THREADS
        ninf = 'T.float32("-inf")'
        L = K._signature("attn_fwd", K.FWD_ARGS, v)
        L += K._qkv_buffers(v, od, out="float32") + K._common_buffers(v)
        shared = "shared" if not self.cpu else "global"
        allocs = [("Qs", (BQ, D), od, shared), ("Ks", (BK, D), od, shared), ("Vs", (BK, Dv), od, shared),
                  ("S", (BQ, BK), "float32", shared), ("Pc", (BQ, BK // 2), od, shared),
                  ("MDH", (BQ, BK // 16), "uint32", shared), ("Mx", (BQ,), "float32", shared),
                  ("MN", (BQ,), "float32", shared), ("PM", (2, BQ), "float32", shared),
                  ("PS", (2, BQ), "float32", shared),
                  ("Ls", (BQ,), "float32", shared), ("Al", (BQ,), "float32", shared),
                  ("ACC", ((NT, self.nacc) if self.cpu else (self.nacc,)), "float32", "local"),
                  ("Af", (4,), "uint32", "local"), ("Bf", (4,), "uint32", "local"), ("Cf", (4,), "float32", "local"),
                  ("Er", (1,), "uint32", "local"), ("Wr", (4,), "float32", "local"), ("Wm", (1,), "float32", "local"),
                  ("Ir", (2,), "int32", "local"), ("Mw", (1,), "uint32", "local")]
        if self.cpu:
            ind = "        "
            L += [f"    for blk in T.parallel(((Nq + {BQ - 1}) // {BQ}) * B * Hq):",
                  f"{ind}qt = blk % ((Nq + {BQ - 1}) // {BQ})", f"{ind}bh = blk // ((Nq + {BQ - 1}) // {BQ})"]
        else:
            L += [f"    for qt in T.thread_binding((Nq + {BQ - 1}) // {BQ}, thread=\"blockIdx.x\"):",
                  "        for bh in T.thread_binding(B * Hq, thread=\"blockIdx.y\"):",
                  f"            for tx in T.thread_binding({NT}, thread=\"threadIdx.x\"):"]
            ind = "                "
        for name, shape, dt, scope in allocs:
            L.append(f'{ind}{name} = T.alloc_buffer({shape}, "{dt}", scope="{scope}")')
        L += [f"{ind}NKT = (Nk + {BK - 1}) // {BK}", f"{ind}G = Hq // Hk",
              f"{ind}b = bh // Hq", f"{ind}h = bh % Hq", f"{ind}hk = h // G", f"{ind}q0 = qt * {BQ}"]
        if not self.cpu:
            L += [f"{ind}w = tx // 32", f"{ind}g = tx % 32 // 4", f"{ind}t = tx % 4"]
        L += K._ksum_base(v, ind) + K._query_summary(v, ind) + K._tile_range(v, ind)

        def phase(ind: str, body: List[str]) -> List[str]:
            """A stretch of the thread program between barriers."""
            if self.cpu:
                return ([f"{ind}for tx in range({NT}):", f"{ind}    w = tx // 32", f"{ind}    g = tx % 32 // 4",
                         f"{ind}    t = tx % 4"] + [f"{ind}    {line}" for line in body])
            return [f"{ind}{line}" for line in body] + [f"{ind}T.tvm_storage_sync(\"shared\")"]

        def load(buf: str, src: str, rows: int, width: int, r0: str, n: str, clamp: str) -> List[str]:
            tot = rows * width
            return [f"for e0 in range({-(-tot // NT)}):",
                    f"    if e0 * {NT} + tx < {tot}:",
                    f"        {buf}[(e0 * {NT} + tx) // {width}, (e0 * {NT} + tx) % {width}] = "
                    f"{src}[b, {clamp}, T.min({r0} + (e0 * {NT} + tx) // {width}, {n} - 1), (e0 * {NT} + tx) % {width}]"]

        # prologue: the query tile, row state, accumulators
        body = load("Qs", "Q", BQ, D, "q0", "Nq", "h")
        body += [f"if tx < {BQ}:", f"    Mx[tx] = {ninf}", "    Ls[tx] = T.float32(0)",
                 f"for i in {self.U(self.nacc)}:", f"    {self.acc('i')} = T.float32(0)"]
        L += phase(ind, body)
        loop, ind2 = K._key_tile_loop(v, ind, BK)
        L += loop
        L += phase(ind2, load("Ks", "K", BK, D, "k0", "Nk", "hk") + load("Vs", "V", BK, Dv, "k0", "Nk", "hk"))
        # 2. logits on dense mma, predicate, into S
        qc, kc = "T.min(q0 + ri, Nq - 1)", "T.min(k0 + ci, Nk - 1)"
        conds = K._allowed(v, qc, kc)
        conds[0], conds[1] = "q0 + ri < Nq", "k0 + ci < Nk"
        val = "Cf[i] * scale"
        if v.mask == "float":
            val += f" + MASK[b * m_sb + h * m_sh + {qc} * m_si + {kc} * m_sj]"
        if v.logit_mods:
            val = K.logit(v, "Cf[i]", qc, kc)
        body = [f"for nb in range({BK // 8}):",
                f"    for i in {self.U(4)}:", "        Cf[i] = T.float32(0)",
                f"    for kd in {self.U(D // 16)}:"]
        body += self.mma_qk("        ", "nb", "kd")
        body += [f"    for i in {self.U(4)}:",
                 "        ri = 16 * w + g + 8 * (i // 2)", "        ci = nb * 8 + 2 * t + i % 2",
                 f"        S[ri, ci] = T.if_then_else({K._and(conds)}, {val}, {ninf})"]
        L += phase(ind2, body)
        # 3. two threads per row (thread tx: row rw = tx % 64, half hf = tx // 64 of the key tile): the row max
        # from the two halves' maxima, then each thread selects N:M in its groups, writes their kept
        # probabilities to Pc and their positions to the metadata half-words of its keys
        n, m, NH = v.nm_n, v.nm_m, BK // 16

        def rowwise(lines: List[str]) -> List[str]:
            # rw / hf spelled out (a let-bound name here trips TVM's buffer flattening on CUDA)
            return [re.sub(r"\bhf\b", f"(tx // {BQ})", re.sub(r"\brw\b", f"(tx % {BQ})", x)) for x in lines]

        def kept(p: int) -> str:
            """Position ``p`` of the 4-group is among the ``n`` largest of its ``m``-group (ties keep
            the lower key), as in the reference and the other kernels."""
            base = (p // m) * m
            terms = []
            for o in range(base, base + m):
                if o == p:
                    continue
                c = f"S[rw, c4 + {o}] > S[rw, c4 + {p}]"
                if o < p:
                    c = f"S[rw, c4 + {o}] >= S[rw, c4 + {p}]"
                terms.append(f"T.Cast(\"int32\", {c})")
            return f"({' + '.join(terms)} < {n})"

        body = ["Wr[1] = T.float32(\"-inf\")",
                       f"for j in range({BK // 2}):", f"    Wr[1] = T.max(Wr[1], S[rw, hf * {BK // 2} + j])",
                       "PM[hf, rw] = Wr[1]"]
        L += phase(ind2, rowwise(body))
        body = ["Wr[0] = Mx[rw]", "Wr[1] = T.max(Wr[0], T.max(PM[0, rw], PM[1, rw]))",
                       f"mu = T.if_then_else(Wr[1] == {ninf}, T.float32(0), Wr[1])",
                       "alpha = T.exp(Wr[0] - mu)",
                       # both threads of the row compute and store the same bits
                       "Al[rw] = alpha", "MN[rw] = Wr[1]",
                       "Wr[2] = T.float32(0)",
                       f"for hw in range({NH // 2}):",
                       f"    hwi = hf * {NH // 2} + hw",
                       "    Mw[0] = T.uint32(0)",
                       "    for q4 in range(4):",
                       "        c4 = hwi * 16 + q4 * 4",
                       "        Ir[0] = 3", "        Ir[1] = 0"]
        for p in range(4):
            # a barrier analysis refuses shared reads in statement conditions: select, not branch
            body += [f"        kp{p} = {kept(p)}",
                     f"        Ir[0] = T.if_then_else(kp{p}, T.min(Ir[0], {p}), Ir[0])",
                     f"        Ir[1] = T.if_then_else(kp{p}, T.max(Ir[1], {p}), Ir[1])"]
        body += ["        p0 = T.exp(S[rw, c4 + Ir[0]] - mu)", "        p1 = T.exp(S[rw, c4 + Ir[1]] - mu)",
                 f"        Pc[rw, c4 // 2] = {self.to_operand('p0')}", f"        Pc[rw, c4 // 2 + 1] = {self.to_operand('p1')}",
                 "        Wr[2] = Wr[2] + p0 + p1",
                 "        Mw[0] = T.bitwise_or(Mw[0], T.shift_left(T.Cast(\"uint32\", Ir[0] + Ir[1] * 4), "
                 "T.Cast(\"uint32\", 4 * q4)))",
                 "    MDH[rw, hwi] = Mw[0]",
                 "PS[hf, rw] = Wr[2]"]
        L += phase(ind2, rowwise(body))
        # 4. rescale, P V on sparse tensor cores
        # (the row state moves on here: every thread has read Mx in step 3)
        body = [f"if tx < {BQ}:",
                "    Ls[tx] = Ls[tx] * Al[tx] + PS[0, tx] + PS[1, tx]", "    Mx[tx] = MN[tx]",
                f"for i in {self.U(self.nacc)}:",
                f"    {self.acc('i')} = {self.acc('i')} * Al[16 * w + g + 8 * (i % 4 // 2)]",
                f"for kb in {self.U(BK // 32)}:"]
        if not self.cpu:
            body += ["    for r in T.unroll(4):", f"        Af[r] = {self.frag_p('w', 'g', 't', 'kb', 'r')}",
                     f"    Er[0] = {self.meta('w', 'g', 't', 'kb')}"]
        body += [f"    for nbv in {self.U(Dv // 8)}:"]
        body += self.mma_pv("        ", "kb", "nbv")
        L += phase(ind2, body)
        # epilogue: 1 / l per row, lse; the output from the accumulators
        body = [f"if tx < {BQ}:",
                "    Al[tx] = T.if_then_else(Ls[tx] > T.float32(0), T.float32(1) / Ls[tx], T.float32(0))",
                "    if q0 + tx < Nq:",
                "        LSE[b, h, q0 + tx] = T.if_then_else(Ls[tx] > T.float32(0), Mx[tx] + T.log(Ls[tx]), "
                f"{ninf})"]
        if v.sinks:  # the sink's logit joins the row's max and sum (lse written by rows in range only)
            body = [f"if tx < {BQ}:"] + ["    " + x for x in K.sink_epilogue(v, "", "Mx[tx]", "Ls[tx]", "Al[tx]",
                                                                              "Wm[0]", dt="float32")]
            body += ["    if q0 + tx < Nq:", "        LSE[b, h, q0 + tx] = Wm[0]"]
        L += phase(ind, body)
        body = [f"for nbv in {self.U(Dv // 8)}:",
                f"    for i in {self.U(4)}:",
                "        ri = 16 * w + g + 8 * (i // 2)",
                "        if q0 + ri < Nq:",
                f"            O[b, h, q0 + ri, nbv * 8 + 2 * t + i % 2] = {self.acc('nbv * 4 + i')} * Al[ri]"]
        L += phase(ind, body)
        return "\n".join(L) + "\n"


def sp_forward_source(v: Variant, target: str = "cuda") -> str:
    """TVMScript of the sparse tensor-core DFSS forward for ``v`` (``target``: ``cuda`` or ``llvm``,
    the emulated build)."""
    why = sp_supported(v)
    if why:
        raise ValueError(f"the mma.sp kernel does not serve this variant: {why}")
    if v.block_q != SP_BLOCK_Q or v.block_k != sp_block_k(v.head_dim, v.head_dim_v):
        raise ValueError("the mma.sp kernel needs its own tile sizes (cuda.cuda_variant sets them)")
    if target not in ("cuda", "llvm"):
        raise ValueError(f"target {target!r}: cuda or llvm")
    return _Gen(v, target).source()


def register_probe_source() -> str:
    """TVMScript of a small CPU function that evaluates, for the 32 lanes of warp 0, the *kernel's*
    register expressions (the ones the CUDA kernel passes to ``mma.sp``): the metadata register from
    the metadata half-words ``MDH (16, 2)`` of 16 rows, the packed A fragment of a compressed float16 tile ``Pc (16, 16)`` and
    the packed B fragment of a value tile ``Vs (32, 8)``; tests compare them with PTX's layouts."""
    g = _Gen(Variant(head_dim=16, head_dim_v=8, policy="dfss", nm_n=2, nm_m=4, block_q=SP_BLOCK_Q, block_k=64,
                     mma="sp", operand_dtype="float16"), "llvm")
    return "\n".join([
        "@T.prim_func",
        "def probe(md: T.handle, pc: T.handle, vs: T.handle, e: T.handle, a: T.handle, bv: T.handle):",
        '    T.func_attr({"global_symbol": "probe", "tir.noalias": True})',
        '    MDH = T.match_buffer(md, (16, 2), "uint32")',
        '    Pc = T.match_buffer(pc, (16, 16), "float16")',
        '    Vs = T.match_buffer(vs, (32, 8), "float16")',
        '    E = T.match_buffer(e, (32,), "uint32")',
        '    A = T.match_buffer(a, (32, 4), "uint32")',
        '    Bv = T.match_buffer(bv, (32, 4), "uint32")',
        "    for lane in range(32):",
        "        g = lane // 4",
        "        t = lane % 4",
        f"        E[lane] = {g.meta('0', 'g', 't', '0')}",
        "        for r in range(4):",
        f"            A[lane, r] = {g.frag_p('0', 'g', 't', '0', 'r')}",
        f"            Bv[lane, r] = {g.frag_v('g', 't', '0', '0', 'r')}",
    ]) + "\n"
