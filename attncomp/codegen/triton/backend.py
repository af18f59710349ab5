"""Host side of the Triton backend: one site description, schedules, launches of the kernel template.

:class:`TritonBackend` has the interface of ``attncomp.codegen.reference.ReferenceBackend``
(``supports``, ``forward``, ``backward``, each with the ``preds`` keyword) and computes the same
function (DESIGN.md §4, §4.1) with the kernels of :mod:`.template`: every policy (``dense``/``et``,
``dfss``, ``hash``, ``drop``, ``spion``) with every predicate, the residual mask and dropout.

The host path never reads the device: no ``.item()``/``.tolist()``, no data-dependent shapes.
Grids are sized from shapes; tile lists are padded to the number of tiles and carry a count;
sorted layouts come from the device (:mod:`.layout`).

The backward is deterministic (two launches, no atomics) unless a ``DQ_ATOMIC`` launch configuration
is chosen (dQ added with float32 atomics in the dK/dV pass); with PyTorch's deterministic algorithms
enabled such configurations are never candidates and a forced one falls back to the two launches. One
exception: a relative-position bias's table gradient is added with float32 atomics in every configuration
(its last bits can differ between runs; dq, dk, dv and the other modifiers' gradients do not).

Score modifiers (DESIGN.md §4.2) run in the template (:class:`Site` turns ``mods`` into kernel arguments; a
relative bias into a look-up table, :func:`rel_lut`); such sites take no launch plan and no Gluon kernel.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections import OrderedDict
from typing import Optional, Tuple

import torch
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from ...opspec import bounded_put as _put, bucket_range, call_signature, half_given_aux, output_strides, tensor_sig
from ...policy import DFSS, SPION, Drop, Hash
from ...spec import AttentionSpec, Modifiers
from ..modifiers import mod_grads, rel_lut
from ..reference import cacheable, default_positions
from . import configs
from .common import LOG2E, MASK_BOOL, MASK_FLOAT, MASK_NONE
from .common import cdiv as _cdiv, next_pow2 as _next_pow2, pow2_block as _pow2, seed_word as _seed_word
from .common import window_bound as _clamp
from .layout import (GK_IDS, KV_COPY_PAD, Layout, counting_layout, derive_layout, draw_words, layout_from_aux,
                     window_ranges)
from .schedule import tile_lists, tile_summaries
from .template import (MODE_DKDV, MODE_DQ, MODE_FWD, POLICY_DENSE, POLICY_DFSS, POLICY_SORTED, POLICY_SPION,
                       POS_ARANGE, POS_NONE, POS_VECTOR, SCHED_LIST, SCHED_RANGE, SCHED_SPAN)
from . import cugraph, decode, launch as launch_mod, layout as _layout_mod, record, template
from .launch import FastLaunch

__all__ = ["TritonBackend", "attention_forward", "attention_backward", "Site", "draw_keep", "spec_window"]

_POLICIES = {"dense": POLICY_DENSE, "et": POLICY_DENSE, "dfss": POLICY_DFSS, "hash": POLICY_SORTED,
             "drop": POLICY_SORTED, "spion": POLICY_SPION}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the template's kernels, launched through the short host path after their first call per argument
# class (the seed changes from call to call: keyed by its class)
_attention_kernel = FastLaunch(template._attention_kernel, volatile=("seed",))
_bwd_preprocess = FastLaunch(template._bwd_preprocess)
_MAX_HEAD_DIM = 256

#: the configuration of the latest forward and backward launch (read by benchmarks and reports)
last_configs: dict = {}
# configuration chosen per call signature in this process (see Site.signature)
_config_memo: dict = {}


def _empty(shape, dtype, device, strides=None) -> torch.Tensor:
    """Every output and workspace buffer comes from here (tests swap it for a NaN-filling one);
    contiguous, or with ``strides``."""
    if strides is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def _out_empty(q: torch.Tensor, dv: int) -> torch.Tensor:
    """The forward's output in the op's layout (:func:`attncomp.ops.output_strides`: heads inner),
    allocated with its strides (a transposed view costs a few microseconds more per call)."""
    B, H, N, _ = q.shape
    return _empty((B, H, N, dv), q.dtype, q.device, output_strides(B, H, N, dv))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _bstride(t) -> int:
    return 0 if t is None or t.shape[0] == 1 else t.stride(0)


def _mask_view(m: torch.Tensor) -> torch.Tensor:
    """A residual mask as the kernels read it: 4-D (leading broadcast dimensions added), bool as bytes."""
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.view(torch.uint8) if m.dtype == torch.bool else m


def _token_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A ``(B or 1, N)`` predicate tensor as the kernels read it (bool as bytes, unit last stride)."""
    if t is None:
        return None
    t = _last_contiguous(t)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class Site:
    """Everything about one call that the kernels need, derived once from the spec and tensors."""

    def __init__(self, spec: AttentionSpec, q, k, v, attn_mask, dropout_p: float, seed: int, preds=None,
                 q_aux=None, k_aux=None, block_pattern=None, layout: Optional[Layout] = None,
                 sorted_kv: bool = False, mods: Optional[Modifiers] = None, unsorted: bool = False):
        """``sorted_kv``: a forward's site, which may read a ``drop`` layout's sorted K/V copies
        (:attr:`kv_sorted`); the backward's never does. ``mods``: the tensors of the spec's score
        modifiers (DESIGN.md §4.2). ``unsorted``: a decode kernel's site (:mod:`.decode`), which applies
        ``drop``'s keep rule per logit: no sorted layout is built."""
        self.B, self.Hq, self.Nq, self.D = (int(s) for s in q.shape)
        self.Hk, self.Nk, self.Dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[-1])
        self.groups = self.Hq // self.Hk
        self.dtype = q.dtype
        self.device = q.device
        self.scale = _scale(spec, self.D)
        pol = spec.policy
        self.policy = _POLICIES[pol.name]
        if unsorted and self.policy == POLICY_SORTED:
            self.policy = POLICY_DENSE
        if isinstance(pol, DFSS):
            r = pol.resolved(spec.torch_dtype() or q.dtype)
            self.nm_n, self.nm_m = r.n, r.m
        else:
            self.nm_n, self.nm_m = 1, 1
        self.exclude_self = bool(getattr(pol, "exclude_self", False))
        self.dropout_p = float(dropout_p)
        self.dropout = self.dropout_p > 0.0
        self.seed_word = _seed_word(seed)
        self.inv_keep = 1.0 / (1.0 - self.dropout_p) if self.dropout else 1.0
        self.block_d, self.block_dv = _pow2(self.D), _pow2(self.Dv)
        dummy = q

        # residual dense mask
        if attn_mask is None:
            self.mask_kind, self.mask, self.mask_strides = MASK_NONE, dummy, (0, 0, 0, 0)
        else:
            m = self.mask = _mask_view(attn_mask)
            self.mask_kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_FLOAT
            # broadcast dimensions read the same element: stride 0
            self.mask_strides = tuple(0 if m.shape[i] == 1 else m.stride(i) for i in range(4))

        # structured predicates (DESIGN §4.1)
        get = (lambda nm: getattr(preds, nm, None)) if preds is not None else (lambda nm: None)
        left, right = _bounds(spec)
        self.win_left, self.win_right = left, right
        self.pos_off = _pos_off(spec, self.Nq, self.Nk)
        q_pos, k_pos = get("q_pos"), get("k_pos")
        given_pos = (q_pos, k_pos)
        if left is None and right is None:
            self.pos = POS_NONE
            q_pos = k_pos = None
        elif q_pos is None and k_pos is None:
            self.pos = POS_ARANGE
        else:
            self.pos = POS_VECTOR
            if q_pos is None:
                q_pos = (torch.arange(self.Nq, device=self.device) + self.pos_off)[None]
            if k_pos is None:
                k_pos = torch.arange(self.Nk, device=self.device)[None]
        self.q_pos, self.k_pos = _token_tensor(q_pos), _token_tensor(k_pos)
        q_seg, k_seg = get("q_seg"), get("k_seg")
        self.seg = q_seg is not None and k_seg is not None
        self.q_seg, self.k_seg = (_token_tensor(q_seg), _token_tensor(k_seg)) if self.seg else (None, None)
        self.q_val, self.k_val = _token_tensor(get("q_valid")), _token_tensor(get("k_valid"))
        tok = (self.q_pos, self.k_pos, self.q_seg, self.k_seg, self.q_val, self.k_val)
        self.tok_b = self.B if any(t is not None and t.shape[0] > 1 for t in tok) else 1

        # policy tensors
        self.pattern, self.spion_bs, self.pat_strides = dummy, 0, (0, 0, 0)
        if isinstance(pol, SPION):
            if block_pattern is None:
                raise ValueError("policy 'spion' needs a block_pattern")
            p = block_pattern.view(torch.uint8) if block_pattern.dtype == torch.bool else block_pattern
            self.pattern, self.spion_bs = p, int(pol.block_size)
            self.pat_strides = (0 if p.shape[0] == 1 else p.stride(0), p.stride(1), p.stride(2))
        self.layout, self.sorted_key = None, ()
        # query tiles of a sorted layout with its ranges as the only predicate (a window around default
        # positions is cut into them below) visit the span of their ranges, computed in the kernel: no lists
        spans = (self.policy == POLICY_SORTED and self.pos != POS_VECTOR and not self.seg and self.q_val is None
                 and self.k_val is None)
        # a forward of such tiles over keys kept by a draw reads them from sorted copies, made by the
        # draw's scatter launch
        copies = (spans and sorted_kv and isinstance(pol, Drop) and layout is None and q_aux is None
                  and k_aux is None and configs.sorted_kv_enabled(self.Nq))
        if self.policy == POLICY_SORTED:
            # the window around default positions becomes part of each query's key range (computed
            # by the counting sort's scatter, or by window_ranges for other layouts)
            window = (self.pos_off, left, right) if self.pos == POS_ARANGE else None
            if layout is None:
                if q_aux is None and k_aux is None:
                    # derived on the device, fused with the sort: LSH buckets, or keep draws of the call's seed
                    layout = _derived_for(spec, q, k, window, seed, (k, v) if copies else None)
                elif q_aux is None or k_aux is None:
                    raise half_given_aux(pol)
                else:
                    layout = _layout_for(spec, q_aux, k_aux, window)
            if layout.window != window:
                layout = window_ranges(layout, *(window or (0, None, None)))
            if window is not None:
                self.pos, self.win_left, self.win_right = POS_NONE, None, None
            self.layout = layout
        # padding alone: tile lists (which skip padded tiles) only where the kernel is long enough to
        # hide the three launches that build them; below that the span tests validity per logit
        padding_lists = (self.q_val is not None or self.k_val is not None) and self.Nq * self.Nk >= PAD_LIST_MIN
        self.sched = SCHED_LIST if (self.pos == POS_VECTOR or self.seg or padding_lists
                                    or self.policy in (POLICY_SORTED, POLICY_SPION)) else SCHED_SPAN
        self.sched_q = SCHED_RANGE if spans else self.sched
        #: the forward's key/value tiles come in row order from the layout's sorted copies (``Layout.kv``)
        self.kv_sorted = copies and self.layout.kv is not None
        if self.policy == POLICY_SORTED:
            # the policy, whether the ranges are cut to a window, and whether K/V come from sorted copies:
            # hash's buckets and drop's kept prefix make different tiles fastest (configs.GPU_DEFAULTS_SORTED)
            self.sorted_key = (pol.name, self.layout.window is not None, self.kv_sorted)
        self._dummy = dummy
        self._kv = self.layout.kv if self.kv_sorted else (k, v)
        # a 2:4 selection can be fused with the forward's exponentials (config key NM_EXP)
        self.nm_exp_ok = self.policy == POLICY_DFSS and self.nm_m == 4 and self.nm_n == 2
        self._modifiers(spec, mods, given_pos)

    def _modifiers(self, spec: AttentionSpec, mods: Optional[Modifiers], given_pos: tuple) -> None:
        """The score modifiers' kernel arguments (:meth:`mod_args`) and meta-parameters (:attr:`mod_meta`,
        empty without modifiers: such a site launches the kernel it launched before they existed)."""
        self.alibi, self.rel, self.sinks = bool(spec.alibi), spec.rel_buckets is not None, bool(spec.sinks)
        self.softcap = None if spec.softcap is None else float(spec.softcap)
        self.mq_pos = self.mk_pos = None
        self.slopes = self.lut = self.sink_t = None
        self.rel_md = None
        self.mod_meta = {}
        if not (self.alibi or self.rel or self.softcap is not None or self.sinks):
            return
        mods = mods if mods is not None else Modifiers()
        for on, t, nm in ((self.alibi, mods.alibi_slopes, "alibi_slopes"), (self.rel, mods.rel_table, "rel_table"),
                          (self.sinks, mods.sinks, "sinks")):
            if on and t is None:
                raise ValueError(f"the spec has {spec.describe_modifiers()} but no {nm} was given")
        mpos = False
        if (self.alibi or self.rel) and self.pos != POS_VECTOR and any(t is not None for t in given_pos):
            # positions that no window reads (the site has none, or a sorted layout holds it) still place
            # the relative modifiers: the kernels read the vectors (defaults where one side is absent)
            qp, kp = given_pos
            dq, dk = default_positions(spec, self.Nq, self.Nk, self.device)
            self.mq_pos = _token_tensor(qp if qp is not None else dq)
            self.mk_pos = _token_tensor(kp if kp is not None else dk)
            mpos = True
        if self.alibi:
            self.slopes = _last_contiguous(mods.alibi_slopes.reshape(-1))
        if self.rel:
            self.rel_md = int(spec.rel_max_distance)
            self.lut = rel_lut(spec, mods.rel_table, self.device)
        if self.sinks:
            self.sink_t = _last_contiguous(mods.sinks.reshape(-1))
        self.mod_meta = dict(ALIBI=self.alibi, REL=self.rel, SOFTCAP=self.softcap is not None, SINKS=self.sinks,
                             MPOS=mpos)

    def mod_args(self, dslopes=None, dlut=None) -> tuple:
        """``(Slopes, Lut, Sinks, DSlopes, DLut, softcap, rel_md)``: None for each one the site lacks (a
        constant to Triton: nothing is passed or read); ``dslopes``/``dlut``: the dK/dV pass's gradient
        buffers."""
        return (self.slopes, self.lut, self.sink_t, dslopes, dlut, self.softcap, self.rel_md)
    @functools.cached_property
    def tma_ok(self) -> bool:
        """Whether key/value tiles can come through TMA descriptors: rows in order (no sorted layout but
        through its sorted copies, no N:M key order), a Hopper GPU (or the interpreter), 16-byte aligned
        bases and strides. Computed on first use: only a launch whose configuration asks for TMA pays
        for the checks."""
        return ((self.policy != POLICY_SORTED or self.kv_sorted) and self.nm_m <= 2 and _has_tma(self.device)
                and all(_tma_aligned(t) for t in self._kv))

    @property
    def tag(self) -> str:
        """The sorted layout's name for the tuning defaults (``configs.GPU_DEFAULTS_SORTED``): the
        policy, ``+kv`` where K/V come from sorted copies; ``""`` for other policies."""
        if not self.sorted_key:
            return ""
        return self.sorted_key[0] + ("+kv" if self.kv_sorted else "")

    # -- kernel arguments ------------------------------------------------------------------------
    def _reads_copies(self, block_n: int) -> bool:
        """Whether launches with ``block_n``-key tiles read the sorted copies (tiles no longer than the
        zeros after the kept keys)."""
        return self.kv_sorted and block_n <= KV_COPY_PAD

    def fwd_kv(self, k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple:
        """``(K, V, KV_SORTED)`` of a forward launch with ``block_n``-key tiles: the sorted copies where
        the site reads them, else ``k`` and ``v``."""
        if self._reads_copies(block_n):
            return (*self._kv, True)
        return k, v, False

    def kv_descriptors(self, cfg: dict, block_n: int) -> tuple:
        """``(Desc0, Desc1, TMA)`` of a forward or dQ launch: descriptors of ``block_n``-key blocks of K
        and V when ``cfg`` asks for TMA and the site allows it, else placeholders the kernel never reads.
        (A forward's K and V: :meth:`fwd_kv`.)"""
        if not (cfg.get("TMA") and self.tma_ok) or (self.kv_sorted and not self._reads_copies(block_n)):
            return self._dummy, self._dummy, False
        k, v = self._kv
        return _descriptor(k, block_n, self.block_d), _descriptor(v, block_n, self.block_dv), True

    def q_descriptors(self, cfg: dict, block_m: int, q: torch.Tensor, grad_out: torch.Tensor) -> tuple:
        """``(Desc0, Desc1, TMA)`` of a dK/dV launch: descriptors of ``block_m``-query blocks of Q and dO
        when ``cfg`` asks for them (key ``TMA_Q``; ``TMA`` is the dQ launch's K and V) and the query rows
        are in order: any policy but a sorted layout (an N:M key order leaves queries alone)."""
        if not (cfg.get("TMA_Q") and self.policy != POLICY_SORTED and _has_tma(self.device)
                and _tma_aligned(q) and _tma_aligned(grad_out)):
            return self._dummy, self._dummy, False
        return _descriptor(q, block_m, self.block_d), _descriptor(grad_out, block_m, self.block_dv), True

    def dq_target(self, cfg: dict, block_m: int, dq32: torch.Tensor) -> tuple:
        """``(DQ, DQ_ATOMIC)`` of a one-launch backward adding dQ into the float32 buffer ``dq32``: a TMA
        descriptor of ``block_m``-query blocks and mode 2 when ``cfg`` asks for it and the query rows are
        in order (any policy but a sorted layout), else the buffer itself and per-element atomics (1)."""
        if not (int(cfg["DQ_ATOMIC"]) == 2 and self.policy != POLICY_SORTED and _has_tma(self.device)
                and _tma_aligned(dq32)):
            return dq32, 1
        return _descriptor(dq32, block_m, self.block_d), 2

    def meta(self, block_m: int, block_n: int, outer_q: bool = True) -> dict:
        """The launch's meta-parameters; ``outer_q``: a pass over query tiles (forward, dQ), else the
        dK/dV pass over key tiles."""
        return dict(
            GROUPS=self.groups, HEAD_D=self.D, HEAD_DV=self.Dv, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
            MASK_KIND=self.mask_kind, CHECK_Q=self.Nq % block_m != 0, CHECK_K=self.Nk % block_n != 0,
            POLICY=self.policy, NM_N=self.nm_n, NM_M=self.nm_m, EXCLUDE_SELF=self.exclude_self,
            DROPOUT=self.dropout, PRESCALE=(self.mask_kind == MASK_FLOAT or not self.scale > 0.0
                                            or self.alibi or self.rel or self.softcap is not None),
            POS=self.pos, HAS_LEFT=self.win_left is not None, HAS_RIGHT=self.win_right is not None,
            SEG=self.seg, QVAL=self.q_val is not None, KVAL=self.k_val is not None,
            SPION_BS=self.spion_bs, SCHED=self.schedule(outer_q), **self.mod_meta,
        )

    def schedule(self, outer_q: bool) -> int:
        """The tile schedule of a pass over query tiles (``outer_q``: forward, dQ) or key tiles (dK/dV)."""
        return self.sched_q if outer_q else self.sched

    def pred_args(self, lst, cnt) -> tuple:
        d = self._dummy
        lay = self.layout

        def ptr(t):
            return d if t is None else t

        # (positions that only the modifiers read: mq_pos/mk_pos, where the window reads none)
        qpos = self.q_pos if self.mq_pos is None else self.mq_pos
        kpos = self.k_pos if self.mk_pos is None else self.mk_pos
        return (
            ptr(lay and lay.q_perm), ptr(lay and lay.k_perm), ptr(lay and lay.lo), ptr(lay and lay.hi),
            ptr(qpos), ptr(kpos), ptr(self.q_seg), ptr(self.k_seg), ptr(self.q_val), ptr(self.k_val),
            self.mask, self.pattern, ptr(lst), ptr(cnt),
            _bstride(qpos), _bstride(kpos), _bstride(self.q_seg), _bstride(self.k_seg),
            _bstride(self.q_val), _bstride(self.k_val), *self.mask_strides, *self.pat_strides,
            *((0, 0, 0) if lst is None else (_st(lst, 0), _st(lst, 1), lst.stride(2))),
            *((0, 0) if cnt is None else (_st(cnt, 0), _st(cnt, 1))),
            self.pos_off, _clamp(self.win_left), _clamp(self.win_right),
        )

    def lists(self, block_m: int, block_n: int, outer_q: bool):
        """The tile lists for query tiles of ``block_m`` and key tiles of ``block_n`` (``None`` for a
        span schedule): per query tile when ``outer_q``, else per key tile."""
        if self.schedule(outer_q) != SCHED_LIST:
            return None, None
        key = self._pattern_key(block_m, block_n, outer_q)
        if key is not None:
            hit = _LIST_CACHE.get(key)
            if hit is not None:
                _LIST_CACHE.move_to_end(key)
                return hit[1]
        lists = self._build_lists(block_m, block_n, outer_q)
        if key is not None and cacheable(self.device):
            _LIST_CACHE[key] = (self.pattern, lists)  # the entry holds the pattern: its memory stays its own
            if len(_LIST_CACHE) > _LIST_CACHE_SIZE:
                _LIST_CACHE.popitem(last=False)
        return lists

    def _pattern_key(self, block_m: int, block_n: int, outer_q: bool):
        """A cache key for lists that depend only on a SPION pattern, the sizes and scalar windows
        (no token tensors, no sorted layout); ``None`` otherwise. A model's pattern is fixed between
        refreshes, so its lists are built once per layer and tile shape, not on every call."""
        if not self.spion_bs or self.layout is not None or self.pos == POS_VECTOR or self.seg \
                or self.q_val is not None or self.k_val is not None:
            return None
        try:
            pat = _tensor_key(self.pattern)
        except RuntimeError:  # an inference tensor tracks no version: nothing to key a cache on
            return None
        return (pat, self.spion_bs, self.Nq, self.Nk, self.Hq, self.pos, self.pos_off, self.win_left,
                self.win_right, block_m, block_n, outer_q)

    def _build_lists(self, block_m: int, block_n: int, outer_q: bool):
        lay = self.layout
        sorted_ = lay is not None
        qsum, ksum = tile_summaries(block_m, block_n, self.Nq, self.Nk, self.B if sorted_ else self.tok_b,
                                    self.Hq if sorted_ else 1, self.Hk if sorted_ else 1, lay and lay.q_perm,
                                    lay and lay.k_perm, self.q_pos, self.k_pos, self.q_seg, self.k_seg, self.q_val,
                                    self.k_val, lay and lay.lo, lay and lay.hi, self.pos_off, self.pos, self.device)
        per_head = sorted_ or (self.spion_bs and self.pattern.shape[0] > 1)
        return tile_lists(qsum, ksum, outer_q=outer_q, block_m=block_m, block_n=block_n,
                          rows_h=self.Hq if per_head else 1, groups_k=self.groups if sorted_ else 1,
                          pattern=self.pattern if self.spion_bs else None, spion_bs=self.spion_bs,
                          pos_kind=self.pos, win_left=_clamp(self.win_left, None),
                          win_right=_clamp(self.win_right, None), seg=self.seg, q_val=self.q_val is not None,
                          k_val=self.k_val is not None, sorted_ranges=sorted_)

    # -- configuration keys ----------------------------------------------------------------------
    def signature(self) -> tuple:
        """What the choice of launch configuration depends on (a key of this process's memo: the
        meta-parameters in :meth:`meta`'s fixed order, no sorting or device string per call)."""
        m = self.meta(16, 16)
        del m["CHECK_Q"], m["CHECK_K"]
        return (self.dtype, _next_pow2(self.Nq), _next_pow2(self.Nk), self.device, *m.values(), *self.sorted_key)

    def tune_key(self) -> dict:
        arch = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        m = self.meta(16, 16)
        m.pop("CHECK_Q")
        m.pop("CHECK_K")
        # sequence lengths by power of two: one tuning per size class
        key = {**m, "dtype": str(self.dtype), "nq": _next_pow2(self.Nq), "nk": _next_pow2(self.Nk), "arch": arch}
        if self.sorted_key:
            key["layout"] = list(self.sorted_key)
        return key


def _strides(*tensors) -> tuple:
    """Batch, head and row strides of each (B, H, N, D) tensor (zeros for an absent one)."""
    return tuple(x for t in tensors for x in ((0, 0, 0) if t is None else t.stride()[:3]))


# Nq * Nk from which a site with padding (q_valid / k_valid) alone builds tile lists. A GPT-2 step on
# an H100 (4 x 2048, all-ones attention_mask) was host-bound (the models benchmark's host time per call), the three
# list launches per call being part of that host path; the bound itself is a choice, not measured
PAD_LIST_MIN = 4096 * 4096

_TMA_DEVICES: dict = {}


def _has_tma(device: torch.device) -> bool:
    """Whether kernels on ``device`` can read through TMA descriptors: Hopper or newer, or the
    interpreter (which emulates them)."""
    if configs.interpret_mode():
        return True
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _TMA_DEVICES.get(idx)
    if ok is None:
        ok = _TMA_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


_CHECKED_BLOCKS: set = set()


def _descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A TMA descriptor of a ``(B, H, N, D)`` tensor in blocks of ``rows`` tokens by ``cols`` features
    (zero-filled past ``N`` and ``D``). Built without the constructor's checks, which cost more host
    time than the launch: what they assert of the tensor, :func:`_tma_aligned` checked before any
    descriptor is asked for; the block shape is checked once per shape."""
    block = [1, 1, rows, cols]
    if (rows, cols) not in _CHECKED_BLOCKS:
        TensorDescriptor(t, list(t.shape), list(t.stride()), block)  # raises on a block shape TMA cannot take
        _CHECKED_BLOCKS.add((rows, cols))
    return record.descriptor(t, list(t.shape), list(t.stride()), block)


def _tma_aligned(t: torch.Tensor) -> bool:
    """Whether ``t`` can be described to TMA: 4-D, unit last stride, a 16-byte aligned base, strides of
    whole 16-byte multiples and no broadcast (stride 0) dimension of more than one element."""
    size = t.element_size()
    return (t.dim() == 4 and t.stride(3) == 1 and t.data_ptr() % 16 == 0 and min(t.shape) > 0
            and all((st * size) % 16 == 0 and (st > 0 or n == 1) for st, n in zip(t.stride()[:3], t.shape[:3])))


def _scale(spec: AttentionSpec, D: int) -> float:
    """The spec's softmax scale (``1 / sqrt(D)`` where it gives none)."""
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)


