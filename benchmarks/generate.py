"""Generation: ``generate()`` of a Llama model, eager against transformers' static cache and attncomp.

A ``LlamaForCausalLM`` built from a config (random weights, seed 0; 4 layers, hidden 2048, 32 query / 8
key-value heads, intermediate 5632, vocab 32000, bf16 on a GPU) generates greedily from a left-padded batch
(row ``b`` has ``b % 4 * 8`` padding tokens on the left, attention-mask zeros) with ``min_new_tokens =
max_new_tokens``, so every path generates the same number of tokens. Paths (``--paths``), each on a fresh copy
of the same weights after ``torch._dynamo.reset()``:

=================================  ==============================================================================
``eager``                          the model as built (``attn_implementation="sdpa"``); the reference
``hf-static``                      ``generate(..., cache_implementation="static")``: transformers compiles the
                                   decode step itself (its ``CompileConfig``; on a CPU with
                                   ``_compile_all_devices``, which it otherwise skips)
``attncomp-dense``                 ``attncomp.compile(model, policy="dense")``, default (dynamic) KV cache
``attncomp-dense-reduce-overhead`` the same with ``mode="reduce-overhead"`` (CUDA graphs) and a static cache
                                   (``--ro-cache``), transformers' own compile disabled; GPU only
``attncomp-hash|drop|dfss``        ``attncomp.compile(model, policy=...)`` with the policy's defaults
=================================  ==============================================================================

Columns of a row (one per ``B`` x prompt x path):

* ``first_call_s``: ``attncomp.compile`` (or nothing) plus the first ``generate`` of ``new_tokens`` tokens,
  wall clock, synchronised: capture and compilation included. Inductor's and attncomp's disk caches are the
  environment's, so a path measured earlier in the same run (or an earlier run) may have warmed them.
* ``tokens_per_s``: ``B * new_tokens`` over the median time of ``--repeats`` later ``generate`` calls.
* ``step_ms``: one decode step, ``(t(new_tokens) - t(1)) / (new_tokens - 1)`` with ``t(1)`` the median time
  of a ``generate`` of one new token (prefill only; warmed once first).
* ``kv_bandwidth_frac``: ``null`` (no decode kernel is instrumented yet).
* ``logits_match``: per-step logits (``output_logits=True``) against eager's, for the dense paths
  (``hf-static``, ``attncomp-dense*``); ``null`` for eager itself and for the sparse policies, which compute
  another function. Each batch row is compared up to and including the first step where its tokens differ
  from eager's (later steps see another prefix). Tolerance: float32, ``allclose(rtol=1e-4, atol=1e-4)``;
  float16/bfloat16, ``max |a - b| <= 0.05 * max |eager|`` over the compared steps (bf16 rounds each layer's
  activations to 8 bits of mantissa; greedy ties may then pick another token, which ``tokens_equal`` shows).
* ``logits_rel_diff``: that ``max |a - b| / max |eager|``, for every path (how far a sparse policy moves).
* ``tokens_equal``: the fraction of the ``B * new_tokens`` generated tokens equal to eager's.
* ``graphs``: graphs dynamo compiled for the path (every call of it, timed or not); ``null`` for eager.
* ``error``: why a row has no numbers (an exception's first line, a skipped row's reason), or a finding
  next to its numbers (a path whose graphs keep growing after the first call recompiles per call or step).

Output: ``benchmarks/results/generate_<device>.json`` (``h100``, ``h200`` from the GPU's name, ``cpu``), a
document of ``benchmarks/common.py`` with the model and settings, written after every path, copied under ``$OUT``
when set; ``--smoke`` writes ``generate_cpu_smoke.json`` into a temporary folder unless ``--out`` (a file, or a
folder) is given. ``--merge`` keeps the rows of the file already there that this run does not measure again (a
table assembled over several GPU calls; their command and commit go to ``previous``). A markdown table is printed
last; progress goes to stderr. ``--time-budget S`` starts no new row (nor path) after ``S`` seconds.

Usage::

    python -m attncomp bench generate --smoke                       # CPU, 2 layers, hidden 64, seconds to minutes
    python -m attncomp bench generate --B 1,4 --prompt 1024,8192 --new-tokens 64 --time-budget 450
    python benchmarks/generate.py --paths eager,attncomp-dense --B 4 --prompt 1024
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from attncomp.cli import csv_list  # noqa: E402
from benchmarks import common as C  # noqa: E402

PATHS = ("eager", "hf-static", "attncomp-dense", "attncomp-dense-reduce-overhead", "attncomp-hash",
         "attncomp-drop", "attncomp-dfss")
#: paths that compute eager's function (their logits are compared)
DENSE = ("hf-static", "attncomp-dense", "attncomp-dense-reduce-overhead")
POLICY = {"attncomp-dense": "dense", "attncomp-dense-reduce-overhead": "dense", "attncomp-hash": "hash",
          "attncomp-drop": "drop", "attncomp-dfss": "dfss"}
FIELDS = ("B", "prompt", "new_tokens", "path", "first_call_s", "tokens_per_s", "step_ms", "kv_bandwidth_frac",
          "logits_match", "tokens_equal", "error")
MODEL = dict(layers=4, hidden=2048, heads=32, kv_heads=8, intermediate=5632, vocab=32000)
SMOKE_MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=176, vocab=32000)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: logits tolerances (see the module docstring)
FP32_TOL = 1e-4
HALF_REL_TOL = 0.05


def _log(t0: float, msg: str) -> None:
    print(f"[generate {time.strftime('%H:%M:%S')} +{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr,
          flush=True)


def _paths(s: str) -> List[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in PATHS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown path(s) {', '.join(bad)}; valid: {', '.join(PATHS)}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attncomp bench generate",
                                description="generate() throughput, first-call time and logits of a Llama model: "
                                            "eager, transformers' static cache, attncomp's policies")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, 2 layers, hidden 64, 4/2 heads, fp32, B=2, prompt 16, 4 new tokens, 1 repeat")
    p.add_argument("--paths", type=_paths, default=list(PATHS), help=f"comma separated (default: all: {','.join(PATHS)})")
    p.add_argument("--B", type=csv_list(int), default=None, help="batch sizes (default: 1,4,32 on a GPU)")
    p.add_argument("--prompt", type=csv_list(int), default=None,
                   help="prompt lengths, padding included (default: 1024,8192,32768 on a GPU)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per call (default: 128 on a GPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed generate calls per figure (default: 3; smoke: 1)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="model dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--frozen", action="store_true",
                   help="parameters with requires_grad=False (attncomp then folds weights as constants); by "
                        "default they require grad, as from_pretrained leaves them")
    p.add_argument("--ro-cache", choices=("static", "dynamic"), default="static",
                   help="KV cache of attncomp-dense-reduce-overhead (default: static, which CUDA graphs capture once)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no new row or path starts (what was measured is written)")
    p.add_argument("--out", default=None, help="JSON file, or a folder for generate_<device>.json")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing output file that this run does not measure again")
    return p


# ---------------------------------------------------------------------------------------------- timing

def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t = time.perf_counter()
    r = fn()
    _sync()
    return time.perf_counter() - t, r


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _err(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    # dynamo wraps a backend's exception: its own message is the line after "raised:"
    for i, ln in enumerate(lines[:-1]):
        if ln.rstrip().endswith("raised:"):
            lines = lines[i + 1:]
            break
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


# ---------------------------------------------------------------------------------------------- model, inputs

def build_model(m: Dict[str, int], max_len: int, dtype, device: str, frozen: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                      num_key_value_heads=m["kv_heads"], max_position_embeddings=max_len,
                      pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD_ID
    if frozen:
        model.requires_grad_(False)
    return model


def make_inputs(B: int, prompt: int, vocab: int, device: str):
    import torch

    g = torch.Generator().manual_seed(1000 * B + prompt)
    ids = torch.randint(3, vocab, (B, prompt), generator=g)
    mask = torch.ones_like(ids)
    for b in range(B):
        pad = min(b % 4 * 8, prompt - 1)
        ids[b, :pad] = PAD_ID
        mask[b, :pad] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def estimate_bytes(path: str, B: int, prompt: int, new: int, m: Dict[str, int], n_params: int, elem: int) -> int:
    """A rough peak for one path of a row on a GPU: a copy of the weights, the KV cache, the prefill's largest
    activations, the stored logits and, on the paths that run SDPA on transformers' padding mask, that mask
    (bool, and its float form inside SDPA) of ``B x prompt x (prompt + new)``."""
    hd = m["hidden"] // m["heads"]
    kv = m["layers"] * 2 * B * (prompt + new) * m["kv_heads"] * hd * elem
    act = B * prompt * (3 * m["intermediate"] + 6 * m["hidden"]) * elem
    logits = 2 * new * B * m["vocab"] * 4
    mask = B * prompt * (prompt + new) * (1 + elem) if path in ("eager", "hf-static") else 0
    return n_params * elem + kv + act + logits + mask


# ---------------------------------------------------------------------------------------------- comparison

def compare(got, ref, new: int, prompt: int, half: bool) -> Dict[str, Any]:
    """tokens_equal, logits_rel_diff and logits_match of one path's output (sequences, logits) against eager's."""
    import torch

    seq, want = got.sequences[:, prompt:], ref.sequences[:, prompt:]
    tokens_equal = float((seq == want).float().mean())
    a = torch.stack([x.float() for x in got.logits])  # (steps, B, V)
    b = torch.stack([x.float() for x in ref.logits]).to(a.device)
    differ = (seq != want).to(a.device)
    steps = torch.arange(new, device=a.device)
    first = torch.where(differ.any(1), differ.float().argmax(1), torch.full_like(differ[:, 0], new, dtype=torch.long))
    keep = (steps[:, None] <= first[None, :])  # (steps, B): up to and including the first differing step
    da, db = a[keep], b[keep]
    scale = float(db.abs().max()) or 1.0
    diff = float((da - db).abs().max())
    if half:
        match = diff <= HALF_REL_TOL * scale
    else:
        match = bool(torch.allclose(da, db, rtol=FP32_TOL, atol=FP32_TOL))
    return {"tokens_equal": round(tokens_equal, 6), "logits_rel_diff": diff / scale, "logits_match": bool(match)}


# ---------------------------------------------------------------------------------------------- one path

def _path_setup(path: str, model, on_gpu: bool, ro_cache: str):
    """(module to call generate on, extra generate kwargs) for a path; compiles lazily."""
    import attncomp

    if path == "eager":
        return model, {}
    if path == "hf-static":
        kw: Dict[str, Any] = {"cache_implementation": "static"}
        if not on_gpu:
            from transformers import CompileConfig

            cc = CompileConfig()
            cc._compile_all_devices = True  # transformers compiles on CPUs only with this flag
            kw["compile_config"] = cc
        return model, kw
    if path == "attncomp-dense-reduce-overhead":
        fast = attncomp.compile(model, policy="dense", mode="reduce-overhead")
        kw = {"disable_compile": True}
        if ro_cache == "static":
            kw["cache_implementation"] = "static"
        return fast, kw
    return attncomp.compile(model, policy=POLICY[path]), {}


def run_path(path: str, base, inputs, row: Dict[str, Any], args, ref, on_gpu: bool, half: bool, t0: float):
    """Fill ``row`` for one path; returns the path's output of the logits call (for eager: the reference)."""
    import torch

    B, prompt, new = row["B"], row["prompt"], row["new_tokens"]
    opts = dict(do_sample=False, pad_token_id=PAD_ID)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    g0 = _graphs()
    out = None
    fast = None
    try:
        with torch.no_grad():
            _sync()
            t = time.perf_counter()
            fast, kw = _path_setup(path, model, on_gpu, args.ro_cache)

            def gen(n, **more):
                return fast.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **opts, **kw, **more)

            gen(new)
            _sync()
            row["first_call_s"] = round(time.perf_counter() - t, 3)
            g_first = _graphs()
            _log(t0, f"  {path}: first call {row['first_call_s']:.2f} s ({g_first - g0} graph(s))")
            t_new = statistics.median(_timed(lambda: gen(new))[0] for _ in range(args.repeats))
            g_steady = _graphs()
            gen(1)  # warm the prefill-only call (a static cache of another length is another graph)
            g_one = _graphs()
            t_one = statistics.median(_timed(lambda: gen(1))[0] for _ in range(args.repeats))
            g_end = _graphs()
            row["tokens_per_s"] = round(B * new / t_new, 2)
            row["step_ms"] = round(1e3 * (t_new - t_one) / (new - 1), 4) if new > 1 else None
            out = gen(new, output_logits=True, return_dict_in_generate=True)
            g_all = _graphs()
        if path != "eager":
            row["graphs"] = g_all - g0
            grew = (g_steady - g_first) + (g_end - g_one) + (g_all - g_end)
            if grew > 0:
                row["error"] = (f"recompiles: {grew} new graph(s) in {2 * args.repeats + 1} generate call(s) after "
                                f"the first ({g_first - g0} in the first call)")
            elif g_first - g0 >= 8:
                row["error"] = f"recompiles: {g_first - g0} graphs in the first generate of {new} tokens"
        if path in POLICY:
            import attncomp

            rep = attncomp.report(fast)
            notes = [n.splitlines()[0][:200] for n in rep.notes if "storm" in n or "graph break" in n]
            if notes:
                row["notes"] = notes
                if any("storm" in n for n in notes) and not row["error"]:
                    row["error"] = notes[0]
            if rep.rewritten == 0:
                row["error"] = (row["error"] + "; " if row["error"] else "") + "no attention site rewritten"
        if ref is not None and out is not None:
            c = compare(out, ref, new, prompt, half)
            row["tokens_equal"] = c["tokens_equal"]
            row["logits_rel_diff"] = round(c["logits_rel_diff"], 8)
            if path in DENSE:
                row["logits_match"] = c["logits_match"]
    except Exception as e:  # a failing path is a result, not the end of the table
        row["error"] = _err(e)
        if path != "eager":
            row["graphs"] = _graphs() - g0
        _log(t0, f"  {path}: FAILED {row['error']}")
        out = None
    finally:
        model = fast = None  # the copy goes before the next path builds its own
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- output

