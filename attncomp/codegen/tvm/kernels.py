"""TVMScript (TIR) sources of the attention kernels, generated per kernel variant.

One template (DESIGN.md §6): a flash-style loop over key tiles whose *tile schedule* (which key tiles a
query tile visits) and *entry predicate* (the §4.1 predicates, the dense residual mask and the policy's
keep rule, evaluated in registers) are specialised per :class:`Variant`. The generators here only build
text; :mod:`.build` parses and compiles it (so this module imports neither tvm nor torch, and the
source text is what the kernel cache hashes).

Kernels (all ``float32`` or ``float64`` compute; the host converts half types):

* ``attn_fwd``: ``(out, lse)``; parallel over batch x heads x query tiles; per query tile, key tiles
  of ``BK`` keys: ``S = scale (q k^T)`` on a transposed key tile (vectorised over keys), predicate,
  N:M selection inside the tile (groups of ``m`` keys never straddle tiles: ``BK % m == 0``), online
  softmax, ``P V`` vectorised over the value dim. ``N x N`` is never built.
* ``attn_bwd_dkdv``: ``(dk, dv)`` per KV head and key tile, looping over the query heads of its GQA
  group and their query tiles; ``attn_bwd_dq``: ``dq`` per query tile. Both recompute ``P`` from
  ``lse`` with the same predicate and selection code, so every policy whose keep rule is elementwise or
  local to a key group (all of them) has its backward.

Score modifiers (DESIGN.md §4.2, :func:`logit`): ALiBi and the relative bias (read from a host look-up
table per clamped distance, :func:`attncomp.codegen.modifiers.rel_lut`) are added to ``scale * q·k``, then
the soft-cap, before the float mask and the policy's selection; sinks join the row's max and sum at its
end (:func:`sink_epilogue`). Backward: the soft-cap's ``1 - tanh^2`` on ``dS`` (:func:`cap_factor`); the
dK/dV kernel writes ALiBi's gradient as one partial sum per key and query head and the table's as per-tile
sums of each distance (each element owned by one parallel iteration); the host sums both and computes
the sinks' gradient from ``lse`` and ``delta``. A variant without modifiers generates the source it did
before they existed.

Tile schedule: with default positions (``q_pos = i + qoff``, ``k_pos = j``) a causal or windowed
query tile visits only the key tiles its window can reach; a ``spion`` tile (``BQ``, ``BK`` dividing
the block size) is skipped when its block is off the pattern and off the diagonal; with positions,
segments or key validity given, per-key-tile summaries (built on the device by the host,
:func:`attncomp.codegen.tvm.backend.tile_summaries`) let a query tile skip key tiles that cannot hold
an allowed entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["Variant", "forward_source", "dkdv_source", "dq_source", "KERNEL_VERSION", "FWD_ARGS"]

#: bumped whenever the generated code changes meaning (part of every cache key through the source)
KERNEL_VERSION = 1

NEG_INF = 'T.float32("-inf")'


@dataclass(frozen=True)
class Variant:
    """Everything that selects a kernel (a compile-time specialisation).

    ``policy``: ``dense`` | ``dfss`` | ``hash`` | ``drop`` | ``spion``. ``mask``: ``none`` | ``bool`` |
    ``float`` (dense residual ``attn_mask``). ``window_left``/``window_right``: ``None`` = unbounded;
    ``causal`` adds ``right <= 0``. ``q_pos``/``k_pos``/``seg``/``q_valid``/``k_valid``: which predicate
    tensors the call gives.
    """

    head_dim: int
    head_dim_v: int
    dtype: str = "float32"  # compute dtype: float32 | float64
    block_q: int = 32
    block_k: int = 64
    policy: str = "dense"
    nm_n: int = 1
    nm_m: int = 1
    exclude_self: bool = False
    block_size: int = 64  # spion
    mask: str = "none"
    causal: bool = False
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    q_pos: bool = False
    k_pos: bool = False
    seg: bool = False
    q_valid: bool = False
    k_valid: bool = False
    dropout: bool = False
    #: CUDA kernel family: "" (the scalar template) or "sp" (DFSS on sparse tensor cores, :mod:`.sparse`)
    mma: str = ""
    #: operand dtype of the tensor-core kernels (float16 | bfloat16); "" for the others
    operand_dtype: str = ""
    #: score modifiers (DESIGN.md §4.2): ALiBi, the relative-position bias (a look-up table per clamped
    #: distance), the soft-cap (its cap a scalar argument), attention sinks
    alibi: bool = False
    rel: bool = False
    softcap: bool = False
    sinks: bool = False

    def __post_init__(self):
        if self.policy == "dfss" and self.block_k % self.nm_m:
            raise ValueError(f"block_k {self.block_k} must be a multiple of m={self.nm_m}")
        if self.policy == "spion" and (self.block_size % self.block_q or self.block_size % self.block_k):
            raise ValueError("spion tiles must divide the block size")

    @property
    def right(self) -> Optional[int]:
        """Effective right bound of the position window (``None``: unbounded)."""
        r = self.window_right
        if self.causal:
            r = 0 if r is None else min(r, 0)
        return r

    @property
    def positional(self) -> bool:
        return self.right is not None or self.window_left is not None

    @property
    def summaries(self) -> bool:
        """Whether the kernel reads per-key-tile summaries (positions given, segments, key validity)."""
        return (self.positional and (self.q_pos or self.k_pos)) or self.seg or self.k_valid

    @property
    def logit_mods(self) -> bool:
        """Whether the logits are modified (ALiBi, relative bias, soft-cap; the sinks change only the softmax)."""
        return self.alibi or self.rel or self.softcap

    def to_json(self) -> dict:
        # a variant without modifiers describes itself as it did before they existed
        d = dataclasses.asdict(self)
        for f in _MOD_FIELDS:
            if not d[f]:
                del d[f]
        return d

    def digest(self) -> str:
        return hashlib.sha256(repr(sorted(self.to_json().items())).encode()).hexdigest()[:12]


_MOD_FIELDS = ("alibi", "rel", "softcap", "sinks")


# ---------------------------------------------------------------------------------------------
# Arguments: the order here is the calling convention (host and artefact metadata use it).

FWD_ARGS = ("q", "k", "kt", "v", "o", "lse")


def _extra_args(v: Variant) -> List[Tuple[str, str]]:
    """``(name, kind)`` of the variant's extra arguments, in order: ``handle`` or a scalar dtype."""
    a: List[Tuple[str, str]] = []
    if v.mask != "none":
        a += [("mask", "handle"), ("m_sb", "int32"), ("m_sh", "int32"), ("m_si", "int32"), ("m_sj", "int32")]
    if v.policy in ("hash", "drop"):
        a += [("qaux", "handle"), ("kaux", "handle")]
    if v.policy == "spion":
        a += [("bpat", "handle"), ("bp_sh", "int32")]
    if v.q_pos:
        a += [("qpos", "handle"), ("qpos_sb", "int32")]
    if v.k_pos:
        a += [("kpos", "handle"), ("kpos_sb", "int32")]
    if v.seg:
        a += [("qseg", "handle"), ("qseg_sb", "int32"), ("kseg", "handle"), ("kseg_sb", "int32")]
    if v.q_valid:
        a += [("qval", "handle"), ("qval_sb", "int32")]
    if v.k_valid:
        a += [("kval", "handle"), ("kval_sb", "int32")]
    if v.summaries:
        a += [("ksum", "handle"), ("ksum_sb", "int32")]
    a += [("scale", v.dtype), ("qoff", "int32")]
    if v.dropout:
        a += [("seed", "int64"), ("drop_p", "float32"), ("inv_keep", "float32")]
    if v.alibi:
        a += [("slopes", "handle")]
    if v.rel:
        a += [("lut", "handle"), ("rel_md", "int32")]
    if v.softcap:
        a += [("softcap", v.dtype)]
    if v.sinks:
        a += [("sinks", "handle")]
    return a