def _st(t, d) -> int:
    return 0 if t.shape[d] == 1 else t.stride(d)


def _bounds(spec: AttentionSpec) -> Tuple[Optional[int], Optional[int]]:
    if hasattr(spec, "bounds"):
        return spec.bounds()
    return None, (0 if spec.causal else None)


def attention_forward(spec: AttentionSpec, q, k, v, attn_mask=None, dropout_p: float = 0.0, seed: int = 0,
                      config: Optional[dict] = None, *, preds=None, q_aux=None, k_aux=None, block_pattern=None,
                      layout: Optional[Layout] = None, check=None,
                      mods: Optional[Modifiers] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of DESIGN.md §4 through the template's forward.

    ``check``: called before anything is built for a call that no launch plan serves (a call that a
    plan serves repeats one that passed it: the plan's key holds all that the check reads). ``mods``: the
    tensors of the spec's score modifiers (DESIGN.md §4.2); a site with modifiers takes no launch plan
    (its tables and learnable tensors are the call's own) and no Gluon kernel."""
    _TAKEN.plan = None
    if config is None and layout is None and decode.eligible(spec, q, k, dropout_p, k_aux):
        if check is not None:
            check()
        return _decode_forward(spec, q, k, v, attn_mask, seed, preds, q_aux, k_aux, block_pattern, mods)
    if spec.modifiers():
        if config is not None and config.get("KERNEL") == "gluon":
            raise ValueError(f"config {config} asks for the Gluon forward, which cannot run this call: score "
                             f"modifiers ({spec.describe_modifiers()})")
        if q.is_cuda:
            gluon_skipped["fwd"] = f"score modifiers ({spec.describe_modifiers()})"
        if check is not None:
            check()
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        return _forward(spec, q, k, v, attn_mask, dropout_p, seed, preds, q_aux, k_aux, block_pattern, layout, config,
                        mods)[:2]
    if config is None or config.get("KERNEL") == "gluon":
        res = _gluon_forward(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout, config, check)
        if res is not None:
            return res
    given = q, k, v
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    as_given = q is given[0] and k is given[1] and v is given[2]  # no copy made here
    # a launch plan (below) serves dense and DFSS calls that bring nothing of their own to sort or list,
    # and hash/drop calls that derive their layout on the device (a recorded plan)
    key = None
    kind = _POLICIES.get(spec.policy.name)
    derived = kind == POLICY_SORTED and q_aux is None and k_aux is None
    # hash/drop given their policy tensors (drop's keep masks from draw_keep), without position vectors
    with_aux = (kind == POLICY_SORTED and q_aux is not None and k_aux is not None
             and (preds is None or (preds.q_pos is None and preds.k_pos is None)))
    # what a sorted plan's run takes besides the tensors: the policy tensors given, or the seed of
    # drop's keep draws
    sorted_kw = {"q_aux": q_aux, "k_aux": k_aux} if with_aux else {}
    if derived and isinstance(spec.policy, Drop):
        sorted_kw["seed"] = seed
    if (config is None and block_pattern is None and layout is None
            and (kind in (POLICY_DENSE, POLICY_DFSS) or derived or with_aux) and _attention_kernel.short_path_open()):
        sw = _seed_word(seed)
        key = _plan_key(spec, q, k, v, attn_mask, preds, dropout_p, sw, q_aux, k_aux)
        plan = _PLANS.get(key)
        if plan is not None:
            res = plan.run(q, k, v, attn_mask, preds and preds.q_valid, preds and preds.k_valid, sw, **sorted_kw)
            if res is not None:
                if as_given:  # a plan the op may keep serves the call's tensors as they come
                    _TAKEN.plan = plan
                return res
            key = None
        elif key not in _SEEN:  # a plan is built the second time its key is seen (decode steps never repeat)
            _put(_SEEN, key, True, _MAX_PLANS)
            key = None
    if check is not None:
        check()
    if key is not None and (derived or with_aux) and cacheable(q.device):
        window = spec_window(spec, q.shape[2], k.shape[2]) if with_aux else None
        if with_aux:  # the layout first (the cache's, from the draw), then the launches that read it
            layout = _layout_for(spec, q_aux, k_aux, window)
        with record.record() as rec:
            out, lse, site, launched = _forward(spec, q, k, v, attn_mask, dropout_p, seed, preds, None, None,
                                                block_pattern, layout, config)
        plan = _SortedPlan.make(spec, rec, site, q, k, v, attn_mask, preds, out, lse, launched, key[-1], window,
                                layout)
    else:
        out, lse, site, launched = _forward(spec, q, k, v, attn_mask, dropout_p, seed, preds, q_aux, k_aux,
                                            block_pattern, layout, config)
        plan = None
        if key is not None and site is not None and site.sched == SCHED_SPAN and launched:
            entry = _attention_kernel.last_entry
            plan = entry and _ForwardPlan(spec, site, q, k, v, out, lse, *launched[-1], entry, key[-1])
            plan = plan if plan and plan.slots else None
    if plan is not None:
        _put(_PLANS, key, plan, _MAX_PLANS)
        if as_given:
            _TAKEN.plan = plan
    return out, lse


def _decode_forward(spec, q, k, v, attn_mask, seed, preds, q_aux, k_aux, block_pattern, mods):
    """``(out, lse)`` of a decoding step through :mod:`.decode`'s split-KV kernels."""
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    site = Site(spec, q, k, v, attn_mask, 0.0, seed, preds, block_pattern=block_pattern, mods=mods, unsorted=True)
    out = _out_empty(q, site.Dv)
    lse = _empty((site.B, site.Hq, site.Nq), torch.float32, q.device)
    decode.decode_forward(site, spec, q, k, v, out, lse, q_aux, k_aux, seed)
    return out, lse


def _forward(spec, q, k, v, attn_mask, dropout_p, seed, preds, q_aux, k_aux, block_pattern, layout, config,
             mods=None):
    """``(out, lse, site, launched)``: the forward through a :class:`Site`; ``launched`` lists the
    launches' ``(config, grid, tma)`` (``site`` None and nothing launched for empty sizes)."""
    site = Site(spec, q, k, v, attn_mask, dropout_p, seed, preds, q_aux, k_aux, block_pattern, layout, sorted_kv=True,
                mods=mods)
    B, Hq, Nq, Nk = site.B, site.Hq, site.Nq, site.Nk
    out = _out_empty(q, site.Dv)
    lse = _empty((B, Hq, Nq), torch.float32, q.device)
    launched = []
    if Nq == 0 or B * Hq == 0:
        return out, lse, site, launched
    if Nk == 0:
        if site.sinks:  # (the sink alone in the denominator)
            return out.zero_(), lse.copy_(site.sink_t.to(torch.float32)[None, :, None].expand(B, Hq, Nq)), site, launched
        return out.zero_(), lse.fill_(float("-inf")), site, launched

    def launch(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        lst, cnt = site.lists(bm, bn, True)
        kd, vd, tma = site.kv_descriptors(cfg, bn)
        kk, vv, kv_sorted = site.fwd_kv(k, v, bn)
        grid = (_cdiv(Nq, bm), B * Hq)
        kw = dict(BLOCK_M=bm, BLOCK_N=bn, MODE=MODE_FWD, NATURAL=False, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], TMA=tma, NM_EXP=bool(cfg.get("NM_EXP")) and site.nm_exp_ok,
                  KV_SORTED=kv_sorted, **site.meta(bm, bn))
        _attention_kernel[grid](*_fwd_args(site, q, kk, vv, out, lse, kd, vd, lst, cnt, site.seed_word), **kw)
        launched.append((cfg, grid, tma))

    _run_tuned("fwd", site, launch, configs.fwd_candidates, config)
    return out, lse, site, launched


# -- the Gluon Hopper forward -------------------------------------------------------------------
# Dense and DFSS 2:4 sites (no mask tensor, no predicate vectors, no dropout; causal or not) on sm_90
# GPUs run :mod:`.hopper`'s kernel: asynchronous warp-group MMAs with the softmax of one key tile
# overlapping the previous tile's P @ V, which the template cannot express. Everything else runs the
# template.

_GLUON: dict = {}  # device index -> the module, or None where it cannot run
_GLUON_OFF: dict = {}  # launch keys whose compile failed (this Triton's Gluon) -> why
_PRED_NAMES = ("q_pos", "k_pos", "q_seg", "k_seg", "q_valid", "k_valid")
#: why the latest dense or DFSS forward (``"fwd"``) on a CUDA device did not run the Gluon kernel, or its backward
#: (``"bwd"``) the Gluon dK/dV pass by default (None when it did)
gluon_skipped: dict = {}


def _gluon_module(device: torch.device):
    """:mod:`.hopper` where it can run on ``device`` (compute capability 9.x, Gluon importable)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _GLUON:
        mod = None
        if torch.cuda.get_device_capability(idx)[0] == 9:
            try:
                from . import hopper as mod
            except Exception as e:  # a Triton without the Gluon API the kernel is written in
                _GLUON_OFF["import"] = f"{type(e).__name__}: {e}"
                mod = None
        _GLUON[idx] = mod
    return _GLUON[idx]


def _gluon_bwd(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout, grad_out,
               config: Optional[dict]) -> Optional[tuple]:
    """``(config, causal, off, nm24)`` of a backward that runs a Gluon kernel (:mod:`.hopper_bwd`):
    ``config`` where it asks for it (``KERNEL="gluon"``; ``ValueError`` where the call cannot run it), else by
    default ``configs.GLUON_BWD``'s for the dense sites it has on sm_90 (the warp-specialised kernel ``WS``, and
    for the two passes where it cannot run the dQ pass it names: Gluon's, ``DQ_GLUON``, or the template's) and
    ``configs.GLUON_BWD_DFSS``'s for DFSS 2:4 sites (the warp-specialised kernel only: not under PyTorch's
    deterministic algorithms); ``None`` where the template's dK/dV pass runs
    (``gluon_skipped["bwd"]`` says why)."""
    forced = config is not None
    if (config.get("KERNEL") != "gluon") if forced else not q.is_cuda:
        return None
    why, causal, off, nm24 = _gluon_why_not(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout, forced)
    cfg = config if forced else (configs.GLUON_BWD_DFSS if nm24 else configs.GLUON_BWD).get((q.shape[-1], causal))
    # (_gluon_why_not asked hopper.applies: the Gluon forward's inputs are the backward's)
    why = why or ("no configuration" if cfg is None else None) or (
        None if _tma_aligned(grad_out) else "a tensor TMA cannot read (16-byte aligned base and strides, unit last "
                                            "stride)")
    if nm24 and why is None:  # DFSS: the warp-specialised kernel only (its dQ added by TMA reductions)
        why = ("DFSS without the warp-specialised kernel (configuration key WS)" if not cfg.get("WS") else
               "DFSS under PyTorch's deterministic algorithms (the warp-specialised kernel adds dQ in a varying "
               "order)" if torch.are_deterministic_algorithms_enabled() else
               "DFSS: this Triton's Gluon builds no TMA reductions" if not _gluon_bwd_module().FUSED_DQ else None)
    if forced and why is not None:
        raise ValueError(f"config {config} asks for the Gluon backward, which cannot run this call: {why}")
    if not forced:
        gluon_skipped["bwd"] = why
    return None if why is not None else (cfg, causal, off, nm24)


def _gluon_bwd_module():
    """:mod:`.hopper_bwd` (imported where a configuration asks for it: the device is an sm_90 GPU)."""
    from . import hopper_bwd

    return hopper_bwd


def _gluon_nm24(spec: AttentionSpec, dtype: torch.dtype) -> Optional[bool]:
    """Whether the Gluon kernel serves the spec's policy as DFSS 2:4 (``True``) or dense (``False``);
    ``None`` where it does not serve it."""
    kind = _POLICIES.get(spec.policy.name)
    if kind == POLICY_DENSE and not getattr(spec.policy, "exclude_self", False):
        return False
    if kind == POLICY_DFSS:
        r = spec.policy.resolved(spec.torch_dtype() or dtype)
        return True if (r.n, r.m) == (2, 4) else None
    return None


def _gluon_why_not(spec: AttentionSpec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout,
                   forced: bool) -> Tuple[Optional[str], bool, int, bool]:
    """``(why, causal, off, nm24)``: why a forward call cannot take the Gluon kernel (``None`` where it
    can), whether it is causal, the default position of query 0 when it is (else 0), and whether it is
    DFSS 2:4 (else dense)."""
    if not q.is_cuda or configs.interpret_mode():
        return "not a CUDA device", False, 0, False
    if spec.modifiers():  # (the template applies them)
        return f"score modifiers ({spec.describe_modifiers()})", False, 0, False
    nm24 = _gluon_nm24(spec, q.dtype)
    if nm24 is None:
        return f"policy {spec.policy.name!r}", False, 0, False
    if not forced and q.dim() == 4 and k.shape[2] < configs.GLUON_MIN_KEYS:
        return f"{k.shape[2]} keys < {configs.GLUON_MIN_KEYS}", False, 0, nm24
    if not configs.gluon_enabled():
        return "ATTNCOMP_GLUON=0", False, 0, nm24
    if attn_mask is not None or dropout_p or block_pattern is not None or layout is not None:
        return "a mask tensor, dropout or a layout", False, 0, nm24
    if preds is not None and any(getattr(preds, n, None) is not None for n in _PRED_NAMES):
        return "predicate vectors", False, 0, nm24
    left, right = _bounds(spec)
    if left is not None or right not in (None, 0):
        return "a window", False, 0, nm24
    if q.dim() != 4 or min(q.shape[:3]) == 0 or k.shape[2] == 0:
        return "empty", False, 0, nm24
    causal = right == 0
    if not forced and configs.gluon_config(q.shape[-1], causal, nm24) is None:
        # (DFSS at D=64: the template measured as fast)
        return (f"no configuration for {'DFSS 2:4' if nm24 else 'dense'} at D={q.shape[-1]}"
                f"{', causal' if causal else ''} (configs.GLUON_FWD{'_DFSS' if nm24 else ''})"), causal, 0, nm24
    off = _pos_off(spec, q.shape[2], k.shape[2]) if causal else 0
    mod = _gluon_module(q.device)
    if mod is None:
        return _GLUON_OFF.get("import", "not an sm_90 GPU"), causal, off, nm24
    if not all(_tma_aligned(t) for t in (q, k, v)):
        return "a tensor TMA cannot read (16-byte aligned base and strides, unit last stride)", causal, off, nm24
    return mod.applies(q, k, v, off, nm24, _scale(spec, q.shape[-1])), causal, off, nm24


def _gluon_forward(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout, config, check):
    """``(out, lse)`` from the Gluon kernel, or ``None`` where the call goes to the template."""
    why, causal, off, nm24 = _gluon_why_not(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout,
                                            config is not None)
    cfg = None
    if why is None:  # (without a config, _gluon_why_not checked that a default exists)
        cfg = config or configs.gluon_config(q.shape[-1], causal, nm24, q.shape[2])
        if _GLUON_OFF:  # configurations whose compile failed (only then is the key built)
            why = _GLUON_OFF.get((nm24, *sorted(cfg.items())))
    if q.is_cuda:
        gluon_skipped["fwd"] = why
    if why is not None:
        if config is not None:
            raise ValueError(f"config {config} asks for the Gluon forward, which cannot run this call: {why}")
        return None
    if check is not None:
        check()
    from triton.compiler.errors import CompilationError

    B, Hq, Nq, D = q.shape
    out = _out_empty(q, D)
    lse = _empty((B, Hq, Nq), torch.float32, q.device)
    mod = _gluon_module(q.device)
    try:
        mod.forward(q, k, v, _scale(spec, D), causal, off, out, lse, cfg, nm24)
    except (CompilationError, OutOfResources) as e:  # this Triton's Gluon: the template runs it
        _GLUON_OFF[(nm24, *sorted(cfg.items()))] = gluon_skipped["fwd"] = f"{type(e).__name__}: {str(e)[:200]}"
        if config is not None:
            raise
        return None
    last_configs["fwd"] = dict(cfg, KERNEL="gluon")
    entry = mod.kernel_for(cfg).last_entry
    if config is None and entry is not None:  # the launch took (or can take) the short path: the op may keep it
        _TAKEN.plan = _GluonPlan(mod, spec, q, off, cfg, nm24, entry, _state(_seed_word(0)))
    return out, lse


class _GluonPlan:
    """A Gluon forward for the op to keep under the call's key (``ops._CALLS``: spec, sizes, strides,
    dtypes, alignment, no mask or predicate): a repeat builds the four TMA descriptors for its own
    tensors and launches the kept compiled kernel, without the checks of :func:`_gluon_why_not` (the
    key holds what they read) and without ``JITFunction.run``. What the key does not hold is checked
    per call: ``ATTNCOMP_GLUON``, the device and flags of :func:`_state`, the short launch path."""

    def __init__(self, mod, spec, q, off: int, cfg: dict, nm24: bool, entry: tuple, state: tuple):
        self.mod, self.cfg, self.nm24, self.entry, self.state = mod, cfg, nm24, entry, state
        self.kernel = mod.kernel_for(cfg)
        self.scale, self.off = _scale(spec, q.shape[-1]), off
        self.config = dict(cfg, KERNEL="gluon")
        B, Hq, Nq, D = q.shape
        self.lse_shape, self.device = (B, Hq, Nq), q.device
        # the launch's C arguments per address set of q, k, v, out and lse (the key fixes the rest):
        # a model's steady state repeats its addresses, and a repeat then builds no descriptor
        self.kept = launch_mod.kept_launcher(entry[0])
        self.launches: dict = {}

    def call(self, q, k, v, attn_mask, q_valid, k_valid, seed):
        """``(out, lse)`` for the call's tensors, or None where the plan does not hold now."""
        kernel = self.kernel
        state = _state(_seed_word(0))
        if state != self.state or not configs.gluon_enabled() or not kernel.short_path_open():
            return None
        out = _out_empty(q, q.shape[-1])
        lse = _empty(self.lse_shape, torch.float32, self.device)
        if self.kept is None:
            grid, args = self.mod.launch_args(q, k, v, self.scale, self.off, out, lse, self.cfg, self.nm24)
            kernel.launch_entry(self.entry, grid, args, state[2])
        else:
            key = (_ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(lse))
            hit = self.launches.get(key)
            if hit is None:
                grid, args = self.mod.launch_args(q, k, v, self.scale, self.off, out, lse, self.cfg, self.nm24)
                hit = (grid[0], grid[1], self.kept[0]((*args, *self.entry[1])))
                _put(self.launches, key, hit, _MAX_KEPT_LAUNCHES)
            self.kept[1](hit[0], hit[1], 1, kernel._stream(state[2]), hit[2])
            kernel.hits += 1
        last_configs["fwd"] = self.config
        gluon_skipped["fwd"] = None
        return out, lse


