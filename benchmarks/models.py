"""End-to-end models: a compiled model against what the user had (eager, and ``torch.compile``).

Random-weight Hugging Face models built from configs (no download), default attention implementation,
timed in one process: ``eager_ms`` (the model as it is), ``compile_ms`` (``torch.compile(model)``,
default mode), ``attncomp_ms`` (``attncomp.compile(model, policy)``, dynamo capture + Inductor around
the op), each the median of ``--iters`` timed calls after 2 warm-up calls (CPU: at least 7 calls, as
BENCHMARKS.md asks). ``host_us`` is the host time of one op call at the site's spec on a tiny shape
(1 x 1 x 16 x D, q, k and v laid out as a model's projections give them; the best of 7 rounds of 50
calls back to back, timed until the last call returns), called as the compiled
graph calls it (hash: no buckets, the op derives them; drop: no keep masks, the op draws them from a
fresh seed per call, the draw counts): what the op adds per call besides its arithmetic.

Inputs (``--inputs``, row key ``inputs``): ``mask``, ``input_ids`` with an ``attention_mask`` (BERT's rows right-padded);
``no-mask``, ``input_ids`` alone (decoders with ``use_cache=False``, as a training call; transformers then derives
its mask from the positions); ``packed``, decoders given ``position_ids`` that restart for 8 documents per row
(packed sequences: a documents predicate).

Rows: ``{"model", "device", "mode": "infer"|"train", "B", "N", "inputs", "policy", "eager_ms", "compile_ms",
"attncomp_ms", "host_us"}``; a table is printed last, JSON is written to
``benchmarks/results/models_<device>.json`` (``cpu``, ``h100``, ``h200``, from the device name) after every row,
replacing the rows measured again and keeping the others (other models, modes or policies).

Usage::

    python -m attncomp bench models                 # CPU configs on a CPU, GPU configs on a GPU
    python -m attncomp bench models --smoke         # tiny shapes, seconds (CI; writes nothing unless --json)
    python -m attncomp bench models --policies dense,dfss --only llama
    python -m attncomp bench models --inductor-mode reduce-overhead   # both compilers with CUDA graphs
    python -m attncomp bench models --only gpt2,llama --inputs mask,no-mask,packed
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attncomp  # noqa: E402
from benchmarks import common as C  # noqa: E402

T = None  # transformers, imported in main

#: the ways of calling a model (``--inputs``)
INPUTS = ("mask", "no-mask", "packed")
DOCUMENTS = 8  # per row, in the packed inputs


def device_name() -> str:
    return C.device_tag()


def configs(device: str, smoke: bool) -> List[Dict[str, Any]]:
    """(model, mode, B, N, policies) rows to run."""
    if smoke:
        return [dict(model="gpt2", mode="infer", B=1, N=32, hidden=64, layers=1, heads=2),
                dict(model="llama", mode="infer", B=1, N=32, hidden=64, layers=1, heads=4, kv=2),
                dict(model="llama", mode="train", B=1, N=32, hidden=64, layers=1, heads=4, kv=2),
                dict(model="bert", mode="infer", B=2, N=32, hidden=64, layers=1, heads=2, pad=True)]
    if device == "cpu":
        return [dict(model="gpt2", mode="infer", B=2, N=512, hidden=256, layers=4, heads=4),
                dict(model="llama", mode="infer", B=2, N=512, hidden=256, layers=4, heads=8, kv=2),
                dict(model="bert", mode="infer", B=4, N=256, hidden=256, layers=4, heads=4, pad=True)]
    llama = dict(model="llama", hidden=2048, layers=4, heads=32, kv=8)
    return [dict(llama, mode="infer", B=2, N=4096), dict(llama, mode="train", B=2, N=4096),
            dict(llama, mode="infer", B=1, N=16384), dict(llama, mode="train", B=1, N=16384),
            dict(model="gpt2", mode="infer", B=4, N=2048, hidden=1024, layers=4, heads=16),
            dict(model="bert", mode="infer", B=8, N=512, hidden=1024, layers=4, heads=16, pad=True)]


def build(c: Dict[str, Any]):
    h, L, nh = c["hidden"], c["layers"], c["heads"]
    if c["model"] == "gpt2":
        cfg = T.GPT2Config(n_embd=h, n_layer=L, n_head=nh, vocab_size=1000, n_positions=max(c["N"], 64),
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return T.GPT2Model(cfg)
    if c["model"] == "llama":
        cfg = T.LlamaConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=c["kv"],
                            intermediate_size=2 * h, vocab_size=1000, max_position_embeddings=max(c["N"], 64))
        return T.LlamaModel(cfg)
    cfg = T.BertConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh, intermediate_size=2 * h,
                       vocab_size=1000, max_position_embeddings=max(c["N"], 64), hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return T.BertModel(cfg, add_pooling_layer=False)


def inputs(c: Dict[str, Any], device) -> Dict[str, Any]:
    """The call's keyword arguments for the configuration's ``inputs`` (:data:`INPUTS`)."""
    B, N = c["B"], c["N"]
    ids = torch.randint(3, 1000, (B, N), device=device)
    kind = c.get("inputs", "mask")
    if kind == "mask":
        am = torch.ones(B, N, dtype=torch.long, device=device)
        if c.get("pad"):  # right padding: every other row ends at 3/4
            am[1::2, (3 * N) // 4:] = 0
        return dict(input_ids=ids, attention_mask=am)
    x: Dict[str, Any] = dict(input_ids=ids)
    if c["model"] != "bert":
        x["use_cache"] = False
    if kind == "packed":  # documents of N / 8 tokens, positions restarting at each
        doc = -(-N // DOCUMENTS)
        x["position_ids"] = (torch.arange(N, device=device) % doc).expand(B, N)
    return x


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    return host_and_wall_ms(fn, device, iters)[1]


def host_and_wall_ms(fn, device, iters: int = 10):
    """Median host time (until ``fn`` returns, started on an idle device) and wall time of one call, ms."""
    host, wall = [], []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(wall)


def host_us(fast, device, iters: int = 50, rounds: int = 7) -> float:
    """Host time of one op call at the first site's spec, on a tiny shape: rounds of ``iters`` calls
    back to back, each started on an idle device and timed until the last call returns (the device
    keeps up at this shape), the best round's time per call."""
    node = next((n for g in fast.graphs for n in g.graph.nodes if attncomp.ops.is_attention_node(n)), None)
    if node is None:
        return float("nan")
    A = attncomp.ops.ARG_INDEX
    spec = attncomp.AttentionSpec.from_json(node.args[A["spec"]])
    if spec.policy.name == "spion":  # its pattern comes from the model's calibration state
        return float("nan")
    D = spec.head_dim or 64
    dt = spec.torch_dtype() or torch.float32
    # laid out as a model's projections give them: (B, N, H, D) viewed as (B, H, N, D)
    q = torch.randn(1, 16, spec.gqa_groups, D, device=device, dtype=dt).transpose(1, 2)
    k = torch.randn(1, 16, 1, D, device=device, dtype=dt).transpose(1, 2)
    v = torch.randn(1, 16, 1, D, device=device, dtype=dt).transpose(1, 2)
    # as the compiled graph calls the op: hash buckets and drop's keep masks left to the op, drop with a
    # fresh seed per call (attncomp.ops.next_seed, as in a training call)
    pol = spec.policy.name
    args = [None] * len(A)
    for name, val in (("q", q), ("k", k), ("v", v), ("spec", spec.to_json()), ("dropout_p", 0.0), ("seed", 0)):
        args[A[name]] = val
    if spec.mask_kind != "none":
        args[A["attn_mask"]] = torch.ones(1, 1, 16, 16, dtype=torch.bool, device=device) \
            if spec.mask_kind == "bool" else torch.zeros(1, 1, 16, 16, dtype=dt, device=device)

    def call():
        if pol == "drop":
            args[A["seed"]] = attncomp.ops.next_seed(spec.policy.seed)
        torch.ops.attncomp.attention(*args)

    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(rounds):  # the best round: the host's own cost, without its scheduling noise
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        best = min(best, time.perf_counter() - t0)
    sync(device)
    return best * 1e6 / iters


