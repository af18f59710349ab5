"""CUDA backward kernels (dK/dV and dQ) from the forward's template pieces, built ahead of time to cubin.

Both recompute ``P = exp(S - lse)`` with the same entry predicate (:func:`.kernels._allowed`), N:M
selection inside a key tile, dropout hash and tile schedule as every other kernel, so every policy
has its backward (dense and dfss are the ones the GPU tests check); ``delta = rowsum(dO * O)`` comes
from the host, as on the CPU.

* ``attn_bwd_dkdv``: one thread block per (key tile of ``BK`` keys, batch x KV head), one thread per
  key. For each query head of the KV head's group and each query tile the schedule can reach, the
  block stages the query tile (q, dO, lse, delta) in shared memory (each thread reads its own key's
  k and v rows from global memory); every thread writes the logits of
  its key for the tile's rows to shared ``S`` (N:M selection needs the logits of the other keys of
  its group), then accumulates ``dV_j += P_ij dO_i`` and ``dK_j += dS_ij q_i`` in registers.
* ``attn_bwd_dq``: one thread block per (query tile, batch x query head), one thread per query row;
  key and value tiles staged in shared memory, ``dQ_i += dS_ij k_j`` in registers.

Score modifiers as in :mod:`.kernels`; the dK/dV kernel's thread writes its key's share of ALiBi's
gradient, and adds each logit's gradient into the relative bias's table ``(2 * max_distance + 1, Hq)``
with float32 atomics (whose order varies: the table's gradient can differ in its last bits between runs;
the CPU build runs its blocks in order and adds plainly).

One generator writes each kernel for ``target="cuda"`` (thread bindings, shared memory, barriers)
and ``target="llvm"``: the same statements with the block's threads as loops between barriers and
per-thread registers given a thread dimension. The llvm build is what the CPU tests run against the
reference backward; the cubins are what a GPU runs (:mod:`attncomp.runtime.cubin`).
"""

from __future__ import annotations

import dataclasses
from typing import List

from . import kernels as K
from .kernels import Variant
from .tiles import cuda_variant

__all__ = ["bwd_variant", "bwd_source", "bwd_threads", "bwd_grid", "BWD_KINDS"]

BWD_KINDS = ("dkdv", "dq")


def bwd_variant(v: Variant, kind: str) -> Variant:
    """The variant with the tile sizes of the CUDA backward kernel ``kind``."""
    if kind == "dq":
        return cuda_variant(dataclasses.replace(v, mma="", operand_dtype=""))
    bk = 64
    bq = 32 if max(v.head_dim, v.head_dim_v) <= 128 else 16
    if v.policy == "spion":
        bk = min(v.block_size, 32)
        bq = min(bq, v.block_size)
    return dataclasses.replace(v, mma="", operand_dtype="", block_q=bq, block_k=bk)


def bwd_threads(v: Variant, kind: str) -> int:
    return v.block_k if kind == "dkdv" else v.block_q


def bwd_grid(v: Variant, kind: str) -> list:
    """Launch grid as the loader's expressions (:func:`attncomp.runtime.cubin.launch_dims`)."""
    if kind == "dkdv":
        return [["cdiv", ["shape", "k", 2], v.block_k], ["mul", ["shape", "k", 0], ["shape", "k", 1]], 1]
    return [["cdiv", ["shape", "q", 2], v.block_q], ["mul", ["shape", "q", 0], ["shape", "q", 1]], 1]


