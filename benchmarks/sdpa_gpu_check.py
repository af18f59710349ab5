"""GPU check of the SDPA backend against the reference (float32): forward, lse, backward, every
predicate kind, GQA, empty rows; then the per-call host time of dense against SDPA.

Usage (on a CUDA machine): ``python benchmarks/sdpa_gpu_check.py``. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
import time

import torch

from attncomp.codegen import get_backend
from attncomp.spec import AttentionSpec, Predicates


def main() -> int:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hk, Nq, Nk, D = 2, 8, 2, 77, 133, 64
    sd, ref = get_backend("sdpa"), get_backend("reference")
    bad = 0
    kv = torch.rand(B, Nk, device=dev, generator=g) < 0.8
    kv[1] = False
    cases = {
        "none": (AttentionSpec(), None, None),
        "causal": (AttentionSpec(causal=True), None, None),
        "causal_bottom_right": (AttentionSpec(causal=True, causal_align="bottom_right"), None, None),
        "window_padding": (AttentionSpec(causal=True, window_left=9, causal_align="bottom_right"),
                           Predicates(k_valid=kv), None),
        "float_mask": (AttentionSpec(mask_kind="float"), None,
                       torch.randn(B, 1, Nq, Nk, device=dev, generator=g)),
    }
    for dtype in (torch.bfloat16, torch.float32):
        for name, (spec, preds, mask) in cases.items():
            q = torch.randn(B, Hq, Nq, D, device=dev, dtype=dtype, generator=g)
            k = torch.randn(B, Hk, Nk, D, device=dev, dtype=dtype, generator=g)
            v = torch.randn(B, Hk, Nk, D, device=dev, dtype=dtype, generator=g)
            m = None if mask is None else mask.to(dtype)
            go = torch.randn(B, Hq, Nq, D, device=dev, dtype=dtype, generator=g)
            kw = {} if preds is None else {"preds": preds}
            args = (spec, q, k, v, m, None, None, None, 0.0, 0)
            out, lse = sd.forward(*args, **kw)
            grads = sd.backward(*args, out, lse, go, **kw)[:3]
            f = [t.float() for t in (q, k, v)]
            fargs = (spec, *f, None if m is None else m.float(), None, None, None, 0.0, 0)
            rout, rlse = ref.forward(*fargs, **kw)
            rgrads = ref.backward(*fargs, rout, rlse, go.float(), **kw)[:3]
            tol = 3e-2 if dtype == torch.bfloat16 else 2e-3
            errs = {"out": (out.float() - rout).abs().max().item(),
                    "lse": (torch.nan_to_num(lse, neginf=0.0) - torch.nan_to_num(rlse, neginf=0.0)).abs().max().item(),
                    "lse_inf": int((torch.isneginf(lse) != torch.isneginf(rlse)).sum().item())}
            for nm, a, b in zip(("dq", "dk", "dv"), grads, rgrads):
                errs[nm] = ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            ok = all(not (e != e) and e <= (0 if n == "lse_inf" else tol * 2) for n, e in errs.items())
            bad += not ok
            print(f"{str(dtype):15s} {name:20s} {'ok ' if ok else 'BAD'} " +
                  " ".join(f"{n}={e:.2e}" for n, e in errs.items()), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