def mod_grad_args(v: Variant) -> Tuple[str, ...]:
    """The dK/dV kernels' outputs for the modifiers' gradients (after dk, dv): ALiBi's partial sums
    ``dslopes (B, Hq, Nk)`` (one per key and query head), the look-up table's ``dlut``."""
    return (("dslopes",) if v.alibi else ()) + (("dlut",) if v.rel else ())


#: the backward kernels' leading arguments (then dk, dv or dq)
BWD_ARGS = ("q", "k", "kt", "v", "vt", "do", "lse", "delta")


def arg_names(kind: str, v: Variant) -> Tuple[str, ...]:
    kind = kind.split("_", 1)[0]  # fwd_sp_emu, dq_cuda_emu, ...: the arguments of their kind
    base = {"fwd": FWD_ARGS, "dkdv": BWD_ARGS + ("dk", "dv") + mod_grad_args(v), "dq": BWD_ARGS + ("dq",)}[kind]
    return tuple(base) + tuple(n for n, _ in _extra_args(v))


# number of int32 summary fields per key tile: kpos min, kpos max, kseg min, kseg max, any valid key
KSUM_FIELDS = 5


def _signature(name: str, base: Tuple[str, ...], v: Variant) -> List[str]:
    params = [f"{n}: T.handle" for n in base] + [f"{n}: T.{k}" for n, k in _extra_args(v)]
    return [
        "@T.prim_func",
        f"def {name}({', '.join(params)}):",
        f'    T.func_attr({{"global_symbol": "{name}", "tir.noalias": True}})',
        "    B = T.int32()",
        "    Hq = T.int32()",
        "    Hk = T.int32()",
        "    Nq = T.int32()",
        "    Nk = T.int32()",
    ]


def _qkv_buffers(v: Variant, dt: str, *, out: Optional[str] = None, grad_out: bool = False) -> List[str]:
    """The CUDA kernels' Q, K, V (in ``dt``), then O (in ``out``) or dO, then LSE buffers (``lse`` in the
    compute dtype, the op's :func:`~attncomp.opspec.lse_dtype`)."""
    D, Dv = v.head_dim, v.head_dim_v
    L = [f'    Q = T.match_buffer(q, (B, Hq, Nq, {D}), "{dt}")',
         f'    K = T.match_buffer(k, (B, Hk, Nk, {D}), "{dt}")',
         f'    V = T.match_buffer(v, (B, Hk, Nk, {Dv}), "{dt}")']
    if out is not None:
        L.append(f'    O = T.match_buffer(o, (B, Hq, Nq, {Dv}), "{out}")')
    if grad_out:
        L.append(f'    DO = T.match_buffer(do, (B, Hq, Nq, {Dv}), "{dt}")')
    return L + [f'    LSE = T.match_buffer(lse, (B, Hq, Nq), "{v.dtype}")']


def _common_buffers(v: Variant) -> List[str]:
    L = []
    if v.mask != "none":
        mdt = "uint8" if v.mask == "bool" else v.dtype
        L += ["    mask_n = T.int32()", f'    MASK = T.match_buffer(mask, (mask_n,), "{mdt}")']
    if v.policy in ("hash", "drop"):
        L += ['    QA = T.match_buffer(qaux, (B, Hq, Nq), "int32")',
              '    KA = T.match_buffer(kaux, (B, Hk, Nk), "int32")']
    if v.policy == "spion":
        L += ["    bp_n = T.int32()", "    NBq = T.int32()", "    NBk = T.int32()",
              '    BP = T.match_buffer(bpat, (bp_n, NBq, NBk), "int32")']
    for nm, cond in (("qpos", v.q_pos), ("kpos", v.k_pos), ("qseg", v.seg), ("kseg", v.seg),
                     ("qval", v.q_valid), ("kval", v.k_valid)):
        if cond:
            L += [f"    {nm}_n = T.int32()", f'    {nm.upper()} = T.match_buffer({nm}, ({nm}_n,), "int32")']
    if v.summaries:
        L += ["    ksum_n = T.int32()", '    KSUM = T.match_buffer(ksum, (ksum_n,), "int32")']
    dt = v.dtype
    if v.alibi:
        L += [f'    SLOPES = T.match_buffer(slopes, (Hq,), "{dt}")']
    if v.rel:
        L += ["    lut_n = T.int32()", f'    LUT = T.match_buffer(lut, (lut_n,), "{dt}")']
    if v.sinks:
        L += [f'    SINKS = T.match_buffer(sinks, (Hq,), "{dt}")']
    return L


def mod_grad_buffers(v: Variant) -> List[str]:
    """Buffers of :func:`mod_grad_args` (``dlut`` flat: its layout is the kernel family's)."""
    L = []
    if v.alibi:
        L += [f'    DSL = T.match_buffer(dslopes, (B, Hq, Nk), "{v.dtype}")']
    if v.rel:
        L += ["    dlut_n = T.int32()", f'    DLUT = T.match_buffer(dlut, (dlut_n,), "{v.dtype}")']
    return L


