"""Distributed benchmark: compiled models under DDP/FSDP2, and context-parallel attention.

Two parts, run in ``--gpus`` spawned processes (NCCL on GPUs, gloo on the CPU), every process with
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` (NVLink
multicast stays off):

* ``train``: a Llama-style model (4 layers, hidden 2048, 32 query / 8 KV heads of 64, RMSNorm, RoPE,
  SwiGLU) trained under ``DistributedDataParallel`` and under FSDP2 (``fully_shard`` per layer and
  at the root), eager and compiled by ``attncomp.compile`` with the ``dense`` and ``hash`` policies;
  median step time (forward, backward, optimizer step) per rank, the slowest rank reported, and the
  ratio compiled / eager under the same wrapper (target <= 1).
* ``cp``: ``attncomp.distributed.context_parallel_attention`` at N = 65536 and 131072 over the
  ranks against one GPU running the whole sequence through ``attncomp.functional.attention``
  (policies ``dense`` and ``drop``; causal with the balanced layout, and non-causal); per-rank time
  (the slowest rank) and scaling efficiency ``t_one / (world * t_rank)`` (target >= 0.9, i.e.
  ``t_rank <= 0.55 t_one`` on 2 GPUs).

Results go to ``benchmarks/results/distributed_<device>x<gpus>.json`` (and ``$OUT`` when set), replacing the
file; a table is printed last. A configuration that fails records its error and the run goes on.

    python -m attncomp bench distributed                 # 2 GPUs, both parts
    python -m attncomp bench distributed --parts cp --ns 65536
    python -m attncomp bench distributed --smoke         # CPU, gloo, 2 processes, tiny shapes (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(_NO_MULTICAST)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attncomp bench distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes: the plumbing in well under a minute")
    ap.add_argument("--gpus", type=int, default=2, help="processes (one GPU each)")
    ap.add_argument("--parts", default="train,cp", help="comma-separated, run in this order: train, cp")
    ap.add_argument("--policies", default="dense,hash", help="policies of the compiled model (train)")
    ap.add_argument("--wrappers", default="ddp,fsdp2")
    ap.add_argument("--cp-policies", default="dense,drop")
    ap.add_argument("--ns", default=None, help="context-parallel sequence lengths (default 65536,131072)")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch of the train part (default 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length of the train part (default 2048)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/distributed_<device>x<gpus>.json)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the whole run (default 3000; smoke 120)")
    a = ap.parse_args(argv)
    bad = [p for p in a.parts.split(",") if p not in ("train", "cp")]
    if bad:
        ap.error(f"unknown part(s) {', '.join(bad)}; valid: train, cp")
    if a.smoke:
        a.steps = a.steps or 2
        a.timeout = a.timeout or 120
    a.steps = a.steps or 10
    a.timeout = a.timeout or 3000
    return a


# ---------------------------------------------------------------------------------------------
# The model of the train part.

def llama_config(smoke: bool) -> Dict[str, int]:
    if smoke:
        return dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
    return dict(layers=4, hidden=2048, heads=32, kv_heads=8, ffn=5632, vocab=32000)


def build_llama(cfg: Dict[str, int]):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.eps = eps

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight

    def rope(x, pos):
        d = x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        ang = pos[:, None].float() * inv[None]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            h, self.nh, self.nkv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
            self.hd = h // self.nh
            self.q = nn.Linear(h, self.nh * self.hd, bias=False)
            self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
            self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
            self.o = nn.Linear(self.nh * self.hd, h, bias=False)

        def forward(self, x):
            B, N, _ = x.shape
            pos = torch.arange(N, device=x.device)
            q = rope(self.q(x).view(B, N, self.nh, self.hd).transpose(1, 2), pos)
            k = rope(self.k(x).view(B, N, self.nkv, self.hd).transpose(1, 2), pos)
            v = self.v(x).view(B, N, self.nkv, self.hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o(a.transpose(1, 2).reshape(B, N, -1))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            h, f = cfg["hidden"], cfg["ffn"]
            self.n1, self.attn, self.n2 = RMSNorm(h), Attention(), RMSNorm(h)
            self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), \
                nn.Linear(f, h, bias=False)

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
            self.layers = nn.ModuleList([Layer() for _ in range(cfg["layers"])])
            self.norm = RMSNorm(cfg["hidden"])
            self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    return Llama()


# ---------------------------------------------------------------------------------------------
# Timing.

def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, steps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in ms after ``warmup`` calls (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def slowest(ms: float, device) -> float:
    """The largest of the ranks' times (each rank times its own work)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:400]


def _all_ok(ok: bool, device) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


# ---------------------------------------------------------------------------------------------
# Part 1: DDP / FSDP2 training steps.

