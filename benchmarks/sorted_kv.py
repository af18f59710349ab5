"""The ``hash``/``drop`` forward kernel alone, with its key/value tiles gathered through the sorted layout's
permutation (what the template does) or read in row order from sorted copies of K and V (``KV_SORTED``),
by address loads or through TMA descriptors, for several tile configurations; each output checked against
the gathered one, and SDPA's causal forward timed in the same run.

    python benchmarks/sorted_kv.py [--policies hash,drop] [--dims 64,128] [--n 16384] [--json PATH]
                                   [--configs BMxBNwWsS,...]

Shapes as ``attention.py``'s: B=4, H=16, bf16, causal; hash with 16 buckets, drop with rates 0.5/0.5. The
copies' own cost is timed as a ``torch.gather`` of all rows (an upper bound: a fused copy reads and
writes only the rows a range reaches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention import bench_ms, make_inputs, make_spec  # noqa: E402

CONFIGS = {
    "gather": ["64x64w4s3", "128x64w8s3", "128x128w8s3", "64x128w4s3"],
    "sorted": ["64x64w4s3", "128x64w8s3", "128x128w8s3", "128x64w4s3"],
    "sorted+tma": ["64x64w4s3", "128x64w8s3", "128x128w8s3", "128x128w8s2", "128x64w4s3"],
}


def _cfg(text):
    bm, rest = text.split("x")
    bn, rest = rest.split("w")
    w, s = rest.split("s")
    return int(bm), int(bn), int(w), int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="hash,drop")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default="", help="the gathered variant's configurations (BMxBNwWsS, comma-separated)"
                    "; with it the sorted copies are not timed")
    a = ap.parse_args(argv)
    configs = {"gather": a.configs.split(",")} if a.configs else CONFIGS
    from attncomp.codegen.triton import backend as TB

    dev, dt, B, H, N = a.device, torch.bfloat16, a.b, a.h, a.n
    gpu = dev == "cuda"
    rows = []
    for d in map(int, a.dims.split(",")):
        q, k, v, _ = make_inputs(B, H, N, d, dt, dev)
        sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), False) \
            if gpu else float("nan")
        for pol in a.policies.split(","):
            spec = make_spec(pol, True, dt)
            site = TB.Site(spec, q, k, v, None, 0.0, 7, None, None, None, None, None)
            lay = site.layout
            idx = lay.k_perm.long()[..., None].expand(-1, -1, -1, d)

            def copies():
                return torch.gather(k, 2, idx), torch.gather(v, 2, idx)

            ks, vs = copies()
            copy_ms = bench_ms(copies, False) if gpu else float("nan")
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=dev)
            ref = None
            for variant, names in configs.items():
                for name in names:
                    bm, bn, w, st = _cfg(name) if gpu else (16, 16, 1, 1)
                    lst, cnt = site.lists(bm, bn, True)
                    kk, vv = (k, v) if variant == "gather" else (ks, vs)
                    tma = variant == "sorted+tma"
                    kd = TB._descriptor(ks, bn, site.block_d) if tma else site._dummy
                    vd = TB._descriptor(vs, bn, site.block_dv) if tma else site._dummy
                    grid = (TB._cdiv(N, bm), B * H)

                    def launch():
                        TB._attention_kernel[grid](
                            *TB._fwd_args(site, q, kk, vv, out, lse, kd, vd, lst, cnt, site.seed_word),
                            BLOCK_M=bm, BLOCK_N=bn, MODE=TB.MODE_FWD, NATURAL=False, num_warps=w, num_stages=st,
                            TMA=tma, NM_EXP=False, KV_SORTED=variant != "gather", **site.meta(bm, bn))

                    out.fill_(float("nan"))
                    try:
                        launch()
                    except Exception as e:  # a configuration this GPU cannot take
                        print(f"{pol} D={d} {variant} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    if ref is None:
                        ref = out.clone()
                    err = float((out.float() - ref.float()).abs().max())
                    ms = bench_ms(launch, False) if gpu else float("nan")
                    row = dict(policy=pol, D=d, N=N, variant=variant, config=name, kernel_ms=ms, copy_ms=copy_ms,
                               sdpa_ms=sdpa, x_sdpa_kernel=sdpa / ms, max_err=err)
                    rows.append(row)
                    print(f"{pol} D={d} {variant:10} {name:12} {ms:7.3f} ms  x{sdpa / ms:5.2f}  err {err:.2e}",
                          flush=True)
                    if not gpu:
                        break
    print("\npolicy  D    variant     config        kernel ms  copy ms  SDPA ms  x SDPA (kernel)  x SDPA (+copy)")
    for r in rows:
        extra = r["copy_ms"] if r["variant"] != "gather" else 0.0
        print(f"{r['policy']:6} {r['D']:4}  {r['variant']:10}  {r['config']:12} {r['kernel_ms']:9.3f}  "
              f"{r['copy_ms']:7.3f}  {r['sdpa_ms']:7.3f}  {r['x_sdpa_kernel']:15.2f}  "
              f"{r['sdpa_ms'] / (r['kernel_ms'] + extra):14.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
