"""The TVM backend's rows of the kernel benchmark (``python -m attncomp bench kernels --backend tvm``; table ``tvm``).

CPU (``--device cpu``, BENCHMARKS.md "On a CPU"): the TVM ``llvm`` kernels against SDPA's CPU kernel
(dense attention: the number every policy has to beat) and the reference backend (what ``auto`` ran
on a CPU for the sparse policies before), all timed in the same process: median of 7 timed calls
after 2 warm-up calls, fresh random inputs. Kernels are built (or loaded from the disk cache) before
timing. Sparse policies report their density (kept / allowed entries) and the ideal speedup.

GPU (``--device cuda --cubins DIR``): the cubins built on a CPU machine (``python -m attncomp
build-kernels ... --out DIR``) imported into the kernel cache and timed against SDPA:
forward rows, and forward+backward rows (the CUDA backward kernels) for dense and dfss. dfss rows
come twice on a GPU: ``kernel: mma.sp`` (the sparse tensor-core forward) and ``kernel: scalar`` (the
scalar template, ``ATTNCOMP_TVM_DFSS_KERNEL=scalar``), on the same inputs.

    python -m attncomp bench kernels --backend tvm --device cpu     # benchmarks/results/kernels_cpu.json
    python -m attncomp build-kernels --arch sm_90 --head-dim 64 --out build/tvm-cubins
    python -m attncomp bench kernels --backend tvm --device cuda --cubins build/tvm-cubins

Rows go to the kernels results file of the device (``kernels_<device>.json``, table ``tvm``), replacing its
``tvm`` rows and keeping the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.policy import DFSS, Dense, Drop, Hash, SPION, ceil_div, lsh_buckets  # noqa: E402
from attncomp.spec import AttentionSpec, dtype_name  # noqa: E402
from benchmarks import common as C  # noqa: E402

TB = None  # attncomp.codegen.tvm.backend, imported by main (apache-tvm on a CPU machine)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attncomp bench kernels --backend tvm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ns", default="1024,4096")
    ap.add_argument("--dims", default="64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--policies", default="dense,dfss,hash,drop,spion")
    ap.add_argument("--bwd-max-n", type=int, default=1024, help="forward+backward rows up to this N (CPU)")
    ap.add_argument("--ref-max-n", type=int, default=2048, help="reference backend timed up to this N")
    ap.add_argument("--cubins", default=None, help="folder of prebuilt cubins (--device cuda)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def median_ms(fn: Callable[[], object], device: str, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def case(policy: str, causal: bool, B: int, H: int, N: int, D: int, dtype, device: str, seed: int = 0):
    """Spec and tensors of one benchmark case (random block pattern of density ~0.12 for spion, 16 LSH
    buckets for hash, keep rates 0.5/0.5 for drop)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(device, dtype) for _ in range(3))
    pol = {"dense": Dense(), "dfss": DFSS(), "hash": Hash(n_buckets=16), "drop": Drop(q_rate=0.5, k_rate=0.5),
           "spion": SPION(block_size=64)}[policy].resolved(dtype)
    qa = ka = bp = None
    if policy == "hash":
        qa, ka = lsh_buckets(q, k, 16, 0)
    elif policy == "drop":
        qa = (torch.rand(B, H, N, generator=g) >= 0.5).to(device)
        ka = (torch.rand(B, H, N, generator=g) >= 0.5).to(device)
    elif policy == "spion":
        nb = ceil_div(N, 64)
        bp = (torch.rand(1, nb, nb, generator=g) < 0.12).to(device)
    spec = AttentionSpec(causal=causal, dtype=dtype_name(dtype), head_dim=D, policy=pol)
    return spec, q, k, v, (qa, ka, bp)


def density(spec, q, k, aux) -> float:
    """Kept / allowed entries (on a 512-query slice to bound memory)."""
    qs = q[:, :, :512]
    qa, ka, bp = aux
    s, allowed = R.logits(spec, qs.float(), k.float())
    if spec.policy.name == "spion":
        bp = bp[:, : ceil_div(qs.shape[2], 64)]
    keep = R.keep_mask(spec, s, allowed, None if qa is None else qa[:, :, :512], ka, bp)
    return float(keep.sum() / allowed.sum().clamp_min(1))


