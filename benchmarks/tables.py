"""The markdown tables of ``benchmarks/README.md`` and the docs it points to, computed from the results files and
nothing else.

Those pages (:data:`DOCS`) mark each generated table with ``<!-- table: NAME -->`` ... ``<!-- end -->``; this module
prints them (``python -m attncomp bench tables``), rewrites them in the pages (``--write``) or checks that the pages
hold what the results files give (``--check``, exit 1 otherwise; ``tests/test_benchmarks_docs.py`` runs it). A
table whose results file is not in the repository reads "no results file yet".

    python -m attncomp bench tables --write
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import common as C  # noqa: E402

README = os.path.join(HERE, "README.md")
#: the pages whose marked tables this module writes: the benchmarks' README and the guides with their own tables
DOCS = [README] + [os.path.join(os.path.dirname(HERE), "docs", f) for f in ("generation.md", "distributed.md")]
MARK = re.compile(r"<!-- table: ([\w-]+) -->\n.*?<!-- end -->", re.S)

#: the kernel targets (the issue's, for N >= 4096): (what, policy, pass, Ns, causal values, at least, baseline)
TARGETS = [
    ("dense fwd >= 1.0x SDPA", "dense", "fwd", (4096, 16384), (False, True), 1.0, "sdpa_ms"),
    ("dense fwd+bwd >= 0.95x SDPA", "dense", "fwd+bwd", (4096, 16384), (False, True), 0.95, "sdpa_ms"),
    ("dfss 2:4 fwd >= 0.90x dense SDPA", "dfss", "fwd", (4096, 16384), (False, True), 0.90, "sdpa_ms"),
    ("dfss 2:4 fwd+bwd >= 0.85x dense SDPA", "dfss", "fwd+bwd", (4096, 16384), (False, True), 0.85, "sdpa_ms"),
    ("hash(16) fwd >= 5x SDPA causal, N=16384", "hash", "fwd", (16384,), (True,), 5.0, "sdpa_ms"),
    ("drop(0.5/0.5) fwd >= 2.5x SDPA causal, N=16384", "drop", "fwd", (16384,), (True,), 2.5, "sdpa_ms"),
]

_POLICY_ORDER = ("dense", "dfss", "hash", "drop", "spion")


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b, nd: int = 2) -> str:
    return _f(a / b, nd) if a and b else "-"


def _span(xs: List[float]) -> str:
    """``x`` or ``lo-hi`` (rows of one group measured by different runs)."""
    if not xs:
        return "-"
    lo, hi = _f(min(xs)), _f(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def _md(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _porder(p: str) -> int:
    name = p.split("(")[0]
    return _POLICY_ORDER.index(name) if name in _POLICY_ORDER else len(_POLICY_ORDER)


def _rows(doc, table: str) -> List[dict]:
    return [r for r in doc.get("rows", []) if r.get("table", "policies") == table] if doc else []


def _source(doc, path: str) -> str:
    v = doc.get("versions") or {}
    vs = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers") if v.get(k))
    return f"`results/{os.path.basename(path)}` ({doc.get('device_name') or doc.get('device')}; {vs})"


# ---------------------------------------------------------------------------------------------- kernels

def kernels_policies(doc) -> Optional[str]:
    """x SDPA (SDPA's time over attncomp's; dense SDPA for every policy) per N, full / causal, and the TFLOP/s
    at the largest N (dense FLOPs: effective for sparse policies)."""
    rows = _rows(doc, "policies")
    if not rows:
        return None
    ns = sorted({r["N"] for r in rows})
    idx = {(r["policy"], r["pass"], r["D"], r["N"], r["causal"]): r for r in rows}
    keys = sorted({(r["policy"], r["pass"], r["D"]) for r in rows},
                  key=lambda k: (_porder(k[0]), k[1] != "fwd", -k[2]))
    ntf = max((r["N"] for r in rows if r.get("tflops")), default=ns[-1])
    header = ["policy", "pass", "D"] + [f"N={n} full / causal" for n in ns] + [f"TFLOP/s N={ntf} full / causal"]
    out = []
    for p, ps, d in keys:
        cells = []
        for n in ns:
            a, b = idx.get((p, ps, d, n, False)), idx.get((p, ps, d, n, True))
            cells.append(" / ".join(_ratio(r and r.get("sdpa_ms"), r and r.get("attncomp_ms")) for r in (a, b)))
        a, b = idx.get((p, ps, d, ntf, False)), idx.get((p, ps, d, ntf, True))
        cells.append(" / ".join(_f(r and r.get("tflops"), 0) for r in (a, b)))
        out.append([p, ps, str(d)] + cells)
    return _md(header, out)


def kernels_targets(doc) -> Optional[str]:
    rows = _rows(doc, "policies")
    if not rows:
        return None
    out = []
    for what, policy, ps, ns, causals, least, base in TARGETS:
        sel = [r for r in rows if r["policy"] == policy and r["pass"] == ps and r["N"] in ns and r["causal"] in causals
               and r.get(base) and r.get("attncomp_ms")]
        if not sel:
            out.append([what, "not measured", "-"])
            continue
        per_d = []
        met = 0
        for d in sorted({r["D"] for r in sel}, reverse=True):
            xs = [round(r[base] / r["attncomp_ms"], 2) for r in sel if r["D"] == d]
            met += sum(x >= least for x in xs)
            per_d.append(f"D={d} {_f(min(xs))}" + (f"-{_f(max(xs))}" if len(xs) > 1 else ""))
        verdict = "yes" if met == len(sel) else "no" if met == 0 else f"{met} of {len(sel)} shapes"
        out.append([what, ", ".join(per_d), verdict])
    return _md(["target (N >= 4096)", "measured x SDPA", "met?"], out)


def kernels_predicates(doc) -> Optional[str]:
    """Per predicate and policy: achieved/ideal (allowed fraction x no-mask time / time), forward / forward+backward."""
    rows = _rows(doc, "predicates")
    if not rows:
        return None
    idx = {(r["policy"], r["predicate"], r["passes"]): r for r in rows}
    policies = sorted({r["policy"] for r in rows}, key=_porder)
    out = []
    for k in sorted({r["predicate"] for r in rows}):
        any_ = next(r for r in rows if r["predicate"] == k)
        out.append([k, f"{any_['Nq']}x{any_['Nk']}", _f(any_["allowed"], 3)]
                   + [" / ".join(_f(r and r["achieved_over_ideal"]) for r in (idx.get((p, k, "fwd")),
                                                                                idx.get((p, k, "fwd+bwd"))))
                      for p in policies])
    D = sorted({r["D"] for r in rows})
    return _md(["predicate (D=" + ",".join(map(str, D)) + ")", "Nq x Nk", "allowed"]
               + [f"{p} fwd / fwd+bwd" for p in policies], out)


def kernels_spion(doc) -> Optional[str]:
    rows = _rows(doc, "spion")
    if not rows:
        return None
    idx = {(r["predicate"], r["D"], r["Nq"], r["passes"]): r for r in rows}
    keys = sorted({(r["predicate"], r["D"], r["Nq"]) for r in rows}, key=lambda k: (k[2], k[1], k[0]))
    out = []
    for k, d, n in keys:
        a, b = idx.get((k, d, n, "fwd")), idx.get((k, d, n, "fwd+bwd"))
        any_ = a or b
        out.append([k, str(d), str(n), _f(any_["density"], 3),
                    " / ".join(_f(r and r.get("x_sdpa")) for r in (a, b)),
                    " / ".join(_f(r and r.get("x_flex")) for r in (a, b)),
                    " / ".join(_f(r and r["achieved_over_ideal"]) for r in (a, b))])
    return _md(["pattern", "D", "N", "density", "x SDPA fwd / fwd+bwd", "x Flex fwd / fwd+bwd",
                "achieved/ideal fwd / fwd+bwd"], out)


def kernels_tvm(doc) -> Optional[str]:
    rows = _rows(doc, "tvm")
    if not rows:
        return None
    ns = sorted({r["N"] for r in rows})
    idx = {}
    for r in rows:  # a later run of the same row (field ``run``) replaces an earlier one
        idx[(r["policy"].split("(")[0], r.get("kernel", ""), r["causal"], r["N"], r["pass"])] = r
    keys = sorted({k[:3] for k in idx}, key=lambda k: (_porder(k[0]), k[1], k[2]))
    ref = any(r.get("reference_ms") for r in rows)
    out = []
    for p, kern, c in keys:
        cells = []
        for n in ns:
            a, b = idx.get((p, kern, c, n, "fwd")), idx.get((p, kern, c, n, "fwd+bwd"))
            cells.append(" / ".join(_ratio(r and r["sdpa_dense_ms"], r and r["tvm_ms"]) for r in (a, b)))
            if ref:
                cells.append(_ratio(a and a.get("reference_ms"), a and a["tvm_ms"]))
        out.append([p, kern or "-", "yes" if c else "no"] + cells)
    header = ["policy", "kernel", "causal"]
    for n in ns:
        header.append(f"N={n} x SDPA fwd / fwd+bwd")
        if ref:
            header.append(f"N={n} x reference fwd")
    return _md(header, out)


# ---------------------------------------------------------------------------------------------- models

def models(doc) -> Optional[str]:
    """Per model, mode, shape and Inductor mode: eager and ``torch.compile`` ms, and per policy attncomp's ms with
    its speedup over eager and over ``torch.compile`` (each against the baselines of its own run)."""
    rows = doc.get("rows", []) if doc else []
    if not rows:
        return None
    policies = sorted({r["policy"] for r in rows}, key=_porder)
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        key = (r["model"], r["mode"], r["B"], r["N"], r.get("inductor_mode") or "", r.get("inputs", "mask"))
        groups.setdefault(key, {})[r["policy"]] = r
    show_inputs = any(k[5] != "mask" for k in groups)  # (a column only where a file has other calls)
    out = []
    for (m, mode, b, n, im, inp), by in sorted(groups.items(),
                                               key=lambda kv: (kv[0][0], kv[0][1], kv[0][3], kv[0][4], kv[0][5])):
        ok = [r for r in by.values() if "error" not in r]
        eager, comp = (_span([r[k] for r in ok]) for k in ("eager_ms", "compile_ms"))
        cells = []
        for p in policies:
            r = by.get(p)
            cells.append("-" if r is None else "failed" if "error" in r else
                         f"{_f(r['attncomp_ms'])} ({_ratio(r['eager_ms'], r['attncomp_ms'])}x, "
                         f"{_ratio(r['compile_ms'], r['attncomp_ms'])}x)")
        out.append([m, mode, f"{b}x{n}"] + ([inp] if show_inputs else []) + [im or "default", eager, comp] + cells)
    return _md(["model", "mode", "BxN"] + (["inputs"] if show_inputs else []) + ["Inductor mode", "eager ms",
                                                                                  "torch.compile ms"]
               + [f"{p} ms (x eager, x compile)" for p in policies], out)


# ---------------------------------------------------------------------------------------------- generate

def generate(doc) -> Optional[str]:
    """Per row (B, prompt, new tokens) and path: tokens/s with its ratio to eager's, ms per decode step,
    first-call seconds, per-step logits against eager (dense paths), greedy tokens equal to eager's, or
    why the path has no figures."""
    rows = doc.get("rows", []) if doc else []
    if not rows:
        return None
    eager = {(r["B"], r["prompt"], r["new_tokens"]): r.get("tokens_per_s") for r in rows if r["path"] == "eager"}
    paths = list(dict.fromkeys(r["path"] for r in rows))  # the benchmark's order (rows of merged runs interleave)
    out = []
    for r in sorted(rows, key=lambda r: (r["prompt"], r["B"], r["new_tokens"], paths.index(r["path"]))):
        shape = (r["B"], r["prompt"], r["new_tokens"])
        if r.get("tokens_per_s") is None:
            why = str(r.get("error") or "not measured")
            why = "not reached in the run's time budget" if why.startswith("skipped: --time-budget") else why
            out.append([*map(str, shape), r["path"], "-", "-", "-", "-", "-", "-", why.split(" Stack trace")[0]])
            continue
        match = {True: "yes", False: "no", None: "-"}[r.get("logits_match")]
        out.append([*map(str, shape), r["path"], _f(r["tokens_per_s"], 1), _ratio(r["tokens_per_s"], eager.get(shape)),
                    _f(r.get("step_ms")), _f(r.get("first_call_s"), 1), match, _f(r.get("tokens_equal")),
                    r.get("note") or ""])
    return _md(["B", "prompt", "new", "path", "tokens/s", "x eager", "step ms", "first call s", "logits match",
                "tokens equal", "note"], out)


def decode(doc) -> Optional[str]:
    """Per B and cache length: the decode kernels' device time (CUDA-graph replay) with its KV read as a fraction
    of the copy bandwidth, per policy, SDPA's device time (dense), ``hash``'s call through the template's
    sorted layout (its steps with derived buckets), and ``hash`` with the buckets a KV cache keeps (the decode kernels:
    device time, the share of the keys read, and dense's time over it)."""
    rows = [r for r in (doc.get("rows", []) if doc else []) if r.get("table") == "decode" and r.get("ms")]
    if not rows:
        return None
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["Nk"]), {})[r["policy"]] = r

    def cell(r):
        return "-" if r is None or r.get("graph_ms") is None else \
            f"{r['graph_ms']:.3f} ({_f(r.get('kv_bandwidth_frac'))})"

    out = []
    for (B, nk), p in sorted(by.items()):
        d, h, hc = p.get("dense"), p.get("hash"), p.get("hash-cache")
        cached = "-"
        if hc is not None and hc.get("graph_ms"):
            cached = f"{hc['graph_ms']:.3f} (reads {_f(hc.get('keys_read'))})"
            if d is not None and d.get("graph_ms"):
                cached += f", {d['graph_ms'] / hc['graph_ms']:.2f}x dense"
        out.append([str(B), str(nk), cell(d), _f(d and d.get("sdpa_graph_ms"), 3), cell(p.get("dfss")),
                    cell(p.get("drop")), _f(h and h.get("template_ms"), 3), cached])
    return _md(["B", "keys", "dense ms (x bw)", "SDPA ms", "dfss ms (x bw)", "drop ms (x bw)", "hash ms (template)",
                "hash, cache's buckets ms"], out)