#: address sets a Gluon plan keeps the launch arguments of (a model's layers at one shape share a plan)
_MAX_KEPT_LAUNCHES = 64


def _fwd_args(site: Site, q, k, v, out, lse, kd, vd, lst, cnt, seed_word) -> tuple:
    """The forward launch's positional arguments."""
    return (q, k, v, out, out, lse, lse, out, out, out, kd, vd,
            *_strides(q, k, v, out, None, None, None, None), *site.pred_args(lst, cnt),
            site.Hq, site.Nq, site.Nk, site.scale * LOG2E, site.scale, seed_word, site.dropout_p, site.inv_keep,
            *site.mod_args())


# -- forward launch plans ------------------------------------------------------------------------
# A forward whose kernel needs nothing built per call (no sorted layout, no tile lists, no SPION
# pattern) launches, for the same spec, sizes, strides, dtypes, alignments, mask and predicate
# shapes, dropout and seed class, the same compiled kernel with the same arguments but the call's
# tensors and seed. The plan keeps that argument list, with the places of the call's values marked,
# and launches the kept kernel (launch.FastLaunch's entry) without building a Site again.

_PLANS: dict = {}
_SEEN: dict = {}  # keys seen once (no plan yet)
_MAX_PLANS = 1024  # sizes are part of the key (a decode loop adds one per step): bounded


