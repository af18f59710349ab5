"""Shared cases of the kernel-template tests (CPU interpreter and GPU): predicates, masks, policies.

No Triton import and no environment change here, so both the interpreter tests and the GPU tests
can use it.
"""

from __future__ import annotations

import torch

from attncomp.policy import DFSS, Dense, Drop, Hash, SPION
from attncomp.spec import Predicates


def _segments(g, B, N, n_docs):
    """Packed documents: sorted segment ids with random boundaries."""
    cuts = torch.stack([torch.randperm(N - 1, generator=g)[:n_docs - 1].sort().values + 1 for _ in range(B)])
    seg = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        for c in cuts[b]:
            seg[b, c:] += 1
    return seg


def make_preds(kinds, g, B, Nq, Nk):
    """``(spec fields, Predicates)`` for the named predicate kinds."""
    fields, p = {}, {}
    if "causal" in kinds:
        fields["causal"] = True
    if "bottom_right" in kinds:
        fields.update(causal=True, causal_align="bottom_right")
    if "window" in kinds:  # a sliding window on position vectors that restart (packed sequences)
        fields.update(window_left=int(torch.randint(3, 9, (1,), generator=g)), window_right=2)
        p["q_pos"] = (torch.arange(Nq)[None] + torch.randint(0, 4, (B, 1), generator=g)) % 29
        p["k_pos"] = (torch.arange(Nk)[None] + torch.randint(0, 4, (B, 1), generator=g)) % 29
    if "segments" in kinds:
        n = min(Nq, Nk)
        seg = _segments(g, B, n, 3)
        p["q_seg"] = torch.cat([seg, seg[:, -1:].expand(B, Nq - n)], 1) if Nq > n else seg
        p["k_seg"] = torch.cat([seg, seg[:, -1:].expand(B, Nk - n)], 1) if Nk > n else seg
    if "k_valid" in kinds:  # right padding of a different length per batch
        lens = torch.randint(Nk // 2, Nk, (B,), generator=g)
        p["k_valid"] = torch.arange(Nk)[None] < lens[:, None]
    if "q_valid" in kinds:
        p["q_valid"] = torch.rand(1, Nq, generator=g) > 0.2
    return fields, Predicates(**p)


def make_mask(kind, g, B, Hq, Nq, Nk):
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(B, 1, Nq, Nk, generator=g) > 0.2
    m = torch.randn(1, Hq, Nq, Nk, generator=g)
    m[torch.rand(1, Hq, Nq, Nk, generator=g) < 0.15] = float("-inf")
    return m


def make_qkv(policy, g, B, Hq, Hk, Nq, Nk, D, dtype):
    """``(q, k, v)`` drawn from ``g`` in ``dtype``; for ``dfss`` q and k lie on a coarse grid, so that the
    logits are exact and N:M selections decide the same way in every precision."""
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hk, Nk, D, generator=g)
    v = torch.randn(B, Hk, Nk, D, generator=g)
    if policy == "dfss":
        q = torch.randint(-3, 4, q.shape, generator=g) / 2
        k = torch.randint(-3, 4, k.shape, generator=g) / 2
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_policy(name, g, B, Hq, Hk, Nq, Nk):
    """``(policy, q_aux, k_aux, block_pattern)``."""
    if name == "dense":
        return Dense(), None, None, None
    if name == "dfss":
        return DFSS(2, 4), None, None, None
    if name == "hash":
        return (Hash(n_buckets=4), torch.randint(0, 4, (B, Hq, Nq), generator=g),
                torch.randint(0, 4, (B, Hk, Nk), generator=g), None)
    if name == "drop":
        return (Drop(), torch.rand(B, Hq, Nq, generator=g) > 0.3, torch.rand(B, Hk, Nk, generator=g) > 0.3, None)
    bs = 16
    pat = torch.rand(Hq, -(-Nq // bs), -(-Nk // bs), generator=g) > 0.6
    return SPION(block_size=bs), None, None, pat


# (policy, predicates, residual mask, B, Hq, Hk, Nq, Nk, D, dtype)
CASES = [
    ("dense", ("causal",), "none", 2, 2, 1, 37, 37, 32, torch.float32),
    ("dense", ("bottom_right", "k_valid"), "bool", 2, 2, 2, 21, 45, 64, torch.float16),
    ("dense", ("window", "segments"), "float", 2, 2, 1, 40, 40, 80, torch.float32),
    ("dense", ("q_valid", "segments", "causal"), "none", 1, 2, 1, 33, 33, 256, torch.bfloat16),
    ("dfss", ("bottom_right",), "float", 1, 2, 1, 23, 40, 32, torch.float32),
    ("dfss", ("segments", "k_valid", "q_valid"), "none", 2, 2, 2, 37, 37, 128, torch.float32),
    ("dfss", ("window",), "bool", 2, 2, 1, 33, 33, 48, torch.bfloat16),
    ("hash", ("causal", "k_valid"), "none", 2, 2, 1, 40, 40, 32, torch.float32),
    ("hash", ("window", "q_valid"), "float", 2, 2, 1, 37, 29, 64, torch.float16),
    ("hash", ("bottom_right", "segments"), "bool", 1, 2, 2, 25, 45, 256, torch.float32),
    ("drop", ("segments", "causal"), "none", 2, 2, 1, 45, 45, 96, torch.float32),
    ("drop", ("bottom_right", "k_valid", "q_valid"), "bool", 2, 4, 2, 19, 37, 32, torch.bfloat16),
    ("drop", ("window",), "float", 1, 2, 2, 40, 40, 128, torch.float32),
    ("spion", ("causal",), "none", 1, 2, 1, 45, 45, 32, torch.float32),
    ("spion", ("window", "k_valid"), "float", 2, 2, 2, 37, 37, 64, torch.float16),
    ("spion", ("segments", "q_valid", "bottom_right"), "bool", 2, 4, 2, 30, 47, 160, torch.float32),
    ("spion", (), "none", 1, 2, 2, 33, 33, 256, torch.bfloat16),
]


def given_buckets_case(g, B, Hq, Hk, Nq, Nk, D, dtype, preds, n_buckets=4, exclude_self=False, device="cpu"):
    """A decoding step of ``hash`` with its buckets given (as a KV cache keeps them): ``(spec, q, k, v, preds, q_aux,
    k_aux, ro, rl)`` with the float64 reference ``ro``/``rl``, and the K and V rows of every key outside the buckets
    of its KV head's group's query rows made NaN after the reference ran (a kernel that reads one gets NaN through
    ``0 * NaN``)."""
    from attncomp.codegen import reference as R
    from attncomp.ops import materialize_aux
    from attncomp.spec import AttentionSpec

    q, k, v = (t.to(device) for t in make_qkv("hash", g, B, Hq, Hk, Nq, Nk, D, dtype))
    fields, pr = make_preds(preds, g, B, Nq, Nk)
    if pr is not None:
        pr = Predicates(*(None if t is None else t.to(device) for t in pr))
    spec = AttentionSpec(dtype=str(dtype).replace("torch.", ""),
                         policy=Hash(n_buckets=n_buckets, exclude_self=exclude_self), **fields)
    qa, ka = materialize_aux(spec, q, k)
    ro, rl = R.attention(q.double(), k.double(), v.double(), None, spec=spec, q_aux=qa, k_aux=ka, preds=pr)
    rows = qa.view(B, Hk, Hq // Hk * Nq)  # the bucket of every query row of a KV head's group
    wanted = (ka[..., :, None] == rows[..., None, :]).any(-1)
    assert 0 < int(wanted.sum()) < wanted.numel()
    unread = ~wanted[..., None].expand_as(k)
    k, v = k.masked_fill(unread, float("nan")), v.masked_fill(unread, float("nan"))
    return spec, q, k, v, pr, qa, ka, ro, rl


def close(name, a, b, tol, grad=False):
    """``a`` equals ``b`` within ``tol = (atol, rtol)``, ``atol`` scaled by ``b``'s largest
    magnitude for gradients (sums of many rounded products); never NaN."""
    atol, rtol = tol
    if grad:
        atol = atol * max(1.0, b.abs().max().item())
    assert not torch.isnan(a).any(), f"NaN in {name}"
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}\n{m}")
