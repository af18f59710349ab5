"""The template's kernels compiled for Hopper (sm_90a) on any machine, a GPU or not: registers, spills,
shared memory and the blocks per SM they allow, per candidate launch configuration.

Triton compiles for a target it is told of; this script tells it an sm_90 GPU (a stand-in driver that
only answers target queries), runs the Triton backend's real forward and backward host code on CPU
tensors with every launch turned into a compile, and reads the compiled kernels: ``ptxas -v`` (the
one Triton ships) for registers and spill stores, Triton's metadata for shared memory, the PTX for the
warp-group MMA instructions. What a configuration costs in occupancy is known before a GPU times it:

* ``regs`` / ``spill``: registers per thread and bytes of spill stores (a spilling kernel is slow);
* ``smem``: shared memory per block (a Hopper block may take 227 KiB);
* ``sass``: SASS instructions (``cuobjdump -sass``), with the counts of the exponentials (``MUFU``) and of
  the compares, selects, min/max and predicate logic a DFSS selection adds;
* ``blocks/SM``: how many blocks of it one SM holds, by registers (64K per SM), shared memory
  (228 KiB per SM, 1 KiB reserved per block) and warps (64 per SM): with one warp group per block,
  two resident blocks let one block's softmax run while the other's matrix products do.

    python tests/codegen/sm90_check.py                          # dense forward candidates, D 64/128, causal and not
    python tests/codegen/sm90_check.py --policies dense,dfss --dims 64,128,256 --passes fwd,bwd
    python tests/codegen/sm90_check.py --json out.json
    python tests/codegen/sm90_check.py --gluon --first 1        # the defaults and the Gluon forward's and dK/dV pass's
    python tests/codegen/sm90_check.py --gluon --gluon-only --no-sass   # the Gluon kernels alone, without SASS counts (faster)

Nothing here needs CUDA; ``tests/codegen/test_sm90_compile.py`` runs it on the default configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.kernels import config_name, make_spec  # noqa: E402

SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
REGS_PER_SM = 64 * 1024
WARPS_PER_SM = 64


class _Sm90Driver:
    """Answers the target queries of Triton's JIT as an sm_90 GPU would; launches nothing."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