# ---------------------------------------------------------------------------------------------
# Pieces of the template


def _qpos(v: Variant, qi: str) -> str:
    return f"QPOS[b * qpos_sb + {qi}]" if v.q_pos else f"({qi} + qoff)"


def _kpos(v: Variant, kj: str) -> str:
    return f"KPOS[b * kpos_sb + {kj}]" if v.k_pos else f"({kj})"


def _rel(v: Variant, qi: str, kj: str) -> str:
    """``k_pos - q_pos`` of an entry (int32), what ALiBi and the relative bias read."""
    return f"({_kpos(v, kj)} - {_qpos(v, qi)})"


def lut_index(v: Variant, qi: str, kj: str) -> str:
    """Row of the look-up table of the relative bias: ``clamp(rel, -rel_md, rel_md) + rel_md``."""
    return f"(T.min(T.max({_rel(v, qi, kj)}, 0 - rel_md), rel_md) + rel_md)"


def logit(v: Variant, dot: str, qi: str, kj: str) -> str:
    """The logit of entry (qi, kj) (indices in range) from its dot product ``dot``: ``scale * dot``, the
    score modifiers in their order (ALiBi plus the relative bias, then the soft-cap), then the float mask."""
    dt = v.dtype
    val = f"{dot} * T.Cast(\"{dt}\", scale)"
    bias = []
    if v.alibi:
        bias.append(f"SLOPES[h] * T.Cast(\"{dt}\", {_rel(v, qi, kj)})")
    if v.rel:
        bias.append(f"LUT[{lut_index(v, qi, kj)} * Hq + h]")
    if bias:
        val = f"{val} + ({' + '.join(bias)})"
    if v.softcap:
        val = f"softcap * T.tanh(({val}) / softcap)"
    if v.mask == "float":
        val += f" + MASK[b * m_sb + h * m_sh + {qi} * m_si + {kj} * m_sj]"
    return val


def cap_factor(v: Variant, sij: str, qi: str, kj: str) -> str:
    """``1 - tanh^2`` of a soft-capped logit ``sij`` (the float mask taken off it, as the reference
    does), 0 for an entry that is not kept (``sij`` -inf)."""
    t = f"({sij})"
    if v.mask == "float":
        t = f"({sij} - MASK[b * m_sb + h * m_sh + {qi} * m_si + {kj} * m_sj])"
    t = f"({t} / softcap)"
    return f"T.if_then_else({sij} == {_neg_inf(v)}, T.{v.dtype}(0), T.{v.dtype}(1) - {t} * {t})"


def _allowed(v: Variant, qi: str, kj: str, tile: bool = False) -> List[str]:
    """Conjuncts of "entry (qi, kj) is allowed and kept by an elementwise rule" (b, h, hk in scope).
    ``tile``: the policy's per-token tensors are read from the tile-local copies QAt[i]/KAt[j]."""
    qa = "QAt[i]" if tile else f"QA[b, h, {qi}]"
    ka = "KAt[j]" if tile else f"KA[b, hk, {kj}]"
    c = [f"{qi} < Nq", f"{kj} < Nk"]
    if v.positional:
        qp, kp = _qpos(v, qi), _kpos(v, kj)
        if v.right is not None:
            c.append(f"{kp} <= {qp} + ({v.right})")
        if v.window_left is not None:
            c.append(f"{kp} >= {qp} - ({v.window_left})")
    if v.seg:
        c.append(f"QSEG[b * qseg_sb + {qi}] == KSEG[b * kseg_sb + {kj}]")
    if v.q_valid:
        c.append(f"QVAL[b * qval_sb + {qi}] != 0")
    if v.k_valid:
        c.append(f"KVAL[b * kval_sb + {kj}] != 0")
    if v.mask == "bool":
        c.append(f"MASK[b * m_sb + h * m_sh + {qi} * m_si + {kj} * m_sj] != T.uint8(0)")
    elif v.mask == "float":
        c.append(f"MASK[b * m_sb + h * m_sh + {qi} * m_si + {kj} * m_sj] != {_neg_inf(v)}")
    if v.policy == "hash":
        c.append(f"{qa} == {ka}")
        if v.exclude_self:
            c.append(f"{qi} != {kj}")
    elif v.policy == "drop":
        c.append(f"{qa} != 0")
        c.append(f"{ka} != 0")
    elif v.policy == "spion":
        bs = v.block_size
        c.append(f"(BP[h * bp_sh, ({qi}) // {bs}, ({kj}) // {bs}] != 0 "
                 f"or ({qi}) // {bs} == ({kj}) // {bs})")
    return c


_EXP_C = ("1.0", "0.6931471805599453", "0.2402265069591007", "0.05550410866482158",
          "0.009618129107628477", "0.0013333558146428443", "0.00015403530393381606")


def _exp_parts(x: str, f: str, n: str) -> Tuple[str, str, str]:
    """float32 ``exp(x) = 2^n p(f)``, ``n = round(x log2 e)``, ``|f| <= 1/2``, ``p`` a degree-6
    polynomial (relative error ~2e-7, no libm call, vectorisable); ``exp(-inf) = 0`` exactly.
    Returns the expressions of ``n``, ``f`` (given ``n``) and the result (given ``f`` and ``n``)."""
    t = f"T.min(T.max(({x}) * T.float32(1.4426950408889634), T.float32(-127.0)), T.float32(127.0))"
    poly = f"T.float32({_EXP_C[-1]})"
    for coef in reversed(_EXP_C[:-1]):
        poly = f"T.float32({coef}) + {f} * ({poly})"
    res = f"({poly}) * T.reinterpret(\"float32\", T.shift_left(T.Cast(\"int32\", {n}) + 127, 23))"
    return f"T.round({t})", f"{t} - {n}", res


def _exp_lines(v: Variant, ind: str, var: str, x: str) -> List[str]:
    """Scalar: lines binding ``var`` to ``exp(x)`` (float64: the intrinsic)."""
    if v.dtype != "float32":
        return [f"{ind}{var} = T.exp({x})"]
    n, f, res = _exp_parts(x, f"{var}_f", f"{var}_n")
    return [f"{ind}{var}_n = {n}", f"{ind}{var}_f = {f}", f"{ind}{var} = {res}"]


