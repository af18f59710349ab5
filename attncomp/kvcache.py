"""Per-key state of a sparse policy kept in a transformers KV cache (DESIGN §6, Generation).

``hash`` keeps a key when its bucket equals the query's, and a key's bucket depends on the key's vector alone
(:func:`attncomp.policy.lsh_side`). A decoding step that derived the buckets of every cached key again would read
the whole cache to attend to a sixteenth of it. Here each layer of a transformers cache keeps its keys' buckets
beside its keys, ``(B, Hk, N)`` int32 in :data:`BUCKETS_ATTR`, computed once when a key is appended
(``attncomp::lsh`` on the appended keys, inside the captured graph) and moved with the keys by every method that
moves them (beam reordering, cropping, batch selection and repetition, reset, offloading).

:func:`keep_key_buckets` swaps the class of each layer it knows (transformers' ``DynamicLayer`` and
``StaticLayer``, exactly those) for a subclass that does this; it leaves every other kind of layer as it is (a
window layer drops and shifts keys, a quantized one stores them otherwise), whose sites keep deriving the buckets
inside the op. :mod:`attncomp.passes.sparsify` finds the buckets a site's keys come with in the graph (the same
appended keys go to the keys and, through ``attncomp::lsh``, to the buckets, in the same way) and gives them to the
op; the decode kernels then read only the keys in a query's bucket.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import torch

from . import ops
from .policy import Hash, lsh_side

__all__ = ["BUCKETS_ATTR", "keep_key_buckets", "keeps_buckets"]

#: the attribute of a cache layer that holds its keys' buckets
BUCKETS_ATTR = "attncomp_key_buckets"


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _up(layer):
    """The layer's methods as transformers defines them (the swapped class's base, see :func:`_subclass`)."""
    return super(type(layer), layer)


class _Buckets:
    """What the dynamic and static variants share: the policy's LSH and the moves of the buckets with the keys."""

    __slots__ = ()  # (a layer's class is swapped in place: the layouts must agree)

    #: ``(n_buckets, seed)`` of the policy (set on each created subclass)
    attncomp_lsh: Tuple[int, int] = (0, 0)

    def _buckets_of(self, keys: torch.Tensor) -> torch.Tensor:
        n, seed = self.attncomp_lsh
        return ops.lsh(keys, keys.shape[1], n, seed)

    def _all_buckets(self) -> None:
        """The buckets of every key the layer holds (a layer that held keys before it kept buckets)."""
        n, seed = self.attncomp_lsh
        keys = self.keys
        if keys is None or keys.dim() != 4:
            setattr(self, BUCKETS_ATTR, torch.zeros(0, dtype=torch.int32, device=getattr(keys, "device", None)))
        else:
            setattr(self, BUCKETS_ATTR, lsh_side(keys, keys.shape[1], n, seed))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        kb = getattr(self, BUCKETS_ATTR)
        if self.get_seq_length() > 0:
            setattr(self, BUCKETS_ATTR, kb.index_select(0, beam_idx.to(kb.device)))
        _up(self).reorder_cache(beam_idx)

    def reset(self) -> None:
        _up(self).reset()
        if self.is_initialized:
            getattr(self, BUCKETS_ATTR).zero_()  # zero keys' bucket (lsh_side of a zero vector is bucket 0)

    def offload(self):
        _up(self).offload()
        if self.is_initialized:
            setattr(self, BUCKETS_ATTR, getattr(self, BUCKETS_ATTR).to("cpu", non_blocking=True))

    def prefetch(self):
        _up(self).prefetch()
        kb = getattr(self, BUCKETS_ATTR, None)
        if self.is_initialized and kb is not None and kb.device != self.keys.device:
            setattr(self, BUCKETS_ATTR, kb.to(self.keys.device, non_blocking=True))