class _Slot:
    """A per-call value in a plan's argument template; reads (shape, stride) delegate to the tensor
    of the call that built the plan, so the template is built by the same code as a launch."""

    __slots__ = ("name", "t")

    def __init__(self, name: str, t=None):
        self.name, self.t = name, t

    def __getattr__(self, attr):
        return getattr(self.t, attr)


def _state(sw: int) -> tuple:
    """What a launch plan depends on besides the call's tensors: the seed word's (``sw``)
    specialisation class, the current device, the tuning flags and deterministic mode."""
    return (sw == 1, sw & 15 == 0, _attention_kernel._device(), configs.tuning_enabled(),
            torch.are_deterministic_algorithms_enabled())


def _plan_key(spec, q, k, v, attn_mask, preds, dropout_p, sw: int, q_aux=None, k_aux=None) -> tuple:
    # the spec by identity: its plan holds it, so no other object takes that id while the plan lives
    return (id(spec), call_signature(q, k, v, attn_mask, preds, dropout_p), tensor_sig(q_aux), tensor_sig(k_aux),
            _state(sw))


# the plan the latest forward of this thread took (TritonBackend.taken_plan)
_TAKEN = threading.local()
# pointer parameters of the template that its forward never reads
_UNUSED_IN_FWD = frozenset(("DO", "Delta", "DQ", "DK", "DV"))
# the template's pointer parameter of each predicate vector of a Site
_PRED_PARAMS = (("QPos", "q_pos"), ("KPos", "k_pos"), ("QSeg", "q_seg"), ("KSeg", "k_seg"), ("QVal", "q_val"),
                ("KVal", "k_val"))