def _exp_vec(v: Variant, ind: str, dst: str, x: str, width: int) -> List[str]:
    """Vectorised ``dst = exp(x)`` over ``j`` in ``range(width)`` (``x`` and ``dst`` in terms of j).
    The intermediate values go through the En/Ef scratch buffers: no let binding inside a vectorised
    loop (TVM's vectoriser would broadcast it)."""
    if v.dtype != "float32":
        return [f"{ind}for j in T.vectorized({width}):", f"{ind}    {dst} = T.exp({x})"]
    n, f, res = _exp_parts(x, "Ef[j]", "En[j]")
    return [f"{ind}for j in T.vectorized({width}):", f"{ind}    En[j] = {n}",
            f"{ind}for j in T.vectorized({width}):", f"{ind}    Ef[j] = {f}",
            f"{ind}for j in T.vectorized({width}):", f"{ind}    {dst} = {res}"]


def _rows(v: Variant, width: int) -> int:
    """Query rows processed together by the tile GEMM loops (accumulators kept in registers)."""
    for r in (4, 2):
        if v.block_q % r == 0 and r * width <= 256:
            return r
    return 1


def _neg_inf(v: Variant) -> str:
    return f'T.{v.dtype}("-inf")'


def _and(conds: List[str]) -> str:
    # nested T.if_then_else-free conjunction: TVMScript maps `and` to tirx.And (short-circuit safe
    # index reads: every read here is in bounds because indices are clamped below)
    return " and ".join(f"({c})" for c in conds)


def _clamp_q(e: str) -> str:
    return f"T.min({e}, Nq - 1)"


def _clamp_k(e: str) -> str:
    return f"T.min({e}, Nk - 1)"


def _bounded_range(ind: str, lo: str, hi: str, n_tiles: str, block: int, lo_pos, hi_pos) -> List[str]:
    """``lo``/``hi`` tile bounds from the first and last allowed positions (``None``: unbounded)."""
    return [f"{ind}{lo} = " + (f"T.max(0, T.floordiv({lo_pos}, {block}))" if lo_pos is not None else "0"),
            f"{ind}{hi} = " + (f"T.min({n_tiles}, T.max(0, T.floordiv({hi_pos}, {block}) + 1))"
                               if hi_pos is not None else n_tiles)]


def _tile_range(v: Variant, ind: str) -> List[str]:
    """``kt_lo``/``kt_hi`` for the query tile starting at ``q0`` (default positions only)."""
    if not (v.positional and not (v.q_pos or v.k_pos)):
        return [f"{ind}kt_lo = 0", f"{ind}kt_hi = NKT"]
    qmin, qmax = "(q0 + qoff)", f"(T.min(q0 + {v.block_q}, Nq) - 1 + qoff)"
    return _bounded_range(ind, "kt_lo", "kt_hi", "NKT", v.block_k,
                          None if v.window_left is None else f"{qmin} - ({v.window_left})",
                          None if v.right is None else f"{qmax} + ({v.right})")


def _query_tile_range(v: Variant, ind: str) -> List[str]:
    """``qt_lo``/``qt_hi``: query tiles that can reach key tile ``k0`` (default positions only)."""
    if not (v.positional and not (v.q_pos or v.k_pos)):
        return [f"{ind}qt_lo = 0", f"{ind}qt_hi = NQT"]
    kmin, kmax = "k0", f"(T.min(k0 + {v.block_k}, Nk) - 1)"
    # allowed needs  kp - right <= qp <= kp + left,  qp = i + qoff
    return _bounded_range(ind, "qt_lo", "qt_hi", "NQT", v.block_q,
                          None if v.right is None else f"{kmin} - ({v.right}) - qoff",
                          None if v.window_left is None else f"{kmax} + ({v.window_left}) - qoff")


def _query_summary(v: Variant, ind: str) -> List[str]:
    """Per query tile: min/max position and segment of its valid rows (into QS local buffer)."""
    if not v.summaries:
        return []
    BQ = v.block_q
    L = [f'{ind}QS = T.alloc_buffer((4,), "int32", scope="local")',
         f"{ind}QS[0] = 2147483647", f"{ind}QS[1] = -2147483647",
         f"{ind}QS[2] = 2147483647", f"{ind}QS[3] = -2147483647",
         f"{ind}for i in range({BQ}):",
         f"{ind}    if q0 + i < Nq:"]
    qi = "q0 + i"
    qp = _qpos(v, qi)
    L += [f"{ind}        QS[0] = T.min(QS[0], {qp})", f"{ind}        QS[1] = T.max(QS[1], {qp})"]
    if v.seg:
        L += [f"{ind}        QS[2] = T.min(QS[2], QSEG[b * qseg_sb + {qi}])",
              f"{ind}        QS[3] = T.max(QS[3], QSEG[b * qseg_sb + {qi}])"]
    return L


def _tile_visit(v: Variant, kt: str) -> str:
    """Condition under which key tile ``kt`` may hold an entry of the query tile (q0 in scope)."""
    c = []
    if v.policy == "spion":
        bs = v.block_size
        c.append(f"(BP[h * bp_sh, q0 // {bs}, ({kt} * {v.block_k}) // {bs}] != 0 "
                 f"or q0 // {bs} == ({kt} * {v.block_k}) // {bs})")
    if v.summaries:
        base = f"ksum_b + {kt} * {KSUM_FIELDS}"
        if v.positional and (v.q_pos or v.k_pos):
            if v.right is not None:
                c.append(f"KSUM[{base}] <= QS[1] + ({v.right})")
            if v.window_left is not None:
                c.append(f"KSUM[{base} + 1] >= QS[0] - ({v.window_left})")
        if v.seg:
            c.append(f"KSUM[{base} + 2] <= QS[3]")
            c.append(f"KSUM[{base} + 3] >= QS[2]")
        if v.k_valid:
            c.append(f"KSUM[{base} + 4] != 0")
    return _and(c) if c else ""



def _key_tile_loop(v: Variant, ind: str, BK: int) -> Tuple[List[str], str]:
    """The loop over the call's key tiles (``kt_lo`` .. ``kt_hi``), the tiles the schedule skips left out,
    ``k0`` set: the lines and the indent of the loop body."""
    L = [f"{ind}for kt in range(kt_lo, kt_hi):"]
    ind2 = ind + "    "
    visit = _tile_visit(v, "kt")
    if visit:
        L += [f"{ind2}if {visit}:"]
        ind2 += "    "
    return L + [f"{ind2}k0 = kt * {BK}"], ind2

