"""The Gluon backward passes (``attncomp/codegen/triton/hopper_bwd.py``) checked and timed in one run: dense
backward, the Gluon dK/dV pass followed by the template's or the Gluon dQ pass, or adding dQ itself (TMA
reductions), against the template's whole backward (this GPU's default
configuration, ``ATTNCOMP_GLUON=0``), what a call runs by default, and cuDNN's backward (SDPA's
forward+backward less its forward, both cuDNN, timed in the same round), per head dim, mask and
configuration, in rounds (every contender once per round, medians).

First a correctness pass against the float64 reference (odd ``N``, GQA, causal aligned top-left and
bottom-right, float16 and bfloat16), then the timings; the table is printed last, JSON goes to ``--out``
(default ``$OUT/gluon_bwd.json`` when ``$OUT`` is set).

    python benchmarks/gluon_bwd.py                         # D 64/128, causal and not, N 4096/16384
    python benchmarks/gluon_bwd.py --dims 128 --ns 16384 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention import bench_ms, flops, make_inputs, make_spec, sdpa_fn  # noqa: E402
from gluon_fwd import failed, write_json  # noqa: E402

# dK/dV tiles (queries per step, keys per block, ring slots) and dQ: the default's dQ pass after the dK/dV pass
# (0), or added in the pass (1: DQ_ATOMIC, TMA reductions), or a Gluon dQ pass after it ((queries, keys, slots))
VARIANTS = [(64, 64, 2, 0), (64, 64, 3, 0), (64, 64, 2, 1), (64, 64, 3, 1), (64, 64, 2, (64, 64, 2)),
            (64, 64, 2, (64, 128, 2)), (64, 64, 2, (64, 64, 3)), (64, 128, 2, "ws"), (64, 128, 3, "ws")]
CASES = [(2, 4, 2, 1000, 64, "full", "bfloat16"), (1, 4, 4, 777, 128, "causal", "float16"),
         (1, 2, 1, 130, 64, "causal", "bfloat16"), (1, 4, 2, 1000, 128, "full", "bfloat16"),
         (2, 2, 2, 2048, 128, "causal", "bfloat16"), (1, 8, 2, 300, 64, "bottom_right", "float16")]


def gluon_cfg(v, D: int) -> dict:
    """The backward configuration of variant ``v``: the Gluon dK/dV pass, then the dQ pass of the default's
    (``configs.GLUON_BWD``)."""
    from attncomp.codegen.triton import configs

    bm, bn, stages, dq = v
    base = {x: y for x, y in configs.GLUON_BWD[(D, True)].items() if x not in ("DQ_ATOMIC", "DQ_GLUON", "WS")}
    if dq == "ws":  # the warp-specialised one-launch kernel (128 keys per block, ``stages`` ring slots)
        return dict(base, WS=stages, DQ_GLUON=[64, 64, 2])
    extra = dict(DQ_GLUON=list(dq)) if isinstance(dq, tuple) else dict(DQ_ATOMIC=2) if dq else {}
    return dict(base, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, **extra)


def name(v) -> str:
    dq = v[3]
    if dq == "ws":
        return "gluon ws %dx%ds%d" % v[:3]
    return "gluon dkdv %dx%ds%d" % v[:3] + (" + gluon dq %dx%ds%d" % dq if isinstance(dq, tuple) else
                                             " fused dq" if dq else "")


def _variants(args) -> list:
    """The variants ``--match`` names (all by default; DFSS: the warp-specialised kernel's only, the passes have no
    selection)."""
    return [v for v in VARIANTS if (not args.match or any(m in name(v) for m in args.match))
            and (args.policy == "dense" or v[3] == "ws")]


def check(args) -> list:
    import torch

    from attncomp.codegen import reference as R
    from attncomp.codegen.triton import backend as TB
    from attncomp.spec import AttentionSpec

    out = []
    for B, Hq, Hk, N, D, mask, dt in CASES:
        dtype = getattr(torch, dt)
        g = torch.Generator().manual_seed(N + D)
        if args.policy == "dfss":  # (whole groups of four keys)
            N = -(-N // 4) * 4
        q = torch.randn(B, Hq, N, D, generator=g).to("cuda", dtype)
        Nk = (N + 40 if args.policy == "dfss" else N + 37) if mask == "bottom_right" else N
        k, v = (torch.randn(B, Hk, Nk, D, generator=g).to("cuda", dtype) for _ in range(2))
        go = torch.randn(B, Hq, N, D, generator=g).to("cuda", dtype)
        spec = AttentionSpec(dtype=dt, causal=mask != "full", causal_align="bottom_right" if mask == "bottom_right"
                             else "top_left", policy=make_spec(args.policy, False, dtype).policy)
        o, lse = TB.attention_forward(spec, q, k, v)
        want = R.attention_backward(q.double(), k.double(), v.double(), None, go.double(), spec=spec)[:3]
        for var in _variants(args):
            got = TB.attention_backward(spec, q, k, v, None, o, lse, go, config=gluon_cfg(var, D))
            errs = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]
            ok = all(e < 2e-2 for e in errs)
            out.append(dict(case=[B, Hq, Hk, N, Nk, D, mask, dt], variant=name(var), rel_err=errs, ok=ok))
            print(f"check {B}x{Hq}/{Hk}x{N}x{Nk} D={D} {mask} {dt} {name(var)}: dq/dk/dv "
                  f"{' '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'FAIL'}", flush=True)
    return out


def run(args) -> list:
    import torch

    from attncomp.codegen.triton import backend as TB

    rows, ran = [], []
    for D, N, causal in itertools.product(args.dims, args.ns, args.causal):
        q, k, v, do = make_inputs(args.B, args.H, N, D, torch.bfloat16, "cuda")
        spec = make_spec(args.policy, causal, q.dtype)
        out, lse = TB.attention_forward(spec, q, k, v)
        fl = flops(args.B, args.H, N, D, causal, "fwd+bwd") - flops(args.B, args.H, N, D, causal, "fwd")
        # the template's own backward (ATTNCOMP_GLUON=0: its default configuration), what a call runs by
        # default (the Gluon dK/dV pass where configs.GLUON_BWD has the site), each variant
        contenders = [("template", None, "0"), ("attncomp default", None, "1")] + [
            (name(x), gluon_cfg(x, D), "1") for x in _variants(args) if D in args.fused_dims or x[3] != 1]
        runs = {}
        for _ in range(args.rounds):
            both = bench_ms(sdpa_fn(causal, q, k, v, do, "fwd+bwd", "cudnn"), False)
            runs.setdefault("cudnn backward", []).append(both - bench_ms(sdpa_fn(causal, q, k, v, None, "fwd",
                                                                                  "cudnn"), False))
            for label, cfg, gluon in contenders:
                os.environ["ATTNCOMP_GLUON"] = gluon
                try:
                    ms = bench_ms(lambda: TB.attention_backward(spec, q, k, v, None, out, lse, do, config=cfg), False)
                except Exception as e:  # a configuration that does not fit is reported, the others go on
                    print(f"{label} D={D}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                finally:
                    os.environ.pop("ATTNCOMP_GLUON")
                runs.setdefault(label, []).append(ms)
                if label == "attncomp default":
                    ran.append(f"D={D} N={N} causal={int(causal)}: {TB.last_configs['bwd']}")
        base = statistics.median(runs["cudnn backward"])
        for label, ms in runs.items():
            med = statistics.median(ms)
            rows.append(dict(D=D, N=N, causal=causal, B=args.B, H=args.H, variant=label, ms=med, rounds=ms,
                             vs_cudnn=base / med, tflops=fl / (med * 1e-3) / 1e12))
            print(f"D={D} N={N} causal={int(causal)} {label}: {med:.3f} ms ({' '.join(f'{x:.3f}' for x in ms)}), "
                  f"{base / med:.2f}x cuDNN", flush=True)
    print("what a call ran by default:", *ran[::args.rounds], sep="\n  ")
    return rows


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="4096,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fused-dims", default="64,128", help="head dims at which the fused-dQ variants are timed")
    ap.add_argument("--match", default="", help="comma-separated parts of variant names: only the variants that "
                    "contain one are timed (e.g. 'ws,gluon dq 64x64s2')")
    ap.add_argument("--policy", default="dense", choices=["dense", "dfss"], help="dfss: DFSS 2:4 (the template's "
                    "backward, the default and the warp-specialised variants, against cuDNN's dense backward)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.dims = [int(x) for x in args.dims.split(",")]
    args.ns = [int(x) for x in args.ns.split(",")]
    args.fused_dims = [int(x) for x in args.fused_dims.split(",")]
    args.causal = [bool(int(x)) for x in args.causal.split(",")]
    args.match = [m for m in args.match.split(",") if m]
    os.environ.setdefault("ATTNCOMP_TRITON_TUNE", "0")
    checks = [] if args.no_check else check(args)
    rows = run(args)
    gpu = torch.cuda.get_device_name()
    write_json(args.out, "gluon_bwd.json", dict(gpu=gpu, torch=torch.__version__, policy=args.policy, checks=checks,
                                                rows=rows))
    print(f"\n{gpu}, {args.policy}, B={args.B} H={args.H}, bf16, backward alone, medians of {args.rounds} rounds")
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'variant':<26} {'ms':>8} {'x cuDNN':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['D']:>4} {r['N']:>6} {int(r['causal']):>6} {r['variant']:<26} {r['ms']:>8.3f} {r['vs_cudnn']:>8.2f} "
              f"{r['tflops']:>8.0f}")
    return failed(checks)


if __name__ == "__main__":
    sys.exit(main())
