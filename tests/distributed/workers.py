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


def _cp_toy(cp: bool, d: int = 16, heads: int = 2):
    """Residual attention layer whose attention is context-parallel (``cp``) or over the whole
    sequence (the single-process reference), same weights either way."""
    import torch.nn as nn

    import attncomp
    from attncomp.distributed import context_parallel_attention

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(x).view(B, N, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if cp:
                a = context_parallel_attention(q, k, v, is_causal=True, layout="balanced")
            else:
                a = attncomp.functional.attention(q, k, v, is_causal=True, policy="dense")
            return x + self.out(torch.tanh(a.transpose(1, 2).reshape(B, N, d)))

    torch.manual_seed(0)
    return Layer().double()


def _compiled_cp_model(rank: int, world: int):
    """A model calling context_parallel_attention, compiled by attncomp.compile: its output shard and
    its parameter gradients (summed over ranks) against the uncompiled model on the whole sequence."""
    import attncomp
    from attncomp.distributed import shard_sequence

    X = torch.randn(2, 8 * world, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref = _cp_toy(cp=False)
    y_ref = ref(X)
    y_ref.pow(2).sum().backward()
    model = _cp_toy(cp=True)
    run = attncomp.compile(model, policy="dense")
    x = shard_sequence(X, rank, world, "balanced", dim=1)
    y = run(x)
    y.pow(2).sum().backward()
    err = {"out": (y - shard_sequence(y_ref, rank, world, "balanced", dim=1)).abs().max().item()}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        err[n] = (g - dict(ref.named_parameters())[n].grad).abs().max().item()
    return err


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
    if world == 2:  # one ring size is enough for the compiled model (a capture costs seconds)
        try:
            res["_compiled_model"] = _compiled_cp_model(rank, world)
        except Exception as e:  # recorded; the parent test names it
            res["_compiled_model"] = {"raised": f"{type(e).__name__}: {e}"[:2000]}
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


# ---------------------------------------------------------------------------------------------
# DDP and FSDP2 of models compiled by attncomp.compile.

#: (wrapper, order, example_inputs, policy): every policy with a backward under both wrappers and
#: both orders; every (wrapper, order) with and without example inputs
DP_CASES = [
    ("ddp", "compile_then_wrap", False, "dense"),
    ("ddp", "compile_then_wrap", True, "dfss"),
    ("ddp", "wrap_then_compile", False, "hash"),
    ("ddp", "wrap_then_compile", True, "drop"),
    ("fsdp2", "compile_then_wrap", False, "drop"),
    ("fsdp2", "compile_then_wrap", True, "hash"),
    ("fsdp2", "wrap_then_compile", False, "dfss"),
    ("fsdp2", "wrap_then_compile", True, "dense"),
]


def dp_case_name(case) -> str:
    wrapper, order, example, policy = case
    return f"{wrapper}-{order}-{'example' if example else 'lazy'}-{policy}"


def _toy_model(d: int = 16, heads: int = 2, layers: int = 2):
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.norm(x)).view(B, N, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.proj(a.transpose(1, 2).reshape(B, N, d))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.head = nn.Linear(d, 4)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    return Model().double()


def _reset_seed_stream(start: int) -> None:
    """Put the per-call seed stream of compiled sites (drop draws, dropout) at ``start``, so that a
    run and its single-process reference draw the same keep masks step for step."""
    import itertools

    from attncomp import ops

    ops._step = itertools.count(start)


def _full_grad(p) -> torch.Tensor:
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _reference_grads(policy: str, X, T, world: int, steps: int):
    """Single-process training of the compiled model on the global batch: gradients per step. The
    drop policy's draws are per local sample index (identical on every rank), so its reference is
    the mean over the ranks' local batches, each drawn from the same point of the seed stream."""
    import attncomp

    model = _toy_model()
    c = attncomp.compile(model, policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    b = X.shape[0] // world
    for s in range(steps):
        opt.zero_grad()
        if policy == "drop":
            for r in range(world):
                _reset_seed_stream(1000 * (s + 1))
                sl = slice(r * b, (r + 1) * b)
                (((c(X[sl]) - T[sl]) ** 2).mean() / world).backward()
        else:
            _reset_seed_stream(1000 * (s + 1))
            ((c(X) - T) ** 2).mean().backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return out


def _wrap(wrapper: str, module, model, mesh):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module)
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _drop_draws(x, world: int):
    """The drop policy's draws in a compiled model: the same local input gives the same output on
    every rank; the draws change from call to call (a fresh draw per training step); restarting the
    seed stream reproduces them."""
    import attncomp

    model = _toy_model()
    c = attncomp.compile(model, policy="drop")
    _reset_seed_stream(7)
    with torch.no_grad():
        y = c(x)
    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y)
    _reset_seed_stream(7)
    with torch.no_grad():
        y2, y3 = c(x), c(x)
    return {"same_across_ranks": max((a - ys[0]).abs().max().item() for a in ys),
            "reproducible": (y2 - y).abs().max().item(), "step_change": (y3 - y2).abs().max().item()}


#: FSDP2 layouts in which ``attncomp.compile(..., example_inputs=...)``'s compile-time forward leaves
#: unsharded parameters behind: an eval-mode compile of the root, layers that keep their parameters
#: unsharded after forward (``reshard_after_forward=False``), and one such layer compiled on its own
#: after the whole model ran (a non-root FSDP2 module: resharded group by group)
FSDP_EXAMPLE_CASES = ("eval-root", "no-reshard-after-forward", "non-root-layer")


def _fsdp_example_compile(case: str, x, t, ref, mesh, steps: int):
    """Compile (dense, with example inputs) a fully_shard-ed model or one of its layers as ``case``
    says, then train the whole model with an optimizer built after the compile: parameters replaced
    by the compile, parameters that stopped being sharded, and the gradient error per step."""
    import attncomp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # the layers' forward is a frame of its own under FSDP2 (its hooks break the graph): the cases
    # before this one compiled it for their models up to dynamo's recompile limit
    torch._dynamo.reset()
    model = _toy_model()
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=case == "eval-root")
    fully_shard(model, mesh=mesh)
    target = model
    if case == "non-root-layer":
        model(x).sum().backward()  # the root's first iteration: the layers become non-root
        target = model.blocks[0]
    if case == "eval-root":
        model.eval()
    ids = [id(p) for p in model.parameters()]
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    compiled = attncomp.compile(target, policy="dense", example_inputs=(x,))
    res = {"replaced": sum(id(p) != i for p, i in zip(model.parameters(), ids)),
           "unsharded": sharded - sum(isinstance(p, DTensor) for p in model.parameters()),
           "notes": list(attncomp.report(compiled).notes), "rewritten": attncomp.report(compiled).rewritten}
    model.train()
    run = compiled if target is model else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res["errors"] = []
    for s in range(steps):
        opt.zero_grad()
        ((run(x) - t) ** 2).mean().backward()
        grads = {n: _full_grad(p) for n, p in model.named_parameters()}
        res["errors"].append(max((grads[n] - ref[s][n]).abs().max().item() for n in grads))
        opt.step()
    return res