def rows(args) -> List[Dict]:
    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    out = []
    if device == "cuda" and args.cubins:
        from attncomp.runtime.cubin import import_folder

        print(f"imported {import_folder(args.cubins)} cubins from {args.cubins}", file=sys.stderr)
    be = TB.TVMBackend()
    for N in (int(x) for x in args.ns.split(",")):
        for D in (int(x) for x in args.dims.split(",")):
            for policy in args.policies.split(","):
                for causal in ((False, True) if policy in ("dense", "dfss") else (False,)):
                    spec, q, k, v, aux = case(policy, causal, args.batch, args.heads, N, D, dtype, device)
                    qa, ka, bp = aux
                    passes = ["fwd"] + (["fwd+bwd"] if (device == "cuda" or N <= args.bwd_max_n)
                                         and policy in ("dense", "dfss") else [])
                    # dfss on a GPU: the sparse tensor-core forward and the scalar one
                    kernels = [""] if device == "cpu" or policy != "dfss" else ["sp", "scalar"]
                    dens = density(spec, q, k, aux)
                    for ps, kern in ((ps, kern) for ps in passes for kern in kernels):
                        if kern:
                            os.environ["ATTNCOMP_TVM_DFSS_KERNEL"] = kern
                        row = {"table": "tvm", "backend": "tvm", "device": device, "policy": spec.policy.describe(),
                               "causal": causal, "B": args.batch, "H": args.heads, "N": N, "D": D,
                               "dtype": dtype_name(dtype), "pass": ps, "density": round(dens, 4),
                               "ideal_speedup": round(1.0 / dens, 2) if dens > 0 else None}
                        if device == "cuda":
                            var = TB.cuda_kernel_variant(spec, q, v, None, None, 0.0)
                            row["kernel"] = "mma.sp" if var.mma == "sp" else "scalar"
                        if ps == "fwd":
                            tvm = lambda: be.forward(spec, q, k, v, None, qa, ka, bp, 0.0, 0)  # noqa: E731
                        else:
                            do = torch.randn_like(q)

                            def tvm():
                                o, lse = be.forward(spec, q, k, v, None, qa, ka, bp, 0.0, 0)
                                return be.backward(spec, q, k, v, None, qa, ka, bp, 0.0, 0, o, lse, do)
                        row["tvm_ms"] = median_ms(tvm, device)
                        # SDPA runs dense attention (with the same causality): the bar for every policy
                        if ps == "fwd":
                            sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                        else:
                            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

                            def sd():
                                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                                o.backward(do)
                        row["sdpa_dense_ms"] = median_ms(sd, device)
                        row["sdpa_over_tvm"] = round(row["sdpa_dense_ms"] / row["tvm_ms"], 3)
                        if device == "cpu" and N <= args.ref_max_n:
                            rb = R.ReferenceBackend()
                            if ps == "fwd":
                                ref = lambda: rb.forward(spec, q, k, v, None, qa, ka, bp, 0.0, 0)  # noqa: E731
                            else:
                                def ref():
                                    o, lse = rb.forward(spec, q, k, v, None, qa, ka, bp, 0.0, 0)
                                    return rb.backward(spec, q, k, v, None, qa, ka, bp, 0.0, 0, o, lse, do)
                            row["reference_ms"] = median_ms(ref, device)
                            row["reference_over_tvm"] = round(row["reference_ms"] / row["tvm_ms"], 2)
                        print(json.dumps(row), file=sys.stderr, flush=True)
                        out.append(row)
                        os.environ.pop("ATTNCOMP_TVM_DFSS_KERNEL", None)
    return out


def table(rs: List[Dict]) -> str:
    head = f"{'policy':<28} {'kernel':<7} {'causal':<6} {'N':>5} {'pass':<8} {'dens':>5} {'tvm ms':>9} {'sdpa ms':>9} " \
           f"{'sdpa/tvm':>8} {'ref ms':>9} {'ref/tvm':>7}"
    lines = [head, "-" * len(head)]
    for r in rs:
        lines.append(f"{r['policy'][:28]:<28} {r.get('kernel', ''):<7} {str(r['causal']):<6} {r['N']:>5} {r['pass']:<8} "
                     f"{r['density']:>5.2f} "
                     f"{r['tvm_ms']:>9.2f} {r['sdpa_dense_ms']:>9.2f} {r['sdpa_over_tvm']:>8.2f} "
                     f"{r.get('reference_ms', float('nan')):>9.1f} {r.get('reference_over_tvm', float('nan')):>7.2f}")
    return "\n".join(lines)


def main(argv=None, command_argv=None) -> int:
    global TB
    args = parse_args(argv)
    from attncomp.codegen.tvm import backend

    TB = backend
    torch.manual_seed(0)
    rs = rows(args)
    from attncomp.codegen.tvm.build import llvm_target, tvm_version

    dev = "cpu" if args.device == "cpu" else C.device_tag()
    doc = C.document("kernels", rs, ["--backend", "tvm"] + list(argv or []) if command_argv is None else command_argv,
                     device=dev, tvm=tvm_version() if args.device == "cpu" else None,
                     target=llvm_target() if args.device == "cpu" else None, threads=torch.get_num_threads(),
                     protocol="tvm rows: median of 7 timed calls after 2 warm-up calls; SDPA = dense attention on "
                              "the same shapes")
    paths = C.write(doc, args.out, keep=lambda r: r.get("table", "policies") != "tvm")
    print(table(rs))
    print(f"wrote {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