def train_rows(args, rank, world, device, dtype, emit) -> None:
    import torch
    import torch.distributed as dist

    import attncomp

    cfg = llama_config(args.smoke)
    B = args.batch or (2 if not args.smoke else 2)
    N = args.seq or (2048 if not args.smoke else 32)
    rows = []
    mesh = None
    for wrapper in args.wrappers.split(","):
        eager_ms = None
        for variant in ["eager"] + args.policies.split(","):
            row = {"part": "train", "wrapper": wrapper, "variant": variant, "batch_per_rank": B, "seq": N,
                   "world": world, **{f"model_{k}": v for k, v in cfg.items()}}
            try:
                torch.manual_seed(0)
                model = build_llama(cfg).to(device=device, dtype=dtype)
                run = model if variant == "eager" else attncomp.compile(model, policy=variant)
                if wrapper == "ddp":
                    from torch.nn.parallel import DistributedDataParallel as DDP

                    run = DDP(run, device_ids=[device.index] if device.type == "cuda" else None)
                elif wrapper == "fsdp2":
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.fsdp import fully_shard

                    mesh = mesh or init_device_mesh(device.type, (world,))
                    for layer in model.layers:
                        fully_shard(layer, mesh=mesh)
                    fully_shard(run, mesh=mesh)
                else:
                    raise ValueError(f"unknown wrapper {wrapper!r}; valid: ddp, fsdp2")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                g = torch.Generator(device="cpu").manual_seed(100 + rank)
                tokens = torch.randint(0, cfg["vocab"], (B, N + 1), generator=g).to(device)

                def step():
                    logits = run(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg["vocab"]),
                                                             tokens[:, 1:].reshape(-1))
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                ms = time_ms(step, device, args.steps)
                ok = True
            except Exception as e:  # recorded; the other ranks fail the same way (same code, same shapes)
                ok, ms = False, None
                row["error"] = _err(e)
                if rank == 0:
                    traceback.print_exc()
            if _all_ok(ok, device):
                row["step_ms"] = slowest(ms, device)
                if variant == "eager":
                    eager_ms = row["step_ms"]
                elif eager_ms:
                    row["vs_eager"] = row["step_ms"] / eager_ms
                if variant != "eager":
                    try:
                        row["sites_rewritten"] = attncomp.report(
                            run.module if wrapper == "ddp" else run).rewritten
                    except Exception as e:
                        row["report_error"] = _err(e)
            elif "error" not in row:
                row["error"] = "failed on another rank"
            emit(row)
            model = run = opt = step = None  # free this configuration before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()


# ---------------------------------------------------------------------------------------------
# Part 2: context-parallel attention vs one device.

def cp_rows(args, rank, world, device, dtype, emit) -> None:
    import torch
    import torch.distributed as dist

    import attncomp
    from attncomp.distributed import context_parallel_attention, shard_sequence

    ns = [int(x) for x in args.ns.split(",")] if args.ns else ([64] if args.smoke else [65536, 131072])
    B, Hq, Hk, D = (1, 4, 2, 16) if args.smoke else (1, 32, 8, 64)
    rows = []
    for N in ns:
        for policy in args.cp_policies.split(","):
            for causal, layout in ((True, "balanced"), (False, "contiguous")):
                for passes in ("fwd", "fwd+bwd"):
                    row = {"part": "cp", "N": N, "policy": policy, "causal": causal, "layout": layout,
                           "passes": passes, "world": world, "B": B, "Hq": Hq, "Hk": Hk, "D": D}
                    g = torch.Generator(device="cpu").manual_seed(N)
                    full = [torch.randn(B, h, N, D, generator=g).to(device=device, dtype=dtype)
                            for h in (Hq, Hk, Hk)]
                    dO = torch.randn(B, Hq, N, D, generator=g).to(device=device, dtype=dtype)

                    def make(fn, tensors, grad):
                        ts = [t.detach().clone().requires_grad_(passes != "fwd") for t in tensors]

                        def run():
                            if passes == "fwd":
                                with torch.no_grad():
                                    fn(*ts)
                            else:
                                fn(*ts).backward(grad)
                        return run

                    # one device, the whole sequence (rank 0 alone; the others wait)
                    one = None
                    if rank == 0:
                        try:
                            one = time_ms(make(lambda q, k, v: attncomp.functional.attention(
                                q, k, v, is_causal=causal, policy=policy, enable_gqa=True), full, dO),
                                device, args.steps)
                        except Exception as e:
                            row["one_error"] = _err(e)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    dist.barrier()
                    shards = [shard_sequence(t, rank, world, layout) for t in full]
                    del full
                    try:
                        ms = time_ms(make(lambda q, k, v: context_parallel_attention(
                            q, k, v, is_causal=causal, policy=policy, layout=layout), shards,
                            shard_sequence(dO, rank, world, layout)), device, args.steps)
                        ok = True
                    except Exception as e:
                        ok, ms = False, None
                        row["error"] = _err(e)
                    del shards, dO
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if _all_ok(ok, device):
                        row["rank_ms"] = slowest(ms, device)
                    elif "error" not in row:
                        row["error"] = "failed on another rank"
                    if one is not None:
                        row["one_device_ms"] = one
                        if "rank_ms" in row:
                            row["rank_over_one"] = row["rank_ms"] / one
                            row["scaling_efficiency"] = one / (world * row["rank_ms"])
                    emit(row)
                    dist.barrier()


