"""Quality per wall-clock second: the same GPT trained once per attention policy on real text.

Corpus: the Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``, without
``site-packages``/``dist-packages``), read as bytes (vocabulary 256), the sorted file list split by file:
every tenth file (index 9, 19, ...) is validation, the rest training. Every machine with Python has it;
its size and version are recorded with the results.

Model: a small GPT in plain PyTorch (RoPE, pre-norm, ``F.scaled_dot_product_attention(is_causal=True)``,
which ``attncomp.compile`` finds and rewrites), by default 8 layers, hidden 768, 12 heads (about 57M
parameters), context 8192, bf16 autocast on a GPU. Each policy gets the same initial weights, the same
training windows in the same order and the same wall-clock budget (``--minutes`` of training steps;
compilation, which a warm-up forward and backward without an optimizer step triggers, and the
evaluations are outside the clock). Validation loss in bits per byte is measured every
``--eval-every-s`` seconds of training time on a fixed set of validation windows, with the compiled model
in eval mode under its own policy (drop: the masks of its base seed; spion: its pattern once switched).

Policies: ``dense``; ``dfss`` (2:4); ``hash`` (16 buckets); ``drop`` (query and key rates 0.5);
``spion``. ``policy="spion"`` alone has ``alpha=None``: it would stay dense until
``attncomp.spion.calibrate`` is called. Here it runs its automatic switch (Alg. 2): dense while it
records each layer's pooled attention map, a test every ``--spion-interval`` steps, and the switch to
the flood-fill pattern once two successive relative map distances are below ``--spion-alpha``.

Results: ``benchmarks/results/quality_<device>.json`` (``h100``, ``h200`` or ``cpu``; ``--out`` a file, or
a folder for ``quality_<device>.json`` in it; ``--smoke``: a temporary folder unless ``--out``), one row per
evaluation, rewritten after each evaluation and copied under ``$OUT`` when set; the document is
``benchmarks/common.py``'s (benchmark, command, commit, device, versions, rows) with the model, context,
corpus, training settings and per-policy runs. Plots of val bpb against wall-clock seconds and against
steps next to it (with matplotlib).

    python examples/train_quality.py                          # every policy, 4 minutes each (GPU)
    python examples/train_quality.py --policies dense --resume --out DIR   # one policy per call
    python examples/train_quality.py --smoke                  # tiny model, 5 steps per policy, CPU

``--resume`` keeps the rows of the policies that a results file already holds complete (their command and
commit go to its ``previous``) and trains the others. A policy that fails to compile or train is reported with its error and the run exits nonzero.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import sys
import sysconfig
import tempfile
import textwrap
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import attncomp  # noqa: E402
from benchmarks import common as C  # noqa: E402  (device tag, versions, commit, results file)

POLICIES = ("dense", "dfss", "hash", "drop", "spion")
LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------
# Data: the standard library's .py files as bytes.

def corpus_files(root: Optional[str] = None) -> Tuple[str, List[str]]:
    """The stdlib folder and its ``.py`` files (paths relative to it, sorted), packages left out."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py"))
    return root, sorted(files)


def load_corpus(root: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """``(train, val, description)``: uint8 tensors of the concatenated files; every tenth file of the
    sorted list is validation."""
    root, files = corpus_files(root)
    parts: Tuple[List[bytes], List[bytes]] = ([], [])
    for i, rel in enumerate(files):
        with open(os.path.join(root, rel), "rb") as f:
            parts[1 if i % 10 == 9 else 0].append(f.read())
    train, val = (torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8) for p in parts)
    desc = (f"Python {sys.version.split()[0]} stdlib .py files at {root}: {len(files)} files, "
            f"{train.numel() / 1e6:.1f} MB train ({len(parts[0])} files), "
            f"{val.numel() / 1e6:.1f} MB validation ({len(parts[1])} files, every tenth of the sorted list), bytes")
    return train, val, desc


def windows(data: torch.Tensor, starts: torch.Tensor, T: int) -> Tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(T + 1)
    seq = data[idx].long()
    return seq[:, :-1], seq[:, 1:]