# ---------------------------------------------------------------------------------------------- distributed

def distributed(doc) -> Optional[str]:
    """The train part (step ms of the slowest rank, compiled / eager under the same wrapper) and the context-parallel
    part (one device on the whole sequence, the slowest rank's ms, scaling efficiency), or why a row has none."""
    rows = doc.get("rows", []) if doc else []
    if not rows:
        return None
    out = []
    train = [r for r in rows if r["part"] == "train"]
    if train:
        out.append(_md(["wrapper", "variant", "step ms", "x eager"],
                       [[r["wrapper"], r["variant"], "failed" if "error" in r else _f(r.get("step_ms")),
                         _f(r.get("vs_eager"))] for r in train]))
    cp = [r for r in rows if r["part"] == "cp"]
    if cp:
        out.append(_md(["N", "policy", "causal", "passes", "one GPU ms", "rank ms", "efficiency"],
                       [[str(r["N"]), r["policy"], "yes" if r["causal"] else "no", r["passes"],
                         _f(r.get("one_device_ms")), "failed" if "error" in r else _f(r.get("rank_ms")),
                         _f(r.get("scaling_efficiency"))]
                        for r in cp]))
    if doc.get("stopped"):
        out.append(f"Not measured: the rest of the run ({doc['stopped']}).")
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------------------- quality

