"""Run a function in ``world`` spawned processes joined by a gloo process group (CPU).

Every process gets a free TCP port on 127.0.0.1 (NCCL with one GPU per rank on request), a bounded gloo timeout, and the whole run a
wall-clock limit, so that a hang fails the test instead of blocking CI. A worker returns a
picklable value; :func:`spawn` returns them by rank, or raises with the failing rank's traceback.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank: int, world: int, port: int, target: str, kwargs: dict, outdir: str, pg_timeout: float,
           backend: str) -> None:
    os.environ.update(_NO_MULTICAST)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout), **extra)
    try:
        mod, fn = target.rsplit(":", 1)
        result = getattr(importlib.import_module(mod), fn)(rank, world, **kwargs)
        payload = ("ok", result)
    except BaseException:  # the parent reports it with the rank
        payload = ("error", traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    try:
        if payload[0] == "ok":
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(target: str, world: int = 2, timeout: float = 240.0, pg_timeout: float = 90.0, backend: str = "gloo",
          **kwargs):
    """Run ``module:function(rank, world, **kwargs)`` in ``world`` processes; return results by rank.
    ``backend="nccl"``: one GPU per rank (rank r on ``cuda:r``), NVLink multicast off."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), target, kwargs, outdir, pg_timeout, backend),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target}: {world} processes did not finish within {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"{target}: rank {r} wrote no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"{target}: rank {r} failed:\n{value}")
            results.append(value)
        return results


def spawn_once(tmp_path_factory, key: str, target: str, **kwargs):
    """:func:`spawn` once per test session, even when pytest-xdist runs the tests that need it in
    several workers (each would otherwise spawn its own processes): the first worker runs it under a
    file lock in the session's shared temporary directory, the others read its results."""
    import fcntl

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return spawn(target, **kwargs)
    root = tmp_path_factory.getbasetemp().parent
    path, lock = root / f"{key}.pkl", root / f"{key}.lock"
    with open(lock, "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            if not path.exists():
                try:
                    payload = ("ok", spawn(target, **kwargs))
                except Exception as e:  # every worker reports the same failure
                    payload = ("error", f"{type(e).__name__}: {e}")
                with open(path, "wb") as f:
                    pickle.dump(payload, f)
            with open(path, "rb") as f:
                status, value = pickle.load(f)
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)
    if status != "ok":
        raise RuntimeError(value)
    return value
