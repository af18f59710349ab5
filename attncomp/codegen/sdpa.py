"""SDPA backend: PyTorch's own fused attention kernels for sites whose policy keeps every allowed entry.

``dense`` and ``et`` sites without dropout compute exactly softmax attention over the allowed
entries, which is what ``scaled_dot_product_attention`` computes; its kernels (the CPU flash kernel,
and flash / memory-efficient on CUDA) are then the fastest correct choice, or compete with
attncomp's own (``attncomp.runtime.dispatch`` decides). Dropout draws differ from attncomp's
counter-based ones, so a call with dropout never runs here.

The structured predicates (DESIGN.md §4.1) become ``is_causal`` when they are exactly SDPA's
top-left causal mask, otherwise one additive mask built from the O(N) predicate vectors (and the
residual ``attn_mask``). Rows with no allowed key give zeros and ``lse = -inf`` (fixed up on the
device, no synchronisation). GQA expands k/v to the query heads; the backward sums the groups back.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..opspec import laid_out, lse_dtype, resolved
from ..spec import AttentionSpec, Predicates
from .reference import cacheable, default_positions, predicate_mask, tracing

__all__ = ["SdpaBackend", "inline_attention", "inline_plan", "keeps_all", "top_left_causal_only"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def keeps_all(spec: AttentionSpec) -> bool:
    """Whether the spec's policy keeps every allowed entry (exact softmax attention)."""
    return bool(getattr(spec.policy, "keeps_all", lambda: False)())


def _has_positions(preds: Optional[Predicates]) -> bool:
    return preds is not None and (preds.q_pos is not None or preds.k_pos is not None)


def top_left_causal_only(spec: AttentionSpec, nq: int, nk: int, preds: Optional[Predicates]) -> bool:
    """Whether the position bound is exactly SDPA's ``is_causal`` (``j <= i`` on default positions)."""
    if not spec.causal or spec.window_left is not None or (spec.window_right is not None and spec.window_right < 0):
        return False
    if _has_positions(preds):
        return False
    return spec.causal_align == "top_left" or nq == nk


_CONSTS: dict = {}


def _aten(name: str):
    """The kernel entry ``torch.<name>`` (one call into C++), else the op's overload (an op packet
    re-resolves the overload on every call; an overload's ``__call__`` adds a Python frame)."""
    return getattr(torch, name, None) or getattr(torch.ops.aten, name).default


_CPU_FWD = _aten("_scaled_dot_product_flash_attention_for_cpu")
_FLASH_FWD = _aten("_scaled_dot_product_flash_attention")
_EFFICIENT_FWD = _aten("_scaled_dot_product_efficient_attention")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The CPU kernel takes any strides but a unit one on the head dim (a transposed k read wrongly)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _const(value: float, dtype: torch.dtype, device) -> Tensor:
    """A 0-dim tensor of ``value``, cached per dtype and device (a Python scalar in ``torch.where``
    costs a host-to-device copy per call on CUDA); built fresh where no tensor may be cached
    (:func:`.reference.cacheable`: a traced call, a CUDA graph's capture or warm-up)."""
    if tracing():
        return torch.full((), value, dtype=dtype, device=device)
    key = (value, dtype, device)
    t = _CONSTS.get(key)
    if t is None:
        t = torch.full((), value, dtype=dtype, device=device)
        if cacheable(device):
            _CONSTS[key] = t
    return t


def _expand(x: Tensor, hq: int) -> Tensor:
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)


