"""What every benchmark shares: the device tag, versions and commit of a run, and its results file.

A results file is ``benchmarks/results/<benchmark>_<device>.json`` (device ``h100``, ``h200``, ``cpu``; from
the GPU's name), one per benchmark and device::

    {"benchmark": "kernels", "command": "python -m attncomp bench kernels ...", "commit": "<git hash>"|null,
     "device": "h100", "device_name": "NVIDIA H100 80GB HBM3", "date": "...",
     "versions": {"torch": ..., "triton": ..., "transformers": ...}, "rows": [...],
     "previous": [{"command", "commit", "date", "versions", "rows"}]}

A run replaces the rows it measures again and keeps the file's other rows (another table, policy or
model of the same benchmark, measured by an earlier command): ``previous`` names the commands those rows
came from and how many of them are kept.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def device_tag(name: Optional[str] = None) -> str:
    """``h100``, ``h200``, ``a100``... from a GPU's name (the current GPU's by default), ``cpu`` without one."""
    if name is None:
        try:
            import torch

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except Exception:
            name = "cpu"
    low = name.lower()
    for tag in ("h200", "h100", "a100", "l40s", "b200", "gh200"):
        if tag in low:
            return tag
    return "cpu" if low.startswith("cpu") else low.replace("nvidia", "").strip().replace(" ", "_")


def device_name() -> str:
    """The GPU's full name, or the CPU's."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:
        pass
    return cpu_name()


def cpu_name() -> str:
    """The CPU's name, for a run on the CPU of a machine that has a GPU too (a smoke run)."""
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions() -> Dict[str, Optional[str]]:
    """torch, triton and transformers versions (``None`` where not installed)."""
    out: Dict[str, Optional[str]] = {}
    for mod in ("torch", "triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def commit() -> Optional[str]:
    """The checkout's commit (with ``+dirty`` when tracked files differ), ``None`` outside git."""
    try:
        h = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if h.returncode != 0:
            return None
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, timeout=10)
        return h.stdout.strip() + ("+dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command(bench: str, argv: Optional[List[str]]) -> str:
    """The command line that reproduces this run."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m attncomp bench", bench] + [_quote(a) for a in args])


def _quote(a: str) -> str:
    return a if a and all(c.isalnum() or c in "-_.,:=/+" for c in a) else json.dumps(a)


def results_path(bench: str, device: Optional[str] = None) -> str:
    return os.path.join(RESULTS, f"{bench}_{device or device_tag()}.json")


def load(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def document(bench: str, rows: List[dict], argv: Optional[List[str]], device: Optional[str] = None,
             **extra) -> Dict[str, Any]:
    """A results document of this run."""
    doc = {"benchmark": bench, "command": command(bench, argv), "commit": commit(),
           "device": device or device_tag(), "device_name": device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions()}
    doc.update(extra)
    doc["rows"] = rows
    return doc


def write(doc: Dict[str, Any], path: Optional[str] = None, keep: Optional[Callable[[dict], bool]] = None,
          copy_to_out: bool = True, base: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write ``doc`` to ``path`` (default: its benchmark's results file) atomically, and a copy under ``$OUT``
    when set. ``keep(row)``: rows of the file already there (or of ``base``, the file as it was before a run that
    writes after every row) to keep, those this run does not measure again; their provenance goes to
    ``previous``. Returns the paths written."""
    path = path or results_path(doc["benchmark"], doc["device"])
    doc = dict(doc)
    old = (base if base is not None else load(path)) if keep is not None else None
    if old:
        kept = [r for r in old.get("rows", []) if keep(r)]
        if kept:
            prov = {k: old.get(k) for k in ("command", "commit", "date", "versions")}
            prov["rows"] = len(kept)
            earlier = [dict(p) for p in old.get("previous", [])]
            doc["previous"] = [prov] + earlier
            doc["rows"] = kept + list(doc["rows"])
    paths = [path]
    out = os.environ.get("OUT")
    if copy_to_out and out and os.path.dirname(os.path.abspath(path)) != os.path.abspath(out):
        paths.append(os.path.join(out, os.path.basename(path)))
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        tmp = p + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, p)
    return paths