def val_batches(val: torch.Tensor, T: int, batch: int, n_batches: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation windows, evenly spaced over the validation bytes."""
    n = batch * n_batches
    if val.numel() < T + 2:
        raise ValueError(f"validation set ({val.numel()} bytes) is shorter than the context {T}")
    starts = torch.linspace(0, val.numel() - T - 1, n).long()
    return [windows(val, starts[i * batch:(i + 1) * batch], T) for i in range(n_batches)]


# ------------------------------------------------------------------------------------------------
# Model: a small GPT with RoPE and pre-norm.

class Rotary(nn.Module):
    def __init__(self, head_dim: int, n_max: int, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        ang = torch.outer(torch.arange(n_max, dtype=torch.float32), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, H, T, D)
        T, h = x.shape[2], x.shape[3] // 2
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, rope: Rotary):
        super().__init__()
        self.h = heads
        self.rope = rope
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, n_max: int, vocab: int = 256):
        super().__init__()
        if d % heads or (d // heads) % 2:
            raise ValueError(f"hidden {d} must split into {heads} heads of even size")
        self.tok = nn.Embedding(vocab, d)
        rope = Rotary(d // heads, n_max)
        self.blocks = nn.ModuleList(Block(d, heads, rope) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def describe_model(args, n_params: int) -> str:
    return (f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads (head dim "
            f"{args.hidden // args.heads}), MLP 4x GELU, RoPE, pre-norm LayerNorm, byte vocabulary 256, "
            f"{n_params / 1e6:.2f}M params")


# ------------------------------------------------------------------------------------------------
# Policies and training.

def make_policy(name: str, args) -> attncomp.Policy:
    if name == "dense":
        return attncomp.Dense()
    if name == "dfss":
        return attncomp.DFSS(2, 4)
    if name == "hash":
        return attncomp.Hash(n_buckets=16)
    if name == "drop":
        return attncomp.Drop(q_rate=0.5, k_rate=0.5)
    if name == "spion":
        return attncomp.SPION(block_size=args.spion_block, alpha=args.spion_alpha, interval=args.spion_interval)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def lr_at(step: int, progress: float, args) -> float:
    if args.warmup and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    p = min(max(progress, 0.0), 1.0)
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))


class Timer:
    """Training time only: each step is timed from a synchronised start to a synchronised end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total = 0.0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __enter__(self):
        self.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.total += time.perf_counter() - self.t0


def train_policy(name: str, args, data, device: torch.device, on_row) -> Dict[str, Any]:
    """Train one policy for the budget; ``on_row(row)`` after each evaluation. Returns the run's summary."""
    train, vals = data
    gpu = device.type == "cuda"
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=gpu)
    torch._dynamo.reset()  # every policy compiles the same model class: start from fresh frames
    if hasattr(attncomp.ops, "_step"):
        # the per-call seed stream of drop draws: the same for a policy whether it runs alone or after others
        attncomp.ops._step = itertools.count()
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.context).to(device)
    policy = make_policy(name, args)
    # every call has the same shapes (training and validation batches alike): static shapes compile faster
    fast = attncomp.compile(model, policy=policy, inductor=args.inductor, dynamic=False)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if gpu else {}))

    def loss_of(x, y):
        with torch.autocast(**amp):
            logits = fast(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate() -> float:
        fast.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in vals:
                total += loss_of(x.to(device), y.to(device)).item()
        fast.train()
        return total / len(vals) / LN2

    # compile (training graph and eval graph) before the clock starts: a forward and backward on a
    # validation batch, no optimizer step, so the weights stay the initial ones
    t0 = time.perf_counter()
    fast.train()
    x, y = vals[0]
    loss_of(x.to(device), y.to(device)).backward()
    opt.zero_grad(set_to_none=True)
    bpb0 = evaluate()
    if name == "spion":
        # the block-sparse kernels that run after the switch are built now too (a diagonal pattern for
        # one forward and backward, and one evaluation), then every site goes back to its dense phase
        sites = list(attncomp.spion.patterns(fast))
        n = -(-args.context // args.spion_block)
        attncomp.spion.set_patterns(fast, {s: torch.eye(n, dtype=torch.bool) for s in sites})
        loss_of(x.to(device), y.to(device)).backward()
        opt.zero_grad(set_to_none=True)
        evaluate()
        attncomp.spion.set_patterns(fast, {s: None for s in sites})
    compile_s = time.perf_counter() - t0
    print(f"[{name}] {policy.describe()}: compiled in {compile_s:.1f}s (training and eval graphs)", flush=True)

    g = torch.Generator().manual_seed(args.seed + 1)  # the same windows in the same order for every policy
    budget = args.minutes * 60.0
    timer = Timer(device)
    step, eval_s, losses = 0, 0.0, []
    slowest = (0.0, 0)  # (seconds, step): a kernel built inside the clock would show here
    switched: Dict[str, int] = {}  # spion: site -> training steps done when its pattern was set
    sites = list(attncomp.spion.patterns(fast)) if name == "spion" else []
    rows = []

    def record(bpb: float):
        row = {"policy": name, "step": step, "wall_s": round(timer.total, 3), "val_bpb": round(bpb, 5)}
        rows.append(row)
        tl = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        print(f"[{name}] step {step:6d}  wall {timer.total:7.1f}s  train loss {tl:>6}  val bpb {bpb:.4f}", flush=True)
        losses.clear()
        on_row(row)

    record(bpb0)
    next_eval = args.eval_every_s
    while timer.total < budget and (args.max_steps is None or step < args.max_steps):
        starts = torch.randint(0, train.numel() - args.context - 1, (args.batch,), generator=g)
        x, y = windows(train, starts, args.context)
        progress = timer.total / budget
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, progress, args)
        before = timer.total
        with timer:
            loss = loss_of(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lv = loss.item()
        if not math.isfinite(lv):
            raise FloatingPointError(f"policy {name}: training loss {lv} at step {step}")
        losses.append(lv)
        slowest = max(slowest, (timer.total - before, step))
        step += 1
        if name == "spion" and len(switched) < len(sites):
            for site, pat in attncomp.spion.patterns(fast).items():
                if pat is not None and site not in switched:
                    switched[site] = step
                    print(f"[{name}] {site} switched to its block pattern after step {step} "
                          f"(density {pat.float().mean():.3f})", flush=True)
        if timer.total >= next_eval:
            te = time.perf_counter()
            record(evaluate())
            eval_s += time.perf_counter() - te
            while next_eval <= timer.total:
                next_eval += args.eval_every_s
    if rows[-1]["step"] != step:
        te = time.perf_counter()
        record(evaluate())
        eval_s += time.perf_counter() - te
    summary = {"policy": policy.describe(), "steps": step, "train_s": round(timer.total, 3),
               "compile_s": round(compile_s, 1), "eval_s": round(eval_s, 1),
               "step_ms": round(1000 * timer.total / max(step, 1), 2), "final_val_bpb": rows[-1]["val_bpb"],
               "slowest_step": {"step": slowest[1], "s": round(slowest[0], 3)},
               "command": args.command}
    if name == "spion":
        summary["spion"] = attncomp.spion.summary(fast)  # its switch steps count the 2 warm-up calls
        summary["spion_switch_after_step"] = switched
        print(f"[{name}] patterns:\n{summary['spion']}", flush=True)
    return summary


# ------------------------------------------------------------------------------------------------
# Results: JSON, plots, table.

def out_path(args, tag: str) -> str:
    if args.out is None:
        if args.smoke:
            return os.path.join(tempfile.mkdtemp(prefix="attncomp-quality-"), f"quality_{tag}.json")
        return C.results_path("quality", tag)
    if os.path.isdir(args.out) or args.out.endswith(os.sep):
        return os.path.join(args.out, f"quality_{tag}.json")
    return args.out


def plot(res: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    base = os.path.splitext(path)[0]
    for key, label, suffix in (("wall_s", "training wall-clock (s)", "time"), ("step", "training steps", "steps")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for pol in dict.fromkeys(r["policy"] for r in res["rows"]):
            rs = [r for r in res["rows"] if r["policy"] == pol]
            ax.plot([r[key] for r in rs], [r["val_bpb"] for r in rs], marker="o", ms=3, label=pol)
        ax.set_xlabel(label)
        ax.set_ylabel("validation bits per byte")
        ax.set_title(textwrap.fill(f"{res['device']}, context {res['context']}: {res['model']}", 90), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{base}_{suffix}.png", dpi=120)
        plt.close(fig)
    print(f"plots: {base}_time.png, {base}_steps.png")


def table(res: Dict[str, Any]) -> str:
    pols = list(dict.fromkeys(r["policy"] for r in res["rows"]))
    by = {p: [r for r in res["rows"] if r["policy"] == p] for p in pols}
    target = by["dense"][-1]["val_bpb"] if "dense" in by else None
    lines = [f"{'policy':<8} {'steps':>7} {'final val bpb':>14} {'time to dense final':>20}"]
    for p in pols:
        rs = by[p]
        if target is None:
            reach = "n/a (no dense)"
        else:
            hit = next((r for r in rs if r["val_bpb"] <= target), None)
            reach = f"{hit['wall_s']:.1f}s" if hit else "never"
        lines.append(f"{p:<8} {rs[-1]['step']:>7} {rs[-1]['val_bpb']:>14.4f} {reach:>20}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {','.join(POLICIES)}")
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall-clock budget per policy")
    ap.add_argument("--eval-every-s", type=float, default=20.0, help="seconds of training time between evaluations")
    ap.add_argument("--eval-batches", type=int, default=16, help="fixed validation batches per evaluation")
    ap.add_argument("--max-steps", type=int, default=None, help="stop a policy after this many steps as well")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                    help="after warm-up: cosine over the wall-clock budget, or constant")
    ap.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spion-block", type=int, default=64)
    ap.add_argument("--spion-alpha", type=float, default=0.1, help="Alg. 2 threshold of the automatic switch")
    ap.add_argument("--spion-interval", type=int, default=25, help="steps per Alg. 2 interval")
    ap.add_argument("--no-inductor", dest="inductor", action="store_false",
                    help="compile without Inductor around the attention op")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--out", default=None, help="results file, or a folder for quality_<device>.json")
    ap.add_argument("--resume", action="store_true", help="append to the results file, skipping complete policies")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model (2 layers, hidden 64, 2 heads, context 128), 5 steps per policy, CPU, fp32")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command = C.command("quality", args.argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.context, args.batch = 2, 64, 2, 128, 4
        args.max_steps, args.minutes, args.eval_batches = 5, 10.0, 2
        args.lr, args.warmup, args.schedule = 3e-3, 0, "constant"
        # the switch within 5 steps: 16-token blocks, one step per interval, any change small enough
        args.spion_block, args.spion_interval, args.spion_alpha = 16, 1, 10.0
        args.inductor = False
        args.device = "cpu"
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in args.policy_list if p not in POLICIES]
    if bad or not args.policy_list:
        ap.error(f"--policies: unknown {bad or 'empty'}; choose from {', '.join(POLICIES)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and args.smoke:
        torch.set_num_threads(1)  # a model this small runs fastest on one thread
    gpu = device.type == "cuda"
    tag = C.device_tag(torch.cuda.get_device_name(device)) if gpu else "cpu"
    path = out_path(args, tag)

    train, val, corpus = load_corpus()
    vals = val_batches(val, args.context, args.batch, args.eval_batches)
    n_params = sum(p.numel() for p in GPT(args.layers, args.hidden, args.heads, 16).parameters())
    model_desc = describe_model(args, n_params)
    res = C.document("quality", [], args.argv, device=tag,
                     device_name=torch.cuda.get_device_name(device) if gpu else C.cpu_name(),
                     commit=args.commit or C.commit() or os.environ.get("ATTNCOMP_COMMIT", "unknown"),
                     model=model_desc, context=args.context, torch=torch.__version__, corpus=corpus,
                     train={"batch": args.batch, "tokens_per_step": args.batch * args.context,
                            "minutes": args.minutes, "max_steps": args.max_steps, "lr": args.lr,
                            "schedule": args.schedule, "warmup": args.warmup, "eval_every_s": args.eval_every_s,
                            "eval_batches": args.eval_batches, "seed": args.seed,
                            "dtype": "bf16 autocast" if gpu else "fp32", "inductor": args.inductor},
                     runs={})
    before = None  # --resume: the file as it was, whose complete policies' rows are kept
    done: set = set()
    if args.resume:
        before = C.load(path)
    if before:
        for key in ("model", "context"):
            if before.get(key) != res[key]:
                print(f"--resume: {path} has {key} {before.get(key)!r}, this run {res[key]!r}: not mixing them")
                return 2
        done = {p for p, r in before.get("runs", {}).items() if r.get("complete")}
        res["runs"] = {p: r for p, r in before.get("runs", {}).items() if p in done}
        skip = [p for p in args.policy_list if p in done]
        if skip:
            print(f"--resume: {', '.join(skip)} already in {path}, skipped")
        args.policy_list = [p for p in args.policy_list if p not in done]

    def save():
        C.write(res, path, keep=(lambda r: r["policy"] in done) if before else None, base=before)

    print(f"{model_desc}; context {args.context}, batch {args.batch}, device {device} ({tag})")
    print(f"corpus: {corpus}")
    failures = {}
    for name in args.policy_list:
        res["runs"][name] = {"complete": False, "command": args.command}

        def on_row(row):
            res["rows"].append(row)
            save()

        try:
            summary = train_policy(name, args, (train, vals), device, on_row)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails at the end
            traceback.print_exc()
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
            failures[name] = f"{type(e).__name__}: {e}"
            res["rows"] = [r for r in res["rows"] if r["policy"] != name]
            res["runs"][name] = {"complete": False, "error": failures[name], "command": args.command}
            save()
            continue
        finally:
            gc.collect()  # the policy's model, optimizer and compiled graphs
            if gpu:
                torch.cuda.empty_cache()
        res["runs"][name] = {"complete": True, **summary}
        save()
    res = C.load(path) or res  # with --resume, the kept rows of the earlier run too
    print(f"\nresults: {path}")
    if res["rows"]:
        plot(res, path)
        print(table(res))
    if failures:
        print("\nfailed policies:")
        for p, e in failures.items():
            print(f"  {p}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