def _scores(v: Variant, ind: str) -> List[str]:
    """S[BQ, BK] = logits of the tile (q0, k0) with disallowed / unkept entries at -inf.

    Needs in scope: b, h, hk, q0, k0; local Qs (the query tile, (BQ, D)); allocates S (, R). KT is k transposed to (B, Hk, D, NKT * BK), zero-padded
    by the host, so a key tile is read contiguously along keys.
    """
    BQ, BK, D = v.block_q, v.block_k, v.head_dim
    RQ = _rows(v, BK)
    ninf = _neg_inf(v)
    L = [
        f"{ind}for i, j in T.grid({BQ}, {BK}):",
        f"{ind}    S[i, j] = T.{v.dtype}(0)",
        f"{ind}for i0, d in T.grid({BQ // RQ}, {D}):",
        f"{ind}    for ii in T.unroll({RQ}):",
        f"{ind}        for j in T.vectorized({BK}):",
        f"{ind}            S[i0 * {RQ} + ii, j] = S[i0 * {RQ} + ii, j] + Qs[i0 * {RQ} + ii, d] * KT[b, hk, d, k0 + j]",
    ]
    qi, kj = "q0 + i", "k0 + j"
    qc, kc = _clamp_q(qi), _clamp_k(kj)
    if v.policy in ("hash", "drop"):
        # the per-token tensors of the tile, copied once: the predicate loop then reads registers
        L += [f"{ind}for i in range({BQ}):", f"{ind}    QAt[i] = QA[b, h, {qc}]",
              f"{ind}for j in range({BK}):", f"{ind}    KAt[j] = KA[b, hk, {kc}]"]
    # every read in the predicate uses clamped indices; the true bounds are its first conjuncts
    conds = _allowed(v, qc, kc, tile=True)
    conds[0], conds[1] = f"{qi} < Nq", f"{kj} < Nk"
    # the scale multiplies the finished dot product (as the reference does), so equal dot products
    # stay equal logits and N:M ties break by key index alike
    val = f"S[i, j] * T.Cast(\"{v.dtype}\", scale)"
    if v.mask == "float":
        val = f"S[i, j] * T.Cast(\"{v.dtype}\", scale) + MASK[b * m_sb + h * m_sh + {qc} * m_si + {kc} * m_sj]"
    if v.logit_mods:
        val = logit(v, "S[i, j]", qc, kc)
    L += [f"{ind}for i, j in T.grid({BQ}, {BK}):",
          f"{ind}    S[i, j] = T.if_then_else({_and(conds)}, {val}, {ninf})"]
    if v.policy == "dfss":
        n, m = v.nm_n, v.nm_m
        terms = []
        for t in range(m):
            o = f"S[i, g0 + {t}]"
            terms.append(f"T.Cast(\"int32\", ({o} > S[i, j]) or ({o} == S[i, j] and g0 + {t} < j))")
        L += [f"{ind}for i, j in T.grid({BQ}, {BK}):",
              f"{ind}    g0 = j - j % {m}",
              f"{ind}    R[i, j] = T.if_then_else({' + '.join(terms)} < {n}, S[i, j], {ninf})",
              f"{ind}for i, j in T.grid({BQ}, {BK}):",
              f"{ind}    S[i, j] = R[i, j]"]
    return L


def _hash_lines(ind: str, var: str, x: str) -> List[str]:
    """Lines binding ``var`` to the float in [0,1) of policy.uniform_hash's mixing of uint32 ``x``."""
    return [
        f"{ind}{var}_0 = {x} * T.uint32(2246822507)",
        f"{ind}{var}_1 = T.bitwise_xor({var}_0, T.shift_right({var}_0, T.uint32(13)))",
        f"{ind}{var}_2 = {var}_1 * T.uint32(3266489909)",
        f"{ind}{var}_3 = T.bitwise_xor({var}_2, T.shift_right({var}_2, T.uint32(16)))",
        f"{ind}{var}_4 = {var}_3 * T.uint32(668265263)",
        f"{ind}{var}_5 = T.bitwise_xor({var}_4, T.shift_right({var}_4, T.uint32(15)))",
        f"{ind}{var} = T.Cast(\"float32\", T.shift_right({var}_5, T.uint32(8))) * T.float32(5.9604644775390625e-08)",
    ]


def _dropout_index(ind: str, qi: str, kj: str) -> List[str]:
    return [
        f"{ind}didx = T.Cast(\"int64\", (b * Hq + h) * Nq + {qi}) * T.Cast(\"int64\", Nk) + T.Cast(\"int64\", {kj})",
        f"{ind}dx = T.bitwise_xor(T.Cast(\"uint32\", T.bitwise_and(didx, T.int64(4294967295))), seedm)",
    ]


def _header(v: Variant) -> List[str]:
    BQ, BK = v.block_q, v.block_k
    L = [f"    NQT = (Nq + {BQ - 1}) // {BQ}", f"    NKT = (Nk + {BK - 1}) // {BK}", "    G = Hq // Hk"]
    if v.dropout:
        L.append('    seedm = T.Cast("uint32", seed)')
    return L


def _scratch(v: Variant, ind: str) -> List[str]:
    BQ, BK, D, dt = v.block_q, v.block_k, v.head_dim, v.dtype
    L = [f'{ind}Qs = T.alloc_buffer(({BQ}, {D}), "{dt}", scope="local")',
         f'{ind}S = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")']
    if v.policy == "dfss":
        L.append(f'{ind}R = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")')
    if v.policy in ("hash", "drop"):
        L += [f'{ind}QAt = T.alloc_buffer(({BQ},), "int32", scope="local")',
              f'{ind}KAt = T.alloc_buffer(({BK},), "int32", scope="local")']
    return L


def _load_q(v: Variant, ind: str) -> List[str]:
    return [f"{ind}for i, d in T.grid({v.block_q}, {v.head_dim}):",
            f"{ind}    Qs[i, d] = Q[b, h, {_clamp_q('q0 + i')}, d]"]


def _ksum_base(v: Variant, ind: str) -> List[str]:
    return [f"{ind}ksum_b = b * ksum_sb"] if v.summaries else []