# a tensor argument as a plan launch passes it: its address (Triton's launcher takes an integer as
# is, where for a tensor it calls data_ptr() and asks the driver about the pointer)
_ptr = torch.Tensor.data_ptr


class _ForwardPlan:
    """One kept forward launch: the compiled kernel, its grid and its argument list with the places
    of the call's own values marked (slots). Pointers the kernel does not read for this launch (the
    backward's, the absent mask's, pattern's and predicates') are passed as null pointers, the call's
    tensors as addresses: the launcher then neither calls back into Python nor asks the driver for them."""

    def __init__(self, spec, site: Site, q, k, v, out, lse, cfg: dict, grid: tuple, tma: bool, entry: tuple,
                 state: tuple):
        self.spec, self.config, self.grid, self.entry, self.state = spec, cfg, grid, entry, state
        self.dv, self.lse_shape = out.shape[-1], tuple(lse.shape)
        self.device = q.device
        marked = object.__new__(Site)  # the site with its tensors marked
        marked.__dict__.update(site.__dict__)
        marked._dummy = _Slot(None, q)  # what the site passes for a pointer that is not read
        marked.mask = _Slot("mask", site.mask) if site.mask_kind != MASK_NONE else marked._dummy
        marked.pattern = marked._dummy
        marked.q_val = None if site.q_val is None else _Slot("q_val", site.q_val)
        marked.k_val = None if site.k_val is None else _Slot("k_val", site.k_val)
        kd = _Slot("kd") if tma else marked._dummy
        vd = _Slot("vd") if tma else marked._dummy
        args = _fwd_args(marked, _Slot("q", q), _Slot("k", k), _Slot("v", v), _Slot("out", out), _Slot("lse", lse),
                         kd, vd, None, None, _Slot("seed"))
        names = [p.name for p in _attention_kernel.fn.params]
        self.slots = tuple((i, a.name) for i, a in enumerate(args)
                           if type(a) is _Slot and a.name is not None and names[i] not in _UNUSED_IN_FWD)
        self.args = [None if type(a) is _Slot else a for a in args]
        if any(isinstance(a, torch.Tensor) for a in args):  # every tensor must be the call's own: no plan
            self.slots = ()
        self.tma_blocks = (cfg["BLOCK_N"], site.block_d, site.block_dv) if tma else None

    def call(self, q, k, v, attn_mask, q_valid, k_valid, seed):
        """:meth:`run` for a call matched by another key (the op's, ``ops.call_signature``), or None
        where what the plan depends on besides the call's tensors differs now (:func:`_state`) or the
        short launch path is closed."""
        sw = _seed_word(seed)
        state = _state(sw)
        if state != self.state or not _attention_kernel.short_path_open():
            return None
        return self.run(q, k, v, attn_mask, q_valid, k_valid, sw, state[2])

    def run(self, q, k, v, attn_mask, q_valid, k_valid, sw: int, device=None):
        """Launch for the call's tensors; ``sw``: its seed word (:func:`.common.seed_word`)."""
        out = _out_empty(q, self.dv)
        lse = _empty(self.lse_shape, torch.float32, self.device)
        vals = {"q": _ptr(q), "k": _ptr(k), "v": _ptr(v), "out": _ptr(out), "lse": _ptr(lse), "seed": sw}
        # (views and copies made here are held in locals until the launch)
        if attn_mask is not None:
            mask = _mask_view(attn_mask)
            vals["mask"] = _ptr(mask)
        if q_valid is not None or k_valid is not None:
            qv, kv = _token_tensor(q_valid), _token_tensor(k_valid)
            vals["q_val"] = None if qv is None else _ptr(qv)
            vals["k_val"] = None if kv is None else _ptr(kv)
        if self.tma_blocks is not None:
            bn, bd, bdv = self.tma_blocks
            vals["kd"], vals["vd"] = _descriptor(k, bn, bd), _descriptor(v, bn, bdv)
        args = self.args.copy()
        for i, name in self.slots:
            args[i] = vals[name]
        _attention_kernel.launch_entry(self.entry, self.grid, args, device)
        last_configs["fwd"] = self.config
        return out, lse


