"""Counts the attention calls of one eager forward without attncomp's matcher.

A call is counted when the model calls ``F.scaled_dot_product_attention`` or flex attention, or when it
takes a softmax over the last dim of a tensor of 3 or more dims that is attention's ``softmax(QK^T) V``:

- its input derives from a product of two tensors (``matmul``, ``@``, ``bmm``, ``baddbmm``, ``einsum``: the
  logits ``QK^T``) through ops that keep the logits' entries (scaling, masks and biases, casts, views, slices,
  pads, concatenation with a learned sink's column, and writes into another tensor as Longformer copies its
  diagonals);
- its result (directly, or through ops that keep its number of elements: dropout, casts, views, masking; or
  slices of it) is an operand of such a product (``AV``).

The second condition keeps out the softmaxes that are not attention and feed no product (MoE routers, gates,
the final vocabulary softmax of a sampler); the first those that feed a product but whose logits are a
projection of one tensor by weights (``F.linear``), not a product of two: the stream-mixing matrices of
hyper-connections (DeepSeek-V4), a weighted pooling.
"""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_SOFTMAX = {"softmax", "_softmax"}
_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"}
_FLEX = {"flex_attention"}
# a slice of the probabilities (a learned sink's column dropped after the softmax) stays attention
_SLICE = {"__getitem__", "narrow"}
# a padded or strided view of the probabilities (chunked sliding windows) stays attention
_RESHAPE = {"pad", "as_strided", "unfold"}
# logits joined with others (a learned sink's column, several blocks of keys) stay logits
_JOIN = {"cat", "concat", "concatenate"}
# a projection by weights makes new values, not logits
_PROJECT = {"linear", "bilinear", "conv1d", "conv2d", "embedding"}
# writes into their first operand
_WRITE = {"__setitem__", "copy_", "index_copy_", "masked_scatter_", "scatter_"}
_SCORES = -1  # the origin of logits


def _softmax_dim(args, kwargs):
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 and isinstance(args[1], int) else None


def _keeps(name: str, out: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``out`` (of op ``name`` on ``t``) holds ``t``'s entries, changed only entry by entry."""
    return out.numel() == t.numel() or (name in _SLICE and out.numel() <= t.numel()) or name in _RESHAPE


class AttentionCounter(TorchFunctionMode):
    """``with AttentionCounter() as c: model(**x)``; then ``c.calls`` is the number of attention calls
    (``c.sdpa``, ``c.softmax``, ``c.flex`` by kind)."""

    def __init__(self):
        super().__init__()
        self.sdpa = 0
        self.flex = 0
        self._softmax_outputs = 0
        self._attending = set()
        # id(tensor) -> (weak reference, index of the softmax it derives from, or _SCORES for logits)
        self._tracked: Dict[int, Tuple[weakref.ref, int]] = {}

    @property
    def softmax(self) -> int:
        return len(self._attending)

    @property
    def calls(self) -> int:
        return self.sdpa + self.flex + self.softmax

    def _origin(self, t):
        entry = self._tracked.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def _track(self, t, origin):
        self._tracked[id(t)] = (weakref.ref(t), origin)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            self.sdpa += 1
            return out
        if name in _FLEX:
            self.flex += 1
            return out
        if name in _SOFTMAX:
            x = args[0] if args else kwargs.get("input")
            dim = _softmax_dim(args, kwargs)
            if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() >= 3 and dim is not None \
                    and dim in (-1, x.dim() - 1) and self._origin(x) == _SCORES:
                self._track(out, self._softmax_outputs)
                self._softmax_outputs += 1
            return out
        flat, _ = tree_flatten((args, kwargs))
        operands = [t for t in flat if isinstance(t, torch.Tensor)]
        if name in _MATMUL:
            self._attending.update(o for t in operands for o in [self._origin(t)] if o is not None and o >= 0)
            if isinstance(out, torch.Tensor) and len(operands) >= 2:
                self._track(out, _SCORES)
            return out
        origins = [(o, t) for t in operands for o in [self._origin(t)] if o is not None]
        if name in _WRITE and operands and self._origin(operands[0]) is None:
            # logits written into a tensor (Longformer's diagonals copied into new_zeros): it holds logits
            o = next((o for o, t in origins if o == _SCORES and t is not operands[0]), None)
            if o is not None:
                self._track(operands[0], o)
                return out
        if name in _PROJECT or not isinstance(out, torch.Tensor):
            return out
        # probabilities first: a sum of probabilities and logits is not logits
        for o, t in sorted(origins, key=lambda ot: ot[0] == _SCORES):
            if _keeps(name, out, t) or (o == _SCORES and name in _JOIN):
                self._track(out, o)
                break
        return out
