"""The Hopper variants of the kernel template, timed side by side in one run: what each technique buys.

Rows, per head dim, mask (causal or not) and sequence length, each against SDPA's cuDNN kernel of the
same pass measured in the same run, with TFLOP/s and the fraction of the GEMM ceiling (a bf16
``8192^3`` matmul timed on the same GPU):

* ``dense fwd``: the default configuration for this GPU, and the first TMA candidate (key/value tiles
  through tensor descriptors) when the default does not use TMA;
* ``dense bwd`` / ``dense fwd+bwd``: the two-pass backward (dK/dV, then dQ; deterministic) against the
  one-pass backward that adds dQ with float32 atomics (config key ``DQ_ATOMIC``), the one-pass backward
  whose dQ shares are TMA bulk reductions (``DQ_ATOMIC=2``, every such candidate of the tuning store:
  ``tma-reduce dq <i>``), and the backward with Q and dO streamed through TMA descriptors in the dK/dV
  pass (``TMA_Q``);
* the DFSS 2:4 breakdown (forward, one tile configuration for all three): dense on the same tiles (no
  selection), the selection applied to the logits before the softmax (default), and the selection
  fused with the exponentials so that only kept logits are exponentiated (config key ``NM_EXP``). The
  first difference is what the selection costs, the second what the saved exponentials give back;
  and the DFSS backward alone, two-pass (the default) against every ``DQ_ATOMIC=2`` candidate.

    python benchmarks/hopper.py                      # GPU: D 64/128, causal and not, N=16384
    python benchmarks/hopper.py --ns 4096,16384 --out results.json
    python benchmarks/hopper.py --only "default fwd,tma fwd"   # the dense forward rows only
    python benchmarks/hopper.py --smoke              # CPU plumbing check under TRITON_INTERPRET=1

The table is printed last; JSON rows go to ``--out`` (default ``$OUT/hopper_<gpu>.json`` when ``$OUT`` is
set, else ``benchmarks/results/hopper_<gpu>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import bench_ms, config_name, flops, gemm_tflops, make_inputs, make_spec, sdpa_fn  # noqa: E402


def _first(cands: List[dict], key: str) -> Optional[dict]:
    return next((c for c in cands if c.get(key)), None)


def variants(D: int, dtype, gpu: str):
    """``(name, policy, passes, fwd config, bwd config)`` of every timed variant at head dim ``D``."""
    from attncomp.codegen.triton import configs

    fw = configs.fwd_candidates(D, D, dtype, 1, gpu=gpu)
    bw = configs.bwd_candidates(D, D, dtype, 1, gpu=gpu)
    nm_fw = configs.fwd_candidates(D, D, dtype, 4, gpu=gpu)
    nm_bw = configs.bwd_candidates(D, D, dtype, 4, gpu=gpu)
    out = [("dense default", "dense", "fwd", fw[0], None)]
    tma = _first(fw, "TMA")
    if tma is not None and not fw[0].get("TMA"):
        out.append(("dense tma", "dense", "fwd", tma, None))
    atomic = next((c for c in bw if c.get("DQ_ATOMIC") == 1), None) or dict(bw[0], DQ_ATOMIC=1)
    reduce = [c for c in bw if c.get("DQ_ATOMIC") == 2] or [dict(bw[0], DQ_ATOMIC=2)]
    out += [("dense two-pass", "dense", "bwd", fw[0], bw[0]),
            ("dense atomic dq", "dense", "bwd", fw[0], atomic),
            ("dense tma q/do", "dense", "bwd", fw[0], _first(bw, "TMA_Q") or dict(bw[0], TMA=1, TMA_Q=1))]
    out += [(f"dense tma-reduce dq {i}", "dense", "bwd", fw[0], c) for i, c in enumerate(reduce)]
    out += [("dense two-pass", "dense", "fwd+bwd", fw[0], bw[0]),
            ("dense atomic dq", "dense", "fwd+bwd", fw[0], atomic)]
    # the DFSS breakdown: one tile shape (DFSS's default) for all three
    tiles = {k: nm_fw[0][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    out += [("dense on dfss tiles", "dense", "fwd", tiles, None),
            ("dfss select", "dfss", "fwd", tiles, None),
            ("dfss select+exp fused", "dfss", "fwd", dict(tiles, NM_EXP=1), None),
            ("dfss select", "dfss", "fwd+bwd", tiles, nm_bw[0]),
            ("dfss select+exp fused", "dfss", "fwd+bwd", dict(tiles, NM_EXP=1), nm_bw[0]),
            ("dfss two-pass", "dfss", "bwd", tiles, nm_bw[0])]
    nm_reduce = [c for c in nm_bw if c.get("DQ_ATOMIC") == 2] or [dict(nm_bw[0], DQ_ATOMIC=2)]
    out += [(f"dfss tma-reduce dq {i}", "dfss", "bwd", tiles, c) for i, c in enumerate(nm_reduce)]
    return out


def _step(policy, causal, q, k, v, do, passes, fwd_cfg, bwd_cfg):
    from attncomp.codegen.triton import backend as TB

    spec = make_spec(policy, causal, q.dtype)
    if passes == "fwd":
        return lambda: TB.attention_forward(spec, q, k, v, config=fwd_cfg)
    out, lse = TB.attention_forward(spec, q, k, v, config=fwd_cfg)
    if passes == "bwd":
        return lambda: TB.attention_backward(spec, q, k, v, None, out, lse, do, config=bwd_cfg)

    def step():
        o, s = TB.attention_forward(spec, q, k, v, config=fwd_cfg)
        TB.attention_backward(spec, q, k, v, None, o, s, do, config=bwd_cfg)

    return step


def run(args) -> List[Dict]:
    import torch
    from attncomp.codegen.triton import configs

    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    gpu = "" if smoke else configs.gpu_tag(torch.device("cuda"))
    B, H = (1, 2) if smoke else (args.batch, args.heads)
    ns = [48] if smoke else [int(n) for n in args.ns.split(",")]
    dims = [32] if smoke else [int(d) for d in args.dims.split(",")]
    ceiling = gemm_tflops(smoke)
    only = [w for w in args.only.split(",") if w]
    rows: List[Dict] = []
    for D in dims:
        for causal in (False, True):
            for N in ns:
                q, k, v, do = make_inputs(B, H, N, D, dtype, dev)
                chosen = [x for x in (variants(32, dtype, "") if smoke else variants(D, dtype, gpu))
                          if not only or any(w in f"{x[0]} {x[2]}" for w in only)]
                base: Dict[str, float] = {}
                if not smoke:
                    for passes in ("fwd", "fwd+bwd"):
                        if passes == "fwd" or any(x[2] != "fwd" for x in chosen):
                            base[passes] = bench_ms(sdpa_fn(causal, q, k, v, do, passes, backend="cudnn"), False)
                    if "fwd+bwd" in base:
                        base["bwd"] = base["fwd+bwd"] - base["fwd"]
                for name, policy, passes, fcfg, bcfg in chosen:
                    if smoke:  # the interpreter runs one small configuration
                        fcfg = dict(configs.interpret_config(4 if policy == "dfss" else 1), **{
                            k: fcfg[k] for k in ("TMA", "NM_EXP") if k in fcfg})
                        bcfg = None if bcfg is None else dict(configs.interpret_config(4 if policy == "dfss" else 1),
                                                              **{k: bcfg[k] for k in ("DQ_ATOMIC", "TMA", "TMA_Q", "NATURAL")
                                                                 if k in bcfg})
                    try:
                        ms = bench_ms(_step(policy, causal, q, k, v, do, passes, fcfg, bcfg), smoke)
                    except Exception as e:  # a variant that does not compile here is a row with its error
                        print(f"  {name} {passes} D{D} N{N} c{int(causal)} failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
                        ms = None
                    f = flops(B, H, N, D, causal, "fwd+bwd" if passes != "fwd" else "fwd")
                    if passes == "bwd":
                        f = f * 2.5 / 3.5
                    tf = None if ms is None else f / (ms * 1e-3) / 1e12
                    row = dict(variant=name, policy=policy, passes=passes, D=D, N=N, causal=causal, B=B, H=H,
                               dtype=str(dtype).replace("torch.", ""), ms=ms, cudnn_ms=base.get(passes),
                               x_cudnn=None if ms is None or passes not in base else base[passes] / ms,
                               tflops=tf, of_gemm=None if tf is None or ceiling is None else tf / ceiling,
                               fwd_config=fcfg, bwd_config=bcfg)
                    rows.append(row)
                    print(_fmt(row), flush=True)
                del q, k, v, do
    meta = dict(gemm_tflops=ceiling)
    if not smoke:
        meta.update(machine=torch.cuda.get_device_name(), torch=torch.__version__)
        import triton

        meta["triton"] = triton.__version__
    out = args.out or (None if smoke else _default_out(gpu))
    if out:
        with open(out, "w") as fh:
            json.dump(dict(meta, rows=rows), fh, indent=1)
    print(f"\nGEMM ceiling: {ceiling:.0f} TFLOP/s" if ceiling else "\n(smoke: no timings that mean anything)")
    for r in rows:
        print(_fmt(r))
    if out:
        print(f"wrote {out}")
    return rows


def _default_out(gpu: str) -> str:
    name = f"hopper_{gpu or 'gpu'}.json"
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], name)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def _fmt(r) -> str:
    def num(x, f):
        return "-" if x is None else format(x, f)

    return (f"{r['variant']:24s} {r['passes']:8s} D{r['D']:<4d} N{r['N']:<6d} {'causal' if r['causal'] else 'full':6s}"
            f" {num(r['ms'], '9.3f')} ms  cudnn {num(r['cudnn_ms'], '8.3f')}  x{num(r['x_cudnn'], '.2f')}"
            f"  {num(r['tflops'], '6.0f')} TF/s  {num(r['of_gemm'], '.2f')} of GEMM"
            f"  {config_name(r['bwd_config'] or r['fwd_config'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated words: time only the variants whose name "
                    "(with its pass, e.g. 'dense default', 'fwd') holds one of them")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
