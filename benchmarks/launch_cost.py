"""What one op call's host time is made of, piece by piece, on a GPU host: each piece timed alone,
back to back (microseconds per call, best of ``--rounds`` rounds of ``--iters`` calls), so that the
pieces can be set against the whole call.

Pieces, per (shape, policy): the whole op call as a compiled graph makes it (and, in the same run,
with launches through Triton's ``CompiledKernel.run`` rather than its C launcher directly, see
``launch.direct``; for a Gluon plan also with its launch arguments built per call rather than kept
per address set, and for a recorded hash/drop plan with its runs of launches as CUDA graphs or launched
one by one, rounds interleaved); the op's call key; the kept plan's ``call``; for the plan's last launch
(recorded as it happens) ``FastLaunch.launch_entry``, the direct launch, ``CompiledKernel.run``,
and the TMA encode of the host descriptor arguments; then shape-free pieces: ``torch.empty`` of the
output, the current stream, a one-argument Triton kernel through its launcher (the driver's floor per
launch), and SDPA itself.
A ``cProfile`` of the plan's calls (top entries by own time) goes to the JSON.

    python benchmarks/launch_cost.py [--shapes tiny,llama] [--policies dense,dfss,hash,drop] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncomp  # noqa: E402,F401  (registers the op)
import host_stub  # noqa: E402  (its timing loop; nothing is stubbed unless its main runs)
from attncomp import ops  # noqa: E402
from attncomp.codegen.triton import cugraph, launch as L  # noqa: E402
from attncomp.ops import ARG_INDEX  # noqa: E402
from attncomp.policy import get_policy  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402

SHAPES = {"tiny": (1, 2, 2, 16, 16), "llama": (2, 32, 8, 4096, 64), "gpt2": (4, 16, 16, 2048, 64)}


def per_call_us(fn, iters: int, rounds: int) -> float:
    return host_stub.per_call_us(fn, iters, rounds, torch.cuda.synchronize)


_LAST = []
_SPYING = []


def _spy():
    """Record each launch_entry call (entry, grid, args, device) in _LAST."""
    orig = L.FastLaunch.launch_entry

    def spy(self, entry, grid, args, device=None):
        if _SPYING:
            _LAST.append((self, entry, grid, list(args), device))
        return orig(self, entry, grid, args, device)

    L.FastLaunch.launch_entry = spy
    return orig


def _forget():
    """Drop every kept plan (the op's and the Triton backend's), so that the next calls make them anew."""
    from attncomp.codegen.triton import backend as TB

    ops._CALLS.clear()
    TB._PLANS.clear()
    TB._SEEN.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,llama")
    ap.add_argument("--policies", default="dense,dfss,hash,drop")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-ab", dest="ab", action="store_false",
                    help="skip the op calls through CompiledKernel.run (the launcher before direct launches)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    it, rd = a.iters, a.rounds
    rows = []
    common = {}

    # shape-free pieces
    one = _one_src()  # a one-argument kernel
    x = torch.empty(1 << 20, device=dev)
    common["torch.empty"] = per_call_us(lambda: torch.empty((2, 32, 16, 64), device=dev, dtype=dt), it, rd)
    common["current stream (triton driver)"] = per_call_us(
        lambda: L.FastLaunch._stream(one, 0), it, rd)
    common["torch.cuda.current_stream"] = per_call_us(lambda: torch.cuda.current_stream(), it, rd)
    one[(1,)](x, 1)
    ent = one.last_entry or next(iter(one._cache.values()))
    common["1-arg kernel, launcher"] = per_call_us(lambda: one.launch_entry(ent, (1,), (x.data_ptr(), 1)), it, rd)
    kern = ent[0]
    stream = one._stream(0)
    launch_c = getattr(kern.run, "launch", None)
    md = kern.packed_metadata
    if launch_c is not None:
        common["1-arg kernel, C launch"] = per_call_us(
            lambda: launch_c(1, 1, 1, stream, kern.function, False, False, None, None, md, None, None, None,
                             x.data_ptr(), 1), it, rd)

    orig = _spy()
    for shape in a.shapes.split(","):
        B, Hq, Hk, N, D = SHAPES[shape]
        q = torch.randn(B, N, Hq, D, device=dev, dtype=dt).transpose(1, 2)
        k, v = (torch.randn(B, N, Hk, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(2))
        common[f"sdpa {shape}"] = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), it, rd)
        for pol in a.policies.split(","):
            spec = AttentionSpec(causal=True, policy=get_policy(pol).resolved(dt))
            js = spec.to_json()
            args = [None] * len(ARG_INDEX)
            for name, val in (("q", q), ("k", k), ("v", v), ("spec", js), ("dropout_p", 0.0), ("seed", 0)):
                args[ARG_INDEX[name]] = val
            op = torch.ops.attncomp.attention.default
            row = {"shape": shape, "policy": pol}
            if pol == "drop":  # as a compiled graph calls it: no masks, a fresh seed; the op draws the masks
                def call():
                    args[ARG_INDEX["seed"]] = ops.next_seed(spec.policy.seed)
                    return op(*args)

                # attncomp::policy_aux's route, for comparison: masks drawn first, then the op given them
                seeds = iter(range(1, 1 << 30))
                aux_op, aux_args = torch.ops.attncomp.policy_aux.default, list(args)

                def aux_call():
                    aux_args[ARG_INDEX["q_aux"]], aux_args[ARG_INDEX["k_aux"]] = aux_op(q, k, js, next(seeds))
                    return op(*aux_args)

                row["policy_aux + op call"] = per_call_us(aux_call, it, rd)
            else:
                def call():
                    return op(*args)

            row["op call"] = per_call_us(call, it, rd)
            if a.ab:  # direct C launches against CompiledKernel.run, rounds interleaved (plans made afresh)
                best = {True: float("inf"), False: float("inf")}
                for _ in range(rd):
                    for on in (False, True):
                        L.direct(on)
                        _forget()
                        best[on] = min(best[on], per_call_us(call, it, 1))
                L.direct(True)
                _forget()
                call()
                call()
                row["A/B: op call, direct"], row["A/B: op call, kernel.run"] = best[True], best[False]
            row["call key"] = per_call_us(lambda: ops._call_key(js, q, k, v, None, None, None, 0.0, 0), it, rd)
            key = ops._call_key(js, q, k, v, None, None, None, 0.0, 0)
            plan = ops._CALLS.get(key)
            row["plan"] = type(plan).__name__ if plan is not None else None
            if plan is not None:
                row["plan.call"] = per_call_us(lambda: plan.call(q, k, v, None, None, None, 0), it, rd)
            if getattr(plan, "replay", None) is not None:  # a recorded plan: its runs as CUDA graphs, or not
                best = {True: float("inf"), False: float("inf")}
                for _ in range(rd):
                    for on in (True, False):
                        cugraph.enabled(on)
                        best[on] = min(best[on], per_call_us(call, it, 1))
                cugraph.enabled(True)
                row["A/B: op call, CUDA graphs"], row["A/B: op call, launch by launch"] = best[True], best[False]
                runs = [st for st in plan.replay.steps if type(st).__name__ == "_Run"]
                row["launches"] = len(plan.replay.launches)
                row["graph runs"] = [dict(launches=len(r.launches), graphs=len(r.graphs), captures=r.captures,
                                          why=r.why) for r in runs]
            if getattr(plan, "kept", None) is not None:  # a Gluon plan: launch arguments kept, or built per call
                kept, best = plan.kept, {True: float("inf"), False: float("inf")}
                for _ in range(rd):
                    for on in (True, False):
                        plan.kept = kept if on else None
                        best[on] = min(best[on], per_call_us(call, it, 1))
                plan.kept = kept
                row["A/B: op call, launch args kept"], row["A/B: op call, built per call"] = best[True], best[False]
                _LAST.clear()
                _SPYING.append(True)
                plan.call(q, k, v, None, None, None, 0)
                _SPYING.clear()
                row["launches"] = len(_LAST)
                if _LAST:
                    fl, entry, grid, largs, device = _LAST[-1]
                    row["launch_entry (last)"] = per_call_us(lambda: orig(fl, entry, grid, largs, device), it, rd)
                    kern, tail = entry
                    g = tuple(grid) + (1,) * (3 - len(grid))
                    st = fl._stream(device if device is not None else fl._device())
                    go = L.direct_launcher(kern)
                    if go is not None:
                        row["direct (last)"] = per_call_us(lambda: go(g[0], g[1], g[2], st, (*largs, *tail)), it, rd)
                    try:
                        row["kernel.run (last)"] = per_call_us(
                            lambda: kern.run(g[0], g[1], g[2], st, kern.function, kern.packed_metadata, None, None,
                                             None, *largs, *tail), it, rd)
                    except Exception as e:  # noqa: BLE001
                        row["kernel.run error"] = repr(e)[:200]
                    descs = [x for x in largs if type(x).__name__ == "TensorDescriptor"]
                    if descs:
                        from triton.backends.nvidia import driver as nv
                        meta = getattr(kern.metadata, "tensordesc_meta", None) or [None] * len(descs)
                        row["TMA encode x%d" % len(descs)] = per_call_us(
                            lambda: [nv.make_tensordesc_arg(d, m) for d, m in zip(descs, meta)], it, rd)
                    row["n args"] = len(largs) + len(tail)
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(500):
                    plan.call(q, k, v, None, None, None, 0)
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
                row["profile"] = s.getvalue()[-3000:]
            rows.append(row)
    L.FastLaunch.launch_entry = orig
    print("common:")
    for name, us in common.items():
        print(f"  {name:34} {us:7.1f} us")
    for r in rows:
        print(f"{r['shape']} {r['policy']} ({r.get('plan')}, {r.get('launches')} launches, {r.get('n args')} args)")
        for name, val in r.items():
            if isinstance(val, float):
                print(f"  {name:34} {val:7.1f} us")
        if r.get("graph runs"):
            print(f"  graph runs: {r['graph runs']}")
    for r in rows:
        if "profile" in r:
            print(f"--- {r['shape']} {r['policy']}\n{r['profile'][-1800:]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "common": common,
                       "rows": rows}, f, indent=1)


def _one_src():
    import triton
    import triton.language as tl

    @triton.jit
    def one(X, n):
        tl.store(X + tl.program_id(0), n)

    return L.FastLaunch(one)


if __name__ == "__main__":
    main()
