"""The Gluon Hopper forward (``attncomp/codegen/triton/hopper.py``) checked and timed in one run, against
SDPA's cuDNN kernel (dense, for both policies) and the template's forward (this GPU's default
configuration), per policy (dense, DFSS 2:4), head dim, mask and configuration (tile sizes, warps, ring
depth). DFSS rows give the dense-equivalent TFLOP/s (the dense forward's FLOPs over the time).

First a correctness pass (odd ``N``, GQA, causal, heads-inner output, float16 and bfloat16) against
``attncomp.codegen.reference`` in float32 on the same inputs, then the timings; the table is printed
last, JSON goes to ``--out`` (default ``$OUT/gluon_fwd.json`` when ``$OUT`` is set). Rows: cuDNN, the template (``ATTNCOMP_GLUON=0``), what
a dense call runs by default, the Gluon kernel under its default configuration for (D, causal) and, at
``--variants-at`` lengths, under every other configuration (all through the backend's host path).

    python benchmarks/gluon_fwd.py                        # D 64/128, causal and not, N=16384
    python benchmarks/gluon_fwd.py --ns 4096,16384 --dims 128
    python benchmarks/gluon_fwd.py --policies dfss --variants-at 0
    python benchmarks/gluon_fwd.py --dims 128 --ns 4096 --variants-at 4096 --match 128x128w4s2v2 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention import attncomp_fn, bench_ms, config_name, flops, gemm_tflops, make_inputs, sdpa_fn  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, key ring, value ring[, kind]); kind "ws": the warp-specialised kernel (two
# or three consumer warp groups of 64 queries, taking turns when two, and a producer warp), "wsnp": without turns;
# "+ptx": the 2:4 selection in PTX (KEEP_PTX), "+p32": the probabilities carried in 32 bits (P_F32)
_OPTS = {"ptx": "KEEP_PTX", "p32": "P_F32"}
VARIANTS = {64: [(64, 128, 4, 2, 2), (64, 128, 4, 2, 1), (64, 64, 4, 2, 2), (128, 64, 8, 2, 2), (128, 128, 8, 2, 2),
                 (128, 128, 4, 2, 2, "ws"), (128, 128, 4, 3, 3, "ws"), (128, 128, 4, 2, 2, "wsnp"),
                 (128, 128, 4, 3, 3, "wsnp"), (128, 256, 4, 2, 2, "wsnp"), (192, 128, 4, 2, 2, "wsnp"),
                 (192, 128, 4, 3, 3, "wsnp"), (192, 64, 4, 3, 3, "wsnp"), (192, 64, 4, 4, 4, "wsnp")],
            128: [(128, 128, 8, 2, 2), (128, 128, 8, 2, 1), (64, 128, 4, 2, 1), (64, 64, 4, 2, 2), (64, 64, 4, 3, 3),
                  (64, 128, 4, 2, 2), (128, 128, 4, 2, 2, "ws"), (128, 128, 4, 2, 2, "wsnp"), (128, 64, 4, 3, 3, "ws"),
                  (128, 128, 4, 3, 2, "ws"), (128, 128, 4, 3, 2, "wsnp"), (128, 128, 4, 2, 1, "wsnp"),
                  (192, 64, 4, 2, 2, "wsnp"), (192, 64, 4, 3, 3, "wsnp")]}
for _D, _tiles in ((64, (128, 128, 4, 3, 3)), (128, (128, 128, 4, 2, 2))):
    VARIANTS[_D] += [_tiles + ("wsnp+" + o,) for o in ("ptx", "p32", "ptx+p32")]
CASES = [(2, 4, 2, 1000, 64, False, "bfloat16"), (1, 4, 4, 1000, 128, True, "float16"),
         (1, 2, 1, 130, 64, True, "bfloat16"), (1, 2, 2, 77, 128, False, "bfloat16"),
         (2, 2, 2, 4096, 128, True, "bfloat16"), (1, 8, 2, 2048, 64, True, "float16")]


def _cfg(v):
    bm, bn, w, s, vs = v[:5]
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, STAGES=s, V_STAGES=vs)
    if len(v) > 5:
        kind, *opts = v[5].split("+")
        cfg.update(WS=True, PINGPONG=kind == "ws")
        cfg.update({_OPTS[o]: True for o in opts})
    return cfg


def _name(v) -> str:
    return config_name(dict(_cfg(v), KERNEL="gluon"))


def check(variants, args) -> list:
    import torch

    from attncomp.codegen import reference as R
    from attncomp.codegen.triton import hopper
    from attncomp.ops import output_strides
    from attncomp.policy import DFSS, Dense
    from attncomp.spec import AttentionSpec

    out = []
    for (B, Hq, Hk, N, D, causal, dt), policy in ((c, p) for p in args.policies for c in CASES):
        nm24 = policy == "dfss"
        if nm24 and N % 4:
            N += 4 - N % 4  # the Gluon DFSS forward reads keys as (N/4, 4) groups
        dtype = getattr(torch, dt)
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hk, N, D, device="cuda", dtype=dtype)
        v = torch.randn(B, Hk, N, D, device="cuda", dtype=dtype)
        spec = AttentionSpec(causal=causal, policy=DFSS(2, 4) if nm24 else Dense())
        ro, rl = R.attention(q.float(), k.float(), v.float(), None, spec=spec)
        for var in variants[D]:
            o = torch.empty_strided((B, Hq, N, D), output_strides(B, Hq, N, D), device="cuda", dtype=dtype)
            o.fill_(float("nan"))
            lse = torch.full((B, Hq, N), float("nan"), device="cuda")
            hopper.forward(q, k, v, D ** -0.5, causal, 0, o, lse, _cfg(var), nm24)
            torch.cuda.synchronize()
            err_o = (o.float() - ro).abs().max().item()
            err_l = (lse - rl).abs().max().item()
            # the kernel is deterministic: repeated launches (the short launch path) give the same bits
            same = True
            for _ in range(args.repeat):
                o2, lse2 = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
                hopper.forward(q, k, v, D ** -0.5, causal, 0, o2, lse2, _cfg(var), nm24)
                same = same and torch.equal(o2, o) and torch.equal(lse2, lse)
            ok = err_o < 2e-2 and err_l < 1e-3 and same
            out.append(dict(policy=policy, case=[B, Hq, Hk, N, D, causal, dt], variant=_name(var), err_out=err_o,
                            err_lse=err_l, ok=ok))
            print(f"check {policy} {B}x{Hq}/{Hk}x{N}x{D} causal={causal} {dt} {_name(var)}: out {err_o:.2e} "
                  f"lse {err_l:.2e}"
                  f"{'' if same else ' (repeats differ)'} {'ok' if ok else 'FAIL'}", flush=True)
    return out


def run(args) -> list:
    import torch

    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import configs
    from attention import make_spec

    ceiling = gemm_tflops(False)
    rows, ran = [], []
    for policy, D, N, causal in itertools.product(args.policies, args.dims, args.ns, args.causal):
        q, k, v, _ = make_inputs(args.B, args.H, N, D, torch.bfloat16, "cuda")
        spec = make_spec(policy, causal, q.dtype)
        fl = flops(args.B, args.H, N, D, causal, "fwd")
        base = bench_ms(sdpa_fn(causal, q, k, v, None, "fwd", "cudnn"), False)
        os.environ["ATTNCOMP_GLUON"] = "0"
        try:
            timed = [("cudnn (dense)", base), ("template", bench_ms(attncomp_fn(policy, causal, q, k, v, None,
                                                                                "fwd"), False))]
        finally:
            del os.environ["ATTNCOMP_GLUON"]
        timed.append(("attncomp default", bench_ms(attncomp_fn(policy, causal, q, k, v, None, "fwd"),
                                                   False)))
        ran.append(f"{policy} D={D} N={N} causal={int(causal)}: {config_name(TB.last_configs['fwd'])}")
        default = configs.gluon_config(D, causal, policy == "dfss", N)  # None: the template's sites
        variants = VARIANTS[D] if N in args.variants_at else []
        cfgs = ([dict(default, KERNEL="gluon")] if default else []) + [
            dict(_cfg(x), KERNEL="gluon") for x in variants if _cfg(x) != default]
        runs = {}  # name -> its timings, one per round (with rounds, cuDNN's too)
        for _ in range(args.rounds):  # (in turn: a drift of the GPU's clocks reaches every configuration alike)
            if args.rounds > 1:
                runs.setdefault("cudnn (dense), in turn", []).append(
                    bench_ms(sdpa_fn(causal, q, k, v, None, "fwd", "cudnn"), False))
            for cfg in cfgs:
                name = config_name(cfg) + (" (default)" if default and cfg is cfgs[0] else "")
                try:  # through the backend's host path, as a model's call runs it
                    ms = bench_ms(lambda: TB.attention_forward(spec, q, k, v, config=cfg), False)
                except Exception as e:  # a configuration that does not fit is reported, the others go on
                    print(f"{name} D={D}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                runs.setdefault(name, []).append(ms)
        if args.rounds > 1:  # the ratios against cuDNN's median over the rounds
            base = statistics.median(runs["cudnn (dense), in turn"])
            for name, ms in runs.items():
                print(f"{policy} D={D} N={N} causal={int(causal)} {name}: rounds " + " ".join(f"{x:.3f}" for x in ms))
        timed += [(name, statistics.median(ms)) for name, ms in runs.items()]
        # the default again, after the others: how far the GPU drifted within the row
        timed.append(("attncomp default, again", bench_ms(attncomp_fn(policy, causal, q, k, v, None, "fwd"),
                                                          False)))
        for name, ms in timed:
            tf = fl / (ms * 1e-3) / 1e12
            rows.append(dict(policy=policy, D=D, N=N, causal=causal, B=args.B, H=args.H, variant=name, ms=ms,
                             vs_cudnn=base / ms, tflops=tf, of_gemm=tf / ceiling if ceiling else None))
            print(f"{policy} D={D} N={N} causal={int(causal)} {name}: {ms:.3f} ms, {base / ms:.2f}x cuDNN, "
                  f"{tf:.0f} TFLOP/s", flush=True)
    print("what a call ran by default:", *ran, sep="\n  ")
    return rows, ceiling


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="dense,dfss")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="16384")
    ap.add_argument("--variants-at", default="16384", help="lengths at which every configuration is timed "
                    "(elsewhere the default one)")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="time cuDNN and the configurations this many times in "
                    "turn; rows give the medians, ratios against cuDNN's median")
    ap.add_argument("--repeat", type=int, default=10, help="launches per checked configuration compared bit for bit")
    ap.add_argument("--match", default="", help="comma-separated: only the configurations whose name holds one "
                    "of these (e.g. 'ws'), besides the default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.policies = args.policies.split(",")
    args.dims = [int(x) for x in args.dims.split(",")]
    args.ns = [int(x) for x in args.ns.split(",")]
    args.variants_at = [int(x) for x in args.variants_at.split(",") if x]
    args.causal = [bool(int(x)) for x in args.causal.split(",")]
    if args.match:
        keys = args.match.split(",")
        for D in VARIANTS:
            VARIANTS[D] = [v for v in VARIANTS[D] if any(key in _name(v) for key in keys)]
    checks = [] if args.no_check else check(VARIANTS, args)
    rows, ceiling = run(args)
    gpu = torch.cuda.get_device_name()
    write_json(args.out, "gluon_fwd.json", dict(gpu=gpu, torch=torch.__version__, gemm_tflops=ceiling, checks=checks,
                                                rows=rows))
    print(f"\n{gpu}, B={args.B} H={args.H}, bf16; GEMM ceiling {ceiling:.0f} TFLOP/s")
    print(f"{'policy':<6} {'D':>4} {'N':>6} {'causal':>6} {'variant':<34} {'ms':>8} {'x cuDNN':>8} {'TFLOP/s':>8} "
          f"{'of GEMM':>8}")
    for r in rows:
        print(f"{r['policy']:<6} {r['D']:>4} {r['N']:>6} {int(r['causal']):>6} {r['variant']:<34} {r['ms']:>8.3f} "
              f"{r['vs_cudnn']:>8.2f} {r['tflops']:>8.0f} {r['of_gemm']:>8.2f}")
    return failed(checks)


def write_json(path, default_name: str, payload: dict) -> None:
    """``payload`` as JSON to ``path``, or to ``$OUT/default_name`` when no path is given and ``$OUT`` is set."""
    path = path or (os.path.join(os.environ["OUT"], default_name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=1)


def failed(checks: list) -> int:
    """The exit status of a run whose correctness checks are ``checks``: 1 (said) where one failed."""
    bad = [c for c in checks if not c["ok"]]
    if bad:
        print(f"{len(bad)} checks FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