class _SortedPlan:
    """A ``hash``/``drop`` forward kept as the recorded launches of one call (:class:`.record.Replay`)
    and replayed for the calls of the same key:

    * a layout derived on the device (no policy tensors given): the counting sort (three launches;
      ``drop``'s keep draws with the call's seed words, and its sorted K/V copies), the tile summaries
      and lists where the site has padding (else the forward's query tiles span their ranges), the
      forward; one workspace allocation for the layout and lists (the copies are allocated apart and
      freed with the call). The layout stays in the workspace; the
      backward of the call finds it in the layout cache as views made on demand (:class:`_LazyLayout`);
    * policy tensors given (``drop``'s keep masks from :func:`draw_keep`): the layout comes from the
      cache (the draw's) for each call, and the forward (and any summaries and lists) read it."""

    #: the op may hand it calls with policy tensors (``ops._attention_impl``)
    takes_aux = True

    def __init__(self, spec, replay: "record.Replay", fields, window, config: dict, state: tuple, given: bool):
        self.replay, self.fields, self.window, self.config, self.state = replay, fields, window, config, state
        self.spec, self.policy, self.given = spec, spec.policy, given
        self.draws = isinstance(spec.policy, Drop) and not given  # keep draws of each call's seed

    @classmethod
    def make(cls, spec, rec, site, q, k, v, attn_mask, preds, out, lse, launched, state, window=None,
             layout: Optional[Layout] = None) -> "Optional[_SortedPlan]":
        """The plan of a recorded call (``layout``: the one it was given, read in place), or None where
        the recording cannot be replayed."""
        get = (lambda nm: getattr(preds, nm, None)) if preds is not None else (lambda nm: None)
        inputs = {"q": q, "k": k, "v": v, "mask": attn_mask, "q_val": get("q_valid"), "k_val": get("k_valid")}
        if layout is not None:
            if layout.window != window:
                return None
            inputs.update(q_perm=layout.q_perm, k_perm=layout.k_perm, lo=layout.lo, hi=layout.hi)
        present = [t.data_ptr() for t in inputs.values() if t is not None]
        if not launched or site is None or site.layout is None or len(set(present)) != len(present):
            return None  # (tensors at one address: which one a launch read is ambiguous)
        # pointers the forward does not read at this site: null (as a _ForwardPlan passes them)
        unread = set(_UNUSED_IN_FWD) | {nm for nm, t in (("Mask", site.mask_kind == MASK_NONE),
                                                          ("Pat", not site.spion_bs), ("Desc0", not launched[-1][2]),
                                                          ("Desc1", not launched[-1][2])) if t}
        unread |= {nm for nm, attr in _PRED_PARAMS if getattr(site, attr) is None}
        # the forward's seed word is the dropout's: replayed as recorded where it reads none (so that
        # the launch may join a CUDA graph with the layout's)
        seeds = {_attention_kernel: {"seed": "seed"}} if site.dropout else {}
        if isinstance(spec.policy, Drop) and layout is None:  # the draw's seed words: the call's
            seeds[_layout_mod._layout_hist] = {"q_seed": "q_seed", "k_seed": "k_seed"}
        outputs = {"out": out, "lse": lse}
        if site.kv_sorted:  # the sorted K/V copies: allocated per call (not kept with the layout in the workspace)
            outputs["k_sorted"], outputs["v_sorted"] = site.layout.kv
        try:
            replay = record.Replay(rec, inputs, outputs, seeds, {_attention_kernel: unread})
        except ValueError:
            return None
        fields = None
        if layout is None:
            fields = _layout_fields(replay, site.layout)
            if fields is None:
                return None
        return cls(spec, replay, fields, site.layout.window, launched[-1][0], state, layout is not None)

    def call(self, q, k, v, attn_mask, q_valid, k_valid, seed, q_aux=None, k_aux=None):
        """:meth:`run` for a call the op matched by its own key, or None where the plan does not hold now."""
        sw = _seed_word(seed)
        state = _state(sw)
        if state != self.state or not self.replay.open():
            return None
        return self.run(q, k, v, attn_mask, q_valid, k_valid, sw, state[2], q_aux=q_aux, k_aux=k_aux, seed=seed)

    def run(self, q, k, v, attn_mask, q_valid, k_valid, sw: int, device=None, q_aux=None, k_aux=None, seed=None):
        addresses = {"q": _ptr(q), "k": _ptr(k), "v": _ptr(v), "seed": sw}
        if self.draws:
            if seed is None:
                return None
            addresses["q_seed"], addresses["k_seed"] = draw_words(seed)
        if self.given:
            if q_aux is None or k_aux is None:
                return None
            lay = _layout_for(self.spec, q_aux, k_aux, self.window, lazy=True)
            if lay.window != self.window:
                return None
            if type(lay) is _LazyLayout:
                addresses["q_perm"], addresses["k_perm"], addresses["lo"], addresses["hi"] = lay.addresses()
            else:
                addresses.update(q_perm=_ptr(lay.q_perm), k_perm=_ptr(lay.k_perm), lo=_ptr(lay.lo), hi=_ptr(lay.hi))
        if attn_mask is not None:
            addresses["mask"] = _ptr(attn_mask)
        if q_valid is not None:
            addresses["q_val"] = _ptr(q_valid)
        if k_valid is not None:
            addresses["k_val"] = _ptr(k_valid)
        keep = cacheable(q.device)
        ws, outs = self.replay.run(addresses, device, graphs=keep and cugraph.usable(q.device))
        if not self.given and keep:
            try:  # the layout, for the backward of this call
                key = _derived_key(self.policy, q, k, seed)
            except RuntimeError:  # inference tensors: the backward derives it again
                key = None
            if key is not None:
                _put(_LAYOUT_CACHE, key, (weakref.ref(q), weakref.ref(k), _LazyLayout(ws, self.fields, self.window)),
                     _LAYOUT_CACHE_SIZE)
        last_configs["fwd"] = self.config
        return outs["out"], outs["lse"]