class _DynamicBuckets:
    """A ``DynamicLayer`` (keys concatenated per update) that concatenates its keys' buckets alike."""

    __slots__ = ()

    def lazy_initialization(self, key_states, value_states) -> None:
        _up(self).lazy_initialization(key_states, value_states)
        setattr(self, BUCKETS_ATTR, torch.tensor([], dtype=torch.int32, device=self.device))

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = _up(self).update(key_states, value_states, *args, **kwargs)
        setattr(self, BUCKETS_ATTR, torch.cat([getattr(self, BUCKETS_ATTR), self._buckets_of(key_states)], dim=-1))
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        _up(self).crop(tokens_to_remove)
        setattr(self, BUCKETS_ATTR, getattr(self, BUCKETS_ATTR)[..., : self.get_seq_length()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        _up(self).batch_repeat_interleave(repeats)
        if self.get_seq_length() > 0:
            setattr(self, BUCKETS_ATTR, getattr(self, BUCKETS_ATTR).repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _up(self).batch_select_indices(indices)
        if self.get_seq_length() > 0:
            setattr(self, BUCKETS_ATTR, getattr(self, BUCKETS_ATTR)[indices, ...])


class _StaticBuckets:
    """A ``StaticLayer`` (keys written in place at the cache's positions) that writes its keys' buckets alike, into
    a buffer of a fixed address (CUDA graphs replay the decoding steps that write it)."""

    __slots__ = ()

    def lazy_initialization(self, key_states, value_states) -> None:
        _up(self).lazy_initialization(key_states, value_states)
        kb = torch.zeros(self.keys.shape[:3], dtype=torch.int32, device=self.device)
        if not _compiling():
            torch._dynamo.mark_static_address(kb)
        setattr(self, BUCKETS_ATTR, kb)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # the positions the layer writes (it advances its length in place as it writes)
        pos = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        keys, values = _up(self).update(key_states, value_states, *args, **kwargs)
        getattr(self, BUCKETS_ATTR).index_copy_(2, pos, self._buckets_of(key_states))
        return keys, values


@functools.lru_cache(maxsize=None)
def _subclass(base: type, n_buckets: int, seed: int) -> type:
    """``base`` with the methods of :class:`_Buckets` and of its variant. They are the new class's own (its first
    base is ``base``, whose instance layout it keeps: Python swaps an object's class only between equal layouts)
    and reach ``base``'s through :func:`_up`."""
    variant = _StaticBuckets if base.__name__ == "StaticLayer" else _DynamicBuckets
    body = {"__slots__": (), "attncomp_lsh": (n_buckets, seed), "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__doc__": variant.__doc__}
    for part in (_Buckets, variant):
        body.update((k, v) for k, v in vars(part).items() if callable(v) and not k.startswith("__"))
    return type(base.__name__, (base, _Buckets), body)


def _kinds() -> Tuple[type, ...]:
    from transformers import cache_utils as cu

    return cu.DynamicLayer, cu.StaticLayer


def keeps_buckets(layer) -> bool:
    """Whether a cache layer keeps its keys' buckets (swapped by :func:`keep_key_buckets`)."""
    return isinstance(layer, _Buckets)


def keep_key_buckets(cache, policy: Hash) -> Tuple[List[int], List[Tuple[int, str]]]:
    """Make the layers of a transformers KV cache keep their keys' ``hash`` buckets (see the module docstring).
    Returns the indices of the layers that keep them (swapped now or before) and ``(index, kind)`` of those left as
    they are. A cache that builds its layers as it goes (``layer_class_to_replicate``) builds bucket-keeping ones.
    Does nothing for anything but a transformers cache."""
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list):
        return [], []
    try:
        kinds = _kinds()
    except ImportError:
        return [], []
    kept, left = [], []
    for i, layer in enumerate(layers):
        if isinstance(layer, _Buckets):
            if layer.attncomp_lsh == (policy.n_buckets, policy.seed):
                kept.append(i)
            else:
                left.append((i, "keeps the buckets of another hash policy"))
            continue
        kind = type(layer)
        if kind not in kinds:
            left.append((i, kind.__name__))
            continue
        layer.__class__ = _subclass(kind, policy.n_buckets, policy.seed)
        if layer.is_initialized:
            layer._all_buckets()
            kb = getattr(layer, BUCKETS_ATTR)
            if kind.__name__ == "StaticLayer" and not _compiling():
                torch._dynamo.mark_static_address(kb)
        kept.append(i)
    rep = getattr(inner, "layer_class_to_replicate", None)
    if rep in kinds:
        inner.layer_class_to_replicate = _subclass(rep, policy.n_buckets, policy.seed)
    return kept, left
