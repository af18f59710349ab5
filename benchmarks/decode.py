"""Decode attention: one decoding step's attention against a long KV cache, per policy, as a fraction of HBM bandwidth.

A step of ``Nq`` queries (default 1) of ``B`` sequences, ``Hq`` query heads over ``Hk`` KV heads (GQA), head dim
``D``, against ``Nk`` cached keys (bottom-right causal: every cached key is allowed), bf16 on a GPU. Rows
(``table: "decode"``), per ``B`` x ``Nk`` x policy:

* ``ms``: the op's route for the call (``attncomp.codegen.triton.backend.attention_forward``: the decode kernels of
  :mod:`attncomp.codegen.triton.decode`; ``hash``, the template's sorted layout; ``hash-cache``, hash with its buckets
  given as a KV cache keeps them, the decode kernels, ``keys_read``: the share of the keys they read), median of
  ``triton.testing.do_bench``;
* ``sdpa_ms``: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` on the same tensors
  (dense rows; the kernel PyTorch picks);
* ``template_ms``: the template's forward for the same call (one program per query head);
* ``graph_ms``, ``sdpa_graph_ms``: the same calls captured in a CUDA graph and replayed (device time: what a decode
  step costs under ``mode="reduce-overhead"``, without the host's launch work, which bounds ``ms`` at small B);
* ``kv_gbps``: the cache's bytes (K and V, each once) over ``graph_ms``; ``kv_bandwidth_frac``: that over the
  device's copy bandwidth measured in the same run (``copy_gbps``: a 2 GiB ``copy_``, bytes read plus written
  over time);
* ``max_err``: the largest difference of the output from the reference (float32, the same policy tensors).

``--sweep`` also times launch configurations of the decode kernel (``BLOCK_N``, warps, stages, programs per GPU)
on the dense rows of the longest cache (``table: "configs"``). Results go to ``benchmarks/results/decode_<device>.json`` (``$OUT`` too);
a table is printed last. ``--smoke``: the CPU under Triton's interpreter, tiny shapes, checks only.

    python -m attncomp bench decode                       # B 1,8,32 x Nk 16384,32768 x dense,hash,hash-cache,drop,dfss
    python -m attncomp bench decode --B 8 --nk 32768 --policies dense --sweep
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from attncomp.cli import csv_list  # noqa: E402
from benchmarks import common as C  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attncomp bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--B", type=csv_list(int), default=[1, 8, 32])
    ap.add_argument("--nk", type=csv_list(int), default=[16384, 32768])
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--policies", type=csv_list(str), default=["dense", "hash", "hash-cache", "drop", "dfss"])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sweep", action="store_true", help="also time launch configurations (dense rows)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes: checks only")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_<device>.json)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        a.B, a.nk, a.hq, a.hk, a.d = [1, 2], [45], 4, 2, 16
    return a


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn) -> Optional[float]:
    """Device time: ``fn`` captured in a CUDA graph and replayed (no host work between kernels), median ms."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception:  # noqa: BLE001 (a call that cannot be captured: no device time)
        return None


def copy_gbps(device) -> float:
    """Bytes read plus written per second of a 2 GiB device-to-device ``copy_``."""
    import torch

    n = 1 << 30
    x = torch.empty(n, dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x))
    del x, y
    return 2 * 2 * n / (t * 1e-3) / 1e9