def quality(doc) -> Optional[str]:
    """Per policy: training steps in the budget, ms per step, the validation bits per byte at the end and at the last
    evaluation within half the budget, and the training time at which it first reached dense's final value."""
    rows = doc.get("rows", []) if doc else []
    if not rows:
        return None
    runs = doc.get("runs", {})
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    by = {p: [r for r in rows if r["policy"] == p] for p in pols}
    target = by["dense"][-1]["val_bpb"] if "dense" in by else None
    out = []
    for p in pols:
        rs, run = by[p], runs.get(p, {})
        half = [r for r in rs if r["wall_s"] <= rs[-1]["wall_s"] / 2][-1]
        hit = next((r for r in rs if target is not None and r["val_bpb"] <= target), None)
        out.append([p, str(rs[-1]["step"]), _f(run.get("step_ms")), f"{_f(half['val_bpb'], 3)} ({half['wall_s']:.0f} s)",
                    _f(rs[-1]["val_bpb"], 3), "never" if hit is None else f"{hit['wall_s']:.0f} s"])
    return _md(["policy", "steps", "ms per step", "val bpb by half time", "val bpb at the end",
                "reaches dense's final bpb"], out)


# ---------------------------------------------------------------------------------------------- all

#: table name -> (benchmark, device, function)
TABLES: Dict[str, tuple] = {}
for _dev in ("h100", "h200"):
    TABLES[f"kernels-{_dev}"] = ("kernels", _dev, kernels_policies)
    TABLES[f"kernels-targets-{_dev}"] = ("kernels", _dev, kernels_targets)
    TABLES[f"kernels-predicates-{_dev}"] = ("kernels", _dev, kernels_predicates)
    TABLES[f"kernels-spion-{_dev}"] = ("kernels", _dev, kernels_spion)
    TABLES[f"kernels-tvm-{_dev}"] = ("kernels", _dev, kernels_tvm)
    TABLES[f"models-{_dev}"] = ("models", _dev, models)
    TABLES[f"generate-{_dev}"] = ("generate", _dev, generate)
    TABLES[f"decode-{_dev}"] = ("decode", _dev, decode)
    TABLES[f"quality-{_dev}"] = ("quality", _dev, quality)
    for _n in (2, 4):
        TABLES[f"distributed-{_dev}x{_n}"] = ("distributed", f"{_dev}x{_n}", distributed)
