import os, sys, statistics, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import attncomp
import models, transformers
models.T = transformers
from models import configs, model_and_step, timed_ms, host_and_wall_ms

dev = torch.device("cuda")
c = next(c for c in configs("cuda", False) if c["model"] == "bert")
model, step = model_and_step(c, dev, torch.bfloat16)
order = sys.argv[1].split(",")
variants = {}
for name in order:
    torch._dynamo.reset() if name == order[0] else None
    if name == "compile":
        variants[name] = torch.compile(model)
    elif name == "eager":
        variants[name] = model
    else:
        pol, _, inl = name.partition(":")
        os.environ["ATTNCOMP_INLINE_SDPA"] = "0" if inl == "op" else "1"
        variants[name] = attncomp.compile(model, policy=pol, inductor=True)
    step(variants[name]); step(variants[name])
rows = {n: [] for n in variants}
for r in range(4):
    for n, m in variants.items():
        rows[n].append(host_and_wall_ms(lambda: step(m), dev, 30))
for n, v in rows.items():
    print(f"{n:12s} host " + " ".join(f"{h:.2f}" for h, w in v) + "   wall " + " ".join(f"{w:.2f}" for h, w in v))
from torch.profiler import profile, ProfilerActivity
for n in ("compile", [x for x in variants if x.startswith("dense")][0]):
    m = variants[n]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step(m)
    print("==", n)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