@contextlib.contextmanager
def sm90_compiles(options: Optional[Dict] = None):
    """Within: Triton compiles for sm_90 and every launch of a ``@triton.jit`` kernel only compiles
    (the compiled kernels are appended to the yielded list), with the compile ``options`` added (e.g.
    ``maxnreg``); the backend's short launch path is off. Not under ``TRITON_INTERPRET=1``."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import launch

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("sm90_compiles() compiles real kernels: unset TRITON_INTERPRET")
    got: List = []
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kw):
        got.append(real_run(self, *args, grid=grid, warmup=True, **{**kw, **(options or {})}))
        return got[-1]

    was_fast = launch.enabled()
    real_tma = TB._has_tma
    was_active = driver._active  # (None until a driver was asked for: reset_active() would fail without a GPU)
    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    launch.enabled(False)
    TB._has_tma = lambda device: True
    try:
        yield got
    finally:
        JITFunction.run = real_run
        launch.enabled(was_fast)
        TB._has_tma = real_tma
        driver._active = was_active


def _ptxas() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else "ptxas"


def kernel_stats(kernel, num_warps: int, sass: bool = True) -> Dict:
    """Registers, spill bytes, shared memory, warp-group MMAs and blocks per SM of a compiled kernel, and with
    ``sass`` its SASS instruction counts (``cuobjdump``: most of this function's time)."""
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed: {res.stderr.strip()[:300]}")
        ops = _sass_ops(os.path.join(d, "k.cubin")) if sass else {}
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    smem = int(kernel.metadata.shared)
    threads = 32 * num_warps
    by_regs = REGS_PER_SM // (((regs + 7) // 8 * 8) * threads)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem <= SMEM_PER_BLOCK else 0
    return dict(regs=regs, spill=int(spill.group(1)) if spill else 0, smem=smem, fits=smem <= SMEM_PER_BLOCK,
                blocks_per_sm=min(by_regs, by_smem, WARPS_PER_SM // num_warps),
                wgmma=ptx.count("wgmma.mma_async"), sass=sum(ops.values()) if sass else None,
                sass_ops={op: ops[op] for op in _SASS_SHOWN if op in ops})


#: the SASS opcodes a row names next to its instruction count (the exponentials and the selection's compares,
#: selects, min/max and predicate logic)
_SASS_SHOWN = ("MUFU", "FSETP", "FSEL", "FMNMX", "PLOP3", "SEL")


def _sass_ops(cubin: str) -> Dict[str, int]:
    """Instructions per opcode (``FSETP.GE.AND`` counts as ``FSETP``) in a cubin's SASS (``cuobjdump -sass``, the
    one Triton ships); empty where it cannot be read."""
    tool = os.path.join(os.path.dirname(_ptxas()), "cuobjdump")
    res = subprocess.run([tool if os.path.exists(tool) else "cuobjdump", "-sass", cubin], capture_output=True,
                         text=True)
    ops: Dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)", res.stdout):
        op = m.group(1).split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return ops


def compile_config(policy: str, causal: bool, D: int, passes: str, cfg: Dict, N: int = 1024,
                   options: Optional[Dict] = None, sass: bool = True) -> List[Dict]:
    """Compile the kernels of one call (``passes``: ``fwd`` or ``bwd``) under ``cfg`` (and the compile
    ``options`` of :func:`sm90_compiles`) for sm_90; one stats row per attention kernel launched (the
    backward's dK/dV and dQ launches, or the one atomic launch), with SASS counts where ``sass``."""
    import torch

    from attncomp.codegen.triton import backend as TB

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, D, dtype=torch.bfloat16) for _ in range(3))
    spec = make_spec(policy, causal, torch.bfloat16)
    with sm90_compiles(options) as got:
        if cfg.get("KERNEL") == "gluon" and passes == "bwd":  # the backward's Gluon kernels
            from attncomp.codegen.triton import hopper_bwd

            z = torch.zeros(1, 2, N)
            nm24 = policy == "dfss"  # (DFSS: the warp-specialised kernel only)
            dq32 = torch.zeros(q.shape) if cfg.get("DQ_ATOMIC") else None  # (the pass that adds dQ too)
            if not nm24:
                hopper_bwd.dkdv(q, k, v, torch.randn_like(q), z, z, torch.empty_like(k), torch.empty_like(v),
                                D ** -0.5, causal, 0, cfg, dq32)
            if cfg.get("DQ_GLUON") and dq32 is None and not nm24:  # (its dQ pass in Gluon too)
                hopper_bwd.dq_pass(q, k, v, torch.randn_like(q), z, z, torch.empty_like(q), D ** -0.5, causal, 0,
                                   cfg["DQ_GLUON"])
            if cfg.get("WS"):  # (the warp-specialised one-launch kernel; the passes above where it cannot run)
                hopper_bwd.backward_ws(q, k, v, torch.randn_like(q), z, z, torch.empty_like(k), torch.empty_like(v),
                                       torch.zeros(q.shape), D ** -0.5, causal, 0, cfg["WS"], nm24)
        elif cfg.get("KERNEL") == "gluon":  # the Gluon Hopper forward (dense, DFSS 2:4), as the backend calls it
            from attncomp.codegen.triton import hopper

            hopper.forward(q, k, v, D ** -0.5, causal, 0, torch.empty_like(q), torch.empty(1, 2, N), cfg,
                           policy == "dfss")
        elif passes == "fwd":
            TB.attention_forward(spec, q, k, v, config=cfg)
        else:
            out, lse = torch.randn_like(q), torch.randn(1, 2, N)
            TB.attention_backward(spec, q, k, v, None, out, lse, torch.randn_like(q), config=cfg)
    rows = []
    for kern in got:
        name = kern.name if hasattr(kern, "name") else kern.metadata.name
        if not any(x in name for x in ("_attention_kernel", "_attn_fwd", "_bwd_dkdv", "_bwd_dq", "_bwd_ws")):
            continue
        rows.append(dict(kernel=name, **kernel_stats(kern, kern.metadata.num_warps, sass)))
    return rows