def attention_backward(spec: AttentionSpec, q, k, v, attn_mask, out, lse, grad_out, dropout_p: float = 0.0,
                       seed: int = 0, config: Optional[dict] = None, *, preds=None, q_aux=None, k_aux=None,
                       block_pattern=None, layout: Optional[Layout] = None, mods: Optional[Modifiers] = None):
    """``(dq, dk, dv)`` of :func:`attention_forward`'s ``out`` for ``grad_out``; for a spec with score
    modifiers ``(dq, dk, dv, dmods)``, ``dmods`` the :class:`Modifiers` of the gradients of ``mods``' tensors
    (None where absent; see :func:`mod_grads`). Such a spec runs the template (no Gluon kernel).

    By default the dense sites of ``configs.GLUON_BWD`` and the DFSS 2:4 sites of ``configs.GLUON_BWD_DFSS`` on
    sm_90 (:func:`_gluon_bwd`) run one launch of the warp-specialised Gluon kernel (``WS``: dK, dV, and dQ added
    by TMA reductions; DFSS: only where its one launch may run, else the template's backward). Otherwise two launches
    (dK/dV, then dQ; in Gluon or the template's), or with a ``DQ_ATOMIC`` configuration one: the dK/dV
    pass adds dQ into a float32 buffer with atomics (``DQ_ATOMIC=2``: one TMA bulk reduction per tile where
    the query rows are in order, else per-element atomics; the Gluon pass: TMA reductions). The atomics' order
    varies, so while PyTorch's deterministic algorithms are enabled (``torch.use_deterministic_algorithms``)
    such configurations are not candidates (:func:`.configs.bwd_candidates`) and a forced one (the Gluon
    default's too, and the Gluon kernels' wherever Triton lacks TMA reductions) runs the two-pass path.
    """
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    out, grad_out = _last_contiguous(out), _last_contiguous(grad_out)
    site = Site(spec, q, k, v, attn_mask, dropout_p, seed, preds, q_aux, k_aux, block_pattern, layout, mods=mods)
    B, Hq, Hk, Nq, Nk = site.B, site.Hq, site.Hk, site.Nq, site.Nk
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(v.shape, v.dtype, v.device)
    with_mods = bool(spec.modifiers())
    if Nq == 0 or Nk == 0 or B * Hq == 0:
        if with_mods:  # (no logit: zero gradients; delta = rowsum(dO * O) = 0 for the sinks')
            zeros = Modifiers(*(None if t is None else torch.zeros_like(t) for t in (mods or Modifiers())))
            return dq.zero_(), dk.zero_(), dv.zero_(), zeros
        return dq.zero_(), dk.zero_(), dv.zero_()
    gluon = _gluon_bwd(spec, q, k, v, attn_mask, dropout_p, preds, block_pattern, layout, grad_out, config)
    if gluon is not None:
        config = gluon[0]
    delta = _empty((B, Hq, Nq), torch.float32, q.device)
    lse2 = _empty((B, Hq, Nq), torch.float32, q.device)
    lse = lse.contiguous()

    pre_bm = 16 if configs.interpret_mode() else 64
    _bwd_preprocess[(_cdiv(Nq, pre_bm), B * Hq)](
        out, grad_out, lse, delta, lse2, *out.stride()[:3], *grad_out.stride()[:3],
        Hq, Nq, HEAD_DV=site.Dv, BLOCK_DV=site.block_dv, BLOCK_M=pre_bm,
        num_warps=1 if configs.interpret_mode() else 4,
    )
    tensors = (q, k, v, out, grad_out, lse2, delta, dq, dk, dv)
    strides = _strides(q, k, v, None, grad_out, dq, dk, dv)
    scalars = (Hq, Nq, Nk, site.scale * LOG2E, site.scale, site.seed_word, site.dropout_p, site.inv_keep)
    grads = {}  # the modifiers' gradient buffers of the dK/dV launch that ran

    def dkdv_mods(bn):
        """The modifier arguments of a dK/dV launch with ``bn``-key tiles, its gradient buffers allocated."""
        if not with_mods:
            return site.mod_args()
        grads["slopes"] = _empty((B, Hq, _cdiv(Nk, bn)), torch.float32, q.device) if site.alibi else None
        grads["lut"] = torch.zeros(site.lut.shape, dtype=torch.float32, device=q.device) if site.rel else None
        return site.mod_args(grads["slopes"], grads["lut"])

    def launch(cfg):
        bm, bn, w, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
        if gluon is not None:  # a Gluon backward (hopper_bwd; dk and dv are contiguous)
            hb, (causal, off, nm24) = _gluon_bwd_module(), gluon[1:]
            one_launch = hb.FUSED_DQ and not torch.are_deterministic_algorithms_enabled()
            if cfg.get("WS") and one_launch:  # (the warp-specialised kernel: dK, dV and dQ in one launch; DFSS too)
                dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                hb.backward_ws(q, k, v, grad_out, lse2, delta, dk, dv, dq32, site.scale, causal, off, cfg["WS"], nm24)
                dq.copy_(dq32)
                return
            if nm24:  # (_gluon_bwd hands DFSS over only where the one launch runs: the passes have no selection)
                raise RuntimeError("the Gluon backward passes cannot run DFSS")
            if cfg.get("DQ_ATOMIC") and one_launch:
                # (dQ added in the pass: one launch; a Triton whose Gluon builds no TMA reductions runs two)
                dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                hb.dkdv(q, k, v, grad_out, lse2, delta, dk, dv, site.scale, causal, off, cfg, dq32)
                dq.copy_(dq32)
                return
            hb.dkdv(q, k, v, grad_out, lse2, delta, dk, dv, site.scale, causal, off, cfg)
            if cfg.get("DQ_GLUON"):  # (the dQ pass in Gluon too: [queries, keys, ring slots])
                hb.dq_pass(q, k, v, grad_out, lse2, delta, dq, site.scale, causal, off, cfg["DQ_GLUON"])
            else:
                _dq_pass(cfg, bn, bm, w, st)
            return
        # orientation of the dK/dV tiles: queries by keys for a row-wise selection, else keys by queries
        natural = bool(cfg.get("NATURAL", site.policy == POLICY_DFSS))
        lst, cnt = site.lists(bm, bn, False)
        qd, dod, tma = site.q_descriptors(cfg, bm, q, grad_out)
        if cfg.get("DQ_ATOMIC") and not torch.are_deterministic_algorithms_enabled():
            # dQ in the dK/dV pass: float32 atomics into a zeroed buffer (rows no tile visits stay 0);
            # DQ_ATOMIC=2: one TMA bulk reduction per tile, where the query rows are in order
            dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dq_arg, mode = site.dq_target(cfg, bm, dq32)
            _attention_kernel[(_cdiv(Nk, bn), B * Hk)](
                *tensors[:7], dq_arg, dk, dv, qd, dod, *_strides(q, k, v, None, grad_out, dq32, dk, dv),
                *site.pred_args(lst, cnt), *scalars, *dkdv_mods(bn),
                BLOCK_M=bm, BLOCK_N=bn, MODE=MODE_DKDV, NATURAL=natural, num_warps=w, num_stages=st, DQ_ATOMIC=mode,
                TMA=tma, **site.meta(bm, bn, False),
            )
            dq.copy_(dq32)
            return
        _attention_kernel[(_cdiv(Nk, bn), B * Hk)](
            *tensors, qd, dod, *strides, *site.pred_args(lst, cnt), *scalars, *dkdv_mods(bn),
            BLOCK_M=bm, BLOCK_N=bn, MODE=MODE_DKDV, NATURAL=natural, num_warps=w, num_stages=st, TMA=tma,
            **site.meta(bm, bn, False),
        )
        _dq_pass(cfg, bn, bm, w, st)

    def _dq_pass(cfg, bn, bm, w, st):
        # dQ: its own tiles when the config names them ("DQ": [queries, keys, warps, stages]),
        # else the dK/dV shape transposed (large query tile, small key tile)
        qm, qn, qw, qs = cfg.get("DQ") or (bn, bm, w, st)
        lst, cnt = site.lists(qm, qn, True)
        kd, vd, tma = site.kv_descriptors(cfg, qn)
        _attention_kernel[(_cdiv(Nq, qm), B * Hq)](
            *tensors, kd, vd, *strides, *site.pred_args(lst, cnt), *scalars, *site.mod_args(),
            BLOCK_M=qm, BLOCK_N=qn, MODE=MODE_DQ, NATURAL=False, num_warps=qw, num_stages=qs, TMA=tma,
            **site.meta(qm, qn),
        )

    _run_tuned("bwd", site, launch, configs.bwd_candidates, config)
    if with_mods:
        return dq, dk, dv, mod_grads(spec, mods or Modifiers(), lse, delta, grads.get("slopes"), grads.get("lut"))
    return dq, dk, dv


def _run_tuned(kind: str, site: Site, launch, candidates_fn, config: Optional[dict] = None) -> None:
    """Launch with ``config``, or with the remembered/tuned one for this call signature."""
    if config is None:
        # deterministic mode changes the backward's candidates (no DQ_ATOMIC): part of the key
        sig = (kind, configs.tuning_enabled(), torch.are_deterministic_algorithms_enabled()) + site.signature()
        config = _config_memo.get(sig)
        if config is not None:
            launch(config)
        else:
            rec = record.active()
            if rec is not None:  # a choice measured now launches candidates a replay must not repeat
                rec.spoil("the launch configuration was chosen during the call")
            cands = candidates_fn(site.D, site.Dv, site.dtype, site.nm_m, site.spion_bs, configs.gpu_tag(site.device),
                                  site.win_right is not None, site.tag)
            config = configs.choose(f"triton_attention_{kind}", site.tune_key(), cands,
                                    _bencher(launch) if site.device.type == "cuda" else None)
            # last resort: the smallest tiles that hold whole N:M groups, one pipeline stage
            b = max(32, 4 * site.nm_m)
            small = {"BLOCK_M": b, "BLOCK_N": b, "num_warps": 4, "num_stages": 1}
            config = _config_memo[sig] = _launch_with_fallback(launch, config, cands + [small])
    else:
        launch(config)
    last_configs[kind] = config


def _launch_with_fallback(launch, config, candidates):
    """Launch ``config``; if the GPU lacks the shared memory or registers it needs (an attention
    mask adds its own pipelined tiles), take the next candidate instead. Returns the config used."""
    order = [config] + [c for c in candidates if c != config]
    for i, cfg in enumerate(order):
        try:
            launch(cfg)
            return cfg
        except OutOfResources:
            if i == len(order) - 1:
                raise
    return config