class _Gen:
    def __init__(self, v: Variant, kind: str, target: str):
        self.v, self.kind, self.cpu = v, kind, target == "llvm"
        self.NT = bwd_threads(v, kind)
        self.dt = v.dtype

    def reg(self, name: str, idx: str) -> str:
        """A per-thread register array element (the CPU build gives it a thread dimension)."""
        return f"{name}[tx, {idx}]" if self.cpu else f"{name}[{idx}]"

    def alloc_reg(self, ind: str, name: str, n: int, dt: str) -> str:
        shape = f"({self.NT}, {n})" if self.cpu else f"({n},)"
        return f'{ind}{name} = T.alloc_buffer({shape}, "{dt}", scope="local")'

    def shared(self, ind: str, name: str, shape, dt: str) -> str:
        return f'{ind}{name} = T.alloc_buffer({tuple(shape)}, "{dt}", scope="{"global" if self.cpu else "shared"}")'

    def phase(self, ind: str, body: List[str], guard: str = "") -> List[str]:
        """Statements between barriers; ``guard`` (block-uniform) skips them, never the barrier."""
        if guard:
            body = [f"if {guard}:"] + [f"    {b}" for b in body]
        if self.cpu:
            return [f"{ind}for tx in range({self.NT}):"] + [f"{ind}    {b}" for b in body]
        return [f"{ind}{b}" for b in body] + [f'{ind}T.tvm_storage_sync("shared")']

    def load(self, buf: str, src: str, rows: int, width: int, r0: str, n: str, head: str) -> List[str]:
        NT, tot = self.NT, rows * width
        return [f"for e0 in range({-(-tot // NT)}):",
                f"    if e0 * {NT} + tx < {tot}:",
                f"        {buf}[(e0 * {NT} + tx) // {width}, (e0 * {NT} + tx) % {width}] = "
                f"{src}[b, {head}, T.min({r0} + (e0 * {NT} + tx) // {width}, {n} - 1), (e0 * {NT} + tx) % {width}]"]

    def logit(self, qi: str, kj: str, dot: str) -> str:
        """The logit of (qi, kj) from its dot product, -inf where not allowed (indices may be past the
        ends: every read uses clamped indices, the bounds are the first conjuncts)."""
        v = self.v
        qc, kc = f"T.min({qi}, Nq - 1)", f"T.min({kj}, Nk - 1)"
        conds = K._allowed(v, qc, kc)
        conds[0], conds[1] = f"{qi} < Nq", f"{kj} < Nk"
        val = f"{dot} * T.Cast(\"{self.dt}\", scale)"
        if v.mask == "float":
            val += f" + MASK[b * m_sb + h * m_sh + {qc} * m_si + {kc} * m_sj]"
        if v.logit_mods:
            val = K.logit(v, dot, qc, kc)
        return f"T.if_then_else({K._and(conds)}, {val}, {K._neg_inf(v)})"

    def kept(self, row: str, j: str) -> str:
        """N:M keep rule of entry ``j`` of a tile row (``row(x)`` gives the logit at tile column x)."""
        n, m = self.v.nm_n, self.v.nm_m
        terms = [f"T.Cast(\"int32\", ({row(f'g0 + {t}')} > {row(j)}) or ({row(f'g0 + {t}')} == {row(j)} and "
                 f"g0 + {t} < {j}))" for t in range(m)]
        return f"({' + '.join(terms)} < {n})"

    def grads(self, ind: str, qi: str, kj: str, sij: str, lse: str, dl: str, dp: str) -> List[str]:
        """``p``/``pd``/``ds`` of one entry from its (kept or -inf) logit."""
        v, dt = self.v, self.dt
        L = [f"{ind}p = T.exp({sij} - {lse})", f"{ind}dpv = {dp}"]
        if v.dropout:
            L += K._dropout_index(ind, qi, kj) + K._hash_lines(ind, "du", "dx")
            L += [f"{ind}pd = T.if_then_else(du >= drop_p, p * T.Cast(\"{dt}\", inv_keep), T.{dt}(0))",
                  f"{ind}dpd = T.if_then_else(du >= drop_p, dpv * T.Cast(\"{dt}\", inv_keep), T.{dt}(0))",
                  f"{ind}ds = p * (dpd - {dl})"]
        else:
            L += [f"{ind}pd = p", f"{ind}ds = p * (dpv - {dl})"]
        if v.softcap:  # through c * tanh(s / c): the gradient of the logit before the cap
            L[-1] = L[-1].replace(f"{ind}ds = ", f"{ind}dsr = ")
            L += [f"{ind}ds = dsr * {K.cap_factor(v, sij, f'T.min({qi}, Nq - 1)', f'T.min({kj}, Nk - 1)')}"]
        return L

    def signature(self) -> List[str]:
        v, D, Dv, dt = self.v, self.v.head_dim, self.v.head_dim_v, self.dt
        name = "attn_bwd_dkdv" if self.kind == "dkdv" else "attn_bwd_dq"
        grads = ("dk", "dv") if self.kind == "dkdv" else ("dq",)
        mods = K.mod_grad_args(v) if self.kind == "dkdv" else ()
        L = K._signature(name, K.BWD_ARGS + grads + mods, v)
        L += K._qkv_buffers(v, dt, grad_out=True) + [f'    DELTA = T.match_buffer(delta, (B, Hq, Nq), "{v.dtype}")']
        shapes = {"dq": f"(B, Hq, Nq, {D})", "dk": f"(B, Hk, Nk, {D})", "dv": f"(B, Hk, Nk, {Dv})"}
        L += [f'    {g.upper()}_ = T.match_buffer({g}, {shapes[g]}, "{dt}")' for g in grads]
        if mods:
            L += K.mod_grad_buffers(v)
        return L + K._common_buffers(v)

    def blocks(self, nblocks: str, rows: str) -> List[str]:
        if self.cpu:
            # the CUDA kernel adds the table's gradient with atomics: here the blocks run in order
            loop = "T.serial" if self.v.rel and self.kind == "dkdv" else "T.parallel"
            return [f"    for blk in {loop}(({nblocks}) * {rows}):",
                    f"        bx = blk % ({nblocks})", f"        by = blk // ({nblocks})"], "        "
        return [f"    for bx in T.thread_binding({nblocks}, thread=\"blockIdx.x\"):",
                f"        for by in T.thread_binding({rows}, thread=\"blockIdx.y\"):",
                f"            for tx in T.thread_binding({self.NT}, thread=\"threadIdx.x\"):"], "                "

    # ------------------------------------------------------------------------------------------
    def dkdv(self) -> str:
        v, dt, NT = self.v, self.dt, self.NT
        BQ, BK, D, Dv = v.block_q, v.block_k, v.head_dim, v.head_dim_v
        ninf = K._neg_inf(v)
        L = self.signature()
        head, ind = self.blocks(f"(Nk + {BK - 1}) // {BK}", "B * Hk")
        L += head
        # each thread reads only its own key's k and v rows: from global memory (cached), no staging
        L += [self.shared(ind, "Qs", (BQ, D), dt), self.shared(ind, "Dos", (BQ, Dv), dt),
              self.shared(ind, "Lr", (BQ,), dt), self.shared(ind, "Dl", (BQ,), dt),
              self.shared(ind, "S", (BQ, BK), dt),
              self.alloc_reg(ind, "DK", D, dt), self.alloc_reg(ind, "DV", Dv, dt),
              *([self.alloc_reg(ind, "DSA", 1, dt)] if v.alibi else []),
              f'{ind}W = T.alloc_buffer((2,), "{dt}", scope="local")']
        L += [f"{ind}NQT = (Nq + {BQ - 1}) // {BQ}", f"{ind}G = Hq // Hk",
              f"{ind}b = by // Hk", f"{ind}hk = by % Hk", f"{ind}k0 = bx * {BK}"]
        if v.dropout:
            L.append(f'{ind}seedm = T.Cast("uint32", seed)')
        L += K._ksum_base(v, ind) + K._query_tile_range(v, ind)
        body = [f"for d in range({D}):", f"    {self.reg('DK', 'd')} = T.{dt}(0)",
                 f"for e in range({Dv}):", f"    {self.reg('DV', 'e')} = T.{dt}(0)"]
        L += self.phase(ind, body)
        L += [f"{ind}for gh in range(G):", f"{ind}    h = hk * G + gh"]
        if v.alibi:
            L += self.phase(ind + "    ", [f"{self.reg('DSA', '0')} = T.{dt}(0)"])
        L += [f"{ind}    for qt in range(qt_lo, qt_hi):"]
        ind3 = ind + "        "
        L += [f"{ind3}q0 = qt * {BQ}"] + K._query_summary(v, ind3)
        guard = K._tile_visit(v, f"(k0 // {BK})")
        # the query tile: q, dO, lse (a row without a kept key has lse -inf: +inf makes its P zero), delta
        body = self.load("Qs", "Q", BQ, D, "q0", "Nq", "h") + self.load("Dos", "DO", BQ, Dv, "q0", "Nq", "h")
        body += [f"if tx < {BQ}:",
                 f"    W[0] = T.Cast(\"{dt}\", LSE[b, h, T.min(q0 + tx, Nq - 1)])",
                 f"    Lr[tx] = T.if_then_else(W[0] == {ninf}, T.{dt}(\"inf\"), W[0])",
                 f"    Dl[tx] = T.Cast(\"{dt}\", DELTA[b, h, T.min(q0 + tx, Nq - 1)])"]
        L += self.phase(ind3, body, guard)
        body = [f"for i in range({BQ}):", f"    W[0] = T.{dt}(0)",
                f"    for d in range({D}):", "        W[0] = W[0] + Qs[i, d] * K[b, hk, T.min(k0 + tx, Nk - 1), d]",
                f"    S[i, tx] = {self.logit('q0 + i', 'k0 + tx', 'W[0]')}"]
        L += self.phase(ind3, body, guard)
        sij = "S[i, tx]"
        body = [f"for i in range({BQ}):"]
        if v.policy == "dfss":
            body += [f"    g0 = tx - tx % {v.nm_m}",
                     f"    sk = T.if_then_else({self.kept(lambda x: f'S[i, {x}]', 'tx')}, S[i, tx], {ninf})"]
            sij = "sk"
        body += [f"    W[1] = T.{dt}(0)", f"    for e in range({Dv}):", "        W[1] = W[1] + Dos[i, e] * V[b, hk, T.min(k0 + tx, Nk - 1), e]"]
        body += self.grads("    ", "q0 + i", "k0 + tx", sij, "Lr[i]", "Dl[i]", "W[1]")
        body += [f"    for e in range({Dv}):", f"        {self.reg('DV', 'e')} = {self.reg('DV', 'e')} + pd * Dos[i, e]",
                 f"    for d in range({D}):", f"        {self.reg('DK', 'd')} = {self.reg('DK', 'd')} + ds * Qs[i, d]"]
        qc, kc = "T.min(q0 + i, Nq - 1)", "T.min(k0 + tx, Nk - 1)"
        if v.alibi:  # this key's share of dslope[h] (summed over keys and batches on the host)
            body += [f"    {self.reg('DSA', '0')} = {self.reg('DSA', '0')} + ds * T.Cast(\"{dt}\", "
                     f"{K._rel(v, qc, kc)})"]
        if v.rel:  # each logit's gradient into the table's row of its distance
            lj = f"{K.lut_index(v, qc, kc)} * Hq + h"
            add = (f"DLUT[{lj}] = DLUT[{lj}] + ds" if self.cpu
                   else f"T.evaluate(T.cuda.atomic_add(T.address_of(DLUT[{lj}]), ds))")
            body += ["    if ds != T.{}(0):".format(dt), f"        {add}"]
        L += self.phase(ind3, body, guard)
        if v.alibi:
            L += self.phase(ind + "    ", ["if k0 + tx < Nk:", f"    DSL[b, h, k0 + tx] = {self.reg('DSA', '0')}"])
        body = ["if k0 + tx < Nk:",
                f"    for d in range({D}):",
                f"        DK_[b, hk, k0 + tx, d] = {self.reg('DK', 'd')} * T.Cast(\"{dt}\", scale)",
                f"    for e in range({Dv}):",
                f"        DV_[b, hk, k0 + tx, e] = {self.reg('DV', 'e')}"]
        L += self.phase(ind, body)
        return "\n".join(L) + "\n"

    def dq(self) -> str:
        v, dt = self.v, self.dt
        BQ, BK, D, Dv = v.block_q, v.block_k, v.head_dim, v.head_dim_v
        ninf = K._neg_inf(v)
        L = self.signature()
        head, ind = self.blocks(f"(Nq + {BQ - 1}) // {BQ}", "B * Hq")
        L += head
        L += [self.shared(ind, "Ks", (BK, D), dt), self.shared(ind, "Vs", (BK, Dv), dt),
              self.alloc_reg(ind, "Qr", D, dt), self.alloc_reg(ind, "Dor", Dv, dt), self.alloc_reg(ind, "DQ", D, dt),
              self.alloc_reg(ind, "Rw", 2, dt),
              f'{ind}S = T.alloc_buffer(({BK},), "{dt}", scope="local")',
              f'{ind}R = T.alloc_buffer(({BK},), "{dt}", scope="local")',
              f'{ind}W = T.alloc_buffer((2,), "{dt}", scope="local")']
        L += [f"{ind}NKT = (Nk + {BK - 1}) // {BK}", f"{ind}G = Hq // Hk",
              f"{ind}b = by // Hq", f"{ind}h = by % Hq", f"{ind}hk = h // G", f"{ind}q0 = bx * {BQ}"]
        if v.dropout:
            L.append(f'{ind}seedm = T.Cast("uint32", seed)')
        L += K._ksum_base(v, ind) + K._query_summary(v, ind) + K._tile_range(v, ind)
        qc = "T.min(q0 + tx, Nq - 1)"
        body = [f"for d in range({D}):", f"    {self.reg('Qr', 'd')} = Q[b, h, {qc}, d]",
                f"    {self.reg('DQ', 'd')} = T.{dt}(0)",
                f"for e in range({Dv}):", f"    {self.reg('Dor', 'e')} = DO[b, h, {qc}, e]",
                f"W[0] = T.Cast(\"{dt}\", LSE[b, h, {qc}])",
                f"{self.reg('Rw', '0')} = T.if_then_else(W[0] == {ninf}, T.{dt}(\"inf\"), W[0])",
                f"{self.reg('Rw', '1')} = T.Cast(\"{dt}\", DELTA[b, h, {qc}])"]
        L += self.phase(ind, body)
        L += [f"{ind}for kt in range(kt_lo, kt_hi):", f"{ind}    k0 = kt * {BK}"]
        ind2 = ind + "    "
        guard = K._tile_visit(v, "kt")
        L += self.phase(ind2, self.load("Ks", "K", BK, D, "k0", "Nk", "hk") + self.load("Vs", "V", BK, Dv, "k0", "Nk", "hk"),
                        guard)
        body = [f"for j in range({BK}):", f"    W[0] = T.{dt}(0)",
                f"    for d in range({D}):", f"        W[0] = W[0] + {self.reg('Qr', 'd')} * Ks[j, d]",
                f"    S[j] = {self.logit('q0 + tx', 'k0 + j', 'W[0]')}"]
        if v.policy == "dfss":
            body += [f"for j in range({BK}):", f"    g0 = j - j % {v.nm_m}",
                     f"    R[j] = T.if_then_else({self.kept(lambda x: f'S[{x}]', 'j')}, S[j], {ninf})",
                     f"for j in range({BK}):", "    S[j] = R[j]"]
        body += [f"for j in range({BK}):", f"    W[1] = T.{dt}(0)",
                 f"    for e in range({Dv}):", f"        W[1] = W[1] + {self.reg('Dor', 'e')} * Vs[j, e]"]
        body += self.grads("    ", "q0 + tx", "k0 + j", "S[j]", self.reg("Rw", "0"), self.reg("Rw", "1"), "W[1]")
        body += [f"    for d in range({D}):", f"        {self.reg('DQ', 'd')} = {self.reg('DQ', 'd')} + ds * Ks[j, d]"]
        L += self.phase(ind2, body, guard)
        body = ["if q0 + tx < Nq:", f"    for d in range({D}):",
                f"        DQ_[b, h, q0 + tx, d] = {self.reg('DQ', 'd')} * T.Cast(\"{dt}\", scale)"]
        L += self.phase(ind, body)
        return "\n".join(L) + "\n"


def bwd_source(v: Variant, kind: str, target: str = "cuda") -> str:
    """TVMScript of the backward kernel ``kind`` (dkdv | dq) of ``v`` (tile sizes of
    :func:`bwd_variant`) for ``target`` (cuda | llvm)."""
    if kind not in BWD_KINDS:
        raise ValueError(f"backward kernel {kind!r}: one of {', '.join(BWD_KINDS)}")
    if target not in ("cuda", "llvm"):
        raise ValueError(f"target {target!r}: cuda or llvm")
    g = _Gen(v, kind, target)
    return g.dkdv() if kind == "dkdv" else g.dq()
