"""The ``python -m attncomp`` command line.

Subcommands register themselves in :data:`COMMANDS` (name -> ``(help, add_arguments, run)``), so new
ones are one function pair each. Present:

* ``build-kernels``: build the TVM backend's CUDA kernels (cubin + launch metadata) ahead of time for
  GPU archs, on any machine with apache-tvm and nvcc, into the kernel cache and optionally a folder a
  GPU machine imports (:func:`attncomp.runtime.cubin.import_folder`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["main", "COMMANDS", "build_kernels"]

COMMANDS: Dict[str, Tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}

_POLICIES = ("dense", "dfss", "hash", "drop", "spion")


def _csv(kind):
    def parse(s: str):
        try:
            return [kind(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _add_build_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", type=_csv(str), default=["sm_90"], help="GPU archs, comma separated (sm_90,sm_80)")
    p.add_argument("--policy", type=_csv(str), default=list(_POLICIES),
                   help=f"policies, comma separated (default: all: {','.join(_POLICIES)})")
    p.add_argument("--head-dim", type=_csv(int), default=[64, 128], help="head dims, comma separated")
    p.add_argument("--value-dim", type=int, default=None, help="value head dim (default: the head dim)")
    p.add_argument("--nm", type=str, default=None, help="dfss N:M, e.g. 2:4 (default: 2:4)")
    p.add_argument("--block-size", type=_csv(int), default=[64], help="spion block sizes")
    p.add_argument("--dfss-kernel", type=_csv(str), default=["sp", "scalar"],
                   help="dfss CUDA kernels, comma separated: sp (sparse tensor cores, float16/bfloat16 "
                        "inputs), scalar (every dtype) (default: both)")
    p.add_argument("--operand-dtype", type=_csv(str), default=["float16", "bfloat16"],
                   help="operand dtypes of the sp kernels (default: float16,bfloat16)")
    causal = p.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_const", const=[True], help="causal only")
    causal.add_argument("--no-causal", dest="causal", action="store_const", const=[False], help="non-causal only")
    p.add_argument("--mask", type=_csv(str), default=["none"], help="dense mask kinds: none,bool,float")
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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attncomp", description="attncomp command line")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (help_, add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return COMMANDS[args.command][2](args)