def _sum_groups(x: Tensor, hk: int) -> Tensor:
    B, H, N, D = x.shape
    return x if H == hk else x.view(B, hk, H // hk, N, D).sum(2)


def _plan(spec: AttentionSpec, q: Tensor, k: Tensor, attn_mask: Optional[Tensor], preds: Optional[Predicates]):
    """``(is_causal, bias, row_ok)``: SDPA's causal flag, an additive mask in q's dtype (or None), and
    the bool ``(B|1, H|1, Nq)`` rows that have an allowed key (None when every row has one)."""
    nq, nk = q.shape[-2], k.shape[-2]
    is_causal = top_left_causal_only(spec, nq, nk, preds)
    pm = predicate_mask(spec, nq, nk, q.device, preds, positions=not is_causal)
    if attn_mask is None and pm is None:
        return is_causal, None, None
    if attn_mask is None:
        allowed, bias = pm, None
    elif attn_mask.dtype == torch.bool:
        allowed, bias = (attn_mask if pm is None else attn_mask & pm), None
    else:
        bias = attn_mask.to(q.dtype)
        if pm is not None:
            bias = torch.where(pm, bias, _const(float("-inf"), q.dtype, q.device))
        allowed = None
    if bias is None:
        bias = torch.where(allowed, _const(0.0, q.dtype, q.device), _const(float("-inf"), q.dtype, q.device))
    # rows with an allowed key: from the O(N) vectors where they decide it (the causal bound included),
    # else by reducing the mask
    row_ok = _rows_from_vectors(spec, nq, nk, q.device, preds) if attn_mask is None else None
    if row_ok is None and not is_causal:
        row_ok = allowed.any(-1) if allowed is not None else (bias != float("-inf")).any(-1)
    elif row_ok is None:
        # a top-left causal row i keeps key 0 only if the mask allows it: recompute the rows with the bound
        i, j = default_positions(spec, nq, nk, q.device)    # is_causal: top-left, or Nq == Nk
        row_ok = ((bias != float("-inf")) & (j[:, None, :] <= i[:, :, None])).any(-1)
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return is_causal, bias, row_ok


def _rows_from_vectors(spec: AttentionSpec, nq: int, nk: int, device, preds: Optional[Predicates]):
    """The rows with an allowed key, ``(B|1, 1, Nq)``, from the O(N) predicate vectors (prefix counts of
    valid keys inside each row's position window), instead of reducing the N×N mask. Applies to position
    bounds and padding with default key positions; ``None`` where it does not (segments, given k_pos)."""
    preds = preds or Predicates.none()
    if preds.q_seg is not None or preds.k_seg is not None or preds.k_pos is not None:
        return None
    qpos = preds.q_pos if preds.q_pos is not None else default_positions(spec, nq, nk, device)[0]
    qpos = qpos.to(torch.int64)
    left, right = spec.bounds()
    lo = (qpos - left).clamp(min=0) if left is not None else torch.zeros_like(qpos)
    hi = (qpos + right).clamp(max=nk - 1) if right is not None else torch.full_like(qpos, nk - 1)
    if preds.k_valid is None:
        ok = hi >= lo
    else:
        kv = preds.k_valid.to(torch.int32)
        cs = torch.nn.functional.pad(torch.cumsum(kv, -1, dtype=torch.int32), (1, 0))   # (B|1, Nk + 1)
        b = max(cs.shape[0], lo.shape[0])
        cs = cs.expand(b, -1)
        hi_c, lo_c = hi.clamp(min=-1).expand(b, -1), lo.clamp(max=nk).expand(b, -1)
        ok = (hi_c >= lo_c) & (cs.gather(1, hi_c + 1) > cs.gather(1, lo_c))
    if preds.q_valid is not None:
        ok = ok & preds.q_valid
    return ok[:, None, :]


def _scale(spec: AttentionSpec, d: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(d)


class SdpaBackend:
    """``torch.nn.functional.scaled_dot_product_attention``'s kernels, with attncomp's (out, lse) contract."""

    name = "sdpa"
    #: the score modifiers (DESIGN.md §4.2) its kernels apply: none yet (the reference applies them all)
    modifiers: tuple = ()

    def supports(self, spec: AttentionSpec, q: Tensor, preds: Optional[Predicates] = None) -> Optional[str]:
        if not keeps_all(spec):
            return f"policy {spec.policy.name!r} does not keep every allowed entry (SDPA runs dense and et)"
        if spec.modifiers():
            reason = spec.modifiers_missing(self.modifiers, "SDPA")
            if reason is not None:
                return reason
        if q.dtype not in (_CUDA_DTYPES if q.is_cuda else _DTYPES):
            return f"dtype {q.dtype} not supported"
        if q.device.type not in ("cpu", "cuda"):
            return f"device {q.device.type} not supported"
        return None

    def supports_call(self, spec: AttentionSpec, q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                      preds: Optional[Predicates] = None) -> Optional[str]:
        """What the call adds to :meth:`supports`: no dropout, value head dim equal to q's."""
        r = self.supports(spec, q, preds)
        if r is not None:
            return r
        if dropout_p:
            return "dropout draws differ from attncomp's (the reference or Triton run dropout)"
        if v is not None and v.shape[-1] != q.shape[-1]:
            return f"value head dim {v.shape[-1]} differs from q's {q.shape[-1]}"
        return None

    # -- forward ------------------------------------------------------------------------------
    def forward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, preds=None):
        if dropout_p:
            raise RuntimeError("SDPA backend: dropout is not run here (attncomp's dropout draws differ)")
        plan = _plan(spec, q, k, attn_mask, preds)
        out, lse, raw = self._forward(spec, q, k, v, attn_mask, preds, plan=plan)
        # a plan with no tensor in it (is_causal alone: no mask, no predicate, no bound that needs one)
        # depends on the spec and the sizes only, and is kept for the call's repeats
        fixed = plan if plan[1] is None and plan[2] is None else None
        # FlashAttention's (out, lse) as the op returns them (no GQA expansion, lse as it came): its
        # repeats call the kernel alone
        flash = (fixed is not None and q.is_cuda and lse is raw and min(q.shape[-2], k.shape[-2]) > 0
                 and _use_flash(q, k, None, fixed[0]) and (q.shape[1] == k.shape[1] or _GROUPED[0] is True))
        _TAKEN.plan = _Plan(self, spec, fixed, (fixed[0], _scale(spec, q.shape[-1])) if flash else None)
        # SDPA's kernels follow q's memory layout: heads inner for q from a model's projections, the
        # op's layout (attncomp.ops.output_like); the op copies another
        return out, lse

    @staticmethod
    def taken_plan():
        """The plan of this thread's latest forward (see :class:`_Plan`), taken once."""
        plan, _TAKEN.plan = getattr(_TAKEN, "plan", None), None
        return plan

    def _forward(self, spec, q, k, v, attn_mask, preds, plan=None):
        hq = q.shape[1]
        is_causal, bias, row_ok = _plan(spec, q, k, attn_mask, preds) if plan is None else plan
        scale = _scale(spec, q.shape[-1])
        if q.shape[-2] == 0 or k.shape[-2] == 0:
            out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
            return out, lse, lse
        if q.is_cuda and _grouped_flash(q, k, bias, is_causal):
            out, lse = _flash_grouped(q, k, v, is_causal, scale)
        elif q.is_cuda:
            out, lse = _cuda_forward(q, _expand(k, hq), _expand(v, hq), bias, is_causal, scale)
        else:
            # the CPU kernel takes grouped k/v heads as they are (no repeat; checked on torch 2.11 and
            # 2.13, the admitted range's ends, forward and backward), and reads its inputs as if the head
            # dim were contiguous: a transposed view gives wrong results
            out, lse = _CPU_FWD(_dense(q), _dense(k), _dense(v), 0.0, is_causal, attn_mask=bias, scale=scale)
        raw_lse = lse
        ldt = lse_dtype(q.dtype)
        if lse.dtype != ldt:
            lse = lse.to(ldt)
        if row_ok is not None:
            if q.is_cuda:  # SDPA's CPU kernel already writes zeros for a row with no allowed key
                out = torch.where(row_ok[..., None], out, _const(0.0, out.dtype, out.device))
            lse = torch.where(row_ok, lse, _const(float("-inf"), ldt, lse.device))
        if lse.shape != q.shape[:-1]:
            lse = lse.expand(q.shape[:-1])
        # SDPA's lse follows its own layout; the op's contract (and its fake) is contiguous
        return out, (lse if lse.is_contiguous() else lse.contiguous()), raw_lse

    # -- backward -----------------------------------------------------------------------------
    def backward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                 out, lse, grad_out, need_mask_grad=False, preds=None):
        if dropout_p:
            raise RuntimeError("SDPA backend: dropout is not run here (attncomp's dropout draws differ)")
        if q.is_cuda:
            dq, dk, dv = _cuda_backward(spec, q, k, v, attn_mask, preds, grad_out, out, lse)
            return dq, dk, dv, None
        is_causal, bias, _ = _plan(spec, q, k, attn_mask, preds)
        # the op's lse is the kernel's own (float64 for float64 inputs); an empty row's lse is -inf, and
        # SDPA's kernel wants a finite one there (its p is 0 anyway)
        raw = torch.where(torch.isneginf(lse), _const(0.0, lse.dtype, lse.device), lse)
        # grouped k/v heads as they are: dk and dv come with k's heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _dense(grad_out.to(q.dtype)), _dense(q), _dense(k), _dense(v), _dense(out), raw, 0.0, is_causal,
            attn_mask=bias, scale=_scale(spec, q.shape[-1]))
        return dq, dk, dv, None


