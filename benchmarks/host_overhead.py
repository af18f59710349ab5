"""Host overhead per attention call at a tiny shape: attncomp's op path against SDPA.

At ``(1, 2, 16, 16)`` the arithmetic is negligible, so the time per call is what the host spends:
argument checks, spec handling, backend choice, deriving policy tensors, launching kernels. Rows:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (the floor);
* ``functional``: ``attncomp.functional.attention`` (checks + spec per call, then the op);
* ``op``: ``torch.ops.attncomp.attention`` called directly, as a compiled graph calls it (``hash``
  also without buckets, ``causal,derived``: compiled graphs leave them to the op);
* with ``--backward``: forward + backward of each.

Usage: ``python benchmarks/host_overhead.py [--device cpu|cuda] [--iters N] [--backward] [--json PATH]``.
Prints one line per (path, policy, mask) with the median microseconds per call over 7 repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import attncomp
from attncomp.functional import attention
from attncomp.ops import materialize_aux
from attncomp.policy import SPION, get_policy
from attncomp.spec import AttentionSpec


def _time_us(fn, iters: int, device) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    reps = []
    for _ in range(7):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        reps.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (1: host cost without OpenMP noise on a shared machine)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 16, 16
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=args.backward) for _ in range(3))
    kv = torch.rand(B, N, device=dev) < 0.8
    rows = []

    def run(name, policy, mask, fn):
        if args.backward:
            def step():
                o = fn()
                o.sum().backward()
        else:
            step = fn
        try:
            with torch.set_grad_enabled(args.backward):
                us = _time_us(step, args.iters, dev)
        except Exception as e:  # one failing row does not stop the others
            print(f"{name:11s} {policy:6s} {mask:14s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        rows.append({"path": name, "policy": policy, "mask": mask, "us": round(us, 1), "device": str(dev),
                     "backward": args.backward})
        print(f"{name:11s} {policy:6s} {mask:14s} {us:8.1f} us/call", flush=True)

    run("sdpa", "-", "none", lambda: F.scaled_dot_product_attention(q, k, v))
    run("sdpa", "-", "causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    for pol in ("dense", "dfss", "hash", "drop", "spion", "et"):
        p = SPION(block_size=16) if pol == "spion" else pol
        extra = {"block_pattern": torch.ones(1, 1, 1, dtype=torch.bool, device=dev)} if pol == "spion" else {}
        run("functional", pol, "none", lambda: attention(q, k, v, policy=p, **extra))
        run("functional", pol, "causal", lambda: attention(q, k, v, policy=p, is_causal=True, **extra))
        run("functional", pol, "causal+padding",
            lambda: attention(q, k, v, policy=p, is_causal=True, k_valid=kv, **extra))
        spec = AttentionSpec(causal=True, policy=get_policy(p).resolved(dtype))
        sj = spec.to_json()
        qa, ka = materialize_aux(spec, q, k)
        bp = extra.get("block_pattern")
        run("op", pol, "causal", lambda: torch.ops.attncomp.attention(
            q, k, v, None, qa, ka, bp, None, None, None, None, None, None, sj, 0.0, 0)[0])
        if pol == "hash":  # as compiled graphs call it: no buckets, the op derives them
            run("op", pol, "causal,derived", lambda: torch.ops.attncomp.attention(
                q, k, v, None, None, None, None, None, None, None, None, None, None, sj, 0.0, 0)[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, H, N, D], "dtype": str(dtype), "torch": torch.__version__,
                       "attncomp": getattr(attncomp, "__version__", None), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
