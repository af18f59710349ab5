"""SPION pattern generation time (Alg. 3-4): the patterns of a 12-layer model at L=4096, B=64.

Each layer's averaged attention map ``(L, L)`` (softmax rows of random logits with a local band and a
few global columns, the structure the flood fill follows) is built on the device first; the timed
region is ``attncomp.spion.generate_pattern`` over every layer (convolution, pooling, quantile, flood
fill), synchronised, median of ``--repeats`` after one warm-up. Target: under one second.

    python benchmarks/spion_patterns.py                    # CPU here, CUDA when there is a GPU
    python benchmarks/spion_patterns.py --smoke            # tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attncomp.spion import generate_pattern, pattern_from_pool, pool_map  # noqa: E402


def layer_map(L: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    s = torch.randn(L, L, generator=g, device=device)
    i = torch.arange(L, device=device)
    s += 4.0 * ((i[:, None] - i[None, :]).abs() < 48)  # local band
    s[:, torch.randint(0, L, (8,), generator=g, device=device)] += 3.0  # global columns
    return s.softmax(-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.length, args.block, args.repeats = 2, 256, 16, 1
    dev = torch.device(args.device)
    maps = [layer_map(args.length, s, dev) for s in range(args.layers)]

    def run():
        pats = [generate_pattern(m, args.block) for m in maps]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return pats

    pats = run()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)

    def stage(fn):  # one stage over every layer, synchronised
        t = time.perf_counter()
        res = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return res, time.perf_counter() - t

    pools, t_pool = stage(lambda: [pool_map(m, args.block) for m in maps])
    _, t_fill = stage(lambda: [pattern_from_pool(p) for p in pools])
    dens = sum(float(p.float().mean()) for p in pats) / len(pats)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    row = dict(device=name, layers=args.layers, L=args.length, block=args.block, seconds=med, density=dens,
               pool_seconds=t_pool, fill_seconds=t_fill,
               torch=torch.__version__, threads=torch.get_num_threads())
    print(f"SPION patterns: {args.layers} layers, L={args.length}, B={args.block} on {name}: {med:.3f} s "
          f"(median of {args.repeats}; target < 1 s), mean density {dens:.3f}; filter+pooling {t_pool:.3f} s, "
          f"quantile+flood fill {t_fill:.3f} s")
    out = args.json or (os.path.join(os.environ["OUT"], "spion_patterns.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