# ---------------------------------------------------------------------------------------------
# Processes.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args, outdir: str) -> None:
    os.environ.update(_NO_MULTICAST)
    import torch
    import torch.distributed as dist

    if args.smoke:
        device, backend, dtype = torch.device("cpu"), "gloo", torch.float32
        torch.set_num_threads(1)
    else:
        device, backend, dtype = torch.device("cuda", rank), "nccl", torch.bfloat16
        torch.cuda.set_device(device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(60, int(args.timeout))), **kw)
    rows = []

    def emit(row):  # rank 0 keeps the rows so far on disk: a run stopped by --timeout still reports them
        rows.append(row)
        if rank == 0:
            with open(os.path.join(outdir, "rows.json"), "w") as f:
                json.dump(rows, f)

    try:
        for part in args.parts.split(","):  # in the order given
            {"train": train_rows, "cp": cp_rows}[part](args, rank, world, device, dtype, emit)
        # every rank reaches the end before any tears the group down: rank 0 aborted now and then at
        # teardown ("terminate called without an active exception", CPU smoke run under load), most
        # likely because a peer closed its gloo connections while rank 0 still timed its rows. Only on
        # success: after an error the group is torn down at once, so the error is not a hang.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _device_name(smoke: bool) -> str:
    from benchmarks import common as C

    return "cpu" if smoke else C.device_tag()


def main(argv=None) -> int:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    args = parse_args(argv)
    world = args.gpus
    if not args.smoke:
        if torch.cuda.device_count() < world:
            print(f"needs {world} GPUs, found {torch.cuda.device_count()} (use --smoke on a CPU)")
            return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), args, outdir), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout
        stopped = None
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    stopped = f"stopped by --timeout after {args.timeout:.0f} s; the rows measured before are kept"
                    print(stopped, file=sys.stderr)
                    break
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        rows = []
        if os.path.exists(os.path.join(outdir, "rows.json")):
            with open(os.path.join(outdir, "rows.json")) as f:
                rows = json.load(f)
        if stopped and not rows:
            raise TimeoutError(f"the benchmark measured nothing within {args.timeout:.0f} s")
    return finish(args, world, rows, time.time() - t0, argv, stopped)


def finish(args, world, rows, seconds, argv=None, stopped=None) -> int:
    from benchmarks import common as C

    dev = _device_name(args.smoke)
    doc = C.document("distributed", rows, argv, device=dev, gpus=0 if args.smoke else world, processes=world,
                     backend="gloo" if args.smoke else "nccl", smoke=bool(args.smoke), seconds=round(seconds, 1),
                     **({"stopped": stopped} if stopped else {}))
    paths = C.write(doc, args.out or C.results_path("distributed", f"{dev}x{world}"))
    print(table(rows))
    print(f"\nwritten: {', '.join(paths)}")
    return 1 if stopped else 0


def table(rows) -> str:
    def f(x, nd=2):
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    out = ["train (step ms, slowest rank; ratio compiled/eager under the same wrapper, target <= 1)",
           f"{'wrapper':8} {'variant':8} {'step ms':>10} {'vs eager':>9}  note"]
    for r in rows:
        if r["part"] == "train":
            out.append(f"{r['wrapper']:8} {r['variant']:8} {f(r.get('step_ms')):>10} {f(r.get('vs_eager')):>9}  "
                       f"{r.get('error', '')}")
    out += ["", "context parallel (per-rank ms, slowest rank, vs one device on the whole sequence; "
                "efficiency target >= 0.9)",
            f"{'N':>7} {'policy':6} {'causal':6} {'layout':10} {'passes':7} {'one ms':>9} {'rank ms':>9} "
            f"{'rank/one':>8} {'eff':>5}  note"]
    for r in rows:
        if r["part"] == "cp":
            out.append(f"{r['N']:>7} {r['policy']:6} {str(r['causal']):6} {r['layout']:10} {r['passes']:7} "
                       f"{f(r.get('one_device_ms')):>9} {f(r.get('rank_ms')):>9} {f(r.get('rank_over_one')):>8} "
                       f"{f(r.get('scaling_efficiency')):>5}  {r.get('error', r.get('one_error', ''))}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