def run(args) -> List[Dict]:
    import torch

    from attncomp.codegen.triton import configs

    rows = []
    for policy in args.policies.split(","):
        for D in (int(d) for d in args.dims.split(",")):
            for passes in args.passes.split(","):
                nm = 4 if policy == "dfss" else 1
                cands = (configs.fwd_candidates if passes == "fwd" else configs.bwd_candidates)(
                    D, D, torch.bfloat16, nm, gpu=args.gpu)
                cands = cands[:args.first] if args.first > 0 else cands
                cands = [] if args.gluon_only else cands
                for causal in (False, True):
                    gluon = None
                    if args.gluon and passes == "fwd" and policy in ("dense", "dfss"):
                        gluon = configs.gluon_config(D, causal, policy == "dfss")
                    elif args.gluon and policy in ("dense", "dfss"):  # (the backward's Gluon kernels)
                        gluon = (configs.GLUON_BWD_DFSS if policy == "dfss" else configs.GLUON_BWD).get((D, causal))
                    for cfg in cands + ([dict(gluon, KERNEL="gluon")] if gluon else []):
                        try:
                            got = compile_config(policy, causal, D, passes, cfg, sass=args.sass)
                        except Exception as e:  # a configuration that does not compile is a row with its error
                            got = [dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")]
                        for i, r in enumerate(got):
                            row = dict(policy=policy, D=D, passes=passes, causal=causal, config=config_name(cfg),
                                       launch=i, **r)
                            rows.append(row)
                            print(_fmt(row), flush=True)
    return rows


def _fmt(r: Dict) -> str:
    head = f"{r['policy']:5s} {r['passes']:3s} D{r['D']:<3d} {'causal' if r['causal'] else 'full  '} {r['config']:34s}"
    if "error" in r:
        return f"{head} failed: {r['error']}"
    return (f"{head} #{r['launch']} regs {r['regs']:3d}  spill {r['spill']:5d} B  smem {r['smem'] / 1024:6.1f} KiB"
            f"{'' if r['fits'] else ' (too much)'}  blocks/SM {r['blocks_per_sm']}  wgmma {r['wgmma']}"
            + ("" if r["sass"] is None else f"  sass {r['sass']}")
            + "".join(f" {op} {n}" for op, n in r["sass_ops"].items()))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="dense")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--passes", default="fwd")
    ap.add_argument("--gpu", default="h100", help="whose per-GPU defaults head the candidate lists "
                    "(h100; '' for the lists' own heads, the H200's)")
    ap.add_argument("--first", type=int, default=0, help="only the first N candidates of each list (1: the default)")
    ap.add_argument("--gluon", action="store_true", help="also the Gluon Hopper forward's configurations "
                    "(dense and DFSS 2:4: configs.GLUON_FWD, GLUON_FWD_DFSS) and, with --passes bwd, the Gluon "
                    "backward's (dense: configs.GLUON_BWD; DFSS 2:4, the warp-specialised kernel: "
                    "configs.GLUON_BWD_DFSS)")
    ap.add_argument("--gluon-only", action="store_true", help="with --gluon: the Gluon configurations alone, not "
                    "the template's candidates")
    ap.add_argument("--no-sass", dest="sass", action="store_false", help="leave out the SASS instruction counts "
                    "(cuobjdump takes most of a row's time)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.gluon_only and not args.gluon:
        ap.error("--gluon-only needs --gluon")
    rows = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