# the plan the latest forward of this thread ran (SdpaBackend.taken_plan)
_TAKEN = threading.local()


class _Plan:
    """A forward this backend ran, for the op to keep under the call's key (``attncomp.ops._CALLS``:
    the spec string, the tensors' sizes, strides, dtypes and device, which mask and predicates are
    present, the backend selection's state). A repeat goes from the op straight to the kernel: no spec
    resolution, backend selection or bucket derivation; where the call brought no mask and no predicate,
    SDPA's flags are kept too (they depend on the spec and the sizes only). The result is the full
    path's, computed by the same code (:meth:`SdpaBackend._forward`, the op's output layout)."""

    __slots__ = ("backend", "spec", "fixed", "flash", "laid_out")

    def __init__(self, backend: "SdpaBackend", spec: AttentionSpec, fixed: Optional[tuple],
                 flash: Optional[tuple] = None):
        self.backend, self.spec, self.fixed, self.flash, self.laid_out = backend, spec, fixed, flash, laid_out

    def call(self, q, k, v, attn_mask, q_valid, k_valid, seed):
        if self.flash is not None:  # (is_causal, scale): FlashAttention's outputs are the op's
            r = _FLASH_FWD(q, k, v, 0.0, self.flash[0], False, scale=self.flash[1])
            return self.laid_out(r[0]), r[1]
        preds = None
        if q_valid is not None or k_valid is not None:
            preds = Predicates(None, None, None, None, q_valid, k_valid)
        out, lse, _ = self.backend._forward(self.spec, q, k, v, attn_mask, preds, plan=self.fixed)
        return self.laid_out(out), lse