def forward_source(v: Variant) -> str:
    BQ, BK, D, Dv, dt = v.block_q, v.block_k, v.head_dim, v.head_dim_v, v.dtype
    ninf = _neg_inf(v)
    L = _signature("attn_fwd", FWD_ARGS, v)
    L += [f'    Q = T.match_buffer(q, (B, Hq, Nq, {D}), "{dt}")',
          f'    K = T.match_buffer(k, (B, Hk, Nk, {D}), "{dt}")',
          "    NKp = T.int32()",
          f'    KT = T.match_buffer(kt, (B, Hk, {D}, NKp), "{dt}")',
          f'    V = T.match_buffer(v, (B, Hk, Nk, {Dv}), "{dt}")',
          f'    O = T.match_buffer(o, (B, Hq, Nq, {Dv}), "{dt}")',
          f'    LSE = T.match_buffer(lse, (B, Hq, Nq), "{dt}")']
    L += _common_buffers(v) + _header(v)
    ind = "        "
    L += ["    for bhq in T.parallel(B * Hq * NQT):",
          f"{ind}b = bhq // (Hq * NQT)", f"{ind}h = bhq // NQT % Hq", f"{ind}hk = h // G",
          f"{ind}q0 = bhq % NQT * {BQ}"]
    L += _scratch(v, ind)
    L += [f'{ind}P = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")',
          f'{ind}ACC = T.alloc_buffer(({BQ}, {Dv}), "{dt}", scope="local")',
          f'{ind}Mx = T.alloc_buffer(({BQ},), "{dt}", scope="local")',
          f'{ind}Ls = T.alloc_buffer(({BQ},), "{dt}", scope="local")',
          f'{ind}W = T.alloc_buffer((2,), "{dt}", scope="local")',
          f'{ind}Wv = T.alloc_buffer((16,), "{dt}", scope="local")',
          f'{ind}Mu = T.alloc_buffer((1,), "{dt}", scope="local")',
          f'{ind}En = T.alloc_buffer(({BK},), "{dt}", scope="local")',
          f'{ind}Ef = T.alloc_buffer(({BK},), "{dt}", scope="local")']
    L += _load_q(v, ind) + _ksum_base(v, ind) + _query_summary(v, ind)
    L += [f"{ind}for i in range({BQ}):",
          f"{ind}    Mx[i] = {ninf}",
          f"{ind}    Ls[i] = T.{dt}(0)",
          f"{ind}    for e in T.vectorized({Dv}):",
          f"{ind}        ACC[i, e] = T.{dt}(0)"]
    L += _tile_range(v, ind)
    loop, ind2 = _key_tile_loop(v, ind, BK)
    L += loop + [f"{ind2}kn = T.min({BK}, Nk - k0)"]
    L += _scores(v, ind2)
    ind3 = ind2 + "    "
    LN = 16 if BK % 16 == 0 else BK
    L += [f"{ind2}for i in range({BQ}):",
          f"{ind3}for l in T.vectorized({LN}):",
          f"{ind3}    Wv[l] = S[i, l]",
          f"{ind3}for c in range(1, {BK // LN}):",
          f"{ind3}    for l in T.vectorized({LN}):",
          f"{ind3}        Wv[l] = T.max(Wv[l], S[i, c * {LN} + l])",
          f"{ind3}W[0] = Mx[i]",
          f"{ind3}for l in range({LN}):",
          f"{ind3}    W[0] = T.max(W[0], Wv[l])",
          f"{ind3}mu = T.if_then_else(W[0] == {ninf}, T.{dt}(0), W[0])"]
    L += _exp_lines(v, ind3, "alpha", "Mx[i] - mu")
    L += [f"{ind3}Mu[0] = mu"]
    L += _exp_vec(v, ind3, "P[i, j]", "S[i, j] - Mu[0]", BK)
    L += [f"{ind3}for l in T.vectorized({LN}):",
          f"{ind3}    Wv[l] = P[i, l]",
          f"{ind3}for c in range(1, {BK // LN}):",
          f"{ind3}    for l in T.vectorized({LN}):",
          f"{ind3}        Wv[l] = Wv[l] + P[i, c * {LN} + l]",
          f"{ind3}W[1] = T.{dt}(0)",
          f"{ind3}for l in range({LN}):",
          f"{ind3}    W[1] = W[1] + Wv[l]",
          f"{ind3}Ls[i] = Ls[i] * alpha + W[1]",
          f"{ind3}Mx[i] = W[0]",
          f"{ind3}for e in T.vectorized({Dv}):",
          f"{ind3}    ACC[i, e] = ACC[i, e] * alpha"]
    if v.dropout:
        L += [f"{ind3}for j in range({BK}):"]
        L += _dropout_index(ind3 + "    ", "q0 + i", "k0 + j")
        L += _hash_lines(ind3 + "    ", "du", "dx")
        L += [f"{ind3}    P[i, j] = T.if_then_else(du >= drop_p, P[i, j], T.{dt}(0))"]
    RV = _rows(v, Dv)
    L += [f"{ind2}for i0 in range({BQ // RV}):",
          f"{ind3}for j in range(kn):",
          f"{ind3}    for ii in T.unroll({RV}):",
          f"{ind3}        for e in T.vectorized({Dv}):",
          f"{ind3}            ACC[i0 * {RV} + ii, e] = ACC[i0 * {RV} + ii, e] + P[i0 * {RV} + ii, j] * V[b, hk, k0 + j, e]"]
    keep = f" * T.Cast(\"{dt}\", inv_keep)" if v.dropout else ""
    if v.sinks:
        L += [f"{ind}for i in range({BQ}):", f"{ind}    if q0 + i < Nq:"]
        L += sink_epilogue(v, ind + "        ", "Mx[i]", "Ls[i]", "W[0]", "LSE[b, h, q0 + i]", keep)
        L += [f"{ind}        for e in T.vectorized({Dv}):",
              f"{ind}            O[b, h, q0 + i, e] = ACC[i, e] * W[0]"]
        return "\n".join(L) + "\n"
    L += [f"{ind}for i in range({BQ}):",
          f"{ind}    if q0 + i < Nq:",
          f"{ind}        W[0] = T.if_then_else(Ls[i] > T.{dt}(0), T.{dt}(1) / Ls[i], T.{dt}(0)){keep}",
          f"{ind}        for e in T.vectorized({Dv}):",
          f"{ind}            O[b, h, q0 + i, e] = ACC[i, e] * W[0]",
          f"{ind}        LSE[b, h, q0 + i] = T.if_then_else(Ls[i] > T.{dt}(0), "
          f"T.Cast(\"{dt}\", Mx[i] + T.log(Ls[i])), {ninf})"]
    return "\n".join(L) + "\n"