def model_and_step(c, device, dtype):
    """The configuration's model (seeded weights, in its mode) and ``step(m)``: one call of ``m`` (a
    compiled form of the model) on the configuration's inputs, a training step in train mode."""
    torch.manual_seed(0)
    model = build(c).to(device=device, dtype=dtype)
    x = inputs(c, device)
    train = c["mode"] == "train"
    model.train(train)

    def step(m):
        if train:
            out = m(**x).last_hidden_state
            out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                m(**x)

    return model, step


def graphs_ab(fast, step, device, iters: int, before: set, rounds: int = 5) -> Dict[str, Any]:
    """``attncomp_ms`` with the recorded hash/drop plans' runs launched as CUDA graphs and launched
    kernel by kernel (``attncomp.codegen.triton.cugraph``), rounds interleaved in this process (medians),
    and what the runs of the plans made since ``before`` (ids of the op's plans then) hold (graphs
    kept, captures, launches served)."""
    from attncomp.codegen.triton import cugraph, record

    times = {True: [], False: []}
    try:
        for _ in range(rounds):
            for on in (True, False):
                cugraph.enabled(on)
                times[on].append(timed_ms(lambda: step(fast), iters, device))
    finally:
        cugraph.enabled(True)
    runs = [st for p in attncomp.ops._CALLS.values() if id(p) not in before
            for st in getattr(getattr(p, "replay", None), "steps", ()) if type(st) is record._Run]
    return {"attncomp_ms graphs": statistics.median(times[True]),
            "attncomp_ms launch by launch": statistics.median(times[False]),
            "graph runs": [dict(graphs=len(r.graphs), captures=r.captures, hits=r.hits, why=r.why) for r in runs]}


