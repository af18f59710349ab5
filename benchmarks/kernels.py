"""Kernel benchmark: attncomp's attention kernels against SDPA, FlexAttention and the unfused chain.

Protocol (BENCHMARKS.md): on the GPU, bf16, B=4, H=16, D in {64, 128}, N in {1024, 4096, 16384},
causal and not, forward and forward+backward; median of ``triton.testing.do_bench`` on fresh random
inputs; every baseline timed in the same process on the same shapes:

* ``sdpa``: ``F.scaled_dot_product_attention`` with torch's own backend choice (cuDNN on Hopper), and
  ``sdpa_flash`` restricted to the FlashAttention-2 backend;
* ``flex``: ``flex_attention`` under ``torch.compile`` with the same mask as a ``BlockMask``
  (``None`` when not causal); the block mask's build time is reported separately;
* ``unfused``: ``softmax(q @ k^T * scale [+ causal mask]) @ v`` in bf16, the DFSS paper's baseline
  (skipped where its N x N tensors would not fit the GPU).

attncomp is timed through its Triton backend functions (``attention_forward``/``attention_backward``: the
kernels plus their host-side launch code). Sparse policies also report their density (kept /
allowed entries). Ratios are baseline time / attncomp time (> 1: attncomp is faster); for every
policy the SDPA column is dense attention, the number the policy has to beat.

Tables (``--table``): ``policies`` (the rows above), ``structured`` (structured-mask predicates and SPION
block patterns, see :func:`run_structured`), ``all``. ``--backend tvm`` runs the TVM backend's rows instead
(:mod:`benchmarks._tvm`: the ``llvm`` kernels on a CPU, prebuilt cubins on a GPU; table ``tvm``).

Output: a table (printed last) and ``benchmarks/results/kernels_<device>.json`` (``h100``, ``h200``, ``cpu``; a copy
under ``$OUT`` when set). A run replaces the rows it measures (its tables and policies) and keeps the others;
the plot ``kernels_<device>.png`` (speedup over SDPA against N, per policy) is redrawn from the policy rows.

Kernels are compiled ahead in parallel worker processes (Triton's and Inductor's disk caches are
shared), so the timed process only loads them. ``--sweep`` times every candidate configuration of
the Triton kernels instead (used to choose the defaults in ``attncomp/codegen/triton/configs.py``).
``--smoke`` runs the plumbing on the CPU through Triton's interpreter on tiny shapes (written under ``$TMPDIR``).

    python -m attncomp bench kernels --policies dense,dfss,hash,drop --ns 4096,16384 --no-unfused
    python -m attncomp bench kernels --table structured
    python -m attncomp bench kernels --backend tvm --device cpu
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

from benchmarks import common as C  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attncomp bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="triton", choices=("triton", "tvm"),
                    help="triton (default): the policy and structured tables; tvm: the TVM backend's rows "
                         "(python -m attncomp bench kernels --backend tvm --help lists their options)")
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
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<device>.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check under TRITON_INTERPRET=1 "
                                                         "(JSON under $TMPDIR unless --out)")
    ap.add_argument("--table", default="policies", choices=("policies", "structured", "all"),
                    help="policies: the policy table; structured: predicate and spion rows (see run_structured)")
    ap.add_argument("--structured-rows", default="predicates,spion", help="which rows --table structured runs")
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

    if smoke:  # the interpreter compiles nothing: one call is the measurement
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


def candidate_pairs(policy, D, dtype, sweep: bool, tune: bool, causal: bool = False):
    """The (fwd, bwd) configurations the run will launch: all candidates, or the defaults."""
    import torch
    from attncomp.codegen.triton import configs

    nm_m = 1
    if policy == "dfss":
        nm_m = make_spec(policy, False, dtype).policy.m
    gpu = configs.gpu_tag(torch.device("cuda")) if torch.cuda.is_available() else ""
    fw = configs.fwd_candidates(D, D, dtype, nm_m, gpu=gpu, bounded=causal)
    bw = configs.bwd_candidates(D, D, dtype, nm_m, gpu=gpu, bounded=causal)
    if not (sweep or tune):
        fw, bw = fw[:1], bw[:1]
    n = max(len(fw), len(bw))
    return [(fw[min(i, len(fw) - 1)], bw[min(i, len(bw) - 1)]) for i in range(n)]


# ---------------------------------------------------------------------------------------------

def _atomic_name(mode) -> str:
    return "" if not mode else ("+tmadq" if int(mode) == 2 else "+atomic")


def config_name(c: dict) -> str:
    """``128x64w8s3+tma``: a launch configuration in a word (``T``: key tiles outer, ``NATURAL=0``;
    ``+dq...``: the dQ launch's tiles, warps and stages; ``+atomic``/``+tmadq``: dQ added in the dK/dV
    launch by element atomics / TMA bulk reductions; ``gluon 64x128w4s2v1``: the Gluon Hopper forward's
    tiles, warps, key-ring and value-ring depths; `` ws``/`` wsnp``: its warp-specialised kernel with or
    without turns, ``+ptx``/``+p32`` its keys ``KEEP_PTX``/``P_F32``; ``gluon dkdv 64x64s2+dq...``: the
    backward's Gluon dK/dV pass, then the template's dQ pass, ``+gdq64x64s2`` the Gluon dQ pass, ``+tmadq`` dQ
    added in the dK/dV pass; ``gluon bwd ws 64x128s2``: the backward's warp-specialised kernel, 64-query steps,
    128-key blocks, ring slots)."""
    if c.get("KERNEL") == "gluon" and c.get("DQ") and c.get("WS"):  # the backward's warp-specialised kernel
        return f"gluon bwd ws 64x128s{c['WS']}"
    if c.get("KERNEL") == "gluon" and c.get("DQ"):  # the backward's Gluon dK/dV pass, then a dQ pass
        dq = ("+gdq%dx%ds%d" % tuple(c["DQ_GLUON"]) if c.get("DQ_GLUON") and not c.get("DQ_ATOMIC") else
              "+tmadq" if c.get("DQ_ATOMIC") else f"+dq{'x'.join(map(str, c['DQ']))}")
        return f"gluon dkdv {c['BLOCK_M']}x{c['BLOCK_N']}s{c['STAGES']}{dq}"
    if c.get("KERNEL") == "gluon":
        ws = (" ws" if c.get("PINGPONG", True) else " wsnp") if c.get("WS") else ""
        rings = f"s{c['STAGES']}v{c.get('V_STAGES', c['STAGES'])}"
        opts = f"{'+ptx' if c.get('KEEP_PTX') else ''}{'+p32' if c.get('P_F32') else ''}"
        return f"gluon {c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}{rings}{ws}{opts}"
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}{'T' if c.get('NATURAL') == 0 else ''}"
            f"{'+dq' + 'x'.join(map(str, c['DQ'])) if c.get('DQ') else ''}{'+tma' if c.get('TMA') else ''}"
            f"{'+tmaq' if c.get('TMA_Q') else ''}{_atomic_name(c.get('DQ_ATOMIC'))}"
            f"{'+nmexp' if c.get('NM_EXP') else ''}")


def _sweep_ms(fn, cfg) -> Optional[float]:
    """The time of one candidate (printed as it is measured), or ``None`` (printed) when it does not
    compile or run here."""
    try:
        ms = bench_ms(fn, False)
        print(f"  {cfg}: {ms:.3f} ms", flush=True)
        return ms
    except Exception as e:
        print(f"  config {cfg} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return None


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
                        ms = _sweep_ms(lambda: TB.attention_forward(spec, q, k, v, config=cfg), cfg)
                        if ms is not None:
                            res.append(dict(policy=policy, D=D, N=N, causal=causal, kernel="fwd", config=cfg, ms=ms))
                    if "fwd+bwd" in passes_list:
                        out, lse = TB.attention_forward(spec, q, k, v)
                        for cfg in configs.bwd_candidates(D, D, dtype, nm_m):
                            ms = _sweep_ms(lambda: TB.attention_backward(spec, q, k, v, None, out, lse, do,
                                                                         config=cfg), cfg)
                            if ms is not None:
                                res.append(dict(policy=policy, D=D, N=N, causal=causal, kernel="bwd", config=cfg,
                                                ms=ms))
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
        cells = "  ".join(f"{config_name(c['config'])}={c['ms']:.3f}" for c in rows)
        print(f"{key[0]:5s} D{key[1]:<3d} N{key[2]:<5d} c{int(key[3])} {key[4]}: {cells}")
    return res


def gemm_tflops(smoke: bool) -> Optional[float]:
    """The bf16 matmul ceiling of this GPU (TFLOP/s), measured now."""
    if smoke:
        return None
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, False)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def run_table(args, policies, dims, causals, passes_list) -> List[dict]:
    import torch
    from attncomp.codegen.triton import backend as TB

    dtype = torch.bfloat16
    dev = "cpu" if args.smoke else "cuda"
    B, H = (1, 2) if args.smoke else (args.batch, args.heads)
    ceiling = gemm_tflops(args.smoke)  # (each row's TFLOP/s as a fraction of it)
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
                        row = dict(table="policies", policy=policy, **{"pass": passes}, B=B, H=H, D=D, N=N, causal=causal,
                                   dtype="bfloat16", attncomp_ms=ms, **base, density=round(dens, 4),
                                   flex_build_ms=flex_build,
                                   tflops=flops(B, H, N, D, causal, passes) / ms * 1e-9, gemm_tflops=ceiling,
                                   config={"fwd": TB.last_configs.get("fwd"),
                                           "bwd": TB.last_configs.get("bwd") if passes != "fwd" else None})
                        row["of_gemm"] = row["tflops"] / ceiling if ceiling else None
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
            f" {r['tflops']:6.0f} {_frac(r.get('of_gemm'))}")


def _frac(x) -> str:
    return f"{x:6.2f}" if x is not None else "     -"


HEADER = (f"{'policy':6s} {'pass':8s} {'D':5s} {'N':7s} {'mask':6s} {'attncomp':>9s} {'sdpa':>9s} {'sdpa_fa2':>9s}"
          f" {'flex':>9s}"
          f" {'unfused':>9s}  {'dens':>5s} {'x_sdpa':>5s} {'x_flx':>5s} {'x_unf':>5s} {'TF/s':>6s} {'ofGEMM':>6s}")


def _out_path(args) -> str:
    if args.out:
        return args.out
    if args.smoke:
        return os.path.join(os.environ.get("TMPDIR", "/tmp"), "kernels_smoke.json")
    return C.results_path("kernels", _gpu_tag(args))


def write_results(args, rows, keep, argv=None) -> str:
    """Write this run's rows to the kernels results file, keeping the file's rows for which ``keep(row)``;
    redraw the plot from the file's policy rows."""
    path = _out_path(args)
    doc = C.document("kernels", rows, argv, device=_gpu_tag(args), device_name=_machine(args),
                     gemm_tflops=next((r.get("gemm_tflops") for r in rows if r.get("gemm_tflops")), None))
    paths = C.write(doc, path, keep=keep, copy_to_out=not args.smoke)
    doc = C.load(path) or doc
    if any(r.get("table", "policies") == "policies" for r in rows):
        try:
            plot(doc["rows"], [os.path.splitext(p)[0] + ".png" for p in paths], _machine(args))
        except Exception as e:  # the numbers matter more than the picture
            print(f"plot failed: {type(e).__name__}: {e}")
    return path


