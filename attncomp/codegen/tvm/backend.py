"""Host side of the TVM backend: checks, argument preparation and calls of the compiled kernels.

:class:`TVMBackend` has the interface of ``attncomp.codegen.reference.ReferenceBackend`` and computes
the same function (DESIGN.md §4, §4.1) with the TIR kernels of :mod:`.kernels`, compiled for the CPU
(TVM's ``llvm`` target) and called on CPU torch tensors through DLPack (no copy). Every policy runs
forward and backward. Half-precision inputs are computed in float32 (as the reference does) and the
results cast back; float64 inputs run float64 kernels. The kernels read and write ``lse`` (and the
backward's ``delta``) in their compute dtype, which is the op's :func:`~attncomp.opspec.lse_dtype`.

Everything the kernels read is O(N) besides q, k, v (predicate tensors, per-key-tile summaries for
the tile schedule) except a dense ``attn_mask`` when the caller gives one, which is read in place
through its broadcast strides.

Score modifiers (DESIGN.md §4.2): ``forward``/``backward`` take their tensors as ``mods`` (as the reference
and Triton backends); the relative bias goes to the kernels as a look-up table and the gradients of the
modifier tensors come back as a fifth element of ``backward`` (:mod:`attncomp.codegen.modifiers`).

CUDA tensors run prebuilt cubins (:func:`cuda_forward`, :func:`cuda_backward`, loaded without TVM by
:mod:`attncomp.runtime.cubin`); :func:`sparse_emulated_forward` and
:func:`cuda_schedule_backward_on_cpu` run those kernels' schedules built for the CPU (tests).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from ...opspec import lse_dtype
from ...policy import DFSS, SPION, Hash, seed_mix
from ...spec import AttentionSpec, Modifiers
from ..modifiers import mod_grads, rel_lut
from . import build as _build
from .kernels import KSUM_FIELDS, Variant, arg_names

__all__ = ["TVMBackend", "attention_forward", "attention_backward", "make_variant", "tile_summaries"]

_POLICIES = ("dense", "et", "dfss", "hash", "drop", "spion")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_HEAD_DIM = 256
_I32_MAX = 2 ** 31 - 1


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap it for a NaN-filling one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(spec: AttentionSpec, D: int) -> Tuple[int, int]:
    pol = spec.policy
    if isinstance(pol, SPION):
        b = min(pol.block_size, 64)
        return min(b, 32), b
    return 32, 64


def make_variant(spec: AttentionSpec, q, v, attn_mask, preds, dropout_p: float) -> Variant:
    """The kernel variant of one call (what is compiled once and cached)."""
    pol = spec.policy
    D, Dv = int(q.shape[-1]), int(v.shape[-1])
    bq, bk = _blocks(spec, D)
    kw = {}
    name = "dense" if pol.name == "et" else pol.name
    if isinstance(pol, DFSS):
        r = pol.resolved(spec.torch_dtype() or q.dtype)
        kw.update(nm_n=r.n, nm_m=r.m)
    elif isinstance(pol, Hash):
        kw.update(exclude_self=bool(pol.exclude_self))
    elif isinstance(pol, SPION):
        kw.update(block_size=pol.block_size)
    mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
    p = preds
    has = (lambda nm: p is not None and getattr(p, nm) is not None)
    positional = spec.causal or getattr(spec, "window_left", None) is not None \
        or getattr(spec, "window_right", None) is not None
    # ALiBi and the relative bias read the given positions also where no window does
    alibi, rel = bool(spec.alibi), spec.rel_buckets is not None
    positional = positional or alibi or rel
    mods = {nm: True for nm, on in (("alibi", alibi), ("rel", rel), ("softcap", spec.softcap is not None),
                                    ("sinks", bool(spec.sinks))) if on}
    return Variant(head_dim=D, head_dim_v=Dv, dtype="float64" if q.dtype == torch.float64 else "float32",
                   block_q=bq, block_k=bk, policy=name, mask=mask, causal=bool(spec.causal),
                   window_left=getattr(spec, "window_left", None), window_right=getattr(spec, "window_right", None),
                   q_pos=positional and has("q_pos"), k_pos=positional and has("k_pos"), seg=has("q_seg") and has("k_seg"),
                   q_valid=has("q_valid"), k_valid=has("k_valid"), dropout=float(dropout_p) > 0.0, **kw, **mods)


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _row_tensor(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A (B or 1, N) predicate tensor as flat int32 and its batch stride (0 when broadcast)."""
    t = _i32(t)
    return t.reshape(-1), (0 if t.shape[0] == 1 else int(t.shape[1]))


