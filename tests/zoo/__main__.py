"""``python -m tests.zoo [--families a,b] [--registry causal-lm,...] [--jobs N] [--timeout S] [--inductor]
[--train-every K] [--decode P,Q] [--out NAME]``: the registry sweep.

Every family runs :func:`tests.zoo.check.check` in a worker subprocess (a crash or a hang costs that
family only; see :class:`Worker`), ``--jobs`` workers at a time, each family within ``--timeout`` seconds. Results go to
``tests/zoo/results.json`` and ``tests/zoo/RESULTS.md`` (the pinned transformers), or with ``--out newest`` to
``results-newest.json`` and ``RESULTS-newest.md`` (the newest transformers the ranges admit: ``make zoo-newest``); a run
of some families (``--families``, ``--registry``) merges into the results already there. ``--decode static,dfss,drop``
also checks each causal LM's dense decoding into an initialised static cache against eager, and its decoding steps under
those sparse policies against its full forward (:func:`tests.zoo.check.check`); name such a run's results with
``--out`` (``make zoo-decode``: ``--out decode``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import subprocess
import threading
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed

from tests.zoo import families as Z

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS_JSON = os.path.join(HERE, "results.json")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")


def key(registry: str, model_type: str) -> str:
    return f"{registry}/{model_type}"


class Worker:
    """A process that checks one family after another (``python -m tests.zoo.check --serve``): the
    imports are paid once per worker, not per family. A family that kills the process (``crash``) or
    outlives its timeout (``timeout``, the process is killed) costs that family only: the next one
    starts a new process. Workers are replaced every ``RECYCLE`` families."""

    RECYCLE = 20

    def __init__(self, env):
        self.env, self.proc, self.done, self.log = env, None, 0, None

    def _start(self):
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zoo.check", "--serve"], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.done = 0

    def _last_log_line(self):
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:300] if lines else ""

    def stop(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.log.close()
            self.proc = None

    def run(self, registry, model_type, cls, timeout, train, decode=()):
        """The family's result dict (``crash`` or ``timeout`` when the worker gave none)."""
        if self.proc is None or self.done >= self.RECYCLE:
            self.stop()
            self._start()
        t0 = time.time()
        base = dict(registry=registry, model_type=model_type, cls=cls, eager_calls=None, sites=None,
                    rewritten=None, op_calls=None, details={})
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            task = dict(registry=registry, model_type=model_type, out=out, train=train, decode=list(decode))
            try:
                self.proc.stdin.write((json.dumps(task) + "\n").encode())
                self.proc.stdin.flush()
                ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
                line = self.proc.stdout.readline() if ready else None
            except (BrokenPipeError, OSError):
                line = b""
            if line is None:
                self.stop()
                return dict(base, status="timeout", reason=f"no result within {timeout:g} s",
                            seconds=round(time.time() - t0, 1))
            if not line or not os.path.exists(out):
                code = self.proc.wait()
                reason = f"exit code {code}: {self._last_log_line()}"
                self.stop()
                return dict(base, status="crash", reason=reason, seconds=round(time.time() - t0, 1))
            self.done += 1
            with open(out) as f:
                return json.load(f)


def versions():
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return dict(transformers=transformers.__version__, torch=torch.__version__, commit=commit)


def result_paths(out: str = ""):
    """(json, markdown) paths of the results named ``out`` ("" for the pinned transformers' results)."""
    suffix = f"-{out}" if out else ""
    return os.path.join(HERE, f"results{suffix}.json"), os.path.join(HERE, f"RESULTS{suffix}.md")


def _decode_words(checks) -> str:
    out = ""
    if "static" in checks:
        out += (" Causal LMs generate with the dense compiled model into a static cache a forward already initialised "
                "(the left-padded batch, and one row without `attention_mask`), each step's logits against eager's "
                "(`wrong-generate` otherwise).")
    pols = [p for p in checks if p != "static"]
    if pols:
        out += (" Causal LMs then generate under " + ", ".join(pols) + ", each step's logits checked against the "
                "same compiled model's full forward (`wrong-decode` otherwise).")
    return out


