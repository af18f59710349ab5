"""Choose the backend that runs a spec on given tensors, per call.

``auto``: on CUDA tensors with Triton importable and supporting the spec, the sequence-length rule
below picks the fused (flash-style, on-the-fly) Triton kernel or the split form; elsewhere the
reference backend. A named backend is used as asked; if it cannot run the spec, a clear error says
why (nothing silently falls back to different numerics).

Sequence-length rule (E.T. §3.2). The fused kernel re-reads K and V once per query tile; past some
key length the split form (separate ``QK^T`` GEMM, softmax, ``AV`` GEMM, materialising the scores:
the reference backend, whose matmuls run on cuBLAS) is faster. The crossover depends on the policy,
head dim, dtype and GPU, so it is measured, stored by the runtime's autotune store under
``autotune.lookup(SEQ_RULE, {"policy", "head_dim", "dtype", "arch"})`` (:func:`seq_rule_key`; the
store adds library versions and the GPU) and applied per call with the call's key length ``Nk``:

* no stored value: fused for every ``Nk`` (the kernel needs no measurement to be correct);
* ``{"split_above": T}``: fused when ``Nk <= T``, split when ``Nk > T``;
* ``{"timings": [{"n": N, "fused": ms, "split": ms}, ...]}``: ``T`` is the largest measured ``N``
  below the first one where the split form was faster (fused everywhere if it never was);
* optional ``"fused"``/``"split"`` name the backends (default ``"triton"``/``"reference"``); a split
  backend that cannot run the spec falls back to the fused one (both are exact).

Both forms compute the same function to within their dtype's rounding (the Triton kernels' float32
dot runs as tf32); only speed differs.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Dict, Optional, Tuple

import torch

from ..codegen import get_backend
from ..spec import AttentionSpec, dtype_name

log = logging.getLogger(__name__)

__all__ = ["select_backend", "triton_available", "SEQ_RULE", "seq_rule_key", "seq_rule", "choose_form",
           "describe_rule", "record_seq_rule", "clear_rule_cache"]

#: autotune-store name under which sequence-length rules are kept
SEQ_RULE = "seq_len_rule"

_rule_cache: Dict[tuple, Optional[Dict[str, Any]]] = {}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def seq_rule_key(policy: str, head_dim: int, dtype, arch: str) -> Dict[str, Any]:
    """The store key of a sequence-length rule (the store adds library versions and the GPU)."""
    dt = dtype if isinstance(dtype, str) or dtype is None else dtype_name(dtype)
    return {"policy": policy, "head_dim": int(head_dim), "dtype": dt, "arch": arch}


def _memo_key(key: Dict[str, Any]) -> tuple:
    # the store lives under $ATTNCOMP_CACHE_DIR: a different directory is a different store
    return (os.environ.get("ATTNCOMP_CACHE_DIR", ""),) + tuple(sorted(key.items()))


def _autotune_lookup(name: str, key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    try:
        from . import autotune
    except ImportError:
        return None
    try:
        return autotune.lookup(name, key)
    except Exception as e:  # a damaged store never breaks a call: the fused kernel is always correct
        log.warning("attncomp: could not read the sequence-length rule %s: %s", key, e)
        return None


def seq_rule(policy: str, head_dim: int, dtype, arch: str) -> Optional[Dict[str, Any]]:
    """The stored rule for (policy, D, dtype, arch), normalised to ``{"split_above": T, ...}`` or None."""
    key = seq_rule_key(policy, head_dim, dtype, arch)
    mk = _memo_key(key)
    if mk not in _rule_cache:
        _rule_cache[mk] = _normalise(_autotune_lookup(SEQ_RULE, key))
    return _rule_cache[mk]


def clear_rule_cache() -> None:
    _rule_cache.clear()


def _normalise(value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not value:
        return None
    rule = {k: value[k] for k in ("fused", "split") if k in value}
    if value.get("split_above") is not None:
        rule["split_above"] = int(value["split_above"])
    elif value.get("timings"):
        rows = sorted(value["timings"], key=lambda r: int(r["n"]))
        above = None
        for i, r in enumerate(rows):
            if float(r["split"]) < float(r["fused"]):
                above = int(rows[i - 1]["n"]) if i else 0
                break
        if above is None:
            return None
        rule["split_above"] = above
    else:
        return None
    return rule


def choose_form(rule: Optional[Dict[str, Any]], n_keys: int) -> str:
    """``"fused"`` or ``"split"`` for a call with ``n_keys`` keys under ``rule``."""
    if rule is None or rule.get("split_above") is None:
        return "fused"
    return "split" if int(n_keys) > int(rule["split_above"]) else "fused"


def describe_rule(rule: Optional[Dict[str, Any]]) -> str:
    if rule is None:
        return "fused (triton) for every sequence length (no stored measurement)"
    f, s = rule.get("fused", "triton"), rule.get("split", "reference")
    return f"fused ({f}) for Nk <= {rule['split_above']}, split ({s}: QK^T, softmax, AV) above"


def record_seq_rule(policy: str, head_dim: int, dtype, arch: str, value: Dict[str, Any]) -> None:
    """Store a measured rule (``{"split_above": T}`` or ``{"timings": [...]}``) for later calls."""
    from . import autotune

    if _normalise(value) is None and not value.get("timings"):
        raise ValueError(f"a sequence-length rule is {{'split_above': int}} or {{'timings': [...]}}, got {value!r}")
    key = seq_rule_key(policy, head_dim, dtype, arch)
    autotune.record(SEQ_RULE, key, value)
    _rule_cache.pop(_memo_key(key), None)


def _gpu_arch(q: torch.Tensor) -> Optional[str]:
    if not q.is_cuda:
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    return f"sm_{major}{minor}"


def _runs(be, spec: AttentionSpec, q: torch.Tensor, v: Optional[torch.Tensor]) -> bool:
    if be.supports(spec, q) is not None:
        return False
    # a folded site (W_V·W_O) has a value head dim other than q's; the backend must take both
    return v is None or v.shape[-1] == q.shape[-1] or be.supports(spec, v) is None


def _auto(spec: AttentionSpec, q: torch.Tensor, n_keys: int, v: Optional[torch.Tensor] = None) -> Tuple[Any, str]:
    arch = _gpu_arch(q)
    if arch is None or not triton_available():
        return get_backend("reference"), "reference"
    rule = seq_rule(spec.policy.name, q.shape[-1], q.dtype, arch)
    form = choose_form(rule, n_keys)
    names = {"fused": (rule or {}).get("fused", "triton"), "split": (rule or {}).get("split", "reference")}
    for f in ((form, "fused") if form == "split" else ("fused",)):
        try:
            be = get_backend(names[f])
        except (ImportError, ValueError):
            continue
        if _runs(be, spec, q, v):
            return be, f
    return get_backend("reference"), "reference"


def select_backend(spec: AttentionSpec, q: torch.Tensor, k: Optional[torch.Tensor] = None,
                   v: Optional[torch.Tensor] = None):
    """The backend object that runs ``spec`` on these tensors.

    ``k`` gives the key length for the sequence-length rule (else q's length is used); ``v`` lets
    ``auto`` skip a backend that cannot take the value head dim.
    """
    name = spec.backend
    if name == "auto":
        n_keys = (k if k is not None else q).shape[-2]
        return _auto(spec, q, n_keys, v)[0]
    be = get_backend(name)
    reason = be.supports(spec, q)
    if reason is not None:
        raise RuntimeError(f"backend {name!r} cannot run this site ({spec.describe()}): {reason}")
    return be