def _public(q: Tensor, need_lse: bool) -> bool:
    """Whether a traced site calls ``scaled_dot_product_attention`` itself (:func:`inline_attention`)."""
    return q.is_cuda and not need_lse


def inline_plan(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], q_pos: Optional[Tensor], k_pos: Optional[Tensor],
                q_seg: Optional[Tensor], k_seg: Optional[Tensor], q_valid: Optional[Tensor],
                k_valid: Optional[Tensor], spec_json: str, need_lse: bool = True) -> tuple:
    """``(is_causal, bias, row_ok)`` of :func:`inline_attention`, in torch ops: built once per compiled
    graph for the sites that share the mask, the predicate tensors, the mask's part of the spec, the
    sizes and dtype (a model's layers: ``attncomp/passes/inline_sdpa.py``), as a model builds its mask
    once for all its layers. ``q`` and ``k`` give sizes, dtype and device only."""
    spec = resolved(spec_json, q.dtype)
    preds = Predicates(q_pos, k_pos, q_seg, k_seg, q_valid, k_valid)
    preds = preds if preds.any() else None
    if not _public(q, need_lse):
        return _plan(spec, q, k, attn_mask, preds)
    return _public_plan(spec, q, k, attn_mask, preds)


def inline_attention(q: Tensor, k: Tensor, v: Tensor, plan: tuple, spec_json: str,
                     need_lse: bool = True) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of a site that runs SDPA's kernel, in torch ops a tracer records, for a compiled
    graph to call in the op's place (``attncomp/passes/inline_sdpa.py``), with the mask ``plan`` of
    :func:`inline_plan`: Inductor then builds the mask from the predicate vectors in its own fused
    code and calls SDPA's kernel directly, as it does for ``torch.compile``; autograd differentiates
    SDPA's kernel as it does there.

    With ``need_lse`` (or on a CPU) this is what ``attncomp::attention`` computes on this backend
    (:meth:`SdpaBackend.forward`). Without it, on CUDA, ``scaled_dot_product_attention`` itself runs,
    so that the kernel is the one torch picks for the call (cuDNN's where it takes a mask), and ``lse``
    is an empty tensor: the graph reads only ``out``."""
    spec = resolved(spec_json, q.dtype)
    if not _public(q, need_lse) or q.shape[-2] == 0 or k.shape[-2] == 0:
        out, lse, _ = SdpaBackend()._forward(spec, q, k, v, None, None, plan=plan)
        return out, lse
    return _public_forward(spec, q, k, v, plan), q.new_empty((0,), dtype=lse_dtype(q.dtype))


# the forward in torch ops a tracer records, for compiled graphs: the mask plan shared by sites, then
# each site (``attncomp/passes/inline_sdpa.py`` calls them through the registered backend)
SdpaBackend.inline_plan = staticmethod(inline_plan)
SdpaBackend.inline_forward = staticmethod(inline_attention)


def _public_plan(spec: AttentionSpec, q: Tensor, k: Tensor, attn_mask: Optional[Tensor],
                 preds: Optional[Predicates]) -> tuple:
    """``(is_causal, bias, row_ok)`` for ``scaled_dot_product_attention``, which takes a mask or
    ``is_causal``, not both: a causal bound with a mask goes into the mask. Rows with no allowed key
    (``row_ok`` False) get a finite mask (no NaN, forward or backward); their output is zeroed after."""
    is_causal, bias, row_ok = _plan(spec, q, k, attn_mask, preds)
    if bias is not None:
        if is_causal:  # top-left (default positions, or Nq == Nk)
            i, j = default_positions(spec, q.shape[-2], k.shape[-2], q.device)
            bias = torch.where(j[:, None, :] <= i[:, :, None], bias, _const(float("-inf"), bias.dtype, bias.device))
            is_causal = False
        if row_ok is not None:
            bias = torch.where(row_ok[..., None], bias, _const(0.0, bias.dtype, bias.device))
    return is_causal, bias, row_ok


def _public_forward(spec: AttentionSpec, q: Tensor, k: Tensor, v: Tensor, plan: tuple) -> Tensor:
    """``scaled_dot_product_attention`` (torch's own kernel choice) for a :func:`_public_plan`, the rows
    with no allowed key zeroed."""
    is_causal, bias, row_ok = plan
    hq = q.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, _expand(k, hq), _expand(v, hq), attn_mask=bias,
                                                           is_causal=is_causal, scale=_scale(spec, q.shape[-1]))
    if row_ok is not None:
        # zeroed with the heads inner, SDPA's own output layout: a model's transpose(1, 2).reshape(...)
        # of the result is then a view, not a second copy (row_ok has the mask's leading dims: (B|1, H|1, Nq) at most)
        while row_ok.dim() < 3:
            row_ok = row_ok.unsqueeze(0)
        out = torch.where(row_ok.transpose(1, 2)[..., None], out.transpose(1, 2),
                          _const(0.0, out.dtype, out.device)).transpose(1, 2)
    return out


# -- CUDA (run by the GPU issue; the CPU tests cover the choice logic) ----------------------------

def prepared_forward(spec: AttentionSpec, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                     preds: Optional[Predicates]):
    """A callable that runs SDPA on these tensors as a traced site's compiled code runs it per call
    (:func:`inline_attention` without ``lse``: the kernel and the zeroing of empty rows), its mask built
    once beforehand (the compiled code builds it in one fused kernel of its own):
    ``attncomp.runtime.dispatch`` times it against the op."""
    plan = _public_plan(spec, q, k, attn_mask, preds)
    return lambda: _public_forward(spec, q, k, v, plan)


def _aligned_bias(bias: Tensor, q: Tensor, nk: int) -> Tensor:
    """The memory-efficient kernel wants the bias's last dim contiguous and 16-element aligned: pad,
    then take a view of the first ``nk`` columns (broadcast dims stay stride 0)."""
    pad = (-nk) % 16
    b = torch.nn.functional.pad(bias, (0, pad)) if pad else bias.contiguous()
    return b[..., :nk].expand(q.shape[0], q.shape[1], q.shape[2], nk)


def _use_flash(q, k, bias, is_causal) -> bool:
    # FlashAttention aligns causal bottom-right when Nq != Nk: top-left causal goes to the
    # memory-efficient kernel then
    return bias is None and q.dtype in (torch.float16, torch.bfloat16) and (not is_causal or q.shape[-2] == k.shape[-2])


# whether this torch's FlashAttention forward takes k/v with fewer heads than q (grouped-query
# attention: its kernel reads each k/v head for its group of query heads, where other kernels need the
# heads repeated, a copy of k and v per call); learned from the first grouped call
_GROUPED: list = [None]


def _grouped_flash(q, k, bias, is_causal) -> bool:
    """Whether a CUDA forward with grouped k/v heads runs FlashAttention on them as they are."""
    hq, hk = q.shape[1], k.shape[1]
    return hq != hk and hq % hk == 0 and _GROUPED[0] is not False and _use_flash(q, k, bias, is_causal)


def _flash_grouped(q, k, v, is_causal, scale) -> Tuple[Tensor, Tensor]:
    try:
        r = _FLASH_FWD(q, k, v, 0.0, is_causal, False, scale=scale)
    except RuntimeError:
        if _GROUPED[0]:
            raise
        _GROUPED[0] = False  # (a torch whose kernel wants as many k/v heads as q heads)
        hq = q.shape[1]
        return _cuda_forward(q, _expand(k, hq), _expand(v, hq), None, is_causal, scale)
    _GROUPED[0] = True
    return r[0], r[1]


def _cuda_forward(q, k, v, bias, is_causal, scale) -> Tuple[Tensor, Tensor]:
    if _use_flash(q, k, bias, is_causal):
        r = _FLASH_FWD(q, k, v, 0.0, is_causal, False, scale=scale)
        return r[0], r[1]
    if bias is not None:
        bias = _aligned_bias(bias, q, k.shape[-2])
    r = _EFFICIENT_FWD(q, k, v, bias, True, 0.0, is_causal, scale=scale)
    return r[0], r[1][..., : q.shape[-2]]


def _cuda_backward(spec, q, k, v, attn_mask, preds, grad_out, out, lse):
    """SDPA's flash or memory-efficient backward kernel. The forward is recomputed with the same
    kernel so that its backward gets exactly the auxiliary outputs it expects (random-state and
    sequence bookkeeping that the op does not keep)."""
    hq, hk, nk = q.shape[1], k.shape[1], k.shape[-2]
    scale = _scale(spec, q.shape[-1])
    is_causal, bias, row_ok = _plan(spec, q, k, attn_mask, preds)
    kk, vv = _expand(k, hq), _expand(v, hq)
    go = grad_out.to(q.dtype).contiguous()
    if _use_flash(q, k, bias, is_causal):
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, is_causal, False, scale=scale)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            go, q, kk, vv, r[0], r[1], r[2], r[3], r[4], r[5], 0.0, is_causal, r[6], r[7], scale=scale)
        return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)
    zero = _const(0.0, q.dtype, q.device)
    if bias is None:
        bias = torch.zeros((1, 1, 1, nk), dtype=q.dtype, device=q.device)
    if row_ok is not None:
        # rows with no allowed key: a finite bias and a zero grad_out drop them from every gradient
        bias = torch.where(row_ok[..., None], bias, zero)
        go = torch.where(row_ok[..., None], go, zero)
    bias = _aligned_bias(bias, q, nk)
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, kk, vv, bias, True, 0.0, is_causal, scale=scale)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        go, q, kk, vv, bias, r[0], r[1], r[2], r[3], 0.0, [True, True, True, False], is_causal, scale=scale)
    return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)