def sink_epilogue(v: Variant, ind: str, mx: str, ls: str, w: str, lse: str, keep: str = "",
                  dt: Optional[str] = None) -> List[str]:
    """A row's end with attention sinks: the sink's logit joins the running max ``mx`` and sum ``ls``;
    ``w`` gets the factor of the accumulated output (0 for a row with no kept key: the sink attends to
    nothing), ``lse`` the row's log-sum-exp (the sink's logit for such a row)."""
    dt = dt or v.dtype
    return [f"{ind}sk = T.Cast(\"{dt}\", SINKS[h])",
            f"{ind}mf = T.max({mx}, sk)",
            f"{ind}al = T.exp({mx} - mf)",
            f"{ind}lf = {ls} * al + T.exp(sk - mf)",
            f"{ind}{w} = al / lf{keep}",
            f"{ind}{lse} = T.Cast(\"{dt}\", mf + T.log(lf))"]


def _probs_bwd(v: Variant, ind: str) -> List[str]:
    """P[i, j] = exp(S - lse) of kept entries (0 elsewhere and for rows without a kept key), then
    dP = dO V^T, dropout applied to both, dS = P (dP - delta). Needs Do (BQ, Dv), Lr, Dl in scope."""
    BQ, BK, Dv, dt = v.block_q, v.block_k, v.head_dim_v, v.dtype
    RQ = _rows(v, BK)
    # a row without a kept key has lse = -inf: subtracting +inf instead gives exp(-inf) = 0
    L = [f"{ind}for i in range({BQ}):",
         f"{ind}    Mu[0] = T.if_then_else(Lr[i] == {_neg_inf(v)}, T.{dt}(\"inf\"), Lr[i])"]
    L += _exp_vec(v, ind + "    ", "P[i, j]", "S[i, j] - Mu[0]", BK)
    L += [f"{ind}for i, j in T.grid({BQ}, {BK}):",
         f"{ind}    Dp[i, j] = T.{dt}(0)",
         f"{ind}for i0, e in T.grid({BQ // RQ}, {Dv}):",
         f"{ind}    for ii in T.unroll({RQ}):",
         f"{ind}        for j in T.vectorized({BK}):",
         f"{ind}            Dp[i0 * {RQ} + ii, j] = Dp[i0 * {RQ} + ii, j] + Do[i0 * {RQ} + ii, e] * VT[b, hk, e, k0 + j]"]
    if v.dropout:
        L += [f"{ind}for i, j in T.grid({BQ}, {BK}):"]
        L += _dropout_index(ind + "    ", "q0 + i", "k0 + j")
        L += _hash_lines(ind + "    ", "du", "dx")
        L += [f"{ind}    Pd[i, j] = T.if_then_else(du >= drop_p, P[i, j] * T.Cast(\"{dt}\", inv_keep), T.{dt}(0))",
              f"{ind}    Dp[i, j] = T.if_then_else(du >= drop_p, Dp[i, j] * T.Cast(\"{dt}\", inv_keep), T.{dt}(0))"]
    L += [f"{ind}for i, j in T.grid({BQ}, {BK}):",
          f"{ind}    Ds[i, j] = P[i, j] * (Dp[i, j] - Dl[i])"]
    if v.softcap:  # through c * tanh(s / c): the gradient of the logit before the cap
        f = cap_factor(v, "S[i, j]", _clamp_q("q0 + i"), _clamp_k("k0 + j"))
        L += [f"{ind}for i, j in T.grid({BQ}, {BK}):",
              f"{ind}    Ds[i, j] = Ds[i, j] * {f}"]
    return L


def _bwd_scratch(v: Variant, ind: str) -> List[str]:
    BQ, BK, Dv, dt = v.block_q, v.block_k, v.head_dim_v, v.dtype
    L = _scratch(v, ind) + [
        f'{ind}P = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")',
        f'{ind}Dp = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")',
        f'{ind}Ds = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")',
        f'{ind}Do = T.alloc_buffer(({BQ}, {Dv}), "{dt}", scope="local")',
        f'{ind}Lr = T.alloc_buffer(({BQ},), "{dt}", scope="local")',
        f'{ind}Dl = T.alloc_buffer(({BQ},), "{dt}", scope="local")',
        f'{ind}Mu = T.alloc_buffer((1,), "{dt}", scope="local")',
        f'{ind}En = T.alloc_buffer(({BK},), "{dt}", scope="local")',
        f'{ind}Ef = T.alloc_buffer(({BK},), "{dt}", scope="local")']
    if v.dropout:
        L.append(f'{ind}Pd = T.alloc_buffer(({BQ}, {BK}), "{dt}", scope="local")')
    return L


def _bwd_buffers(v: Variant, grads: List[str]) -> List[str]:
    D, Dv, dt = v.head_dim, v.head_dim_v, v.dtype
    L = [f'    Q = T.match_buffer(q, (B, Hq, Nq, {D}), "{dt}")',
         f'    K = T.match_buffer(k, (B, Hk, Nk, {D}), "{dt}")',
         "    NKp = T.int32()",
         f'    KT = T.match_buffer(kt, (B, Hk, {D}, NKp), "{dt}")',
         f'    V = T.match_buffer(v, (B, Hk, Nk, {Dv}), "{dt}")',
         f'    VT = T.match_buffer(vt, (B, Hk, {Dv}, NKp), "{dt}")',
         f'    DO = T.match_buffer(do, (B, Hq, Nq, {Dv}), "{dt}")',
         f'    LSE = T.match_buffer(lse, (B, Hq, Nq), "{dt}")',
         f'    DELTA = T.match_buffer(delta, (B, Hq, Nq), "{dt}")']
    shapes = {"dq": f"(B, Hq, Nq, {D})", "dk": f"(B, Hk, Nk, {D})", "dv": f"(B, Hk, Nk, {Dv})"}
    for g in grads:
        L.append(f'    {g.upper()}_ = T.match_buffer({g}, {shapes[g]}, "{dt}")')
    return L


def _load_rows(v: Variant, ind: str) -> List[str]:
    dt = v.dtype
    return [f"{ind}for i in range({v.block_q}):",
            f"{ind}    Lr[i] = T.Cast(\"{dt}\", LSE[b, h, {_clamp_q('q0 + i')}])",
            f"{ind}    Dl[i] = T.Cast(\"{dt}\", DELTA[b, h, {_clamp_q('q0 + i')}])",
            f"{ind}    for e in T.vectorized({v.head_dim_v}):",
            f"{ind}        Do[i, e] = DO[b, h, {_clamp_q('q0 + i')}, e]"]