def _fsdp_frames_used_up(x, mesh):
    """Two fully_shard-ed models of one class compiled lazily with dynamo's recompile limit at 1:
    under FSDP2 each layer's forward is a frame of its own, so the first model's graphs use up the
    limit and the second runs without attncomp; its report says so instead of "not captured yet"."""
    import attncomp

    torch._dynamo.reset()
    reports = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            model = _toy_model()
            compiled = attncomp.compile(_wrap("fsdp2", model, model, mesh), policy="dense")
            compiled(x).sum().backward()
            rep = attncomp.report(compiled)
            reports.append({"rewritten": rep.rewritten, "graphs": rep.graphs, "notes": list(rep.notes)})
    torch._dynamo.reset()
    return reports


def data_parallel(rank: int, world: int, steps: int = 2):
    """Every case of :data:`DP_CASES`: max abs gradient error per step against single-process
    training, or the error raised."""
    import attncomp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    X = torch.randn(2 * world, 10, 16, generator=g, dtype=torch.float64)
    T = torch.randn(2 * world, 10, 4, generator=g, dtype=torch.float64)
    b = X.shape[0] // world
    x, t = X[rank * b:(rank + 1) * b], T[rank * b:(rank + 1) * b]
    refs = {}
    res = {}
    for case in DP_CASES:
        wrapper, order, example, policy = case
        name = dp_case_name(case)
        try:
            if policy not in refs:
                refs[policy] = _reference_grads(policy, X, T, world, steps)
            model = _toy_model()
            n_params = len(list(model.parameters()))
            kw = {"example_inputs": (x,)} if example else {}
            if order == "compile_then_wrap":
                ids = [id(p) for p in model.parameters()]
                compiled = attncomp.compile(model, policy=policy, **kw)
                seen = len(list(compiled.parameters()))
                replaced = sum(id(p) != i for p, i in zip(model.parameters(), ids))
                run = _wrap(wrapper, compiled, model, mesh)
            else:
                w = _wrap(wrapper, model, model, mesh)
                ids = [id(p) for p in model.parameters()]
                run = compiled = attncomp.compile(w, policy=policy, **kw)
                seen = len(list(run.parameters()))
                # the optimizer below is built after compile: it must get the parameters the wrapper
                # updates (FSDP2: the sharded DTensors), not tensors the compile-time call left behind
                replaced = sum(id(p) != i for p, i in zip(model.parameters(), ids))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            errs = []
            for s in range(steps):
                opt.zero_grad()
                _reset_seed_stream(1000 * (s + 1))
                ((run(x) - t) ** 2).mean().backward()
                grads = {n: _full_grad(p) for n, p in model.named_parameters()}
                missing = [n for n, gr in grads.items() if gr is None]
                if missing:
                    raise AssertionError(f"step {s}: no gradient for {missing}")
                errs.append(max((grads[n] - refs[policy][s][n]).abs().max().item() for n in grads))
                opt.step()
            res[name] = {"errors": errs, "params_before_call": seen, "n_params": n_params,
                         "params_replaced_by_compile": replaced}
            try:
                rep = attncomp.report(compiled)
                res[name]["rewritten"] = rep.rewritten
                res[name]["notes"] = list(rep.notes)
            except Exception as e:
                res[name]["report_raised"] = f"{type(e).__name__}: {e}"[:500]
        except Exception as e:  # recorded per case; the parent test names it
            res[name] = {"raised": f"{type(e).__name__}: {e}"[:2000]}
        dist.barrier()
    for case in FSDP_EXAMPLE_CASES:
        try:
            if "dense" not in refs:
                refs["dense"] = _reference_grads("dense", X, T, world, steps)
            res["_fsdp_example_" + case] = _fsdp_example_compile(case, x, t, refs["dense"], mesh, steps)
        except Exception as e:  # recorded per case; the parent test names it
            res["_fsdp_example_" + case] = {"raised": f"{type(e).__name__}: {e}"[:2000]}
        dist.barrier()
    try:
        res["_fsdp_frames_used_up"] = _fsdp_frames_used_up(x, mesh)
    except Exception as e:  # recorded; the parent test names it
        res["_fsdp_frames_used_up"] = {"raised": f"{type(e).__name__}: {e}"[:2000]}
    dist.barrier()
    try:
        res["_drop"] = _drop_draws(X[:b], world)
    except Exception as e:  # recorded; the parent test names it
        res["_drop"] = {"raised": f"{type(e).__name__}: {e}"[:2000]}
    return res