def write_markdown(data, path=RESULTS_MD):
    fams = data["families"]
    regs = list(Z.REGISTRIES)
    if data.get("decode"):  # a decode sweep covers the causal LMs it was given
        regs = [r for r in regs if any(f["registry"] == r for f in fams.values())]
    statuses = [s for s in ("pass", "eager-fails", "no-attention", "compile-error", "wrong-output",
                            "dynamo-differs", "sites-missing", "not-rewritten", "generate-error", "wrong-generate",
                            "wrong-decode", "decode-refused", "wrong-grad",
                            "crash", "timeout") if any(r["status"] == s for r in fams.values())]
    by = Counter((r["registry"], r["status"]) for r in fams.values())
    lines = ["# Registry sweep results", "",
             f"`python -m tests.zoo` (`make zoo`): transformers {data['transformers']}, torch {data['torch']}, "
             f"commit {data['commit']}, {data['date']}; Inductor {'on' if data.get('inductor') else 'off'}. Runs "
             "merged here: " + "; ".join(f"{r['date']}: {r['families']} families ({r['what']}) in {r['wall_s']} s "
                                         f"with {r['jobs']} jobs" for r in data.get("runs", [])) + ".",
             "", "Every family of transformers' causal-LM, masked-LM, seq2seq-LM and image-classification "
             "registries, built tiny from its default config with random weights, compiled with "
             "`attncomp.compile(model, policy=\"dense\")` and compared with eager (`tests/zoo/check.py` says "
             "what each status means)." + _decode_words(data.get("decode") or []), "",
             "| registry | " + " | ".join(statuses) + " | total |",
             "| --- | " + " | ".join("---:" for _ in statuses) + " | ---: |"]
    for reg in regs + ["all"]:
        row = [sum(v for (r, s), v in by.items() if s == st and (reg == "all" or r == reg)) for st in statuses]
        lines.append(f"| {reg} | " + " | ".join(str(v) for v in row) + f" | {sum(row)} |")
    missing = [f"{m} ({r})" for r, m, _ in Z.families() if key(r, m) not in fams and r in regs]
    if missing:
        lines += ["", f"Not run yet ({len(missing)}): " + ", ".join(missing) + "."]
    lines += ["", "| family | registry | class | eager calls | sites | rewritten | status | reason |",
              "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for k in sorted(fams, key=lambda k: (fams[k]["model_type"], regs.index(fams[k]["registry"]))):
        r = fams[k]
        reason = str(r.get("reason", "")).replace("|", "\\|").replace("\n", " ")
        cells = [r["model_type"], r["registry"], r.get("cls", ""), r.get("eager_calls"), r.get("sites"),
                 r.get("rewritten"), f"**{r['status']}**" if r["status"] != "pass" else "pass", reason]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tests.zoo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--registry", default=",".join(Z.REGISTRIES),
                    help="comma-separated registries among " + ", ".join(Z.REGISTRIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180, help="seconds per family")
    ap.add_argument("--inductor", action="store_true", help="compile around the op with Inductor (slow on a CPU)")
    ap.add_argument("--train-every", type=int, default=20,
                    help="also check training gradients of every K-th family of the full list (0: none)")
    ap.add_argument("--decode", default="", help="comma-separated decoding checks of each causal LM: static (dense, "
                    "into an initialised static cache, against eager), or sparse policies whose decoding steps are "
                    "checked against the full forward (dfss, hash, drop, spion)")
    ap.add_argument("--out", default="", help="name the results: results-NAME.json and RESULTS-NAME.md (default: "
                    "results.json and RESULTS.md, the pinned transformers' sweep)")
    args = ap.parse_args(argv)
    results_json, results_md = result_paths(args.out)
    from tests.zoo.check import DECODE_CHECKS

    decode = tuple(p for p in args.decode.split(",") if p)
    if set(decode) - set(DECODE_CHECKS):
        ap.error(f"--decode takes checks among {', '.join(DECODE_CHECKS)}")

    regs = [r for r in args.registry.split(",") if r]
    bad = [r for r in regs if r not in Z.REGISTRIES]
    if bad:
        ap.error(f"unknown registry {bad}; choose from {', '.join(Z.REGISTRIES)}")
    every = Z.families(tuple(Z.REGISTRIES))
    train_keys = {key(r, m) for i, (r, m, _) in enumerate(every) if args.train_every and i % args.train_every == 0}
    todo = [f for f in every if f[0] in regs]
    if args.families:
        wanted = [m.strip() for m in args.families.split(",") if m.strip()]
        unknown = set(wanted) - {m for _, m, _ in todo}
        if unknown:
            ap.error(f"no such family in {', '.join(regs)}: {', '.join(sorted(unknown))}")
        todo = sorted((f for f in todo if f[1] in wanted), key=lambda f: wanted.index(f[1]))  # in the order given

    env = dict(os.environ, ATTNCOMP_INDUCTOR="1" if args.inductor else "0", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    threads = str(max(1, (os.cpu_count() or 1) // max(1, args.jobs)))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("ATTNCOMP_CACHE_DIR", tempfile.mkdtemp(prefix="attncomp-zoo-cache-"))

    data = dict(families={})
    if os.path.exists(results_json):
        with open(results_json) as f:
            data = json.load(f)
    data.update(versions())
    data["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data["inductor"] = args.inductor
    data["decode"] = list(decode)
    full = not args.families and set(regs) == set(Z.REGISTRIES)
    if full:
        data["families"] = {}  # a full run replaces families that left the registries too

    t0 = time.time()
    print(f"{len(todo)} families, {args.jobs} jobs, timeout {args.timeout:g} s, "
          f"Inductor {'on' if args.inductor else 'off'}", flush=True)
    width = len(str(len(todo)))
    local = threading.local()
    workers = []

    def run(r, m, c):
        if not hasattr(local, "worker"):
            local.worker = Worker(env)
            workers.append(local.worker)
        return local.worker.run(r, m, c, args.timeout, key(r, m) in train_keys, decode)

    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futs = {pool.submit(run, r, m, c): (r, m) for r, m, c in todo}
            for i, fut in enumerate(as_completed(futs), 1):
                r, m = futs[fut]
                res = fut.result()
                data["families"][key(r, m)] = res
                print(f"[{i:{width}}/{len(todo)}] {r:9} {m:28} {res['status']:14} {res.get('seconds', 0):6.1f}s  "
                      f"{str(res.get('reason', ''))[:160]}", flush=True)
                with open(results_json, "w") as f:  # written as it goes: an interrupted sweep keeps its results
                    json.dump(data, f, indent=1, sort_keys=True, default=str)
    finally:
        for w in workers:
            w.stop()
    wall = round(time.time() - t0)
    what = "all registries" if full else ", ".join(regs) + (" (some families)" if args.families else "")
    data["runs"] = ([] if full else data.get("runs", [])[-9:]) + [
        dict(date=data["date"], families=len(todo), what=what, wall_s=wall, jobs=args.jobs)]
    with open(results_json, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
    write_markdown(data, results_md)
    counts = Counter(data["families"][key(r, m)]["status"] for r, m, _ in todo)
    print(f"done in {wall} s: " + ", ".join(f"{s} {n}" for s, n in counts.most_common()), flush=True)
    print(f"wrote {os.path.relpath(results_json, ROOT)} and {os.path.relpath(results_md, ROOT)}")


if __name__ == "__main__":
    main()