def _spec_and_aux(policy: str, q, k):
    """``(spec, (q_aux, k_aux) for the reference)``: the op derives hash buckets and drop draws itself (no aux
    given); the reference gets the same tensors from the layout kernels and the op. ``hash-cache``: hash with its
    buckets given, as a KV cache that keeps its keys' buckets gives them (the same tensors go to the op)."""
    from attncomp.codegen.triton.layout import derive_layout
    from attncomp.ops import materialize_aux
    from attncomp.policy import get_policy
    from attncomp.spec import AttentionSpec

    pol = get_policy(policy.replace("-cache", "")).resolved(q.dtype)
    spec = AttentionSpec(causal=True, causal_align="bottom_right", dtype=str(q.dtype).replace("torch.", ""),
                         policy=pol)
    ref_aux = (None, None)
    if policy == "hash":
        lay = derive_layout(spec, q, k)
        ref_aux = (lay.q_groups, lay.k_groups)
    elif policy == "drop":
        ref_aux = materialize_aux(spec, q, k, seed=0)
    elif policy == "hash-cache":
        ref_aux = materialize_aux(spec, q, k)
    return spec, ref_aux


def run_row(B: int, Nk: int, policy: str, a, copy_bw: Optional[float], sweep: bool, dev) -> List[dict]:
    import torch

    from attncomp.codegen import reference as R
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import decode as DEC

    dtype = torch.float32 if a.smoke else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(B * 1000003 + Nk)
    q = torch.randn(B, a.hq, a.nq, a.d, generator=g).to(dev, dtype)
    k = torch.randn(B, a.hk, Nk, a.d, generator=g).to(dev, dtype)
    v = torch.randn(B, a.hk, Nk, a.d, generator=g).to(dev, dtype)
    spec, ref_aux = _spec_and_aux(policy, q, k)
    given = dict(q_aux=ref_aux[0], k_aux=ref_aux[1]) if policy == "hash-cache" else {}
    out, _ = TB.attention_forward(spec, q, k, v, **given)
    ref, _ = R.attention(q.float(), k.float(), v.float(), None, spec=spec, q_aux=ref_aux[0], k_aux=ref_aux[1])
    err = float((out.float() - ref).abs().max())
    row = dict(table="decode", B=B, Nq=a.nq, Nk=Nk, Hq=a.hq, Hk=a.hk, D=a.d, dtype=str(dtype).replace("torch.", ""),
               policy=policy, max_err=err, ms=None, graph_ms=None, sdpa_ms=None, sdpa_graph_ms=None, template_ms=None,
               kv_gbps=None, kv_bandwidth_frac=None)
    if given:  # the share of the cached keys a step reads: those in the bucket of some query row of their group
        qa, ka = ref_aux
        grp = qa.reshape(B, a.hk, -1)
        row["keys_read"] = float((ka[..., :, None] == grp[..., None, :]).any(-1).float().mean())
    rows = [row]
    if a.smoke:
        return rows
    kv_bytes = 2 * k.numel() * k.element_size()
    row["ms"] = _bench(lambda: TB.attention_forward(spec, q, k, v, **given))
    row["graph_ms"] = gms = _bench_graph(lambda: TB.attention_forward(spec, q, k, v, **given))
    if gms:
        row["kv_gbps"] = kv_bytes / (gms * 1e-3) / 1e9
        row["kv_bandwidth_frac"] = row["kv_gbps"] / copy_bw if copy_bw else None
    if policy == "dense":
        f = torch.nn.functional.scaled_dot_product_attention
        row["sdpa_ms"] = _bench(lambda: f(q, k, v, enable_gqa=True))
        row["sdpa_graph_ms"] = _bench_graph(lambda: f(q, k, v, enable_gqa=True))
    row["template_ms"] = _bench(lambda: TB._forward(spec, q, k, v, None, 0.0, 0, None, given.get("q_aux"),
                                                    given.get("k_aux"), None, None, None))
    if sweep and policy == "dense" and Nk == max(a.nk):
        site = TB.Site(spec, q, k, v, None, 0.0, 0, None, unsorted=True)
        o = TB._out_empty(q, site.Dv)
        lse = torch.empty((B, a.hq, a.nq), dtype=torch.float32, device=dev)
        for bn in (32, 64, 128):
            for w in (2, 4):
                for st in (2, 3):
                    for target in (132, 264, 528):
                        n_split = DEC.split_count(-(-Nk // bn), B * a.hk, target)
                        cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st)
                        try:
                            t = _bench_graph(lambda: DEC.decode_forward(site, spec, q, k, v, o, lse, config=cfg,
                                                                        n_split=n_split))
                        except Exception as e:  # noqa: BLE001 (a configuration that does not fit: recorded)
                            t, why = None, f"{type(e).__name__}: {str(e)[:120]}"
                        else:
                            why = None
                        rows.append(dict(table="configs", B=B, Nk=Nk, D=a.d, BLOCK_N=bn, num_warps=w, num_stages=st,
                                         programs=target, n_split=n_split, ms=t, error=why,
                                         kv_bandwidth_frac=(kv_bytes / (t * 1e-3) / 1e9 / copy_bw) if t and copy_bw
                                         else None))
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    dev = torch.device("cpu" if a.smoke else "cuda")
    copy_bw = None if a.smoke else copy_gbps(dev)
    rows: List[dict] = []
    device = "cpu" if a.smoke else None
    if a.smoke and a.out is None:
        import tempfile

        a.out = os.path.join(tempfile.mkdtemp(), "decode_cpu_smoke.json")
    for B in a.B:
        for Nk in a.nk:
            for pol in a.policies:
                try:
                    rows += run_row(B, Nk, pol, a, copy_bw, a.sweep, dev)
                except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                    rows.append(dict(table="decode", B=B, Nk=Nk, policy=pol, error=f"{type(e).__name__}: {e}"[:300]))
                r = rows[-1] if rows[-1].get("table") == "decode" else next(x for x in rows if x.get("policy") == pol
                                                                            and x["B"] == B and x["Nk"] == Nk)
                print(f"B={B} Nk={Nk} {pol}: {r.get('ms')} ms, graph {r.get('graph_ms')} ms, frac "
                      f"{r.get('kv_bandwidth_frac')}, err {r.get('max_err')} {r.get('error') or ''}", file=sys.stderr,
                      flush=True)
                doc = C.document("decode", rows, argv, device=device, copy_gbps=copy_bw, smoke=a.smoke)
                C.write(doc, a.out)  # after every row: an interrupted run keeps what it measured
    print(table(doc))
    bad = [r for r in rows if r.get("table") == "decode" and (r.get("error") or (r.get("max_err") or 0) > 0.05)]
    return 1 if bad else 0


def table(doc) -> str:
    """The decode rows as markdown."""
    out = ["| B | Nk | policy | ms | graph ms | SDPA ms | SDPA graph ms | template ms | KV GB/s | x copy bandwidth "
           "| max err |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(x, nd=3):
        return "-" if x is None else f"{x:.{nd}g}"

    for r in doc["rows"]:
        if r.get("table") != "decode":
            continue
        pol = r["policy"] + (f" (reads {r['keys_read']:.2f})" if r.get("keys_read") is not None else "")
        out.append(f"| {r['B']} | {r['Nk']} | {pol} | {f(r.get('ms'))} | {f(r.get('graph_ms'))} | "
                   f"{f(r.get('sdpa_ms'))} | {f(r.get('sdpa_graph_ms'))} | "
                   f"{f(r.get('template_ms'))} | {f(r.get('kv_gbps'))} | {f(r.get('kv_bandwidth_frac'), 2)} | "
                   f"{f(r.get('max_err'), 2)} |" + (f" {r['error']}" if r.get("error") else ""))
    best = {}
    for r in doc["rows"]:
        if r.get("table") == "configs" and r.get("ms"):
            key = (r["B"], r["Nk"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for (B, Nk), r in sorted(best.items()):
        out.append(f"\nbest config B={B} Nk={Nk}: BLOCK_N={r['BLOCK_N']} warps={r['num_warps']} "
                   f"stages={r['num_stages']} programs={r['programs']}: {r['ms']:.4g} ms, "
                   f"{r['kv_bandwidth_frac']:.2f} of copy bandwidth")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