# ---------------------------------------------------------------------------------------------
# Context parallel on GPUs (NCCL, one GPU per rank).

GPU_CP_CASES = [(pol, layout, causal, dt) for pol in ("dense", "dfss", "drop", "hash")
                for layout, causal in (("contiguous", False), ("balanced", True), ("contiguous", True))
                for dt in ("bfloat16", "float32")]


def gpu_case_name(c) -> str:
    return f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}-{c[3]}"


def context_parallel_gpu(rank: int, world: int):
    """:data:`GPU_CP_CASES` on ``cuda:rank``: output and gradient shards against the single-GPU
    result on the whole sequence; errors relative to the largest magnitude of the expected tensor."""
    import attncomp
    from attncomp.distributed import context_parallel_attention, shard_sequence

    dev = torch.device("cuda", rank)
    res = {}
    for i, case in enumerate(GPU_CP_CASES):
        pol, layout, causal, dt = case
        dtype = getattr(torch, dt)
        B, Hq, Hk, n, D = 2, 8, 2, 384, 64
        N = n * world
        try:
            Q, K, V, dO = (t.to(dev) for t in _full(2000 + i, B, Hq, Hk, N, D, D, dtype))
            Qe, Ke, Ve = (t.clone().requires_grad_(True) for t in (Q, K, V))
            exp = attncomp.functional.attention(Qe, Ke, Ve, is_causal=causal, policy=pol, enable_gqa=True)
            exp.backward(dO)
            sh = lambda t: shard_sequence(t, rank, world, layout)  # noqa: E731
            q, k, v = (sh(t).clone().requires_grad_(True) for t in (Q, K, V))
            out = context_parallel_attention(q, k, v, is_causal=causal, policy=pol, layout=layout)
            out.backward(sh(dO))
            rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
            res[gpu_case_name(case)] = {"out": rel(out, sh(exp)), "dq": rel(q.grad, sh(Qe.grad)),
                                        "dk": rel(k.grad, sh(Ke.grad)), "dv": rel(v.grad, sh(Ve.grad))}
        except Exception as e:
            res[gpu_case_name(case)] = {"raised": f"{type(e).__name__}: {e}"[:1500]}
        dist.barrier()
    return res