TABLES["kernels-tvm-cpu"] = ("kernels", "cpu", kernels_tvm)
TABLES["models-cpu"] = ("models", "cpu", models)


def table(name: str) -> str:
    """One table's markdown: the source line and the table, or why there is none."""
    bench, dev, fn = TABLES[name]
    path = C.results_path(bench, dev)
    doc = C.load(path)
    body = fn(doc) if doc else None
    if body is None:
        return f"No results file yet (`results/{bench}_{dev}.json`)." if not doc else \
            f"No rows of this table in `results/{os.path.basename(path)}` yet."
    return f"From {_source(doc, path)}:\n\n{body}"


def render(text: str, fn: Callable[[str], str] = table) -> str:
    """``text`` with every marked table regenerated."""
    def sub(m):
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"a page names an unknown table {name!r}; known: {', '.join(TABLES)}")
        return f"<!-- table: {name} -->\n{fn(name)}\n<!-- end -->"

    return MARK.sub(sub, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncomp bench tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the marked tables of the pages (DOCS)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's tables are not current")
    ap.add_argument("names", nargs="*", help=f"tables to print (default all): {', '.join(TABLES)}")
    args = ap.parse_args(argv)
    if args.write or args.check:
        stale = []
        for path in DOCS:
            with open(path) as f:
                text = f.read()
            new = render(text)
            rel = os.path.relpath(path, os.path.dirname(HERE))
            if new == text:
                continue
            if args.check:
                stale.append(rel)
                continue
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {len(MARK.findall(text))} tables of {rel}")
        if stale:
            print(f"the tables of {', '.join(stale)} differ from the results files: "
                  "python -m attncomp bench tables --write", file=sys.stderr)
            return 1
        print("every page's tables are current")
        return 0
    for name in args.names or TABLES:
        if name not in TABLES:
            ap.error(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        print(f"<!-- table: {name} -->\n{table(name)}\n<!-- end -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
