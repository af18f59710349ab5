"""Measured SDPA-against-Triton choices shipped with the package, one table per GPU model.

The autotune store holds what was measured on this machine; these tables hold what was measured on
the project's machines, so that a compile that may not measure (every mode but ``max-autotune``,
see :func:`attncomp.runtime.dispatch.inline_choice`) still decides from a measurement where one
exists. A table is ``attncomp/runtime/tables/<gpu>.json``; it serves a GPU whose name (as
``torch.cuda.get_device_name`` gives it, lowercased) contains ``<gpu>`` as a word (``h100`` serves
"NVIDIA H100 80GB HBM3").

Format (JSON)::

    {"gpu": "NVIDIA H100 80GB HBM3", "torch": "...", "triton": "...", "source": "<the results file>",
     "dense_kernel_choice": [ENTRY, ...],   # keys of dispatch.dense_choice_key (forward + backward)
     "dense_inline_choice": [ENTRY, ...]}   # the same keys, plus "cuda_graphs": true for device time

    ENTRY = {"key": {"nq": 4096, "nk": 4096, "head_dim": 64, "dtype": "bfloat16", "kind": "causal",
                     "arch": "sm_90", "gqa": false},
             "best": "sdpa", "timings": {"sdpa": 1.29, "triton": 1.33}, "row": "<the measured row>"}

The keys are the autotune store's (sizes by power of two), under the store's names
(:data:`~attncomp.runtime.dispatch.DENSE_CHOICE`, :data:`~attncomp.runtime.dispatch.INLINE_CHOICE`).
A bucket with no measured figure has no entry. :func:`from_kernel_results` builds a table from a
kernel benchmark's results (``benchmarks/results/kernels_<gpu>.json``, the policy table's rows of
policy ``dense``: ``sdpa_ms`` is SDPA with torch's own kernel choice, ``attncomp_ms`` the Triton backend):

* ``dense_kernel_choice``: the ``fwd+bwd`` rows (what :func:`~attncomp.runtime.dispatch._time_candidates`
  times);
* ``dense_inline_choice``: the ``fwd`` rows, device time, under ``cuda_graphs: true`` (a graph replayed
  as a CUDA graph runs its kernels back to back, as the benchmark timed them); and without it (per call,
  host time included) only where both times exceed ``host_us``, the op's largest measured host time per
  call on that GPU (the figure the shipped table carries, ``host_us``, with its source,
  ``host_source``: a launch-cost run kept in git history): calls issued back to back are then bound by
  the device, and the per-call time is the device time.

``python -m attncomp.runtime.choice_tables benchmarks/results`` rewrites the shipped tables from the results.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)

__all__ = ["TABLES_DIR", "table_name", "lookup", "from_kernel_results", "clear"]

#: where the shipped tables are (package data)
TABLES_DIR = Path(__file__).resolve().parent / "tables"

_KERNEL = "dense_kernel_choice"
_INLINE = "dense_inline_choice"


def _key(key: Dict[str, Any]) -> tuple:
    return tuple(sorted((str(k), v) for k, v in key.items()))


@functools.lru_cache(maxsize=None)
def _load(folder: str, gpu_name: str) -> Optional[Dict[str, Dict[tuple, dict]]]:
    """The table of ``folder`` that serves ``gpu_name``, indexed by section and key; None without one."""
    name = table_name(gpu_name, folder)
    if name is None:
        return None
    path = os.path.join(folder, name + ".json")
    try:
        with open(path) as f:
            data = json.load(f)
        return {sec: {_key(e["key"]): e for e in data.get(sec, [])} for sec in (_KERNEL, _INLINE)}
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged table never breaks a compile
        log.warning("attncomp: could not read the choice table %s: %s", path, e)
        return None


def table_name(gpu_name: str, folder: Optional[str] = None) -> Optional[str]:
    """The table (file stem) that serves a GPU of this name, or None."""
    words = set(re.split(r"[^a-z0-9]+", gpu_name.lower()))
    try:
        stems = sorted(p[:-5] for p in os.listdir(folder or TABLES_DIR) if p.endswith(".json"))
    except OSError:
        return None
    return next((s for s in stems if s in words), None)


def lookup(section: str, key: Dict[str, Any], gpu_name: Optional[str]) -> Optional[Dict[str, Any]]:
    """The shipped entry (``{"best", "timings", "row"}``) for ``key`` in ``section`` (the store's name:
    ``dense_kernel_choice`` or ``dense_inline_choice``) on a GPU of this name, or None."""
    if not gpu_name:
        return None
    table = _load(str(TABLES_DIR), gpu_name)
    if table is None:
        return None
    return table.get(section, {}).get(_key(key))


def clear() -> None:
    """Forget the tables read so far (tests point :data:`TABLES_DIR` elsewhere)."""
    _load.cache_clear()


# -- building tables from benchmark results ---------------------------------------------------------

def _entry(key: Dict[str, Any], sdpa_ms: float, triton_ms: float, row: str) -> Dict[str, Any]:
    timings = {"sdpa": round(float(sdpa_ms), 4), "triton": round(float(triton_ms), 4)}
    return {"key": key, "best": "sdpa" if timings["sdpa"] <= timings["triton"] else "triton", "timings": timings,
            "row": row}


def from_kernel_results(results: Dict[str, Any], source: str, arch: str = "sm_90",
                        host_us: Optional[float] = None) -> Dict[str, Any]:
    """A table from a kernel benchmark's results (see the module docstring); ``host_us``: the op's
    largest host time per call on that GPU, for the per-call entries (none without it)."""
    from .autotune import shape_bucket

    kernel: List[dict] = []
    inline: List[dict] = []
    for r in results.get("rows", []):
        if (r.get("policy") != "dense" or r.get("table", "policies") != "policies" or not r.get("sdpa_ms")
                or not r.get("attncomp_ms") or r.get("pass") not in ("fwd", "fwd+bwd")):
            continue
        key = {"nq": shape_bucket(r["N"]), "nk": shape_bucket(r["N"]), "head_dim": int(r["D"]), "dtype": r["dtype"],
               "kind": "causal" if r["causal"] else "none", "arch": arch, "gqa": False}
        row = (f"{source}: dense {r['pass']} B={r['B']} H={r['H']} D={r['D']} N={r['N']} causal={r['causal']} "
               f"{r['dtype']}")
        if r["pass"] == "fwd+bwd":
            kernel.append(_entry(key, r["sdpa_ms"], r["attncomp_ms"], row))
            continue
        inline.append(_entry(dict(key, cuda_graphs=True), r["sdpa_ms"], r["attncomp_ms"], row))
        if host_us is not None and min(r["sdpa_ms"], r["attncomp_ms"]) * 1e3 > host_us:
            inline.append(_entry(key, r["sdpa_ms"], r["attncomp_ms"],
                                 row + f" (device-bound per call: op host time <= {host_us:.0f} us)"))
    order = lambda e: json.dumps(e["key"], sort_keys=True)  # noqa: E731
    versions = results.get("versions") or results  # the results format, or the older flat one
    return {"gpu": results.get("device_name") or results.get("machine"), "torch": versions.get("torch"),
            "triton": versions.get("triton"),
            "source": source, "host_us": None if host_us is None else round(host_us, 1),
            _KERNEL: sorted(kernel, key=order), _INLINE: sorted(inline, key=order)}


def build(results_dir: str, out_dir: Optional[str] = None) -> List[str]:
    """Write a table per ``kernels_<gpu>.json`` of ``results_dir`` (H100 and H200) to ``out_dir``
    (default: the shipped tables), keeping the shipped table's host time per call and its source;
    returns the files written."""
    written = []
    for gpu in ("h100", "h200"):
        path = os.path.join(results_dir, f"kernels_{gpu}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            results = json.load(f)
        try:
            with open(TABLES_DIR / f"{gpu}.json") as f:
                shipped = json.load(f)
        except (OSError, ValueError):
            shipped = {}
        table = from_kernel_results(results, f"benchmarks/results/kernels_{gpu}.json", host_us=shipped.get("host_us"))
        table["host_source"] = shipped.get("host_source") if table["host_us"] is not None else None
        out = os.path.join(out_dir or TABLES_DIR, f"{gpu}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        written.append(out)
    return written


if __name__ == "__main__":
    import sys

    for p in build(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"):
        print(p)