def _gpu_tag(args) -> str:
    return "cpu" if args.smoke else C.device_tag(_machine(args))


def _machine(args) -> str:
    import torch

    if args.smoke or not torch.cuda.is_available():
        return f"cpu ({platform.processor() or platform.machine()}), triton interpreter"
    return torch.cuda.get_device_name()


def plot(rows, paths, machine: str = ""):
    """Speedup over SDPA (its own backend choice, dense for every policy) against N, one line per policy
    (solid: full, dashed: causal), one panel per pass and head dim."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    rows = [r for r in rows if r.get("table", "policies") == "policies" and r.get("sdpa_ms") and r.get("attncomp_ms")]
    panels = sorted({(r["pass"], r["D"]) for r in rows}, key=lambda t: (t[0] != "fwd", t[1]))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    policies = sorted({r["policy"] for r in rows}, key=lambda p: ("dense", "dfss", "hash", "drop").index(p)
                      if p in ("dense", "dfss", "hash", "drop") else 9)
    colors = dict(zip(policies, ("C0", "C1", "C2", "C3", "C4", "C5")))
    for ax, (ps, D) in zip(axes.flat, panels):
        for policy in policies:
            for causal in (False, True):
                sel = sorted((r["N"], r["sdpa_ms"] / r["attncomp_ms"]) for r in rows
                             if (r["pass"], r["D"], r["policy"], r["causal"]) == (ps, D, policy, causal))
                if sel:
                    ax.plot([x for x, _ in sel], [y for _, y in sel], marker="o", color=colors[policy],
                            linestyle="--" if causal else "-", label=f"{policy}{' causal' if causal else ''}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ps}, D={D}")
        ax.set_xlabel("N")
        ax.set_ylabel("SDPA ms / attncomp ms")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"kernels, bf16, B=4, H=16: speedup over SDPA (dense) {machine}".strip())
    fig.tight_layout()
    for p in paths:
        fig.savefig(p, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", default="triton")
    known, rest = pre.parse_known_args(argv)
    if known.backend == "tvm":
        from benchmarks import _tvm

        return _tvm.main(rest, command_argv=argv)
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.no_flex = args.no_unfused = True
    os.environ["ATTNCOMP_TRITON_TUNE"] = "1" if args.tune else "0"
    os.environ["ATTNCOMP_AUTOTUNE"] = "1" if args.tune else "0"  # (a process measures only when asked)
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
                    pairs = candidate_pairs(policy, D, dtype, args.sweep, args.tune, causal)
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
    if args.table != "structured" and (not args.smoke or os.environ.get("ATTNCOMP_BENCH_SMOKE_WARM") == "1"):
        warm_up(tasks, args.workers)

    if args.sweep:  # a tuning aid, not a results file: under $OUT (or $TMPDIR) unless --out
        res = sweep(args, policies, dims, causals, passes_list)
        out = args.out or os.path.join(os.environ.get("OUT") or os.environ.get("TMPDIR", "/tmp"),
                                        f"kernels_sweep_{_gpu_tag(args)}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nsweep written to {out}; {time.perf_counter() - t0:.0f}s")
        return 0

    rows, tables = [], set()
    if args.table in ("structured", "all") or args.smoke:
        rows += run_structured(args)
        tables |= {t for t in ("predicates", "spion") if t in args.structured_rows.split(",")}
    if args.table != "structured":
        policy_rows = run_table(args, policies, dims, causals, passes_list)
        rows += policy_rows

    def keep(r):  # rows of the file this run does not measure again
        t = r.get("table", "policies")
        if t == "policies":
            return args.table == "structured" or r.get("policy") not in policies
        return t not in tables

    path = write_results(args, rows, keep, argv)
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f}s; JSON: {path}")
    if args.table != "structured":
        print("ratios: baseline ms / attncomp ms (x_sdpa is against dense SDPA for every policy)")
        print(HEADER)
        for r in policy_rows:
            print(_fmt_row(r))
    return 0


# ---------------------------------------------------------------------------------------------
# Structured masks and SPION (``--table structured``; ``--smoke`` runs them too, tiny and on CPU).
#
# Predicate rows: per policy (dense, dfss, hash, drop) and predicate kind (causal bottom-right with
# Nq = N/2 queries on N keys, a causal window of 4096, 8 packed documents, 25 % right padding),
# ``attncomp_ms`` with the predicates and ``full_ms`` without any mask (same policy, same shapes);
# ``allowed`` is the allowed fraction of the Nq x Nk entries and ``achieved_over_ideal`` =
# ``allowed * full_ms / attncomp_ms`` (1: time shrinks exactly with the allowed entries).
#
# SPION rows: bf16, B=4, H=16, D 64/128, N 4096/16384, forward and forward+backward, block patterns
# of density about 0.10 (``banded``: a band of blocks around the diagonal; ``flood``: what the
# convolutional flood fill gives on maps with local and vertical structure, a band with gaps plus
# stripes of global columns), against dense SDPA (its fastest backend) and FlexAttention given the
# same ``BlockMask``; ``x_sdpa`` over the ideal ``1/density`` is ``achieved_over_ideal``.

PRED_KINDS = ("causal_bottom_right", "window_4096", "docs_8", "right_pad_25")


def _pred_site(kind: str, B: int, N: int, device):
    """``(Nq, spec fields, Predicates, allowed fraction)`` of one predicate kind at length N."""
    import torch

    from attncomp.spec import Predicates

    if kind == "causal_bottom_right":
        nq = N // 2
        allowed = (nq * (N - nq) + nq * (nq + 1) / 2) / (nq * N)
        return nq, dict(causal=True, causal_align="bottom_right"), Predicates(), allowed
    if kind == "window_4096":
        w = min(4096, N // 4) if N < 16384 else 4096
        allowed = sum(min(i, w) + 1 for i in range(N)) / (N * N)
        return N, dict(causal=True, window_left=w), Predicates(), allowed
    if kind == "docs_8":
        seg = (torch.arange(N, device=device) * 8 // N)[None]
        return N, {}, Predicates(q_seg=seg, k_seg=seg), 1 / 8
    if kind == "right_pad_25":
        lens = torch.full((B,), N - N // 4, device=device)
        valid = torch.arange(N, device=device)[None] < lens[:, None]
        return N, {}, Predicates(q_valid=valid, k_valid=valid), 0.75 * 0.75
    raise ValueError(kind)


def spion_pattern(kind: str, nb: int, density: float = 0.10, seed: int = 0):
    """A ``(1, nb, nb)`` bool block pattern of about ``density`` (diagonal included)."""
    import torch

    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    if kind == "banded":
        w = max(0, round((density * nb - 1) / 2))
        return ((i - j).abs() <= w)[None]
    g = torch.Generator().manual_seed(seed)
    pat = (i - j).abs() <= 1  # the filter's diagonal response
    n_stripes = max(1, round(density * nb * 0.35))
    cols = torch.randperm(nb, generator=g)[:n_stripes]
    pat[:, cols] = True  # global tokens: vertical stripes
    pat[:max(1, nb // 64)] = True  # first rows: the fill's start
    while pat.float().mean() < density:  # local blobs along the diagonal, as the fill follows them
        c = int(torch.randint(0, nb, (1,), generator=g))
        r = min(nb - 1, max(0, c + int(torch.randint(-nb // 8, nb // 8 + 1, (1,), generator=g))))
        pat[r:r + 2, c:c + 2] = True
    return pat[None]


def _flex_block_mask(pattern, bs: int, B: int, H: int, N: int, device):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    pat = pattern[0].to(device)

    def mod(b, h, q_idx, kv_idx):
        return pat[q_idx // bs, kv_idx // bs] | (q_idx // bs == kv_idx // bs)

    return create_block_mask(mod, None, None, N, N, device=device, BLOCK_SIZE=bs)


def _time_site(spec, q, k, v, do, passes, smoke, **kw):
    from attncomp.codegen.triton import backend as TB

    def fwd():
        return TB.attention_forward(spec, q, k, v, None, **kw)

    if passes == "fwd":
        return bench_ms(fwd, smoke)

    def step():
        out, lse = fwd()
        TB.attention_backward(spec, q, k, v, None, out, lse, do, **kw)

    return bench_ms(step, smoke)


def run_structured(args) -> List[dict]:
    import torch

    from attncomp.policy import SPION
    from attncomp.spec import dtype_name

    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    B, H = (1, 2) if smoke else (args.batch, args.heads)
    Ds = [32] if smoke else [int(d) for d in args.dims.split(",")]
    passes_list = ["fwd+bwd"] if smoke else [p for p in args.passes.split(",") if p]
    rows = []
    # predicate rows
    N = 48 if smoke else 16384
    which = args.structured_rows.split(",")
    for policy in (("dense", "dfss", "hash", "drop") if "predicates" in which else ()):
        for kind in PRED_KINDS:
            for D in Ds[:1]:
                for passes in (["fwd"] if smoke else passes_list):
                    nq, fields, preds, allowed = _pred_site(kind, B, N, dev)
                    if smoke and kind == "window_4096":
                        fields["window_left"] = 12
                        allowed = sum(min(i, 12) + 1 for i in range(N)) / (N * N)
                    q, _, _, do = make_inputs(B, H, nq, D, dtype, dev)
                    _, k, v, _ = make_inputs(B, H, N, D, dtype, dev, seed=1)
                    spec = make_spec(policy, False, dtype).replace(**fields)
                    t = _time_site(spec, q, k, v, do, passes, smoke, preds=preds)
                    full = _time_site(make_spec(policy, False, dtype), q, k, v, do, passes, smoke)
                    rows.append(dict(table="predicates", policy=policy, predicate=kind, passes=passes, B=B, H=H,
                                     Nq=nq, Nk=N, D=D, dtype=dtype_name(dtype), attncomp_ms=t, full_ms=full,
                                     allowed=allowed, achieved_over_ideal=allowed * full / t))
                    print(_fmt_structured(rows[-1]), flush=True)
    # spion rows
    bs = 16 if smoke else 64
    for N in (() if "spion" not in which else [48] if smoke else ns_of(args) if args.ns else [4096, 16384]):
        for D in Ds:
            for pat_kind in ("banded", "flood"):
                pattern = spion_pattern(pat_kind, -(-N // bs), 0.10 if not smoke else 0.3).to(dev)
                density = _block_density(pattern, N, bs)
                spec = make_spec("dense", False, dtype).replace(policy=SPION(block_size=bs))
                q, k, v, do = make_inputs(B, H, N, D, dtype, dev)
                for passes in passes_list:
                    t = _time_site(spec, q, k, v, do, passes, smoke, block_pattern=pattern)
                    sd = bench_ms(sdpa_fn(False, q, k, v, do, passes, backend=None), smoke)
                    fx = None
                    if not (smoke or args.no_flex):
                        try:
                            bm = _flex_block_mask(pattern, bs, B, H, N, dev)
                            fx = bench_ms(_flex_step(q, k, v, do, passes, bm, bs), smoke)
                        except Exception as e:  # a row without the FlexAttention column, not a lost table
                            print(f"flex failed (spion D{D} N{N} {passes}): {type(e).__name__}: {str(e)[:200]}")
                    rows.append(dict(table="spion", policy="spion", predicate=pat_kind, passes=passes, B=B, H=H,
                                     Nq=N, Nk=N, D=D, dtype=dtype_name(dtype), block=bs, density=density,
                                     attncomp_ms=t, sdpa_ms=sd, flex_ms=fx, x_sdpa=sd / t,
                                     x_flex=None if fx is None else fx / t, ideal=1 / density,
                                     achieved_over_ideal=(sd / t) * density))
                    print(_fmt_structured(rows[-1]), flush=True)
    return rows


def _block_density(pattern, N: int, bs: int) -> float:
    import torch

    nb = pattern.shape[-1]
    keep = pattern[0].cpu() | torch.eye(nb, dtype=torch.bool)
    sizes = torch.full((nb,), bs)
    sizes[-1] = N - bs * (nb - 1)
    return float((keep.float() * sizes[:, None] * sizes[None, :]).sum() / (N * N))


def _flex_step(q, k, v, do, passes, block_mask, bs: int):
    """FlexAttention over a ``BlockMask`` of ``bs``-blocks: its kernels' tiles must divide the
    blocks (its default 128-query tiles do not divide 64), so they are set to fit."""
    import torch

    flex = _flex_compiled()
    t = min(bs, 64)
    opts = {"BLOCK_M": t, "BLOCK_N": t, "BLOCK_M1": t // 2, "BLOCK_N1": t, "BLOCK_M2": t, "BLOCK_N2": t // 2}
    if passes == "fwd":
        return lambda: flex(q, k, v, block_mask=block_mask, kernel_options=opts)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        out = flex(qg, kg, vg, block_mask=block_mask, kernel_options=opts)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return step


def _fmt_structured(r) -> str:
    extra = (f" sdpa {r['sdpa_ms']:.3f} ms x{r['x_sdpa']:.2f}" + (f" flex {r['flex_ms']:.3f} ms x{r['x_flex']:.2f}"
             if r.get("flex_ms") else "") + f" density {r['density']:.3f}") if r["table"] == "spion" else \
        f" full {r['full_ms']:.3f} ms allowed {r['allowed']:.3f}"
    return (f"{r['table']:10s} {r['policy']:6s} {r['predicate']:20s} {r['passes']:8s} D{r['D']} Nq{r['Nq']} Nk{r['Nk']}:"
            f" {r['attncomp_ms']:.3f} ms{extra} achieved/ideal {r['achieved_over_ideal']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
