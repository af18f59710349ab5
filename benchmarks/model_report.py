"""One compiled model of ``models.py`` on this machine: its ``attncomp.report`` (which kernel each site
ran and why, Inductor or not, graph breaks) and a profile of one step's CUDA kernels, to explain a
row of the models table.

    python benchmarks/model_report.py --model gpt2 --policy dense [--mode infer]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncomp  # noqa: E402
import models  # noqa: E402
from models import build, configs, device_name, inputs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--mode", default="infer")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--top", type=int, default=12)
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


if __name__ == "__main__":
    sys.exit(main())