def _bencher(launch):
    def bench(cfg) -> float:
        from triton.testing import do_bench

        return float(do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median"))

    return bench


# Tile lists of recent SPION patterns (see Site._pattern_key), least recently used first.
_LIST_CACHE: "OrderedDict" = OrderedDict()
_LIST_CACHE_SIZE = 96


# A few recent layouts, so that the backward of a call (which gets the same bucket/keep tensors)
# does not sort again. Keyed by the tensors' identity *and* version; the entry holds the tensors,
# so their memory cannot be reused by others while cached.
_LAYOUT_CACHE: dict = {}
_LAYOUT_CACHE_SIZE = 4


def _tensor_key(t: torch.Tensor):
    return (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def _sort_aux(spec: AttentionSpec, q_aux, k_aux, window=None) -> Layout:
    """The layout of given policy tensors: bucket ids that attncomp derived itself lie in a known
    range (:func:`attncomp.ops.bucket_range`), so they take the counting sort; other ids (a caller's,
    of any range) ``torch.sort``. The counting sort cuts the ranges to ``window``."""
    if isinstance(spec.policy, Hash):
        n = bucket_range(q_aux)
        if n is not None and bucket_range(k_aux) == n:
            return counting_layout(q_aux, k_aux, n, kind=GK_IDS, q_shape=tuple(q_aux.shape),
                                   k_shape=tuple(k_aux.shape), window=window)
    return layout_from_aux(spec, q_aux, k_aux, window)


def _layout_for(spec: AttentionSpec, q_aux, k_aux, window=None, lazy: bool = False) -> Layout:
    """The layout of given policy tensors: remembered (a draw's, or an earlier call's), else sorted.
    ``lazy``: a remembered :class:`_LazyLayout` is returned as it is (no views made)."""
    try:
        key = (spec.policy.name, _tensor_key(q_aux), _tensor_key(k_aux))
    except RuntimeError:  # inference tensors track no version: nothing to key a cache on
        return _sort_aux(spec, q_aux, k_aux, window)
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None and hit[0] is q_aux and hit[1] is k_aux:
        lay = hit[2]
        return lay.get() if type(lay) is _LazyLayout and not lazy else lay
    lay = _sort_aux(spec, q_aux, k_aux, window)
    _remember(key, (q_aux, k_aux, lay))
    return lay


def _remember(key, entry, device=None) -> None:
    """Keep a layout for the backward of the same call (not one made where no tensor may be cached:
    :func:`...codegen.reference.cacheable`)."""
    if cacheable(entry[2].lo.device if device is None else device):
        _put(_LAYOUT_CACHE, key, entry, _LAYOUT_CACHE_SIZE)


def _derived_key(policy, q: torch.Tensor, k: torch.Tensor, seed: Optional[int] = None) -> tuple:
    """The cache key of the layout derived from q and k (and for ``drop`` the call's ``seed``): the
    tensors' identity, version and view (the entry's weak references confirm the identity; raises
    RuntimeError for inference tensors)."""
    return ("derived", policy, id(q), q._version, q.shape, q.stride(), id(k), k._version, k.shape, k.stride(),
            seed if isinstance(policy, Drop) else None)


class _LazyLayout:
    """A layout whose tensors lie in a replayed plan's workspace (:class:`_SortedPlan`): views made
    when a backward asks for them."""

    __slots__ = ("ws", "fields", "window", "device", "_layout")

    def __init__(self, ws: torch.Tensor, fields: tuple, window):
        self.ws, self.fields, self.window, self.device, self._layout = ws, fields, window, ws.device, None

    def get(self) -> Layout:
        if self._layout is None:
            self._layout = Layout(*(record.workspace_view(self.ws, *f) for f in self.fields), window=self.window)
        return self._layout

    def addresses(self) -> tuple:
        """The addresses of ``q_perm``, ``k_perm``, ``lo``, ``hi``, without making views."""
        base = self.ws.data_ptr()
        return tuple(base + f[0] for f in self.fields[:4])


def _derived_for(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, window=None,
                 seed: Optional[int] = None, kv: Optional[tuple] = None) -> Layout:
    """:func:`.layout.derive_layout` of q and k (``drop``: keep draws of the call's ``seed``),
    remembered for the backward of the same call (which gets the same q, k and seed): keyed by the
    tensors' identity and version and the seed, held by weak reference (the cache keeps no q or k
    alive). A remembered layout of another window is cut by the caller. A call being recorded
    (:mod:`.record`) derives it: its plan must hold the launches. ``kv``: ``drop``'s ``(k, v)``, whose
    kept rows a derivation copies (``Layout.kv``; a remembered layout has none: the backward reads
    none, and the cache keeps no copy alive; so a call that asks for copies derives afresh)."""
    try:
        key = _derived_key(spec.policy, q, k, seed)
    except RuntimeError:  # inference tensors: no cache
        return derive_layout(spec, q, k, seed=seed, window=window, kv=kv)
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None and hit[0]() is q and hit[1]() is k and record.active() is None and kv is None:
        lay = hit[2]
        return lay.get() if type(lay) is _LazyLayout else lay
    lay = derive_layout(spec, q, k, seed=seed, window=window, kv=kv)
    _remember(key, (weakref.ref(q), weakref.ref(k), lay if lay.kv is None else lay._replace(kv=None)))
    return lay


def draw_keep(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, seed: Optional[int] = None):
    """``drop``'s keep masks ``(q_keep, k_keep)`` (bool, as :func:`attncomp.ops.materialize_aux`
    draws them from ``seed``), drawn by the counting sort's kernels (:func:`.layout.derive_layout`),
    whose layout is remembered for the attention calls that get these masks: the forward and
    backward of the site then sort nothing. The layout's ranges are cut to the window of the spec's
    bounds around default positions, which the site uses unless it has position tensors.

    Repeats of a draw (same spec object, signature of q and k, classes of the two seed words) replay
    the recorded launches of one (:class:`_DrawPlan`), as :class:`_SortedPlan` does for a forward."""
    s = spec.policy.seed if seed is None else seed
    words = draw_words(s)
    key = None
    if _attention_kernel.short_path_open() and cacheable(q.device):
        key = ("draw", id(spec), call_signature(q, k, k, None, None, 0.0), _state(words[0]), words[1] == 1,
               words[1] & 15 == 0)
        plan = _PLANS.get(key)
        if plan is not None:
            if plan.replay.open():
                return plan.run(q, k, words)
            key = None  # (a launch hook is installed: no replay, and no recording either)
        elif key not in _SEEN:
            _put(_SEEN, key, True, _MAX_PLANS)
            key = None
    if key is None:
        return _draw(spec, q, k, seed)[:2]
    with record.record() as rec:
        q_keep, k_keep, lay = _draw(spec, q, k, seed)
    plan = _DrawPlan.make(spec, rec, q, k, q_keep, k_keep, lay)
    if plan is not None:
        _put(_PLANS, key, plan, _MAX_PLANS)
    return q_keep, k_keep


def _draw(spec: AttentionSpec, q, k, seed):
    q_keep = torch.empty(q.shape[:3], dtype=torch.bool, device=q.device)
    k_keep = torch.empty(k.shape[:3], dtype=torch.bool, device=k.device)
    lay = derive_layout(spec, q, k, seed=seed, window=spec_window(spec, q.shape[2], k.shape[2]), keep=(q_keep, k_keep))
    _remember_keep(spec, q_keep, k_keep, lay, q.device)
    return q_keep, k_keep, lay


def _remember_keep(spec: AttentionSpec, q_keep, k_keep, lay, device) -> None:
    try:
        key = (spec.policy.name, _tensor_key(q_keep), _tensor_key(k_keep))
    except RuntimeError:  # inference tensors: the site sorts the masks itself
        return
    _remember(key, (q_keep, k_keep, lay), device)


class _DrawPlan:
    """Keep draws of ``drop`` with their sorted layout (:func:`draw_keep`), kept as the recorded
    launches of one draw: the counting sort's three launches, writing the masks too."""

    def __init__(self, spec, replay: "record.Replay", fields, window):
        self.spec, self.replay, self.fields, self.window = spec, replay, fields, window

    @classmethod
    def make(cls, spec, rec, q, k, q_keep, k_keep, lay) -> "Optional[_DrawPlan]":
        seeds = {"q_seed": "q_seed", "k_seed": "k_seed"}
        try:
            replay = record.Replay(rec, {"q": q, "k": k} if q.data_ptr() != k.data_ptr() else {"q": q},
                                   {"q_keep": q_keep, "k_keep": k_keep}, {_layout_mod._layout_hist: seeds})
        except ValueError:
            return None
        fields = _layout_fields(replay, lay)
        return None if fields is None else cls(spec, replay, fields, lay.window)

    def run(self, q, k, words):
        ws, outs = self.replay.run({"q": _ptr(q), "k": _ptr(k), "q_seed": words[0], "k_seed": words[1]})
        q_keep, k_keep = outs["q_keep"], outs["k_keep"]
        _remember_keep(self.spec, q_keep, k_keep, _LazyLayout(ws, self.fields, self.window), ws.device)
        return q_keep, k_keep


def _layout_fields(replay: "record.Replay", lay: Layout):
    """Where the replay's workspace holds the layout's tensors (``record.Replay.buffer``), or None."""
    fields = tuple(replay.buffer(t) for t in (lay.q_perm, lay.k_perm, lay.lo, lay.hi, lay.q_groups, lay.k_groups))
    return None if any(f is None for f in fields) else fields


def spec_window(spec: AttentionSpec, Nq: int, Nk: int):
    """``(off, left, right)``: the position window of the spec's bounds around default positions
    (query ``i`` at ``i + off``), ``None`` without bounds."""
    left, right = _bounds(spec)
    if left is None and right is None:
        return None
    return (_pos_off(spec, Nq, Nk), left, right)


def _pos_off(spec: AttentionSpec, Nq: int, Nk: int) -> int:
    """The default position of query 0 (key ``j`` is at ``j``): ``Nk - Nq`` when causal bounds align
    bottom-right, else 0."""
    return Nk - Nq if getattr(spec, "causal_align", "top_left") == "bottom_right" else 0


class TritonBackend:
    """Fused Triton kernels (forward and backward) of the one template for every policy and predicate."""

    name = "triton"
    #: the score modifiers (DESIGN.md §4.2) its kernels apply, forward and backward, in registers (the template's;
    #: the Gluon Hopper kernels decline such sites)
    modifiers: tuple = ("alibi", "relative bias", "softcap", "sinks")
    #: handed no hash buckets (compiled graphs pass none), the kernels derive them fused with the sort
    #: (:func:`.layout.derive_layout`); the backward of the call reuses that layout (or derives it again
    #: when it is gone); the op derives buckets for other backends
    derives_aux = True

    def supports(self, spec: AttentionSpec, q: torch.Tensor, preds=None) -> Optional[str]:
        pol = spec.policy.name
        if pol not in _POLICIES:
            return f"policy {pol!r} has no Triton kernel (Triton runs: {', '.join(sorted(_POLICIES))})"
        if spec.modifiers():
            reason = spec.modifiers_missing(self.modifiers, "Triton")
            if reason is not None:
                return reason
        if not (q.is_cuda or configs.interpret_mode()):
            return f"needs CUDA tensors (got {q.device.type}; TRITON_INTERPRET=1 runs it on the CPU)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (float16, bfloat16, float32)"
        if q.dim() != 4:
            return f"expects (B, H, N, D) inputs, got {q.dim()} dims"
        if q.shape[-1] > _MAX_HEAD_DIM:
            return f"head dim {q.shape[-1]} > {_MAX_HEAD_DIM}"
        if spec.head_dim is not None and spec.head_dim > _MAX_HEAD_DIM:
            return f"head dim {spec.head_dim} > {_MAX_HEAD_DIM}"
        return None

    def forward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed, preds=None,
                mods=None):
        return attention_forward(spec, q, k, v, attn_mask, dropout_p, seed, preds=preds, q_aux=q_aux, k_aux=k_aux,
                                 block_pattern=block_pattern, check=functools.partial(self._check, spec, q, k, v, preds),
                                 mods=mods)

    def backward(self, spec, q, k, v, attn_mask, q_aux, k_aux, block_pattern, dropout_p, seed,
                 out, lse, grad_out, need_mask_grad=False, preds=None, mods=None):
        """``(dq, dk, dv, dmask | None)``; for a spec with score modifiers a fifth element, the
        :class:`Modifiers` of their gradients (as ``ReferenceBackend.backward``)."""
        # the mask gradient (a full B x H x Nq x Nk tensor) is left to the caller's fallback
        self._check(spec, q, k, v, preds)
        res = attention_backward(spec, q, k, v, attn_mask, out, lse, grad_out, dropout_p, seed, preds=preds,
                                 q_aux=q_aux, k_aux=k_aux, block_pattern=block_pattern, mods=mods)
        return (*res[:3], None, *res[3:])

    @staticmethod
    def taken_plan():
        """The launch plan that this thread's latest forward took or built, for the tensors as given
        (None where it took none): the op keeps it for its repeats (``ops._CALLS``)."""
        plan, _TAKEN.plan = getattr(_TAKEN, "plan", None), None
        return plan

    def draw_keep(self, spec, q, k, seed=None):
        """``drop``'s keep masks for a compiled site (``attncomp::policy_aux``), drawn with the sort
        that the site's calls then reuse (:func:`draw_keep`)."""
        return draw_keep(spec, q, k, seed)

    def _check(self, spec, q, k, v, preds=None) -> None:
        reason = self.supports(spec, q, preds)
        if reason is None and max(k.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
            reason = f"head dim {max(k.shape[-1], v.shape[-1])} > {_MAX_HEAD_DIM}"
        if reason is not None:
            raise RuntimeError(f"Triton backend cannot run this site ({spec.describe()}): {reason}")
