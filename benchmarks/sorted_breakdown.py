"""Where a ``hash``/``drop`` forward's device time goes on a GPU: each kernel of the call (the counting
sort's three launches, the tile summaries and lists, the forward) from ``torch.profiler``, next to the
whole call (``triton.testing.do_bench``) and SDPA's causal forward in the same run, and the bytes the
histogram launch must read (q and k once) as a bandwidth.

    python benchmarks/sorted_breakdown.py [--policies hash,drop] [--dims 64,128] [--ns 16384]
                                          [--causal 1] [--config BMxBNwWsS] [--json PATH]
                                          [--lsh ELEMSxCHUNKSwWARPS,...] [--sorted-kv 1,0]
                                          [--heads B,HQ,HK] [--heads-inner]

``--lsh`` times the hash rows once per setting of the LSH histogram programs (``layout.LSH_ELEMS``,
``LSH_MAX_CHUNKS``, ``LSH_WARPS``; e.g. ``8192x4w4``, the default), in the same run. ``--sorted-kv 1,0``
times the drop rows with and without the sorted K/V copies (``ATTNCOMP_SORTED_KV``), in turn.

Shapes as ``attention.py``'s: B=4, H=16, bf16; hash with 16 buckets, drop with rates 0.5/0.5. ``--heads 1,32,8``
takes another batch and grouped KV heads, ``--heads-inner`` q, k and v as a model's projections give them
(``(B, N, H, D)`` transposed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import bench_ms, make_inputs, make_spec  # noqa: E402

KERNELS = ("_layout_hist", "_layout_scan", "_layout_scatter", "_tile_summaries", "_tile_lists", "_attention_kernel")


def _config(text: str):
    if not text:
        return None
    bm, rest = text.split("x")
    bn, rest = rest.split("w")
    w, s = rest.split("s")
    return dict(BLOCK_M=int(bm), BLOCK_N=int(bn), num_warps=int(w), num_stages=int(s))


def kernel_us(fn, calls: int = 10) -> dict:
    """Device microseconds per call of each kernel ``fn`` launches (profiled over ``calls`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for ev in prof.key_averages():
        name = next((k for k in KERNELS if k in ev.key), None)
        dev = getattr(ev, "device_time_total", None)
        if dev is None:
            dev = getattr(ev, "cuda_time_total", 0.0)
        if name is not None and dev:
            out[name] += dev / calls
    return dict(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="hash,drop")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--ns", default="16384")
    ap.add_argument("--causal", default="1")
    ap.add_argument("--config", default="", help="forward tiles, e.g. 128x64w4s3 (default: the backend's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lsh", default="", help="LSH histogram settings ELEMSxCHUNKSwWARPS, comma-separated")
    ap.add_argument("--sorted-kv", default="1", help="drop with (1) and/or without (0) sorted K/V copies")
    ap.add_argument("--heads", default="4,16,16", help="batch, query heads, KV heads")
    ap.add_argument("--heads-inner", action="store_true", help="q, k, v as (B, N, H, D) transposed")
    a = ap.parse_args(argv)
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import layout as L

    default = f"{L.LSH_ELEMS}x{L.LSH_MAX_CHUNKS}w{L.LSH_WARPS}"
    settings = a.lsh.split(",") if a.lsh else [default]

    B, H, Hk = map(int, a.heads.split(","))
    dt = torch.bfloat16
    cfg = _config(a.config)
    rows = []
    for n in map(int, a.ns.split(",")):
        for d in map(int, a.dims.split(",")):
            q, k, v, _ = make_inputs(B, H, n, d, dt, "cuda")
            k, v = k[:, :Hk], v[:, :Hk]
            if a.heads_inner:
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            else:
                k, v = k.contiguous(), v.contiguous()
            for causal in (c == "1" for c in a.causal.split(",")):
                sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=Hk != H), False)
                variants = {"hash": [(s, "") for s in settings], "drop": [("", c) for c in a.sorted_kv.split(",")]}
                for pol, lsh, kv in [(p, *s) for p in a.policies.split(",") for s in variants[p]]:
                    spec = make_spec(pol, causal, dt)
                    if kv:
                        os.environ["ATTNCOMP_SORTED_KV"] = kv
                        TB._PLANS.clear()  # (a plan replays the launches it recorded, copies or not)
                    if lsh:
                        e, rest = lsh.split("x")
                        ch, w = rest.split("w")
                        L.LSH_ELEMS, L.LSH_MAX_CHUNKS, L.LSH_WARPS = int(e), int(ch), int(w)
                        # (a kept plan or layout would replay or reuse the previous setting's launches)
                        TB._PLANS.clear()
                        TB._LAYOUT_CACHE.clear()

                    def call():
                        return TB.attention_forward(spec, q, k, v, config=cfg)

                    whole = bench_ms(call, False)
                    parts = kernel_us(call)
                    hist_gb = 2 * q.numel() * q.element_size() / 1e9 if pol == "hash" else 0.0
                    row = dict(policy=pol, B=B, H=H, Hk=Hk, heads_inner=a.heads_inner, N=n, D=d, causal=causal,
                               whole_ms=whole, sdpa_ms=sdpa, x_sdpa=sdpa / whole, kernels_us=parts,
                               config=TB.last_configs.get("fwd"),
                               hist_tb_s=hist_gb / (parts.get("_layout_hist", 0) * 1e-6) / 1e3 if hist_gb else None,
                               lsh=lsh or None, sorted_kv=kv == "1" if kv else None)
                    rows.append(row)
                    print(f"{pol} N={n} D={d} causal={causal} {lsh}{'kv=' + kv if kv else ''}: {whole:.3f} ms "
                          f"({row['x_sdpa']:.2f}x SDPA {sdpa:.3f} ms); config {row['config']}", flush=True)
    print("\npolicy     N    D  causal  kv  whole ms  x SDPA  " + "  ".join(f"{k[1:]:>15}" for k in KERNELS))
    for r in rows:
        ku = r["kernels_us"]
        kv = {None: "-", True: "on", False: "off"}[r["sorted_kv"]]
        print(f"{r['policy']:6} {r['N']:5} {r['D']:4}  {str(r['causal']):6} {kv:3} {r['whole_ms']:8.3f}  "
              f"{r['x_sdpa']:6.2f}  "
              + "  ".join(f"{ku.get(k, 0.0):13.1f}us" for k in KERNELS)
              + (f"  hist {r['hist_tb_s']:.2f} TB/s ({r['lsh']})" if r["hist_tb_s"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
