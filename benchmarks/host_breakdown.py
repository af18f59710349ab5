"""Where the host time of one op call goes, at the shapes of the models table: each stage timed
inclusively by a thin wrapper (a fraction of a microsecond each), not by a profiler that inflates
small Python calls.

For each (shape, policy) the op is called as a compiled graph calls it (``torch.ops.attncomp.attention``
with no buckets or keep draws, the spec as JSON), on an idle device: ``host`` is the time until the
call returns, ``wall`` the time until the device is done too, ``back to back`` the host time per call of
calls issued one after another (what ``models.py``'s ``host_us`` measures). q, k and v are laid out as a
model's projections give them (``--layout contiguous``: as ``torch.randn`` gives them). The policy
``eager`` times ``scaled_dot_product_attention`` itself at the shape: what eager attention pays. Then
the stages: the backend choice,
the keep draws of ``drop`` (``materialize_aux`` with torch ops, or the Triton backend's
``draw_keep`` with its sort), the backend's forward/backward, a forward launch plan's launch, the
``Site`` (predicates, layout, the layout of given keep masks), tile lists, TMA descriptors (built, and
encoded by the launcher), kernel arguments, the op's call key and the SDPA plan, and Triton's
``JITFunction.run`` (taken on a launch's first call only, see ``attncomp/codegen/triton/launch.py``)
and its compiled launcher.

    python benchmarks/host_breakdown.py [--shapes gpt2,bert,llama,tiny] [--policies eager,dense,dfss,hash,drop]
                                        [--backward] [--iters 50] [--rounds 5] [--layout model|contiguous] [--full-path]
                                        [--backend auto|triton|sdpa] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncomp  # noqa: F401,E402  (registers the op)
from attncomp.ops import ARG_INDEX  # noqa: E402
from attncomp.policy import get_policy  # noqa: E402
from attncomp.spec import AttentionSpec  # noqa: E402
from models import host_and_wall_ms, sync  # noqa: E402

# (B, Hq, Hk, N, D, causal, padded): the attention sites of benchmarks/models.py's GPU configs
SHAPES = {"gpt2": (4, 16, 16, 2048, 64, True, False), "bert": (8, 16, 16, 512, 64, False, True),
          "llama": (2, 32, 8, 4096, 64, True, False), "tiny": (1, 2, 2, 16, 16, True, False)}

_acc: dict = collections.defaultdict(float)
_cnt: dict = collections.defaultdict(int)


def _wrap(owner, attr: str, name: str) -> None:
    """Time every call of ``owner.attr`` (inclusive) under ``name``."""
    fn = getattr(owner, attr)
    if getattr(fn, "_timed", False):
        return

    @functools.wraps(fn)
    def timed(*a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            _acc[name] += time.perf_counter_ns() - t0
            _cnt[name] += 1

    timed._timed = True
    setattr(owner, attr, timed)


def instrument() -> list:
    """Wrap the stages; returns their names in print order."""
    from attncomp import ops
    from attncomp.codegen.triton import backend as tb
    from attncomp.runtime import dispatch

    from attncomp.codegen.sdpa import SdpaBackend

    stages = [(ops, "_attention_backward_impl", "op backward impl"), (dispatch, "select_backend", "select_backend"),
              (ops, "_derive_buckets", "derive buckets"), (ops, "materialize_aux", "materialize_aux"), (SdpaBackend, "forward", "sdpa fwd"),
              (SdpaBackend, "backward", "sdpa bwd"), (tb, "attention_forward", "triton fwd"),
              (tb, "attention_backward", "triton bwd"), (tb.Site, "__init__", "Site()"),
              (tb.Site, "lists", "Site.lists"), (tb.Site, "kv_descriptors", "kv descriptors"),
              (tb.Site, "q_descriptors", "q descriptors"), (tb.Site, "pred_args", "Site.pred_args"),
              (tb.Site, "meta", "Site.meta"), (tb, "_derived_for", "derive layout"),
              (tb, "_layout_for", "layout of aux"), (tb, "draw_keep", "draw keep (sort)"),
              (tb._ForwardPlan, "run", "forward plan"), (tb, "_descriptor", "TMA descriptor()"),
              (ops, "_call_key", "op call key")]
    try:
        from attncomp.codegen import sdpa

        stages.append((sdpa._Plan, "call", "sdpa plan"))
    except AttributeError:
        pass
    names = []
    for owner, attr, name in stages:
        if hasattr(owner, attr):
            _wrap(owner, attr, name)
            names.append(name)
    try:
        from triton.runtime.jit import JITFunction

        _wrap(JITFunction, "run", "triton JIT run")
        names.append("triton JIT run")
        from triton.backends.nvidia.driver import CudaLauncher

        _wrap(CudaLauncher, "__call__", "triton launcher")
        names.append("triton launcher")
        from triton.backends.nvidia import driver as nv

        _wrap(nv, "make_tensordesc_arg", "launcher: TMA encode")  # inside the launcher, per descriptor
        names.append("launcher: TMA encode")
    except Exception:
        pass
    return names


def op_args(spec: AttentionSpec, B, Hq, Hk, N, D, padded, device, dtype, grad: bool, layout: str = "model"):
    def make(H):
        if layout == "contiguous":
            return torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=grad)
        # as a model's projections give them: (B, N, H, D) viewed as (B, H, N, D)
        return torch.randn(B, N, H, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_(grad)

    q, k, v = make(Hq), make(Hk), make(Hk)
    args = [None] * len(ARG_INDEX)
    for name, val in (("q", q), ("k", k), ("v", v), ("spec", spec.to_json()), ("dropout_p", 0.0), ("seed", 0)):
        args[ARG_INDEX[name]] = val
    if padded:  # right padding: every other row ends at 3/4
        kv = torch.ones(B, N, dtype=torch.bool, device=device)
        kv[1::2, (3 * N) // 4:] = False
        args[ARG_INDEX["k_valid"]] = kv
    return args, (q, k, v)


def measure(args, tensors, backward: bool, device, iters: int, drop: bool, full_path: bool = False,
            rounds: int = 5):
    from attncomp import ops

    def call():
        if full_path:  # every call through spec parsing and backend selection: what the op's plans save
            ops._CALLS.clear()
        if drop:  # as compiled graphs call a drop site: keep draws of a fresh seed, then the op
            aux = torch.ops.attncomp.policy_aux(tensors[0], tensors[1], args[ARG_INDEX["spec"]], 1)
            args[ARG_INDEX["q_aux"]], args[ARG_INDEX["k_aux"]] = aux
        out = torch.ops.attncomp.attention(*args)[0]
        if backward:
            out.backward(torch.ones_like(out))
            for t in tensors:
                t.grad = None

    return _timed(call, device, iters, rounds)


def _timed(call, device, iters: int, rounds: int = 5):
    """``(host, wall, b2b, stages, counts)`` of ``call``: host and wall time (us, medians) of one call on
    an idle device, the host time per call of ``iters`` calls issued back to back (us, best of
    ``rounds``: what ``models.py``'s ``host_us`` measures), and the stages' time per call (of the single
    calls)."""
    for _ in range(3):
        call()
    _acc.clear()
    _cnt.clear()
    host, wall = host_and_wall_ms(call, device, iters)
    stages = {k: _acc[k] / 1e3 / iters for k in _acc}
    counts = {k: _cnt[k] / iters for k in _cnt}
    b2b = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        b2b.append((time.perf_counter() - t0) / iters * 1e6)
    sync(device)
    return host * 1e3, wall * 1e3, min(b2b), stages, counts


def eager_sdpa(B, Hq, Hk, N, D, causal, padded, device, dtype, layout: str):
    """What eager attention pays per call at the shape: ``scaled_dot_product_attention`` (a boolean
    padding mask built beforehand, GQA by ``enable_gqa``)."""
    q, k, v = op_args(AttentionSpec(), B, Hq, Hk, N, D, False, device, dtype, False, layout)[1]
    mask = None
    if padded:
        mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device=device)
        mask[1::2, ..., (3 * N) // 4:] = False
    F = torch.nn.functional
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  enable_gqa=Hq != Hk)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gpt2,bert,llama,tiny")
    ap.add_argument("--policies", default="dense,dfss,hash,drop")
    ap.add_argument("--backend", default="auto", help="auto, triton, sdpa, ...")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of back-to-back calls (the best is kept)")
    ap.add_argument("--full-path", action="store_true",
                    help="forget the op's kept plans before each call (the path a first call takes)")
    ap.add_argument("--layout", default="model", choices=("model", "contiguous"),
                    help="q, k, v as a model's projections give them (heads inner), or contiguous")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = instrument()
    rows = []
    for shape in args.shapes.split(","):
        B, Hq, Hk, N, D, causal, padded = SHAPES[shape]
        for pol in args.policies.split(","):
            try:
                if pol == "eager":  # the floor: what eager SDPA pays per call at the shape (forward)
                    with torch.no_grad():
                        host, wall, b2b, stages, counts = _timed(
                            eager_sdpa(B, Hq, Hk, N, D, causal, padded, device, dtype, args.layout), device,
                            args.iters, args.rounds)
                else:
                    spec = AttentionSpec(causal=causal, policy=get_policy(pol).resolved(dtype), backend=args.backend,
                                         head_dim=D, gqa_groups=Hq // Hk, dtype=str(dtype).replace("torch.", ""))
                    a, t = op_args(spec, B, Hq, Hk, N, D, padded, device, dtype, args.backward, args.layout)
                    with torch.set_grad_enabled(args.backward):
                        host, wall, b2b, stages, counts = measure(a, t, args.backward, device, args.iters,
                                                                  pol == "drop", args.full_path, args.rounds)
            except Exception as e:  # a failing row does not stop the others
                print(f"{shape:6s} {pol:6s} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            rows.append(dict(shape=shape, policy=pol, backward=args.backward, layout=args.layout,
                             backend=args.backend, full_path=args.full_path, host_us=host,
                             wall_us=wall, b2b_host_us=b2b, stages=stages, calls=counts))
            print(f"\n{shape:6s} {pol:6s} host {host:8.1f} us  wall {wall:9.1f} us  back to back {b2b:7.1f} us/call",
                  flush=True)
            for n in names:
                if n in stages:
                    print(f"    {n:18s} {stages[n]:8.1f} us  ({counts[n]:.0f} calls)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                           torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