def thread_ring_case(world: int, policy, layout: str, causal: bool, dtype, device, *, B=2, Hq=4, Hk=2, n=8,
                     D=6, Dv=5, seed=0):
    """One case of context-parallel attention with the ring emulated by threads (threadring.py):
    ``{"out"|"dq"|"dk"|"dv": max abs error relative to the largest expected magnitude}`` against the
    single-process result on the whole sequence."""
    import attncomp
    from attncomp.distributed import context_parallel_attention, shard_sequence
    from tests.distributed.threadring import thread_ring

    N = n * world
    Q, K, V, dO = (t.to(device) for t in _full(seed, B, Hq, Hk, N, D, Dv, dtype))
    Qe, Ke, Ve = (t.clone().requires_grad_(True) for t in (Q, K, V))
    exp = attncomp.functional.attention(Qe, Ke, Ve, is_causal=causal, policy=policy, enable_gqa=True)
    exp.backward(dO)

    def rank_fn(r):
        sh = lambda t: shard_sequence(t, r, world, layout)  # noqa: E731
        q, k, v = (sh(t).clone().requires_grad_(True) for t in (Q, K, V))
        out = context_parallel_attention(q, k, v, is_causal=causal, policy=policy, layout=layout)
        out.backward(sh(dO))
        rel = lambda a, b: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()  # noqa: E731
        return {"out": rel(out, sh(exp)), "dq": rel(q.grad, sh(Qe.grad)), "dk": rel(k.grad, sh(Ke.grad)),
                "dv": rel(v.grad, sh(Ve.grad))}

    with thread_ring(world) as run:
        per_rank = run(rank_fn)
    return {w: max(r[w] for r in per_rank) for w in per_rank[0]}