def _new_row(B: int, prompt: int, new: int, path: str) -> Dict[str, Any]:
    row: Dict[str, Any] = {k: None for k in FIELDS}
    row.update(B=B, prompt=prompt, new_tokens=new, path=path, logits_rel_diff=None, graphs=None)
    return row


def _key(r: Dict[str, Any]):
    return (r.get("B"), r.get("prompt"), r.get("new_tokens"), r.get("path"))


def write(doc: Dict[str, Any], path: str, before: Optional[Dict[str, Any]]) -> List[str]:
    """Write the run's document (and its copy under ``$OUT``); with ``before`` (``--merge``: the file as it was
    before this run), the rows of ``before`` that this run does not measure again are kept."""
    mine = {_key(r) for r in doc["rows"]}
    keep = None if before is None else (lambda r: _key(r) not in mine)
    return C.write(doc, path, keep=keep, base=before)


def table(rows: List[Dict[str, Any]]) -> str:
    eager = {(r["B"], r["prompt"], r["new_tokens"]): r["tokens_per_s"] for r in rows if r["path"] == "eager"}
    lines = ["| B | prompt | new | path | tokens/s | x eager | step ms | first call s | logits match | tokens equal | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        e = eager.get((r["B"], r["prompt"], r["new_tokens"]))
        ratio = r["tokens_per_s"] / e if r["tokens_per_s"] and e else None
        lm = "-" if r["logits_match"] is None else ("yes" if r["logits_match"] else "NO")
        err = (r.get("error") or "").replace("|", "/")
        lines.append(f"| {r['B']} | {r['prompt']} | {r['new_tokens']} | {r['path']} | {f(r['tokens_per_s'], '.1f')} | "
                     f"{f(ratio, '.2f')} | {f(r['step_ms'], '.2f')} | {f(r['first_call_s'], '.2f')} | {lm} | "
                     f"{f(r['tokens_equal'], '.3f')} | {err[:120]} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    t0 = time.perf_counter()

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = "cuda" if on_gpu else "cpu"
    tag = C.device_tag() if on_gpu else "cpu"
    m = SMOKE_MODEL if args.smoke else MODEL
    if args.smoke:
        Bs, prompts, new, repeats = [2], [16], 4, 1
    else:
        Bs, prompts, new, repeats = [1, 4, 32], [1024, 8192, 32768], 128, 3
    Bs = args.B or Bs
    prompts = args.prompt or prompts
    new = args.new_tokens or new
    args.repeats = args.repeats or repeats
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
    half = dtype in (torch.float16, torch.bfloat16)
    paths = list(args.paths)

    name = f"generate_{tag}{'_smoke' if args.smoke else ''}.json"
    if args.out:
        out_path = (os.path.join(args.out, name) if os.path.isdir(args.out) or not args.out.endswith(".json")
                    else args.out)
    elif args.smoke:
        out_path = os.path.join(tempfile.mkdtemp(prefix="attncomp-bench-"), name)
    else:
        out_path = C.results_path("generate", tag)
    # --merge: the file as it was before this run (it is rewritten after every path)
    before = (C.load(out_path) or {}) if args.merge else None

    from attncomp.api import _inductor_default

    vers = C.versions()
    doc: Dict[str, Any] = C.document(
        "generate", [], argv, device=tag, device_name=C.device_name() if on_gpu else C.cpu_name(),
        torch=vers["torch"], transformers=vers["transformers"], triton=vers["triton"],
        model=dict(m, dtype=str(dtype).replace("torch.", ""), frozen=bool(args.frozen)),
        attncomp_inductor=_inductor_default(),
        repeats=args.repeats,
        padding="left; batch row b has b % 4 * 8 padding tokens",
        tolerance=(f"logits max|a-b| <= {HALF_REL_TOL} * max|eager| up to each batch row's first differing token"
                   if half else f"logits allclose(rtol={FP32_TOL}, atol={FP32_TOL}) up to each batch row's "
                                "first differing token"),
        reduce_overhead_cache=args.ro_cache)
    rows: List[Dict[str, Any]] = doc["rows"]
    _log(t0, f"{device} ({doc['device_name']}), {doc['model']}, B={Bs}, prompt={prompts}, new tokens={new}, "
             f"paths={paths} -> {out_path}")

    base = build_model(m, max(prompts) + new + 8, dtype, device, args.frozen)
    n_params = sum(p.numel() for p in base.parameters())
    elem = torch.tensor([], dtype=dtype).element_size()

    def over_budget() -> bool:
        return args.time_budget is not None and time.perf_counter() - t0 > args.time_budget

    for B in Bs:
        for prompt in prompts:
            if over_budget():
                for path in paths:
                    r = _new_row(B, prompt, new, path)
                    r["error"] = f"skipped: --time-budget {args.time_budget:g} s reached"
                    rows.append(r)
                continue
            _log(t0, f"row B={B} prompt={prompt} new_tokens={new}")
            inputs = make_inputs(B, prompt, m["vocab"], device)
            ref = None
            for path in ["eager"] + [p for p in paths if p != "eager"]:
                skip = _skip_reason(path, B, prompt, new, m, n_params, elem, on_gpu)
                if path not in paths:  # eager, run only for the reference logits
                    if skip is None:
                        _log(t0, "  eager (reference logits only)")
                        ref = _reference(base, inputs, new)
                    continue
                r = _new_row(B, prompt, new, path)
                if over_budget():
                    skip = f"skipped: --time-budget {args.time_budget:g} s reached"
                if skip is not None:
                    r["error"] = skip
                    rows.append(r)
                    continue
                _log(t0, f"  {path}: compile + first generate")
                got = run_path(path, base, inputs, r, args, ref, on_gpu, half, t0)
                if path == "eager":
                    ref = got
                    if got is not None:
                        r["tokens_equal"] = 1.0
                rows.append(r)
                _log(t0, f"  {path}: " + ", ".join(f"{k}={r[k]}" for k in ("tokens_per_s", "step_ms", "logits_match",
                                                                            "tokens_equal", "graphs", "error")))
                write(doc, out_path, before)
            del ref, inputs
            gc.collect()
    written = write(doc, out_path, before)
    _log(t0, f"wrote {', '.join(written)}")
    print(table(rows))
    return 0


def _skip_reason(path: str, B: int, prompt: int, new: int, m: Dict[str, int], n_params: int, elem: int,
                 on_gpu: bool) -> Optional[str]:
    """Why a path of a row does not run here (no GPU for CUDA graphs; too little GPU memory), or ``None``."""
    import torch

    if path == "attncomp-dense-reduce-overhead" and not on_gpu:
        return "skipped: mode='reduce-overhead' (CUDA graphs) needs a GPU"
    if on_gpu:
        need = estimate_bytes(path, B, prompt, new, m, n_params, elem)
        free = torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            return f"skipped: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def _reference(base, inputs, new: int):
    import torch

    try:
        with torch.no_grad():
            return base.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