def run_config(c, policies, device, dtype, iters, imode=None, ab=False):
    """Rows of one model configuration: eager and ``torch.compile`` timed once, then ``attncomp.compile``
    per policy (a policy that fails records its error and the others go on); with ``ab`` also
    :func:`graphs_ab` for hash and drop on a GPU."""
    model, step = model_and_step(c, device, dtype)

    base = dict(model=c["model"], device=device_name(), mode=c["mode"], B=c["B"], N=c["N"],
                inputs=c.get("inputs", "mask"))
    base["eager_ms"] = timed_ms(lambda: step(model), iters, device)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=imode)
    base["compile_ms"] = timed_ms(lambda: step(compiled), iters, device)
    del compiled
    torch._dynamo.reset()
    for policy in policies:
        row = dict(base, policy=policy)
        try:
            before = set(map(id, attncomp.ops._CALLS.values()))  # (plans of earlier models and policies)
            fast = attncomp.compile(model, policy=policy, inductor=True, mode=imode)
            row["attncomp_ms"] = timed_ms(lambda: step(fast), iters, device)
            rep = attncomp.report(fast)
            row["sites"], row["rewritten"] = len(rep.sites), rep.rewritten
            row["host_us"] = host_us(fast, device)
            if ab and device.type == "cuda" and policy in ("hash", "drop"):
                row.update(graphs_ab(fast, step, device, iters, before))
                print(f"  {policy}: CUDA graphs {row['attncomp_ms graphs']:.2f} ms, launch by launch "
                      f"{row['attncomp_ms launch by launch']:.2f} ms; runs {row['graph runs']}", flush=True)
        except Exception as e:  # recorded in the row; the table shows it as failed
            row.update(attncomp_ms=float("nan"), host_us=float("nan"), error=f"{type(e).__name__}: {e}"[:500])
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield row


def run_interleaved(c, policies, device, dtype, iters, rounds, imode=None):
    """Rows of one configuration with eager, ``torch.compile`` and every policy compiled first and then
    timed in turn, ``rounds`` times (each figure the median of its rounds): on a noisy host the ratios
    then come from times taken side by side, not minutes apart."""
    model, step = model_and_step(c, device, dtype)
    torch._dynamo.reset()
    variants = {"eager": model, "compile": torch.compile(model, mode=imode)}
    errors = {}
    for policy in policies:
        try:
            variants[policy] = attncomp.compile(model, policy=policy, inductor=True, mode=imode)
            step(variants[policy])
        except Exception as e:  # recorded in the row; the table shows it as failed
            errors[policy] = f"{type(e).__name__}: {e}"[:500]
            variants.pop(policy, None)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, m in variants.items():
            times[name].append(timed_ms(lambda: step(m), iters, device))
    med = {name: statistics.median(t) for name, t in times.items()}
    base = dict(model=c["model"], device=device_name(), mode=c["mode"], B=c["B"], N=c["N"], eager_ms=med["eager"],
                compile_ms=med["compile"], rounds=rounds)
    for policy in policies:
        row = dict(base, policy=policy)
        if policy in errors:
            row.update(attncomp_ms=float("nan"), host_us=float("nan"), error=errors[policy])
        else:
            rep = attncomp.report(variants[policy])
            row.update(attncomp_ms=med[policy], sites=len(rep.sites), rewritten=rep.rewritten,
                       host_us=host_us(variants[policy], device))
        yield row
    torch._dynamo.reset()


def _row_key(r):
    return (r["model"], r["mode"], r["B"], r["N"], r.get("inputs", "mask"), r["policy"], r.get("inductor_mode"))


