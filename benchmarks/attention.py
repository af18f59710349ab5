"""Attention benchmark: attncomp's Triton kernels against SDPA, FlexAttention and the unfused chain.

Protocol (BENCHMARKS.md): on the GPU, bf16, B=4, H=16, D in {64, 128}, N in {1024, 4096, 16384},
causal and not, forward and forward+backward; median of ``triton.testing.do_bench`` on fresh random
inputs; every baseline timed in the same process on the same shapes:

* ``sdpa``: ``F.scaled_dot_product_attention`` restricted to the FlashAttention backend;
* ``flex``: ``flex_attention`` under ``torch.compile`` with the same mask as a ``BlockMask``
  (``None`` when not causal); the block mask's build time is reported separately;
* ``unfused``: ``softmax(q @ k^T * scale [+ causal mask]) @ v`` in bf16, the DFSS paper's baseline
  (skipped where its N x N tensors would not fit the GPU).

attncomp is timed through its backend functions (``attention_forward``/``attention_backward``: the
kernels plus their host-side launch code). Sparse policies also report their density (kept /
allowed entries). Ratios are baseline time / attncomp time (> 1: attncomp is faster); for every
policy the SDPA column is dense attention, the number the policy has to beat.

Output: a table (printed last), JSON (``benchmarks/results/h200.json``, and ``$OUT/h200.json``
when ``OUT`` is set; rows of policies not run now are kept) and a plot next to the JSON.

Kernels are compiled ahead in parallel worker processes (Triton's and Inductor's disk caches are
shared), so the timed process only loads them. ``--sweep`` times every candidate configuration of
the Triton kernels instead (used to choose the defaults in ``attncomp/codegen/triton/configs.py``).
``--smoke`` runs the script's plumbing on the CPU through Triton's interpreter on tiny shapes.

    python benchmarks/attention.py                       # full table
    python benchmarks/attention.py --quick --policies dfss
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N=4096 only")
    ap.add_argument("--policies", default="dense,dfss", help="comma-separated: dense, dfss")
    ap.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default=None, help="comma-separated sequence lengths (default 1024,4096,16384)")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-unfused", action="store_true")
    ap.add_argument("--tune", action="store_true", help="let the autotune store pick configs (else defaults)")
    ap.add_argument("--sweep", action="store_true", help="time every candidate config of the Triton kernels")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1), help="parallel compile workers")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check under TRITON_INTERPRET=1")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Shapes, inputs, timing.

def ns_of(args) -> List[int]:
    if args.ns:
        return [int(x) for x in args.ns.split(",")]
    if args.smoke:
        return [64]
    return [4096] if args.quick else [1024, 4096, 16384]


def dfss_density(n: int, m: int, N: int, causal: bool) -> float:
    """Kept / allowed entries of N:M on an N x N problem (exact, partial groups included)."""
    def kept_in(length: int) -> int:
        return (length // m) * n + min(length % m, n)

    if not causal:
        return kept_in(N) / N
    kept = sum(kept_in(i + 1) for i in range(N))
    return kept / (N * (N + 1) / 2)


def flops(B, H, N, D, causal: bool, passes: str) -> float:
    f = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * (3.5 if passes == "fwd+bwd" else 1.0)  # bwd = 2.5x fwd (5 matmuls vs 2)


def bench_ms(fn, smoke: bool) -> float:
    import torch

    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    fn()  # compile, tune and allocate outside the timing
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def make_inputs(B, H, N, D, dtype, device, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(4)]


def make_spec(policy: str, causal: bool, dtype):
    from attncomp.policy import get_policy
    from attncomp.spec import AttentionSpec, dtype_name

    pol = get_policy(policy).resolved(dtype)
    return AttentionSpec(causal=causal, dtype=dtype_name(dtype), policy=pol)


# ---------------------------------------------------------------------------------------------
# The contenders.

def attncomp_fn(policy, causal, q, k, v, do, passes, fwd_cfg=None, bwd_cfg=None):
    from attncomp.codegen.triton import backend as TB

    spec = make_spec(policy, causal, q.dtype)
    if passes == "fwd":
        return lambda: TB.attention_forward(spec, q, k, v, config=fwd_cfg)

    def step():
        out, lse = TB.attention_forward(spec, q, k, v, config=fwd_cfg)
        TB.attention_backward(spec, q, k, v, None, out, lse, do, config=bwd_cfg)

    return step


def sdpa_fn(causal, q, k, v, do, passes, backend: Optional[str] = "flash"):
    """SDPA restricted to one backend (``flash``, ``cudnn``, ``efficient``) or, with ``None``, the
    backend torch picks by itself."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def ctx():
        return sdpa_kernel(names[backend]) if backend else contextlib.nullcontext()

    if passes == "fwd":
        def run():
            with ctx():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        with ctx():
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return step


