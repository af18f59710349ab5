"""One compiled model of ``models.py`` on this machine: its ``attncomp.report`` (which kernel each site
ran and why, Inductor or not, graph breaks) and a profile of one step's CUDA kernels, to explain a
row of the models table. With ``--host``, also the host time of one step (the time until the call
returns, started on an idle device, so that launches are not queued behind kernels) next to its wall
time, for eager, ``torch.compile`` and attncomp, and a ``cProfile`` of attncomp's steps: where the
host time goes. With ``--kernels`` (GPU), the kernels of one step of ``torch.compile`` and of attncomp
side by side: launches per step and the GPU time of each kind.

    python benchmarks/model_report.py --model gpt2 --policy dense [--mode infer] [--host] [--kernels]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncomp  # noqa: E402
import models  # noqa: E402
from models import build, configs, device_name, host_and_wall_ms, inputs, sync  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--mode", default="infer")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--host", action="store_true", help="host time per step and a cProfile of attncomp's steps")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel table")
    ap.add_argument("--kernels", action="store_true",
                    help="the GPU kernels of one step, torch.compile's next to attncomp's (counts and times)")
    args = ap.parse_args(argv)
    import transformers

    models.T = transformers
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    c = next(c for c in configs(device_name(), args.smoke) if c["model"] == args.model and c["mode"] == args.mode)
    torch.manual_seed(0)
    model = build(c).to(device=device, dtype=dtype).eval()
    x = inputs(c, device)
    counters = torch._dynamo.utils.counters
    counters.clear()
    fast = attncomp.compile(model, policy=args.policy, inductor=True)
    with torch.no_grad():
        for _ in range(3):
            fast(**x)
    print(attncomp.report(fast))
    print("graph breaks:", dict(counters.get("graph_break", {})))
    if args.host:
        host_table(model, fast, x, device, args.top)
    if args.kernels and device.type == "cuda":
        for name, fn in (("torch.compile", torch.compile(model)), ("attncomp", fast)):
            kernel_table(name, fn, x)
    if args.no_profile:
        return 0
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    with torch.no_grad(), torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            fast(**x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))
    return 0


def kernel_table(name: str, fn, x, steps: int = 3) -> None:
    """The CUDA kernels of one step of ``fn`` (averaged over ``steps``): how many launches a step makes
    and what each kind costs, to compare a compiled model's kernels with another's."""
    import collections

    with torch.no_grad():
        for _ in range(3):
            fn(**x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn(**x)
            torch.cuda.synchronize()
    count, time_us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name[:90]] += 1
            time_us[e.name[:90]] += e.device_time
    print(f"{name}: {sum(count.values()) / steps:.0f} kernels per step, "
          f"{sum(time_us.values()) / steps:.0f} us of GPU time per step")
    for k, n in count.most_common():
        print(f"  {n / steps:5.1f} per step  {time_us[k] / n:8.1f} us  {k}")


def host_table(model, fast, x, device, top: int) -> None:
    """Host and wall time per step of eager, ``torch.compile`` and attncomp, then attncomp's cProfile."""
    compiled = torch.compile(model)
    rows = []
    with torch.no_grad():
        for name, fn in (("eager", model), ("torch.compile", compiled), ("attncomp", fast)):
            for _ in range(3):
                fn(**x)
            h, w = host_and_wall_ms(lambda: fn(**x), device)
            rows.append((name, h, w))
        prof = cProfile.Profile()
        sync(device)
        prof.enable()
        for _ in range(5):
            fast(**x)
        prof.disable()
        sync(device)
    print(f"{'':14s} {'host ms':>8s} {'wall ms':>8s}")
    for name, h, w in rows:
        print(f"{name:14s} {h:8.3f} {w:8.3f}")
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(3 * top)
    st.sort_stats("tottime").print_stats(top)
    print("cProfile of 5 attncomp steps:\n" + buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