def dkdv_source(v: Variant) -> str:
    """dK, dV: parallel over (b, hk, key tile); loops over the group's query heads and query tiles."""
    BQ, BK, D, Dv, dt = v.block_q, v.block_k, v.head_dim, v.head_dim_v, v.dtype
    L = _signature("attn_bwd_dkdv", BWD_ARGS + ("dk", "dv") + mod_grad_args(v), v)
    L += _bwd_buffers(v, ["dk", "dv"]) + mod_grad_buffers(v) + _common_buffers(v) + _header(v)
    ind = "        "
    L += ["    for bkt in T.parallel(B * Hk * NKT):",
          f"{ind}b = bkt // (Hk * NKT)", f"{ind}hk = bkt // NKT % Hk",
          f"{ind}k0 = bkt % NKT * {BK}", f"{ind}kn = T.min({BK}, Nk - k0)"]
    L += _bwd_scratch(v, ind)
    L += [f'{ind}DK = T.alloc_buffer(({BK}, {D}), "{dt}", scope="local")',
          f'{ind}DV = T.alloc_buffer(({BK}, {Dv}), "{dt}", scope="local")',
          f"{ind}for j, d in T.grid({BK}, {D}):", f"{ind}    DK[j, d] = T.{dt}(0)",
          f"{ind}for j, e in T.grid({BK}, {Dv}):", f"{ind}    DV[j, e] = T.{dt}(0)"]
    L += _ksum_base(v, ind)
    L += _query_tile_range(v, ind)
    if v.alibi:
        L += [f'{ind}DSA = T.alloc_buffer(({BK},), "{dt}", scope="local")']
    L += [f"{ind}for gh in range(G):"]
    ind2 = ind + "    "
    L += [f"{ind2}h = hk * G + gh"]
    if v.alibi:
        L += [f"{ind2}for j in range({BK}):", f"{ind2}    DSA[j] = T.{dt}(0)"]
    L += [f"{ind2}for qt in range(qt_lo, qt_hi):"]
    ind3 = ind2 + "    "
    L += [f"{ind3}q0 = qt * {BQ}"]
    L += _query_summary(v, ind3)
    visit = _tile_visit(v, "(k0 // %d)" % BK)
    if visit:
        L += [f"{ind3}if {visit}:"]
        ind3 += "    "
    L += _load_q(v, ind3) + _load_rows(v, ind3) + _scores(v, ind3) + _probs_bwd(v, ind3)
    pv = "Pd" if v.dropout else "P"
    L += [f"{ind3}for j in range({BK}):",
          f"{ind3}    for i in range({BQ}):",
          f"{ind3}        for e in T.vectorized({Dv}):",
          f"{ind3}            DV[j, e] = DV[j, e] + {pv}[i, j] * Do[i, e]",
          f"{ind3}        for d in T.vectorized({D}):",
          f"{ind3}            DK[j, d] = DK[j, d] + Ds[i, j] * Qs[i, d]"]
    qc, kc = _clamp_q("q0 + i"), _clamp_k("k0 + j")
    if v.alibi:  # this key's share of dslope[h] (summed over keys and batches on the host)
        L += [f"{ind3}for j, i in T.grid({BK}, {BQ}):",
              f"{ind3}    DSA[j] = DSA[j] + Ds[i, j] * T.Cast(\"{dt}\", {_rel(v, qc, kc)})"]
    if v.rel:
        # each logit's gradient into this tile's own (b, h, key tile) row of per-distance sums: no
        # two parallel iterations write one element
        L += [f"{ind3}for i, j in T.grid({BQ}, {BK}):",
              f"{ind3}    lj = ((b * Hq + h) * NKT + k0 // {BK}) * (2 * rel_md + 1) + {lut_index(v, qc, kc)}",
              f"{ind3}    DLUT[lj] = DLUT[lj] + Ds[i, j]"]
    if v.alibi:
        L += [f"{ind2}for j in range(kn):", f"{ind2}    DSL[b, h, k0 + j] = DSA[j]"]
    L += [f"{ind}for j in range(kn):",
          f"{ind}    for d in T.vectorized({D}):",
          f"{ind}        DK_[b, hk, k0 + j, d] = DK[j, d] * T.Cast(\"{dt}\", scale)",
          f"{ind}    for e in T.vectorized({Dv}):",
          f"{ind}        DV_[b, hk, k0 + j, e] = DV[j, e]"]
    return "\n".join(L) + "\n"


def dq_source(v: Variant) -> str:
    BQ, BK, D, Dv, dt = v.block_q, v.block_k, v.head_dim, v.head_dim_v, v.dtype
    L = _signature("attn_bwd_dq", BWD_ARGS + ("dq",), v)
    L += _bwd_buffers(v, ["dq"]) + _common_buffers(v) + _header(v)
    ind = "        "
    L += ["    for bhq in T.parallel(B * Hq * NQT):",
          f"{ind}b = bhq // (Hq * NQT)", f"{ind}h = bhq // NQT % Hq", f"{ind}hk = h // G",
          f"{ind}q0 = bhq % NQT * {BQ}"]
    L += _bwd_scratch(v, ind)
    L += [f'{ind}DQ = T.alloc_buffer(({BQ}, {D}), "{dt}", scope="local")',
          f"{ind}for i, d in T.grid({BQ}, {D}):", f"{ind}    DQ[i, d] = T.{dt}(0)"]
    L += _load_q(v, ind) + _load_rows(v, ind) + _ksum_base(v, ind) + _query_summary(v, ind) + _tile_range(v, ind)
    loop, ind2 = _key_tile_loop(v, ind, BK)
    L += loop + [f"{ind2}kn = T.min({BK}, Nk - k0)"]
    L += _scores(v, ind2) + _probs_bwd(v, ind2)
    L += [f"{ind2}for i in range({BQ}):",
          f"{ind2}    for j in range(kn):",
          f"{ind2}        for d in T.vectorized({D}):",
          f"{ind2}            DQ[i, d] = DQ[i, d] + Ds[i, j] * K[b, hk, k0 + j, d]"]
    L += [f"{ind}for i in range({BQ}):",
          f"{ind}    if q0 + i < Nq:",
          f"{ind}        for d in T.vectorized({D}):",
          f"{ind}            DQ_[b, h, q0 + i, d] = DQ[i, d] * T.Cast(\"{dt}\", scale)"]
    return "\n".join(L) + "\n"

