"""The ``python -m attncomp`` command line.

Subcommands register themselves in :data:`COMMANDS` (name -> ``(help, add_arguments, run)``), so new
ones are one function pair each. Present:

* ``report``: compile a tiny random-weight model of a transformers family (or a model of your own,
  ``pkg.module:Class``), run it once and print :func:`attncomp.report`.
* ``bench``: run one of the benchmarks of the repository's ``benchmarks/`` folder (``kernels``, ``models``,
  ``generate``, ``distributed``, ``quality``; ``tables`` prints the README's tables from the results files).
* ``zoo``: the registry sweep (every family of the installed transformers, compiled and compared with eager).
* ``build-kernels``: build the TVM backend's CUDA kernels (cubin + launch metadata) ahead of time for
  GPU archs, on any machine with apache-tvm and nvcc, into the kernel cache and optionally a folder a
  GPU machine imports (:func:`attncomp.runtime.cubin.import_folder`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["main", "COMMANDS", "build_kernels", "report", "bench", "zoo", "BENCHMARKS", "csv_list"]

COMMANDS: Dict[str, Tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}

_POLICIES = ("dense", "dfss", "hash", "drop", "spion")


def csv_list(kind):
    """An argparse ``type``: a comma-separated list of ``kind`` (``"64,128"`` -> ``[64, 128]``)."""
    def parse(s: str):
        try:
            return [kind(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _add_build_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", type=csv_list(str), default=["sm_90"], help="GPU archs, comma separated (sm_90,sm_80)")
    p.add_argument("--policy", type=csv_list(str), default=list(_POLICIES),
                   help=f"policies, comma separated (default: all: {','.join(_POLICIES)})")
    p.add_argument("--head-dim", type=csv_list(int), default=[64, 128], help="head dims, comma separated")
    p.add_argument("--value-dim", type=int, default=None, help="value head dim (default: the head dim)")
    p.add_argument("--nm", type=str, default=None, help="dfss N:M, e.g. 2:4 (default: 2:4)")
    p.add_argument("--block-size", type=csv_list(int), default=[64], help="spion block sizes")
    p.add_argument("--dfss-kernel", type=csv_list(str), default=["sp", "scalar"],
                   help="dfss CUDA kernels, comma separated: sp (sparse tensor cores, float16/bfloat16 "
                        "inputs), scalar (every dtype) (default: both)")
    p.add_argument("--operand-dtype", type=csv_list(str), default=["float16", "bfloat16"],
                   help="operand dtypes of the sp kernels (default: float16,bfloat16)")
    causal = p.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_const", const=[True], help="causal only")
    causal.add_argument("--no-causal", dest="causal", action="store_const", const=[False], help="non-causal only")
    p.add_argument("--mask", type=csv_list(str), default=["none"], help="dense mask kinds: none,bool,float")
    p.add_argument("--dropout", action="store_true", help="also the dropout variants")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="also the backward kernels (dK/dV and dQ) of every variant (default: yes)")
    p.add_argument("--out", default=None, help="also copy the artefacts into this folder (<key>/kernel.cubin, launch.json)")
    p.add_argument("--list", action="store_true", help="list the kernels and their cache keys without building")


def kernel_variants(args: argparse.Namespace):
    """The kernel variants ``build-kernels`` builds for these arguments."""
    import torch

    from .codegen.tvm.backend import make_variant, sparse_variant
    from .policy import get_policy
    from .spec import AttentionSpec

    out = []
    causal = args.causal if args.causal is not None else [False, True]
    for pol, d, c, mask, drop in itertools.product(args.policy, args.head_dim, causal, args.mask,
                                                   [False, True] if args.dropout else [False]):
        if pol not in _POLICIES:
            raise ValueError(f"unknown policy {pol!r}; valid: {', '.join(_POLICIES)}")
        if mask not in ("none", "bool", "float"):
            raise ValueError(f"unknown mask kind {mask!r}; valid: none, bool, float")
        params: List[dict] = [{}]
        if pol == "dfss":
            n, m = (args.nm or "2:4").split(":")
            params = [{"n": int(n), "m": int(m)}]
        elif pol == "spion":
            params = [{"block_size": bs} for bs in args.block_size]
        for kw in params:
            spec = AttentionSpec(causal=c, mask_kind=mask, policy=get_policy(pol, **kw).resolved(torch.float16))
            q = torch.empty(1, 1, 1, d)
            v = torch.empty(1, 1, 1, args.value_dim or d)
            am = None if mask == "none" else torch.empty(1, 1, dtype=torch.bool if mask == "bool" else torch.float32)
            var = make_variant(spec, q, v, am, None, 0.5 if drop else 0.0)
            if pol != "dfss":
                out.append((spec, var))
                continue
            for kind in args.dfss_kernel:
                if kind not in ("sp", "scalar"):
                    raise ValueError(f"unknown dfss kernel {kind!r}; valid: sp, scalar")
                if kind == "scalar":
                    out.append((spec, var))
                    continue
                for od in args.operand_dtype:
                    if od not in ("float16", "bfloat16"):
                        raise ValueError(f"unknown operand dtype {od!r}; valid: float16, bfloat16")
                    sp = sparse_variant(var, getattr(torch, od))
                    if sp is not None:  # dropout variants and other head dims stay scalar
                        out.append((spec, sp))
    return out


def _kind(var, kind: str = "fwd") -> str:
    if kind != "fwd":
        return f", backward {kind}"
    return f", mma.sp {var.operand_dtype}" if var.mma == "sp" else ""


def build_kernels(args: argparse.Namespace) -> int:
    from .codegen.tvm import cuda
    from .runtime.cubin import export_folder
    from .runtime.progress import progress

    try:
        kinds = ("fwd", "dkdv", "dq") if args.backward else ("fwd",)
        todo, seen = [], set()
        for (spec, var), arch, kind in itertools.product(kernel_variants(args), args.arch, kinds):
            key = cuda.cubin_key(var, arch, kind)  # the sp and scalar dfss variants share their backward
            if key not in seen:
                seen.add(key)
                todo.append((spec, var, arch, kind, key))
    except ValueError as e:
        print(f"build-kernels: {e}", file=sys.stderr)
        return 2
    if args.list:
        for spec, var, arch, kind, key in todo:
            print(f"{arch}  {key}  {spec.describe()}, D={var.head_dim}{_kind(var, kind)}")
        return 0
    keys = []
    with progress(len(todo), "build CUDA kernels") as p:
        for spec, var, arch, kind, key in todo:
            try:
                cubin, meta = cuda.get_cubin(var, arch, kind=kind)
            except Exception as e:  # name the kernel that failed, then stop
                print(f"build-kernels: {arch} {spec.describe()} D={var.head_dim}{_kind(var, kind)}: {e}",
                      file=sys.stderr)
                return 1
            keys.append(key)
            print(f"{arch}  {key}  {len(cubin)} bytes  {spec.describe()}, D={var.head_dim}{_kind(var, kind)}")
            p.update()
    if args.out:
        n = export_folder(args.out, keys)
        print(f"{n} kernels copied to {args.out}")
    return 0


COMMANDS["build-kernels"] = ("build the TVM backend's CUDA kernels (cubin) ahead of time", _add_build_kernels,
                             build_kernels)


# ---------------------------------------------------------------------------------------------- report

_CAPTURES = ("dynamo", "export", "fx")


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a transformers model type (gpt2, llama, bert, t5, vit...: a tiny random-weight "
                                 "model built from its default config), or pkg.module:Name / path/to/file.py:Name "
                                 "naming an nn.Module class or a factory (see below)")
    p.add_argument("--policy", default="dense", help="attncomp policy (dense, dfss, hash, drop, spion, et)")
    p.add_argument("--capture", default="dynamo", choices=_CAPTURES, help="how the model is captured")
    p.add_argument("--backend", default="auto", help="attncomp backend (auto, reference, triton, sdpa, tvm)")
    p.add_argument("--seq", type=int, default=16, help="sequence length of a family's example inputs (default 16)")
    p.add_argument("--batch", type=int, default=2, help="batch of a family's example inputs (default 2)")
    p.add_argument("--registry", default=None, choices=("causal-lm", "masked-lm", "seq2seq", "image"),
                   help="which model class of the family (default: seq2seq, masked-lm, causal-lm, image, the first "
                        "that registers it)")
    p.epilog = ("A user module: Name is an nn.Module class (built with no arguments) or a function returning a "
                "module or (module, example_inputs); example inputs are a tuple of arguments or a dict of keyword "
                "arguments, else taken from the module's example_inputs() method or the file's example_inputs() "
                "function (called with the module if it takes an argument).")


class _UsageError(Exception):
    """A bad command line argument: printed as one line, exit code 2."""


def _call_maybe(fn, arg):
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 0
    return fn(arg) if n else fn()


def _load_user(target: str):
    """``(model, example_inputs)`` of ``pkg.module:Name`` or ``path/to/file.py:Name``."""
    import torch

    mod_name, _, attr = target.rpartition(":")
    if not mod_name or not attr:
        raise _UsageError(f"{target!r}: expected pkg.module:Name or path/to/file.py:Name")
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = Path(mod_name)
        if not path.is_file():
            raise _UsageError(f"{target!r}: no file {mod_name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise _UsageError(f"{target!r}: importing {mod_name} failed: {type(e).__name__}: {e}") from None
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise _UsageError(f"{target!r}: cannot import module {mod_name!r}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise _UsageError(f"{target!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(obj):  # an nn.Module class or a factory: either is called with no arguments
        raise _UsageError(f"{target!r}: {attr!r} is neither an nn.Module class nor a function")
    made = obj()
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        made, inputs = made
    if not isinstance(made, torch.nn.Module):
        raise _UsageError(f"{target!r}: {attr} returned {type(made).__name__}, not an nn.Module")
    if inputs is None:
        src = getattr(made, "example_inputs", None) or getattr(module, "example_inputs", None)
        if src is None:
            raise _UsageError(f"{target!r}: no example inputs: return (module, example_inputs) from a factory, or "
                              f"give the module an example_inputs() method")
        inputs = _call_maybe(src, made) if callable(src) else src
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list, dict)):
        raise _UsageError(f"{target!r}: example inputs must be a tuple or a dict, got {type(inputs).__name__}")
    return made.eval(), tuple(inputs) if isinstance(inputs, list) else inputs


def _load_family(model_type: str, registry: Optional[str], batch: int, seq: int):
    """``(model, example_inputs)``: the tiny random-weight model of a transformers family."""
    from . import zoo

    try:
        import transformers  # noqa: F401 (only whether it is there)
    except ImportError:
        raise _UsageError("report of a transformers family needs transformers installed (pip install transformers)") \
            from None
    try:
        if registry:
            cls = zoo.registry(registry).get(model_type)
            if cls is None:
                raise KeyError(model_type)
            reg, cls = registry, cls if isinstance(cls, str) else cls[0]
        else:
            reg, cls = zoo.find(model_type)
    except KeyError:
        import difflib

        known = sorted({m for r in zoo.REGISTRIES for m in zoo.registry(r)})
        close = difflib.get_close_matches(model_type, known, n=3)
        where = f"the {registry} registry" if registry else "transformers' causal-LM, masked-LM, seq2seq or " \
                                                           "image-classification registries"
        raise _UsageError(f"unknown model family {model_type!r}: not in {where}"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + " (or give a module path, pkg.module:Class)") from None
    model, cfg = zoo.build(reg, model_type, cls)
    inputs, _ = zoo.make_inputs(reg, model, cfg, batch, seq, "right")
    return model, inputs


def _is_path(target: str) -> bool:
    return ":" in target or target.endswith(".py")


def report(args: argparse.Namespace) -> int:
    import attncomp

    try:
        attncomp.get_policy(args.policy)  # a bad name fails before any model is built
        if _is_path(args.model):
            model, inputs = _load_user(args.model)
        else:
            model, inputs = _load_family(args.model, args.registry, args.batch, args.seq)
    except (_UsageError, ValueError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    try:
        fast = attncomp.compile(model, policy=args.policy, backend=args.backend, capture=args.capture,
                                example_inputs=inputs)
    except ValueError as e:  # bad options: named by compile
        print(f"report: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"report: compiling {args.model} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    import torch

    with torch.no_grad():
        fast(**inputs) if isinstance(inputs, dict) else fast(*inputs)
    print(attncomp.report(fast))
    return 0


COMMANDS["report"] = ("compile a model (a transformers family or your own module) and print its report",
                      _add_report, report)


# ---------------------------------------------------------------------------------------------- bench

#: the benchmarks behind ``bench``: name -> what it measures (``benchmarks/<name>.py``, ``main(argv) -> int``)
BENCHMARKS = {
    "kernels": "attention kernels against SDPA, FlexAttention and the unfused chain (--backend tvm: TVM's kernels)",
    "models": "compiled Hugging Face models end to end against eager and torch.compile",
    "generate": "generate(): tokens/s, first-call time and per-step logits against eager and the static cache",
    "decode": "one decoding step's attention against a long KV cache, per policy, as a fraction of HBM bandwidth",
    "distributed": "DDP/FSDP2 training steps and context-parallel attention over several processes",
    "quality": "validation loss against wall-clock time per policy for the same model and budget",
    "tables": "print the markdown tables of benchmarks/README.md from the results files",
}


def benchmarks_dir() -> Path:
    """The repository's ``benchmarks/`` folder, next to the package (absent in an installed wheel)."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(BENCHMARKS), metavar="name",
                   help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="passed to the benchmark (python -m attncomp bench NAME --help lists them)")
    p.epilog = ("Results go to benchmarks/results/<name>_<device>.json (device: h100, h200, cpu). "
                "See benchmarks/README.md.")


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py`` of the repository; ``_UsageError`` saying why when it is not there."""
    folder = benchmarks_dir()
    if not folder.is_dir():
        raise _UsageError(f"no benchmarks folder at {folder}: the benchmarks ship with the source repository, "
                          "not with an installed package; run this from a clone (pip install -e .)")
    path = folder / f"{name}.py"
    if not path.is_file():
        raise _UsageError(f"benchmark {name!r} is not in this checkout (no {path})")
    root = str(folder.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(f"benchmarks.{name}")
    if Path(module.__file__).resolve() != path.resolve():
        raise _UsageError(f"benchmarks.{name} resolved to {module.__file__}, not {path}")
    if not callable(getattr(module, "main", None)):
        raise _UsageError(f"{path} has no main(argv)")
    return module


def bench(args: argparse.Namespace) -> int:
    try:
        module = load_benchmark(args.name)
    except _UsageError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    rest = list(args.args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    try:
        rc = module.main(rest)
    except SystemExit as e:  # argparse's --help and errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0 if rc is None else int(rc)


COMMANDS["bench"] = ("run a benchmark of the repository's benchmarks/ folder", _add_bench, bench)


# ---------------------------------------------------------------------------------------------- zoo

def _add_zoo(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="passed to the sweep (--families a,b --registry causal-lm --jobs N --timeout S ...; "
                        "python -m attncomp zoo --help-sweep lists them)")
    p.epilog = "Writes tests/zoo/results.json and tests/zoo/RESULTS.md of the repository."


def zoo(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests" / "zoo" / "__main__.py").is_file():
        print(f"zoo: the registry sweep lives in the source repository's tests/zoo, not found under {root}",
              file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    rest = list(args.args)
    rest = ["--help" if a == "--help-sweep" else a for a in rest if a != "--"]
    sweep = importlib.import_module("tests.zoo.__main__")
    try:
        rc = sweep.main(rest)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0 if rc is None else int(rc)


COMMANDS["zoo"] = ("the registry sweep: every transformers family, compiled and compared with eager", _add_zoo, zoo)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncomp", description="attncomp command line: "
                                     + ", ".join(COMMANDS) + " (python -m attncomp COMMAND --help for each)")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (help_, add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_))
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "zoo":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:  # the sweep's own options, passed through
        args.args = unknown + list(args.args)
    if args.command is None:
        parser.print_help()
        return 2
    return COMMANDS[args.command][2](args)
