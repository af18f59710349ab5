"""Shared test helpers: tolerances per dtype, fresh random inputs, poisoning, closeness checks."""

from __future__ import annotations

import os

import torch

#: (atol, rtol) for comparing a kernel's output with the reference computed in float64
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-3, 2e-3),  # Triton's float32 dot runs as tf32
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (4e-2, 4e-2),
}


#: ``ATTNCOMP_TEST_FULL=1`` (``make test-full``, ``make zoo``): the population tests run every case of their
#: lists; otherwise each keeps its sample (:func:`sample`, ``@pytest.mark.sample(n)``)
FULL = os.environ.get("ATTNCOMP_TEST_FULL", "0") == "1"


def sample(items, keep):
    """``items`` (a list, or a dict's keys), all of them under :data:`FULL`, else those in ``keep``
    (every name of ``keep`` must be one of ``items``: a sample never names a case that is gone)."""
    items = list(items)
    missing = [k for k in keep if k not in items]
    assert not missing, f"the sample names cases that are not in the list: {missing}"
    return items if FULL else [i for i in items if i in keep]


def fresh_seed() -> int:
    """A seed drawn per test run: tests see new random inputs each time."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded per test run."""
    return torch.Generator().manual_seed(fresh_seed())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def steps_vs_full_forward(model, gen, ids: torch.Tensor, am: torch.Tensor) -> float:
    """The worst relative difference, over steps and rows, between the per-step logits of a ``generate()`` from
    prompt ``ids`` with attention mask ``am`` (``gen``: ``output_logits=True, return_dict_in_generate=True``) and
    ``model``'s full forward over the sequence so far, with the positions generate derives from the mask where the
    forward takes them. A decoding step computes the last rows of the full forward (README, "Decoding")."""
    import inspect

    takes_pos = "position_ids" in inspect.signature(type(model).forward).parameters
    worst = 0.0
    with torch.no_grad():
        for t, step in enumerate(gen.logits):
            m = torch.cat([am, torch.ones(am.shape[0], t, dtype=am.dtype, device=am.device)], 1)
            kw = dict(input_ids=gen.sequences[:, :ids.shape[1] + t], attention_mask=m, use_cache=False)
            if takes_pos:
                kw["position_ids"] = (m.cumsum(-1) - 1).clamp(min=0)
            full = model(**kw).logits[:, -1]
            worst = max([worst] + [rel_err(step[r], full[r]) for r in range(step.shape[0])])
    return worst


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = None, msg: str = ""):
    dtype = dtype or actual.dtype
    atol, rtol = TOL[dtype]
    assert not torch.isnan(actual).any(), f"NaN in output {msg}"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or a sentinel (ints) so unwritten elements are caught."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)


def poisoned_empty(shape, dtype, device, strides=None) -> torch.Tensor:
    """A backend allocator (``_empty``) whose buffers come :func:`poison`-ed."""
    if strides is None:
        return poison(torch.empty(shape, dtype=dtype, device=device))
    return poison(torch.empty_strided(shape, strides, dtype=dtype, device=device))


def draw_mask(kind: str, g: torch.Generator, B: int, Nq: int, Nk: int):
    """A residual mask of ``kind``: ``None``, ``"bool"`` (``(B, 1, Nq, Nk)``, about 30 % masked) or
    ``"float"`` (a 2-D ``(Nq, Nk)`` bias broadcast over batch and heads, about 20 % ``-inf``)."""
    if kind == "bool":
        return torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    if kind == "float":
        return torch.where(torch.rand(Nq, Nk, generator=g) > 0.2, torch.randn(Nq, Nk, generator=g),
                           torch.tensor(float("-inf")))
    return None


def qkv(B, Hq, Nq, D, *, Hk=None, Nk=None, Dv=None, dtype=torch.float32, device="cpu", requires_grad=False, seed=None):
    """Fresh random q, k, v (never zeros)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31 - 1, (1,)).item())
    Hk = Hk or Hq
    Nk = Nk or Nq
    Dv = Dv or D

    def mk(*shape):
        t = torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return mk(B, Hq, Nq, D), mk(B, Hk, Nk, D), mk(B, Hk, Nk, Dv)


def case_inputs(case: tuple, g: torch.Generator, call: int):
    """Fresh inputs of a plan test case ``(spec kwargs, (B, Hq, Hk, Nq, Nk, D), mask kind, padding,
    dropout)`` for its ``call``-th call: ``(spec, (q, k, v), mask, preds, dropout)``; with padding the
    second batch row's last ``7 - call`` keys are invalid (another count per call)."""
    from attncomp.spec import AttentionSpec, Predicates

    kw, (B, Hq, Hk, Nq, Nk, D), mask_kind, padded, p = case
    q, k, v = qkv(B, Hq, Nq, D, Hk=Hk, Nk=Nk, seed=int(torch.randint(0, 2 ** 30, (1,), generator=g)))
    mask = draw_mask(mask_kind, g, B, Nq, Nk)
    preds = None
    if padded:
        kv = torch.ones(B, Nk, dtype=torch.bool)
        kv[1, Nk - 7 + call:] = False
        preds = Predicates(k_valid=kv)
    return AttentionSpec(**kw), (q, k, v), mask, preds, p


def tensors(out) -> list:
    """Every tensor of a model output, in order (tensors, tuples, dicts, ModelOutputs, cache objects)."""
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "self_attention_cache"):  # EncoderDecoderCache
        return tensors(out.self_attention_cache) + tensors(out.cross_attention_cache)
    if hasattr(out, "layers") and hasattr(out, "get_seq_length"):  # Cache
        res = []
        for layer in out.layers:
            res += tensors(getattr(layer, "keys", None)) + tensors(getattr(layer, "values", None))
        return res
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors(o)]
    return []