def tile_summaries(variant: Variant, preds, Nk: int, qoff: int, device) -> Tuple[torch.Tensor, int]:
    """Per key tile ``(kpos min, kpos max, kseg min, kseg max, any valid key)`` as flat int32
    ``(B or 1, NKT, 5)`` and its batch stride: what the kernels' tile schedule tests a query tile
    against. Built with O(Nk) tensor operations on the keys' device (no host synchronisation)."""
    BK = variant.block_k
    nkt = -(-Nk // BK)
    pad = nkt * BK - Nk
    rows = []
    for t in (preds.k_pos, preds.k_seg, preds.k_valid):
        if t is not None:
            rows.append(t.shape[0])
    nb = max(rows) if rows else 1

    def tiles(t: torch.Tensor, fill: int) -> torch.Tensor:
        t = t.to(torch.int64).expand(nb, Nk)
        if pad:
            t = torch.nn.functional.pad(t, (0, pad), value=fill)
        return t.reshape(nb, nkt, BK)

    big, small = _I32_MAX, -_I32_MAX
    out = torch.zeros((nb, nkt, KSUM_FIELDS), dtype=torch.int64, device=device)
    kp = preds.k_pos if preds.k_pos is not None else torch.arange(Nk, device=device)[None]
    out[..., 0] = tiles(kp, big).amin(-1)
    out[..., 1] = tiles(kp, small).amax(-1)
    if preds.k_seg is not None:
        out[..., 2] = tiles(preds.k_seg, big).amin(-1)
        out[..., 3] = tiles(preds.k_seg, small).amax(-1)
    if preds.k_valid is not None:
        out[..., 4] = tiles(preds.k_valid, 0).amax(-1)
    else:
        out[..., 4] = 1
    out = out.clamp(small, big).to(torch.int32).contiguous()
    return out.reshape(-1), (0 if nb == 1 else nkt * KSUM_FIELDS)


def _extra_values(variant: Variant, spec: AttentionSpec, q, k, attn_mask, q_aux, k_aux, block_pattern, preds,
                  dropout_p: float, seed: int, ct: torch.dtype, mods: Optional[Modifiers] = None) -> dict:
    """Values of the variant's extra kernel arguments, by name (``mods``: the score modifiers' tensors,
    in the compute dtype ``ct`` as the kernels read them)."""
    B, Hq, Nq, D = (int(s) for s in q.shape)
    Nk = int(k.shape[2])
    vals = {}
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m.to(torch.uint8) if m.dtype == torch.bool else m.to(ct)
        m = m.contiguous()
        if m.numel() > _I32_MAX:
            raise RuntimeError("TVM backend: attn_mask has more than 2^31 elements")
        st = [0 if m.shape[i] == 1 else m.stride(i) for i in range(4)]
        vals.update(mask=m.reshape(-1), m_sb=st[0], m_sh=st[1], m_si=st[2], m_sj=st[3])
    if variant.policy in ("hash", "drop"):
        vals.update(qaux=_i32(q_aux), kaux=_i32(k_aux))
    if variant.policy == "spion":
        vals.update(bpat=_i32(block_pattern), bp_sh=1 if block_pattern.shape[0] > 1 else 0)
    qoff = (Nk - Nq) if getattr(spec, "causal_align", "top_left") == "bottom_right" else 0
    if variant.q_pos:
        vals["qpos"], vals["qpos_sb"] = _row_tensor(preds.q_pos)
    if variant.k_pos:
        vals["kpos"], vals["kpos_sb"] = _row_tensor(preds.k_pos)
    if variant.seg:
        vals["qseg"], vals["qseg_sb"] = _row_tensor(preds.q_seg)
        vals["kseg"], vals["kseg_sb"] = _row_tensor(preds.k_seg)
    if variant.q_valid:
        vals["qval"], vals["qval_sb"] = _row_tensor(preds.q_valid)
    if variant.k_valid:
        vals["kval"], vals["kval_sb"] = _row_tensor(preds.k_valid)
    if variant.summaries:
        vals["ksum"], vals["ksum_sb"] = tile_summaries(variant, preds, Nk, qoff, q.device)
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
    vals.update(scale=float(scale), qoff=int(qoff))
    if variant.dropout:
        vals.update(seed=seed_mix(seed), drop_p=float(dropout_p),
                    inv_keep=1.0 / (1.0 - float(dropout_p)))
    if variant.alibi or variant.rel or variant.sinks:
        mods = mods if mods is not None else Modifiers()
        for on, t, nm in ((variant.alibi, mods.alibi_slopes, "alibi_slopes"),
                          (variant.rel, mods.rel_table, "rel_table"), (variant.sinks, mods.sinks, "sinks")):
            if on and t is None:
                raise ValueError(f"the spec has {spec.describe_modifiers()} but no {nm} was given")
        if variant.alibi:
            vals["slopes"] = mods.alibi_slopes.detach().reshape(-1).to(device=q.device, dtype=ct).contiguous()
        if variant.rel:
            vals["lut"] = rel_lut(spec, mods.rel_table.detach(), q.device, ct).reshape(-1)
            vals["rel_md"] = int(spec.rel_max_distance)
        if variant.sinks:
            vals["sinks"] = mods.sinks.detach().reshape(-1).to(device=q.device, dtype=ct).contiguous()
    if variant.softcap:
        vals["softcap"] = float(spec.softcap)
    return vals


def _no_mod_grads(mods: Optional[Modifiers]) -> Modifiers:
    """The modifiers' gradients of a problem without logits: zeros."""
    return Modifiers(*(None if t is None else torch.zeros_like(t) for t in (mods or Modifiers())))


def _flat(grads: dict) -> dict:
    """The gradient buffers as the kernels take them (the table's flat)."""
    return {n: (t.reshape(-1) if n == "dlut" else t) for n, t in grads.items()}


def _mod_grad_buffers(variant: Variant, q, Nk: int, ct, dlut_shape) -> dict:
    """The dK/dV kernel's gradient outputs of the modifiers: ALiBi's per-key partial sums (every element
    written by the kernel) and the table's sums (zeroed: the kernel adds into them)."""
    B, Hq = int(q.shape[0]), int(q.shape[1])
    out = {}
    if variant.alibi:
        out["dslopes"] = _empty((B, Hq, Nk), ct, q.device)
    if variant.rel:
        out["dlut"] = torch.zeros(dlut_shape, dtype=ct, device=q.device)
    return out


def _prep(x: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    return x.detach().to(ct).contiguous()


def _transposed(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(B, H, N, D)`` as ``(B, H, D, ceil(N / block) * block)``, zero-padded: key tiles read along keys."""
    n = x.shape[2]
    pad = -(-n // block) * block - n
    t = x.transpose(-1, -2)
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.contiguous()


def _call(kind: str, variant: Variant, tensors: dict, extra: dict) -> None:
    fn = _build.get_kernel(kind, variant)
    names = arg_names(kind, variant)
    args: List = []
    for nm in names:
        args.append(tensors[nm] if nm in tensors else extra[nm])
    fn(*args)


def _no_keys(q, v, lse):
    """The result of an empty problem: zero rows, lse -inf."""
    return _empty(q.shape[:-1] + (v.shape[-1],), q.dtype, q.device).zero_(), lse.fill_(float("-inf"))


def _sink_lse(spec: AttentionSpec, empty, mods: Optional[Modifiers]):
    """An empty problem's result; with sinks a row with no key has ``lse = sink[h]`` (its output 0)."""
    out, lse = empty
    if spec.sinks and mods is not None and mods.sinks is not None and lse.numel():
        lse.copy_(mods.sinks.detach().to(device=lse.device, dtype=lse.dtype).reshape(1, -1, 1).expand_as(lse))
    return out, lse


def _forward_start(q, k, v):
    """``(compute dtype, lse buffer, result)`` of a forward: the result of an empty problem, else None."""
    B, Hq, Nq, _ = q.shape
    lse = _empty((B, Hq, Nq), lse_dtype(q.dtype), q.device)
    empty = _no_keys(q, v, lse) if Nq == 0 or B * Hq == 0 or k.shape[2] == 0 else None
    return _compute_dtype(q.dtype), lse, empty


def attention_forward(spec: AttentionSpec, q, k, v, attn_mask=None, q_aux=None, k_aux=None, block_pattern=None,
                      dropout_p: float = 0.0, seed: int = 0, preds=None,
                      mods: Optional[Modifiers] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of DESIGN.md §4 through the compiled TVM forward kernel (``mods``: the tensors of
    the spec's score modifiers, DESIGN.md §4.2)."""
    ct, lse, empty = _forward_start(q, k, v)
    if empty is not None:
        return _sink_lse(spec, empty, mods)
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    variant = make_variant(spec, q, v, attn_mask, preds, dropout_p)
    qc, kc, vc = _prep(q, ct), _prep(k, ct), _prep(v, ct)
    out = _empty((B, Hq, Nq, Dv), ct, q.device)
    extra = _extra_values(variant, spec, q, k, attn_mask, q_aux, k_aux, block_pattern, preds, dropout_p, seed, ct,
                          mods)
    kt = _transposed(kc, variant.block_k)
    _call("fwd", variant, {"q": qc, "k": kc, "kt": kt, "v": vc, "o": out, "lse": lse}, extra)
    return out.to(q.dtype), lse


def attention_backward(spec: AttentionSpec, q, k, v, attn_mask, out, lse, grad_out, q_aux=None, k_aux=None,
                       block_pattern=None, dropout_p: float = 0.0, seed: int = 0, preds=None,
                       mods: Optional[Modifiers] = None):
    """``(dq, dk, dv)`` of :func:`attention_forward`'s ``out`` for ``grad_out``; for a spec with score
    modifiers ``(dq, dk, dv, dmods)``, ``dmods`` the :class:`Modifiers` of the gradients of ``mods``' tensors
    (:func:`..modifiers.mod_grads`)."""
    ct = _compute_dtype(q.dtype)
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    with_mods = bool(spec.modifiers())
    if Nq == 0 or Nk == 0 or B * Hq == 0:
        zeros = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return (*zeros, _no_mod_grads(mods)) if with_mods else zeros
    variant = make_variant(spec, q, v, attn_mask, preds, dropout_p)
    qc, kc, vc, doc = _prep(q, ct), _prep(k, ct), _prep(v, ct), _prep(grad_out, ct)
    delta_ct = (doc * out.detach().to(ct)).sum(-1)
    delta = delta_ct.contiguous()
    lse = lse.detach().to(ct).contiguous()
    extra = _extra_values(variant, spec, q, k, attn_mask, q_aux, k_aux, block_pattern, preds, dropout_p, seed, ct,
                          mods)
    dq = _empty(q.shape, ct, q.device)
    dk = _empty(k.shape, ct, q.device)
    dv = _empty(v.shape, ct, q.device)
    base = {"q": qc, "k": kc, "kt": _transposed(kc, variant.block_k), "v": vc,
            "vt": _transposed(vc, variant.block_k), "do": doc, "lse": lse, "delta": delta}
    # the table's sums: one row of per-distance sums per (batch, query head, key tile), summed here
    nkt = -(-Nk // variant.block_k)
    lut_rows = 2 * int(spec.rel_max_distance or 0) + 1
    grads = _mod_grad_buffers(variant, q, Nk, ct, (B, Hq, nkt, lut_rows))
    _call("dkdv", variant, dict(base, dk=dk, dv=dv, **_flat(grads)), extra)
    _call("dq", variant, dict(base, dq=dq), extra)
    res = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if not with_mods:
        return res
    dlut = grads["dlut"].sum(dim=(0, 2)).t() if "dlut" in grads else None
    return (*res, mod_grads(spec, mods or Modifiers(), lse, delta_ct, grads.get("dslopes"), dlut))


_cubins: dict = {}

#: which CUDA kernel runs dfss sites on float16/bfloat16 tensors: "sp" (sparse tensor cores, the
#: default where the variant allows it) or "scalar" (the scalar template); ATTNCOMP_TVM_DFSS_KERNEL
DFSS_KERNELS = ("sp", "scalar")


def dfss_kernel_choice() -> str:
    import os

    k = os.environ.get("ATTNCOMP_TVM_DFSS_KERNEL", "sp").strip().lower() or "sp"
    if k not in DFSS_KERNELS:
        raise ValueError(f"ATTNCOMP_TVM_DFSS_KERNEL={k!r}: one of {', '.join(DFSS_KERNELS)}")
    return k


def sparse_variant(variant: Variant, dtype: torch.dtype) -> Optional[Variant]:
    """The sparse tensor-core variant of a dfss ``variant`` for operands of ``dtype``, or ``None``
    where that kernel does not apply (other dtypes, N:M other than 2:4/1:2, dropout, head dims)."""
    import dataclasses

    from .sparse import sp_supported

    od = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype)
    if od is None or variant.policy != "dfss" or variant.dtype != "float32":
        return None
    sp = dataclasses.replace(variant, mma="sp", operand_dtype=od)
    return None if sp_supported(sp) else sp


def cuda_kernel_variant(spec: AttentionSpec, q, v, attn_mask, preds, dropout_p: float) -> Variant:
    """The CUDA kernel variant of a call (with its CUDA tile sizes)."""
    from . import cuda as _cuda

    variant = make_variant(spec, q, v, attn_mask, preds, dropout_p)
    if variant.policy == "dfss" and dfss_kernel_choice() == "sp":
        variant = sparse_variant(variant, q.dtype) or variant
    return _cuda.cuda_variant(variant)


def _kernel_inputs(variant: Variant, q, k, v, ct: torch.dtype):
    """q, k, v as the kernel reads them: the operand dtype of a tensor-core kernel, else ``ct``."""
    if variant.mma == "sp":
        od = torch.float16 if variant.operand_dtype == "float16" else torch.bfloat16
        return tuple(x.detach().to(od).contiguous() for x in (q, k, v))
    return _prep(q, ct), _prep(k, ct), _prep(v, ct)


def sparse_emulated_forward(spec: AttentionSpec, q, k, v, attn_mask=None, preds=None,
                            seed: int = 0, mods: Optional[Modifiers] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sparse tensor-core DFSS forward built for the CPU (``llvm``): the same schedule, packing
    and metadata as the CUDA kernel, each warp instruction emulated from the lanes' packed registers
    (:mod:`.sparse`). For tests of that kernel's logic on machines without a GPU; raises where the
    kernel does not apply."""
    ct = _compute_dtype(q.dtype)
    B, Hq, Nq, _ = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    variant = make_variant(spec, q, v, attn_mask, preds, 0.0)
    sp = sparse_variant(variant, q.dtype)
    if sp is None:
        raise ValueError(f"the sparse tensor-core DFSS kernel does not serve this call ({spec.describe()}, {q.dtype})")
    from . import cuda as _cuda

    sp = _cuda.cuda_variant(sp)
    lse = _empty((B, Hq, Nq), lse_dtype(q.dtype), q.device)
    out = _empty((B, Hq, Nq, Dv), torch.float32, q.device)
    qc, kc, vc = _kernel_inputs(sp, q, k, v, ct)
    if sp.operand_dtype == "bfloat16":  # the CPU build reads bfloat16 operands as their bits
        qc, kc, vc = (x.view(torch.int16) for x in (qc, kc, vc))
    extra = _extra_values(sp, spec, q, k, attn_mask, None, None, None, preds, 0.0, seed, ct, mods)
    _call("fwd_sp_emu", sp, {"q": qc, "k": kc, "kt": kc, "v": vc, "o": out, "lse": lse}, extra)
    return out.to(q.dtype), lse


def build_command(variant: Variant, arch: str) -> str:
    """The command line that builds the CUDA kernel of ``variant`` ahead of time."""
    bits = [f"python -m attncomp build-kernels --arch {arch} --policy {variant.policy}",
            f"--head-dim {variant.head_dim}"]
    if variant.head_dim_v != variant.head_dim:
        bits.append(f"--value-dim {variant.head_dim_v}")
    if variant.policy == "dfss":
        bits.append(f"--nm {variant.nm_n}:{variant.nm_m}")
        bits.append(f"--dfss-kernel {'sp' if variant.mma == 'sp' else 'scalar'}")
        if variant.mma == "sp":
            bits.append(f"--operand-dtype {variant.operand_dtype}")
    if variant.policy == "spion":
        bits.append(f"--block-size {variant.block_size}")
    bits.append("--causal" if variant.causal else "--no-causal")
    if variant.mask != "none":
        bits.append(f"--mask {variant.mask}")
    cmd = " ".join(bits)
    if variant.alibi or variant.rel or variant.softcap or variant.sinks:
        # build-kernels has no flags for them: the kernels of such a site are built by get_cubin
        return ("python -c \"from attncomp.codegen.tvm import cuda, kernels; "
                f"v = kernels.Variant(**{variant.to_json()!r}); "
                f"[cuda.get_cubin(v, '{arch}', kind=k) for k in cuda.KINDS]\" (score modifiers; then copy the "
                "cache entries)")
    return cmd


def cuda_forward(spec: AttentionSpec, q, k, v, attn_mask=None, q_aux=None, k_aux=None, block_pattern=None,
                 dropout_p: float = 0.0, seed: int = 0, preds=None,
                 mods: Optional[Modifiers] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward on CUDA tensors through the prebuilt cubin of the call's kernel variant."""
    ct, lse, empty = _forward_start(q, k, v)
    if empty is not None:
        return _sink_lse(spec, empty, mods)
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    variant = cuda_kernel_variant(spec, q, v, attn_mask, preds, dropout_p)
    major, minor = torch.cuda.get_device_capability(q.device)
    kernel = _cuda_kernels(spec, variant, ("fwd",), f"sm_{major}{minor}")["fwd"]
    qc, kc, vc = _kernel_inputs(variant, q, k, v, ct)
    out = _empty((B, Hq, Nq, Dv), ct, q.device)
    extra = _extra_values(variant, spec, q, k, attn_mask, q_aux, k_aux, block_pattern, preds, dropout_p, seed, ct,
                          mods)
    tensors = {"q": qc, "k": kc, "v": vc, "o": out, "lse": lse}
    tensors.update({n: t for n, t in extra.items() if isinstance(t, torch.Tensor)})
    scalars = {n: x for n, x in extra.items() if not isinstance(x, torch.Tensor)}
    kernel.launch(tensors, scalars)
    return out.to(q.dtype), lse


def _backward_setup(spec, q, k, v, attn_mask, out, lse, grad_out, q_aux, k_aux, block_pattern, dropout_p, seed, preds,
                    mods=None):
    """``(variant, base tensors, extra(kernel variant), gradient buffers, finish)`` of a backward through the
    CUDA kernels' schedule; ``finish(dq, dk, dv)`` adds the modifiers' gradients where the spec has any."""
    ct = _compute_dtype(q.dtype)
    variant = make_variant(spec, q, v, attn_mask, preds, dropout_p)
    qc, kc, vc, doc = _prep(q, ct), _prep(k, ct), _prep(v, ct), _prep(grad_out, ct)
    delta_ct = (doc * out.detach().to(ct)).sum(-1)
    delta = delta_ct.contiguous()
    lse = lse.detach().to(ct).contiguous()
    grads = {"dq": _empty(q.shape, ct, q.device), "dk": _empty(k.shape, ct, q.device), "dv": _empty(v.shape, ct, q.device)}
    base = {"q": qc, "k": kc, "v": vc, "do": doc, "lse": lse, "delta": delta}
    # the CUDA dK/dV kernel adds the table's gradient into one (2 * max_distance + 1, Hq) buffer
    lut_shape = (2 * int(spec.rel_max_distance or 0) + 1, int(q.shape[1]))
    mgrads = _mod_grad_buffers(variant, q, int(k.shape[2]), ct, lut_shape)
    grads.update(_flat(mgrads))

    def extra(kernel_variant: Variant) -> dict:
        # per kernel: the tile summaries follow that kernel's key tile
        return _extra_values(kernel_variant, spec, q, k, attn_mask, q_aux, k_aux, block_pattern, preds, dropout_p,
                             seed, ct, mods)

    def finish(dq, dk, dv):
        res = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        if not spec.modifiers():
            return res
        return (*res, mod_grads(spec, mods or Modifiers(), lse, delta_ct, mgrads.get("dslopes"), mgrads.get("dlut")))
    return variant, base, extra, grads, finish


def _cuda_kernels(spec, variant: Variant, kinds, arch: str):
    """The loaded CUDA kernels ``kinds`` of ``variant``: from the cache, built here when TVM and nvcc
    are present, else an error naming the missing kernels and the command that builds them."""
    from ...runtime.cache import default_cache
    from ...runtime.cubin import CubinKernel
    from . import cuda as _cuda

    out, missing = {}, []
    for kind in kinds:
        key = _cuda.cubin_key(variant, arch, kind)
        kernel = _cubins.get(key)
        if kernel is None:
            can_build = _build.tvm_available() and _cuda.nvcc_version() != "none"
            art = _cuda.get_cubin(variant, arch, build=can_build, kind=kind)
            if art is None:
                missing.append(kind)
                continue
            kernel = _cubins[key] = CubinKernel(*art)
        out[kind] = kernel
    if missing:
        what = {"fwd": "forward", "dkdv": "backward dK/dV", "dq": "backward dQ"}
        names = ", ".join(what[k] for k in missing)
        bwd = " --backward" if any(k != "fwd" for k in missing) else ""
        raise RuntimeError(
            f"TVM backend: no CUDA kernel ({names}) for this site ({spec.describe()}, head dim {variant.head_dim}, "
            f"{arch}) in the kernel cache {default_cache().root}. Build it on a machine with TVM and nvcc:\n    "
            f"{build_command(variant, arch)}{bwd} --out <folder>\nthen bring the folder here and call "
            "attncomp.runtime.cubin.import_folder(<folder>), or export a package that carries it.")
    return out


def cuda_backward(spec: AttentionSpec, q, k, v, attn_mask, out, lse, grad_out, q_aux=None, k_aux=None,
                  block_pattern=None, dropout_p: float = 0.0, seed: int = 0, preds=None,
                  mods: Optional[Modifiers] = None):
    """``(dq, dk, dv)`` on CUDA tensors through the prebuilt backward cubins (:mod:`.cuda_bwd`); with score
    modifiers ``(dq, dk, dv, dmods)`` as :func:`attention_backward`."""
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    if Nq == 0 or Nk == 0 or B * Hq == 0:
        zeros = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return (*zeros, _no_mod_grads(mods)) if spec.modifiers() else zeros
    variant, base, extra, grads, finish = _backward_setup(spec, q, k, v, attn_mask, out, lse, grad_out, q_aux, k_aux,
                                                          block_pattern, dropout_p, seed, preds, mods)
    major, minor = torch.cuda.get_device_capability(q.device)
    from . import cuda as _cuda

    kernels = _cuda_kernels(spec, variant, ("dkdv", "dq"), f"sm_{major}{minor}")
    for kind in ("dkdv", "dq"):
        ex = extra(_cuda.kernel_variant(variant, kind))
        tensors = dict(base, **grads)
        tensors.update({n: t for n, t in ex.items() if isinstance(t, torch.Tensor)})
        kernels[kind].launch(tensors, {n: x for n, x in ex.items() if not isinstance(x, torch.Tensor)})
    return finish(grads["dq"], grads["dk"], grads["dv"])


def cuda_schedule_backward_on_cpu(spec: AttentionSpec, q, k, v, attn_mask, out, lse, grad_out, q_aux=None,
                                  k_aux=None, block_pattern=None, dropout_p: float = 0.0, seed: int = 0, preds=None,
                                  mods: Optional[Modifiers] = None):
    """The CUDA backward kernels' TIR (same generator, tile sizes and statements; threads as loops
    between barriers) built for the CPU and run on CPU tensors: what the CPU tests check."""
    from . import cuda as _cuda

    variant, base, extra, grads, finish = _backward_setup(spec, q, k, v, attn_mask, out, lse, grad_out, q_aux, k_aux,
                                                          block_pattern, dropout_p, seed, preds, mods)
    tensors = dict(base, kt=base["k"], vt=base["v"], **grads)
    for kind in ("dkdv", "dq"):
        kv = _cuda.kernel_variant(variant, kind)
        _call(f"{kind}_cuda", kv, tensors, extra(kv))
    return finish(grads["dq"], grads["dk"], grads["dv"])


class TVMBackend:
    """TIR kernels compiled by apache-tvm for the CPU (``llvm``) and, ahead of time, to CUDA cubins:
    every policy, forward and backward."""

    name = "tvm"
    #: the score modifiers (DESIGN.md §4.2) its kernels apply, forward and backward: the CPU (llvm) kernels and
    #: the CUDA ones (on the CUDA table gradient's atomics: :mod:`.cuda_bwd`)
    modifiers: tuple = ("alibi", "relative bias", "softcap", "sinks")

    def supports(self, spec: AttentionSpec, q: torch.Tensor, preds=None) -> Optional[str]:
        pol = spec.policy.name
        if pol not in _POLICIES:
            return f"policy {pol!r} has no TVM kernel (TVM runs: {', '.join(_POLICIES)})"
        if spec.modifiers():
            reason = spec.modifiers_missing(self.modifiers, "TVM")
            if reason is not None:
                return reason
        if q.device.type == "cuda":
            from ...runtime.cubin import cuda_bindings_available

            if not cuda_bindings_available():
                return ("CUDA tensors run prebuilt cubins through cuda.bindings, which is not installed "
                        "(pip install cuda-bindings)")
        elif q.device.type != "cpu":
            return f"the TVM backend runs CPU tensors (llvm) and CUDA tensors (prebuilt cubins), not {q.device.type}"
        elif not _build.tvm_available():
            return "apache-tvm is not installed (pip install 'attncomp[tvm]')"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (float16, bfloat16, float32, float64)"
        if q.dim() != 4:
            return f"expects (B, H, N, D) inputs, got {q.dim()} dims"
        if q.shape[-1] > _MAX_HEAD_DIM or (spec.head_dim or 0) > _MAX_HEAD_DIM:
            return f"head dim {max(q.shape[-1], spec.head_dim or 0)} > {_MAX_HEAD_DIM}"
        if q.numel() > _I32_MAX:
            return "more than 2^31 query elements"
        return None

    def forward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, preds=None,
                mods=None):
        self._check(spec, q, k, v, preds)
        run = cuda_forward if q.is_cuda else attention_forward
        with torch.no_grad():
            return run(spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, preds, mods=mods)

    def backward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                 out, lse, grad_out, need_mask_grad=False, preds=None, mods=None):
        """``(dq, dk, dv, dmask | None)``; for a spec with score modifiers a fifth element, the
        :class:`Modifiers` of their gradients (as ``ReferenceBackend.backward``)."""
        # the mask gradient (a full B x H x Nq x Nk tensor) is left to the caller's fallback
        self._check(spec, q, k, v, preds)
        run = cuda_backward if q.is_cuda else attention_backward
        with torch.no_grad():
            res = run(spec, q, k, v, attn_mask, out, lse, grad_out, q_aux, k_aux, block_pattern, dropout_p, seed,
                      preds, mods=mods)
        return (*res[:3], None, *res[3:])

    def _check(self, spec, q, k, v, preds) -> None:
        reason = self.supports(spec, q, preds)
        if reason is None and max(k.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
            reason = f"head dim {max(k.shape[-1], v.shape[-1])} > {_MAX_HEAD_DIM}"
        if reason is not None:
            raise RuntimeError(f"TVM backend cannot run this site ({spec.describe()}): {reason}")