def main(argv=None) -> int:
    global T
    ap = argparse.ArgumentParser(prog="python -m attncomp bench models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; seconds")
    ap.add_argument("--policies", default=None, help="comma-separated (default: dense on CPU; dense,dfss,hash,drop "
                                                     "on a GPU, hash and drop at N >= 4096)")
    ap.add_argument("--only", default=None, help="comma-separated model names")
    ap.add_argument("--modes", default=None, help="comma-separated: infer, train")
    ap.add_argument("--ns", default=None, help="comma-separated sequence lengths (default: every config's)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 7 CPU, 20 GPU)")
    ap.add_argument("--rounds", type=int, default=1, help="with more than 1: every variant compiled first, then "
                                                         "timed in turn that many times (medians)")
    ap.add_argument("--inductor-mode", default=None,
                    help="Inductor's mode for torch.compile and attncomp alike (e.g. reduce-overhead: CUDA graphs)")
    ap.add_argument("--graphs-ab", action="store_true", help="hash/drop on a GPU: also timed with the plans' "
                                                              "CUDA graphs off, rounds interleaved")
    ap.add_argument("--inputs", default="mask", help=f"comma-separated ways of calling the models: {', '.join(INPUTS)} "
                                                     "(packed: decoders only)")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/models_<device>.json; "
                                                  "--smoke writes nothing unless given)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.inputs.split(",") if k]
    bad = [k for k in kinds if k not in INPUTS]
    if bad:
        ap.error(f"unknown --inputs {bad}; choose from {', '.join(INPUTS)}")
    import transformers

    T = transformers
    transformers.logging.set_verbosity_error()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters or (2 if args.smoke else 7 if device.type == "cpu" else 20)
    rows = []
    path = args.json or (None if args.smoke else C.results_path("models", device_name()))
    meta = dict(cpus=os.cpu_count(), dtype=str(dtype), iters=iters)
    # the file as it was: its rows that this run does not measure again (--only/--modes/--policies) stay
    base = C.load(path) if path and not args.smoke else None
    measured = set()
    for c in (dict(c0, inputs=k) for c0 in configs(device_name(), args.smoke) for k in kinds
              if not (k == "packed" and c0["model"] == "bert")):
        if args.only and c["model"] not in args.only.split(","):
            continue
        if args.modes and c["mode"] not in args.modes.split(","):
            continue
        if args.ns and str(c["N"]) not in args.ns.split(","):
            continue
        pols = args.policies.split(",") if args.policies else (
            ["dense"] if device.type == "cpu" else ["dense", "dfss"] + (["hash", "drop"] if c["N"] >= 4096 else []))
        if args.rounds <= 1:
            rows_of = run_config(c, pols, device, dtype, iters, args.inductor_mode, args.graphs_ab)
        else:
            rows_of = run_interleaved(c, pols, device, dtype, iters, args.rounds, args.inductor_mode)
        for row in rows_of:
            if args.inductor_mode:
                row["inductor_mode"] = args.inductor_mode
            rows.append(row)
            measured.add(_row_key(row))
            print(f"  {row['model']:5s} {row['mode']:5s} {row['B']}x{row['N']} {row['inputs']:7s} {row['policy']:6s} eager "
                  f"{row['eager_ms']:.2f} ms  torch.compile {row['compile_ms']:.2f} ms  attncomp "
                  f"{row['attncomp_ms']:.2f} ms" + (f"  FAILED {row['error']}" if "error" in row else ""), flush=True)
            if path:  # after every row: a run cut short keeps what it measured
                C.write(C.document("models", rows, argv, device=device_name(), **meta), path,
                        keep=lambda r: _row_key(r) not in measured, base=base or {})
    hdr = ("model", "mode", "BxN", "inputs", "policy", "eager ms", "compile ms", "attncomp ms", "vs eager", "vs compile",
           "host us")
    lines = [hdr]
    for r in rows:
        lines.append((r["model"], r["mode"], f"{r['B']}x{r['N']}", r["inputs"], r["policy"], f"{r['eager_ms']:.2f}",
                      f"{r['compile_ms']:.2f}", f"{r['attncomp_ms']:.2f}", f"{r['eager_ms'] / r['attncomp_ms']:.2f}x",
                      f"{r['compile_ms'] / r['attncomp_ms']:.2f}x", f"{r['host_us']:.0f}"))
    w = [max(len(x[i]) for x in lines) for i in range(len(hdr))]
    print()
    for x in lines:
        print("  ".join(c.rjust(w[i]) for i, c in enumerate(x)))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
