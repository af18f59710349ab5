"""Host time of the Triton backend's forward on a machine without a GPU: every kernel of the path a
no-op stand-in for its compiled form, so that what is timed is the host code alone (Python, the
launch keys and arguments, allocations), on CPU tensors.

Rows per policy (``hash``, ``drop``: layouts derived on the device, ``drop`` from a fresh seed per
call, as a compiled graph calls its sites; ``drop-aux``: keep masks drawn first with a fresh seed
(``attncomp::policy_aux``'s route), then the forward given them;
``dense``, ``dfss``), each the microseconds per call, best of ``--rounds`` rounds of ``--iters`` calls:

* ``full``: every call through the ``Site`` (plans forgotten before each call);
* ``plan``: repeats served by the backend's launch plan (``_ForwardPlan``, or for hash/drop the
  recorded ``_SortedPlan``), and the number of launches one call makes.

    python benchmarks/host_stub.py [--shape gpt2|llama|tiny] [--policies hash,drop,drop-aux,dense,dfss]
                                   [--iters 2000] [--rounds 7] [--json PATH]

The stand-in's launch does nothing, so a GPU host pays these figures plus its driver's launch cost
per kernel (and is slower per Python call: ``benchmarks/README.md``, host path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import layout, schedule  # noqa: E402
from attncomp.policy import get_policy  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402

SHAPES = {"tiny": (1, 2, 2, 16, 16), "gpt2": (4, 16, 16, 2048, 64), "llama": (2, 32, 8, 4096, 64)}
KERNELS = [(layout, "_layout_hist"), (layout, "_layout_scan"), (layout, "_layout_scatter"),
           (schedule, "_tile_summaries"), (schedule, "_tile_lists"), (TB, "_attention_kernel")]


class _NoOp:
    """A compiled kernel whose launch does nothing (counts itself)."""

    function, packed_metadata = "fn", "meta"
    launches = 0

    def run(self, *args):
        _NoOp.launches += 1


def stub_kernels() -> None:
    for mod, name in KERNELS:
        fl = getattr(mod, name)
        fl.fn.run = lambda *a, grid, warmup, **kw: _NoOp()
        fl._device = lambda: 0
        fl._stream = lambda dev: 0
        fl._runtime = type("R", (), {"launch_enter_hook": None, "launch_exit_hook": None})()


def per_call_us(fn, iters: int, rounds: int, sync=None) -> float:
    """Microseconds per call of ``fn``, best of ``rounds`` rounds of ``iters`` calls back to back;
    ``sync`` (a GPU's synchronize) runs after the warm-up and after each round, outside the timing."""
    for _ in range(20):
        fn()
    if sync is not None:
        sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        if sync is not None:
            sync()
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    ap.add_argument("--policies", default="hash,drop,drop-aux,dense,dfss")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stub_kernels()
    B, Hq, Hk, N, D = SHAPES[args.shape]
    # as a model's projections give them: (B, N, H, D) viewed as (B, H, N, D)
    q = torch.randn(B, N, Hq, D, dtype=torch.float16).transpose(1, 2)
    k, v = (torch.randn(B, N, Hk, D, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    rows = []
    seeds = iter(range(1, 1 << 30))
    for pol in args.policies.split(","):
        aux = pol == "drop-aux"  # keep draws, then the op given them
        spec = AttentionSpec(causal=True, policy=get_policy(pol.split("-")[0]).resolved(torch.float16))

        def call():
            if aux:  # (a fresh seed per call; the layout cache then holds the draw's layout)
                qk, kk = TB.draw_keep(spec, q, k, next(seeds))
                TB.attention_forward(spec, q, k, v, q_aux=qk, k_aux=kk)
            else:  # drop: a fresh seed per call, the keep draws in the forward's sort
                TB.attention_forward(spec, q, k, v, seed=next(seeds) if spec.policy.name == "drop" else 0)

        def full():  # a first sighting of the key each time, and no layout remembered for these q, k
            TB._PLANS.clear()
            TB._SEEN.clear()
            TB._LAYOUT_CACHE.clear()
            call()

        row = {"policy": pol, "shape": args.shape, "full_us": per_call_us(full, args.iters, args.rounds)}
        TB._PLANS.clear()
        TB._SEEN.clear()
        row["plan_us"] = per_call_us(call, args.iters, args.rounds)
        plan = next(iter(TB._PLANS.values()), None)
        row["plan"] = type(plan).__name__ if plan is not None else None
        n0 = _NoOp.launches
        call()
        row["launches"] = _NoOp.launches - n0
        rows.append(row)
    print(f"{'policy':8} {'full us':>9} {'plan us':>9}  plan            launches")
    for r in rows:
        print(f"{r['policy']:8} {r['full_us']:9.1f} {r['plan_us']:9.1f}  {str(r['plan']):15} {r['launches']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": "cpu (kernels stubbed)", "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
