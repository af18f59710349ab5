"""``benchmarks/README.md`` and ``benchmarks/results/``: the README stays short, its tables are what
``python -m attncomp bench tables`` computes from the results files, every figure in them is a value of a
results file (or the ratio of two values of one row), and every results file says how it was made."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
README = os.path.join(BENCH, "README.md")
sys.path.insert(0, ROOT)

from benchmarks import tables  # noqa: E402

NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _results():
    out = {}
    for p in sorted(glob.glob(os.path.join(BENCH, "results", "*.json"))):
        with open(p) as f:
            out[os.path.basename(p)] = json.load(f)
    return out


def test_readme_is_short():
    assert len(_readme().splitlines()) < 300


def _page(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("path", tables.DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_tables_are_current(path):
    """The marked tables of every page that has some are exactly what the results files give (regenerate:
    bench tables --write)."""
    text = _page(path)
    assert tables.MARK.search(text), f"no generated table in {path}"
    assert tables.render(text) == text, f"{path} is stale: python -m attncomp bench tables --write"


def _table_blocks(text: str):
    """Every markdown table of the text: (inside a generated section, lines)."""
    generated = [(m.start(), m.end()) for m in tables.MARK.finditer(text)]
    blocks, cur, start = [], [], 0
    pos = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("|"):
            if not cur:
                start = pos
            cur.append(line.rstrip("\n"))
        elif cur:
            blocks.append((any(a <= start < b for a, b in generated), cur))
            cur = []
        pos += len(line)
    if cur:
        blocks.append((any(a <= start < b for a, b in generated), cur))
    return blocks


def _cells(line: str):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _candidates(docs):
    """Every number of a results file as a page may print it: values, and ratios of two values of one row."""
    out = set()

    def leaves(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            yield float(x)
        elif isinstance(x, dict):
            for v in x.values():
                yield from leaves(v)
        elif isinstance(x, list):
            for v in x:
                yield from leaves(v)

    for doc in docs.values():  # rows, and the per-run summaries of a file that has them (quality)
        for row in doc.get("rows", []) + list(doc.get("runs", {}).values()):
            vals = [v for v in leaves(row) if v == v]
            for v in vals:
                for nd in range(4):
                    out.add(f"{v:.{nd}f}")
            for a, b in itertools.permutations([v for v in vals if v > 0], 2):
                for nd in (2, 3):
                    out.add(f"{a / b:.{nd}f}")
    return out


@pytest.mark.parametrize("path", tables.DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_table_figure_is_in_a_results_file(path):
    """In the benchmarks' README, a table figure is generated or a command; in the guides, the generated tables'
    figures are values of results files (their other tables are examples, not measurements)."""
    text = _page(path)
    readme = path == README
    cand = _candidates(_results())
    missing = []
    for generated, lines in _table_blocks(text):
        header = _cells(lines[0])
        for line in lines[2:]:
            for head, cell in zip(header, _cells(line)):
                if head.startswith(("target", "met?")):
                    continue  # the targets themselves, and how many shapes meet them
                for num in NUMBER.findall(cell.replace("`", " ")):
                    if not generated and readme and not cell.startswith("`"):
                        missing.append((line, num))  # a figure typed by hand
                    elif generated and num not in cand:
                        missing.append((line, num))
    assert not missing, missing[:20]


def test_results_files_say_how_they_were_made():
    docs = _results()
    assert {"kernels_h100.json", "kernels_h200.json", "models_h100.json", "models_h200.json"} <= set(docs)
    for name, doc in docs.items():
        bench, device = os.path.splitext(name)[0].split("_", 1)
        # a multi-GPU file is named for its device and GPU count (distributed_h200x2.json)
        named = doc["device"] + (f"x{doc['gpus']}" if doc.get("gpus") else "")
        assert doc["benchmark"] == bench and named == device, name
        for key in ("command", "commit", "device", "versions", "rows"):
            assert key in doc, (name, key)
        assert set(doc["versions"]) == {"torch", "triton", "transformers"}, name
        assert doc["rows"], name
    for p in glob.glob(os.path.join(BENCH, "results", "*")):
        assert p.endswith((".json", ".png")), p
        if p.endswith(".png"):  # the kernel benchmark's plot per device, the quality run's two (time, steps)
            stem = os.path.basename(p)[:-4]
            ok = stem + ".json" in docs and stem.startswith("kernels_") or \
                stem.startswith("quality_") and stem.rsplit("_", 1)[0] + ".json" in docs and stem.endswith(("_time", "_steps"))
            assert ok, p


@pytest.mark.parametrize("name", ["kernels", "models", "distributed", "tables"])
def test_benchmark_modules_have_main(name):
    import importlib

    mod = importlib.import_module(f"benchmarks.{name}")
    assert callable(mod.main)


def test_no_experiment_scripts_left():
    """The folder holds the benchmarks behind ``bench`` and their helpers, nothing else."""
    allowed = {"__init__.py", "common.py", "_tvm.py", "kernels.py", "models.py", "distributed.py", "generate.py",
               "decode.py", "quality.py", "tables.py", "README.md", "results", "__pycache__"}
    assert set(os.listdir(BENCH)) <= allowed, set(os.listdir(BENCH)) - allowed