_FLEX = {}


def _flex_compiled():
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        for name in ("recompile_limit", "cache_size_limit"):
            try:
                setattr(torch._dynamo.config, name, 256)
            except Exception:
                pass
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_fn(causal, q, k, v, do, passes):
    """``(step, block-mask build ms)``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _flex_compiled()
    B, H, N, _ = q.shape
    build_ms = None
    block_mask = None
    if causal:
        torch.cuda.synchronize()
        t = time.perf_counter()
        block_mask = create_block_mask(_causal_mod, None, None, N, N, device=q.device)
        torch.cuda.synchronize()
        build_ms = (time.perf_counter() - t) * 1e3
    if passes == "fwd":
        return (lambda: flex(q, k, v, block_mask=block_mask)), build_ms
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        out = flex(qg, kg, vg, block_mask=block_mask)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return step, build_ms


def unfused_fn(causal, q, k, v, do, passes):
    import torch

    N, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    # s, its masked copy and the probabilities: three N x N bf16 tensors (plus autograd's copies)
    need = q.shape[0] * q.shape[1] * N * N * q.element_size() * (3 if passes == "fwd" else 6)
    free = torch.cuda.mem_get_info()[0] if q.is_cuda else float("inf")
    if need > 0.8 * free:
        return None
    keep = torch.ones(N, N, dtype=torch.bool, device=q.device).tril() if causal else None

    def chain(q, k, v):
        s = (q @ k.transpose(-1, -2)) * scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    if passes == "fwd":
        return lambda: chain(q, k, v)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        torch.autograd.grad(chain(qg, kg, vg), (qg, kg, vg), do)

    return step


# ---------------------------------------------------------------------------------------------
# Parallel warm-up: compile every kernel the timed process will need, in worker processes.

def _warm_task(task) -> str:
    import torch

    if task.get("smoke"):
        os.environ["TRITON_INTERPRET"] = "1"
    kind = task["kind"]
    t0 = time.perf_counter()
    dev = "cpu" if task.get("smoke") else "cuda"
    dtype = torch.bfloat16
    try:
        if kind == "attncomp":
            # B=1 and a short length: the same kernel specialisations as the timed shapes
            q, k, v, do = make_inputs(1, task["H"], task["N"], task["D"], dtype, dev)
            for fcfg, bcfg in task["configs"]:
                attncomp_fn(task["policy"], task["causal"], q, k, v, do, task["passes"], fcfg, bcfg)()
        elif kind == "flex":
            q, k, v, do = make_inputs(task["B"], task["H"], task["N"], task["D"], dtype, dev)
            step, _ = flex_fn(task["causal"], q, k, v, do, task["passes"])
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
        return f"{kind} {task.get('policy', '')} D{task['D']} c{int(task['causal'])} {task['passes']}: " \
               f"{time.perf_counter() - t0:.1f}s"
    except Exception as e:  # reported, and the timed run retries (and reports) on its own
        return f"{kind} warm-up failed: {type(e).__name__}: {e}"


def warm_up(tasks, workers: int) -> None:
    if not tasks:
        return
    import multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(tasks))), mp_context=ctx) as ex:
        futs = [ex.submit(_warm_task, t) for t in tasks]
        for f in as_completed(futs):
            print("  warm:", f.result(), flush=True)
    print(f"warm-up of {len(tasks)} tasks: {time.perf_counter() - t0:.1f}s", flush=True)


def candidate_pairs(policy, D, dtype, sweep: bool, tune: bool):
    """The (fwd, bwd) configurations the run will launch: all candidates, or the defaults."""
    from attncomp.codegen.triton import configs

    nm_m = 1
    if policy == "dfss":
        nm_m = make_spec(policy, False, dtype).policy.m
    fw = configs.fwd_candidates(D, D, dtype, nm_m)
    bw = configs.bwd_candidates(D, D, dtype, nm_m)
    if not (sweep or tune):
        fw, bw = fw[:1], bw[:1]
    n = max(len(fw), len(bw))
    return [(fw[min(i, len(fw) - 1)], bw[min(i, len(bw) - 1)]) for i in range(n)]


# ---------------------------------------------------------------------------------------------

def sweep(args, policies, dims, causals, passes_list) -> List[dict]:
    """Time every candidate forward and backward configuration at each N."""
    import torch
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import configs

    dtype, dev = torch.bfloat16, "cuda"
    res = []
    for policy in policies:
        for D in dims:
            for causal in causals:
                for N in ns_of(args):
                    q, k, v, do = make_inputs(args.batch, args.heads, N, D, dtype, dev)
                    spec = make_spec(policy, causal, dtype)
                    nm_m = spec.policy.m if policy == "dfss" else 1
                    for ps in passes_list:
                        for be in (None, "flash", "cudnn"):
                            try:
                                ms = bench_ms(sdpa_fn(causal, q, k, v, do, ps, be), False)
                            except Exception as e:
                                print(f"sdpa {be} failed: {type(e).__name__}: {str(e)[:100]}")
                                continue
                            res.append(dict(policy="sdpa", D=D, N=N, causal=causal, kernel=f"{ps} {be or 'auto'}",
                                            config=None, ms=ms))
                    for cfg in configs.fwd_candidates(D, D, dtype, nm_m):
                        ms = bench_ms(lambda: TB.attention_forward(spec, q, k, v, config=cfg), False)
                        res.append(dict(policy=policy, D=D, N=N, causal=causal, kernel="fwd", config=cfg, ms=ms))
                    if "fwd+bwd" in passes_list:
                        out, lse = TB.attention_forward(spec, q, k, v)
                        for cfg in configs.bwd_candidates(D, D, dtype, nm_m):
                            ms = bench_ms(lambda: TB.attention_backward(spec, q, k, v, None, out, lse, do, config=cfg),
                                          False)
                            res.append(dict(policy=policy, D=D, N=N, causal=causal, kernel="bwd", config=cfg, ms=ms))
                    del q, k, v, do
                    torch.cuda.empty_cache()
    print("\nconfig sweep (ms; best first per group)")
    groups: Dict[tuple, list] = {}
    for r in res:
        groups.setdefault((r["policy"], r["D"], r["N"], r["causal"], r["kernel"]), []).append(r)
    for key, rows in groups.items():
        rows.sort(key=lambda r: r["ms"])
        if key[0] == "sdpa":
            print(f"sdpa  D{key[1]:<3d} N{key[2]:<5d} c{int(key[3])} {key[4]}: {rows[0]['ms']:.3f}")
            continue
        cells = "  ".join(f"{c['config']['BLOCK_M']}x{c['config']['BLOCK_N']}w{c['config']['num_warps']}"
                          f"s{c['config']['num_stages']}{'T' if c['config'].get('NATURAL') == 0 else ''}"
                          f"{'+dq' + 'x'.join(map(str, c['config']['DQ'])) if c['config'].get('DQ') else ''}"
                          f"={c['ms']:.3f}" for c in rows)
        print(f"{key[0]:5s} D{key[1]:<3d} N{key[2]:<5d} c{int(key[3])} {key[4]}: {cells}")
    return res


def run_table(args, policies, dims, causals, passes_list) -> List[dict]:
    import torch
    from attncomp.codegen.triton import backend as TB

    dtype = torch.bfloat16
    dev = "cpu" if args.smoke else "cuda"
    B, H = (1, 2) if args.smoke else (args.batch, args.heads)
    rows = []
    for D in dims:
        for N in ns_of(args):
            for causal in causals:
                for passes in passes_list:
                    q, k, v, do = make_inputs(B, H, N, D, dtype, dev, seed=N + D)
                    base: Dict[str, Optional[float]] = {"sdpa_ms": None, "sdpa_flash_ms": None, "flex_ms": None,
                                                        "unfused_ms": None}
                    flex_build = None
                    if not args.smoke:
                        # torch's own SDPA backend choice, and the FlashAttention backend alone
                        base["sdpa_ms"] = bench_ms(sdpa_fn(causal, q, k, v, do, passes, None), False)
                        base["sdpa_flash_ms"] = bench_ms(sdpa_fn(causal, q, k, v, do, passes, "flash"), False)
                        if not args.no_flex:
                            try:
                                step, flex_build = flex_fn(causal, q, k, v, do, passes)
                                base["flex_ms"] = bench_ms(step, False)
                            except Exception as e:
                                print(f"flex failed (D{D} N{N} c{int(causal)} {passes}): {type(e).__name__}: {e}")
                        if not args.no_unfused:
                            fn = unfused_fn(causal, q, k, v, do, passes)
                            if fn is not None:
                                base["unfused_ms"] = bench_ms(fn, False)
                            torch.cuda.empty_cache()
                    for policy in policies:
                        spec = make_spec(policy, causal, dtype)
                        ms = bench_ms(attncomp_fn(policy, causal, q, k, v, do, passes), args.smoke)
                        dens = 1.0 if policy != "dfss" else dfss_density(spec.policy.n, spec.policy.m, N, causal)
                        row = dict(policy=policy, **{"pass": passes}, B=B, H=H, D=D, N=N, causal=causal,
                                   dtype="bfloat16", attncomp_ms=ms, **base, density=round(dens, 4),
                                   flex_build_ms=flex_build,
                                   tflops=flops(B, H, N, D, causal, passes) / ms * 1e-9,
                                   config={"fwd": TB.last_configs.get("fwd"),
                                           "bwd": TB.last_configs.get("bwd") if passes != "fwd" else None})
                        rows.append(row)
                        print(_fmt_row(row), flush=True)
                        if os.environ.get("OUT") and not args.smoke:  # partial results survive a timeout
                            with open(os.path.join(os.environ["OUT"], "rows.jsonl"), "a") as f:
                                f.write(json.dumps(row) + "\n")
                    del q, k, v, do
                    if not args.smoke:
                        torch.cuda.empty_cache()
    return rows


def _ratio(a, b) -> str:
    return f"{a / b:5.2f}" if a and b else "    -"


def _fmt_row(r) -> str:
    def ms(x):
        return f"{x:9.3f}" if x is not None else "        -"

    return (f"{r['policy']:6s} {r['pass']:8s} D{r['D']:<4d} N{r['N']:<6d} {'causal' if r['causal'] else 'full  '}"
            f" {ms(r['attncomp_ms'])} {ms(r['sdpa_ms'])} {ms(r.get('sdpa_flash_ms'))} {ms(r['flex_ms'])}"
            f" {ms(r['unfused_ms'])}"
            f"  {r['density']:5.3f} {_ratio(r['sdpa_ms'], r['attncomp_ms'])}"
            f" {_ratio(r['flex_ms'], r['attncomp_ms'])} {_ratio(r['unfused_ms'], r['attncomp_ms'])}"
            f" {r['tflops']:6.0f}")


HEADER = (f"{'policy':6s} {'pass':8s} {'D':5s} {'N':7s} {'mask':6s} {'attncomp':>9s} {'sdpa':>9s} {'sdpa_fa2':>9s}"
          f" {'flex':>9s}"
          f" {'unfused':>9s}  {'dens':>5s} {'x_sdpa':>5s} {'x_flx':>5s} {'x_unf':>5s} {'TF/s':>6s}")


def write_results(args, rows, policies):
    import torch
    import triton

    doc = {"machine": _machine(args), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    paths = [args.out]
    if os.environ.get("OUT") and not args.smoke:
        paths.append(os.path.join(os.environ["OUT"], "h200.json"))
    old_rows = []
    if os.path.exists(args.out):
        try:
            with open(args.out) as f:
                old_rows = json.load(f).get("rows", [])
        except (OSError, ValueError):
            old_rows = []
    doc["rows"] = [r for r in old_rows if r.get("policy") not in policies] + rows
    for p in paths:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        tmp = p + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, p)
    try:
        plot(doc["rows"], [os.path.splitext(p)[0] + ".png" for p in paths])
    except Exception as e:  # the numbers matter more than the picture
        print(f"plot failed: {type(e).__name__}: {e}")
    return doc


def _machine(args) -> str:
    import torch

    if args.smoke or not torch.cuda.is_available():
        return f"cpu ({platform.processor() or platform.machine()}), triton interpreter"
    return torch.cuda.get_device_name()


def plot(rows, paths):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    panels = sorted({(r["pass"], r["D"], r["causal"]) for r in rows}, key=lambda t: (t[0] != "fwd", t[1], t[2]))
    if not panels:
        return
    cols = 4
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (ps, D, causal) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["pass"], r["D"], r["causal"]) == (ps, D, causal)]
        ns = sorted({r["N"] for r in sel})
        series = {f"attncomp {p}": [next((r["attncomp_ms"] for r in sel if r["N"] == n and r["policy"] == p), None)
                                   for n in ns] for p in sorted({r["policy"] for r in sel})}
        for base in ("sdpa", "flex", "unfused"):
            series[base] = [next((r[f"{base}_ms"] for r in sel if r["N"] == n), None) for n in ns]
        for name, ys in series.items():
            pts = [(n, y) for n, y in zip(ns, ys) if y]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                        linestyle="--" if not name.startswith("attncomp") else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{ps}, D={D}, {'causal' if causal else 'full'}")
        ax.set_xlabel("N")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("attention, bf16, B=4, H=16 (lower is better)")
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.no_flex = args.no_unfused = True
        args.out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "attncomp-smoke.json")
    os.environ["ATTNCOMP_TRITON_TUNE"] = "1" if args.tune else "0"
    import torch

    policies = [p for p in args.policies.split(",") if p]
    passes_list = [p for p in args.passes.split(",") if p]
    dims = [int(d) for d in args.dims.split(",")]
    causals = [bool(int(c)) for c in args.causal.split(",")]
    dtype = torch.bfloat16
    if args.smoke:
        dims = [32]

    t0 = time.perf_counter()
    tasks = []
    # a fwd+bwd task compiles the forward kernels too
    warm_passes = ["fwd+bwd"] if "fwd+bwd" in passes_list else passes_list
    for policy in policies:
        for D in dims:
            for causal in causals:
                for passes in warm_passes:
                    pairs = candidate_pairs(policy, D, dtype, args.sweep, args.tune)
                    # one task per configuration: compile time spreads over the workers
                    for pair in pairs:
                        tasks.append(dict(kind="attncomp", policy=policy, D=D, causal=causal, passes=passes,
                                          configs=[pair], H=2 if args.smoke else args.heads,
                                          N=64 if args.smoke else 512, smoke=args.smoke))
    if not (args.no_flex or args.sweep):
        for D in dims:
            for causal in causals:
                for passes in passes_list:
                    for N in ns_of(args):
                        tasks.append(dict(kind="flex", D=D, causal=causal, passes=passes, B=args.batch,
                                          H=args.heads, N=N))
    if not args.smoke or os.environ.get("ATTNCOMP_BENCH_SMOKE_WARM") == "1":
        warm_up(tasks, args.workers)

    if args.sweep:
        res = sweep(args, policies, dims, causals, passes_list)
        out = os.path.join(os.environ.get("OUT", os.path.join(HERE, "results")), "sweep.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nsweep written to {out}; {time.perf_counter() - t0:.0f}s")
        return

    rows = run_table(args, policies, dims, causals, passes_list)
    write_results(args, rows, policies)
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f}s; JSON: {args.out}")
    print("ratios: baseline ms / attncomp ms (x_sdpa is against dense SDPA for every policy)")
    print(HEADER)
    for r in rows:
        print(_fmt_row(r))


if __name__ == "__main__":
    main()
