"""Worker functions run by the distributed tests in spawned gloo processes (see harness.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _full(seed: int, B, Hq, Hk, N, D, Dv, dtype):
    g = torch.Generator().manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return mk(B, Hq, N, D), mk(B, Hk, N, D), mk(B, Hk, N, Dv), mk(B, Hq, N, Dv)


#: (name, layout, causal, policy, extra) where extra may set sizes, dtype and policy tensors
def cp_cases():
    cases = []
    for layout in ("contiguous", "balanced"):
        for causal in (False, True):
            for pol in ("dense", "dfss", "drop", "hash"):
                cases.append((f"{pol}-{layout}-{'causal' if causal else 'full'}", layout, causal, pol, {}))
    cases += [
        ("dense-balanced-causal-odd-chunk", "balanced", True, "dense", {"n": 6, "D": 5, "Dv": 3}),
        ("dense-contiguous-causal-mha", "contiguous", True, "dense", {"Hk": 4, "n": 7}),
        ("dfss-2of4-balanced-causal", "balanced", True, {"name": "dfss", "n": 2, "m": 4}, {"n": 16}),
        ("hash-exclude-self-balanced-causal", "balanced", True, {"name": "hash", "n_buckets": 4,
                                                                 "exclude_self": True}, {}),
        ("hash-given-buckets-contiguous-full", "contiguous", False, "hash", {"given": True}),
        ("drop-given-keep-balanced-causal", "balanced", True, "drop", {"given": True}),
        ("dense-float32-balanced-causal", "balanced", True, "dense", {"dtype": torch.float32}),
        ("dense-scale-contiguous-full", "contiguous", False, "dense", {"scale": 0.3}),
    ]
    return cases


def _policy(p):
    import attncomp

    if isinstance(p, dict):
        p = dict(p)
        return attncomp.get_policy(p.pop("name"), **p)
    return attncomp.get_policy(p)


def context_parallel(rank: int, world: int):
    """Every case of :func:`cp_cases` on this rank: max abs errors of the output and gradient shards
    against the single-process result, and of shard-local attention (which must differ)."""
    import attncomp
    from attncomp.distributed import context_parallel_attention, gather_sequence, shard_sequence

    res = {}
    for i, (name, layout, causal, pol, ex) in enumerate(cp_cases()):
        dtype = ex.get("dtype", torch.float64)
        B, Hq, Hk, n = 2, 4, ex.get("Hk", 2), ex.get("n", 8)
        D, Dv = ex.get("D", 6), ex.get("Dv", 5)
        N = n * world
        policy = _policy(pol)
        Q, K, V, dO = _full(1000 + i, B, Hq, Hk, N, D, Dv, dtype)
        tens, full_tens = {}, {}
        if ex.get("given"):
            g = torch.Generator().manual_seed(77 + i)
            if policy.name == "hash":
                full_tens = {"q_buckets": torch.randint(0, 3, (B, Hq, N), generator=g, dtype=torch.int32),
                             "k_buckets": torch.randint(0, 3, (B, Hk, N), generator=g, dtype=torch.int32)}
            else:
                full_tens = {"q_keep": torch.rand(B, Hq, N, generator=g) < 0.7,
                             "k_keep": torch.rand(B, Hk, N, generator=g) < 0.7}
            tens = {k: shard_sequence(t, rank, world, layout) for k, t in full_tens.items()}
        # the single-process result on the whole sequence
        Qe, Ke, Ve = (t.clone().requires_grad_(True) for t in (Q, K, V))
        exp = attncomp.functional.attention(Qe, Ke, Ve, is_causal=causal, policy=policy, enable_gqa=True,
                                            scale=ex.get("scale"), **full_tens)
        exp.backward(dO)
        sh = lambda t: shard_sequence(t, rank, world, layout)  # noqa: E731
        q, k, v = (sh(t).clone().requires_grad_(True) for t in (Q, K, V))
        out = context_parallel_attention(q, k, v, is_causal=causal, policy=policy, layout=layout,
                                         scale=ex.get("scale"), **tens)
        out.backward(sh(dO))
        err = {"out": (out - sh(exp)).abs().max().item(), "dq": (q.grad - sh(Qe.grad)).abs().max().item(),
               "dk": (k.grad - sh(Ke.grad)).abs().max().item(), "dv": (v.grad - sh(Ve.grad)).abs().max().item(),
               "nan": bool(torch.isnan(out).any() or torch.isnan(q.grad).any() or torch.isnan(k.grad).any())}
        # the gathered output is the whole sequence's, in order
        err["gathered"] = (gather_sequence(out.detach(), layout=layout) - exp.detach()).abs().max().item()
        # negative twin: attention over the local shard only is not the result
        with torch.no_grad():
            loc = attncomp.functional.attention(sh(Q), sh(K), sh(V), is_causal=causal, policy=policy,
                                                enable_gqa=True, scale=ex.get("scale"), **tens)
        err["local_only"] = (loc - sh(exp)).abs().max().item()
        res[name] = err
    # clear errors for what cannot be sharded
    errs = {}
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    for key, kw in {"dfss-straddle": dict(policy=_policy({"name": "dfss", "n": 2, "m": 4}), layout="balanced"),
                    "spion": dict(policy="spion"), "layout": dict(layout="zigzag"),
                    "hash-one-sided": dict(policy="hash", q_buckets=torch.zeros(1, 2, 6, dtype=torch.int32))}.items():
        try:
            context_parallel_attention(x, x, x, **kw)
            errs[key] = None
        except ValueError as e:
            errs[key] = str(e)
    res["_errors"] = errs
    return res
