"""The short launch path (:mod:`attncomp.codegen.triton.launch`): after a first call through
``JITFunction.run``, a call whose arguments have the same class launches the kept kernel directly,
with the arguments ``run`` would pass; any difference that Triton specialises on goes through ``run``.

On the CPU the JIT function's ``run`` and the compiled kernel are stand-ins that record what they get;
``tests/codegen/test_template_gpu.py::test_short_launches_equal_jit_launches`` runs the real kernels.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from attncomp.codegen.triton import launch as L  # noqa: E402


def _kernel(X, Y, n, stride, seed, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False):  # noqa: F821
    pass


class _Compiled:
    def __init__(self, tag):
        self.tag, self.function, self.packed_metadata, self.launches = tag, f"fn{tag}", f"meta{tag}", []

    def run(self, *a):
        self.launches.append(a)


class _Harness:
    """A real ``JITFunction`` whose ``run`` compiles nothing: it counts calls and hands out stand-ins."""

    def __init__(self, monkeypatch, volatile=("seed",)):
        self.jit = JITFunction(_kernel)
        self.slow = []

        def run(*args, grid, warmup, **kwargs):
            k = _Compiled(len(self.slow))
            self.slow.append((grid, args, kwargs))
            return k

        monkeypatch.setattr(self.jit, "run", run)
        self.fast = L.FastLaunch(self.jit, volatile)
        monkeypatch.setattr(self.fast, "_device", lambda: 0)
        monkeypatch.setattr(self.fast, "_stream", lambda dev: 1234)

    def __call__(self, *args, grid=(3, 2), **kw):
        kw.setdefault("BLOCK", 64)
        kw.setdefault("num_warps", 4)
        return self.fast[grid](*args, **kw)


def _args(x=None, n=100, stride=64, seed=5, scale=0.5):
    x = torch.zeros(64, dtype=torch.float16) if x is None else x
    return (x, torch.zeros(8, dtype=torch.int32), n, stride, seed, scale)


def test_second_call_of_a_class_launches_the_kept_kernel_with_runs_arguments(monkeypatch):
    h = _Harness(monkeypatch)
    k0 = h(*_args())
    assert len(h.slow) == 1 and h.fast.hits == 0
    a = _args(seed=7, x=torch.ones(64, dtype=torch.float16))  # a new tensor and seed, same classes
    k1 = h(*a)
    assert k1 is k0 and len(h.slow) == 1 and h.fast.hits == 1
    (launched,) = k0.launches
    # grid, stream, function, metadata, no launch metadata or hooks, the runtime arguments, then every
    # constexpr and default in parameter order (BLOCK given, FLAG's default)
    assert launched[:9] == (3, 2, 1, 1234, "fn0", "meta0", None, None, None)
    assert launched[9:15] == a and launched[15:] == (64, False)


@pytest.mark.parametrize("change", ["int value", "alignment", "dtype", "constexpr", "option", "seed to 16",
                                    "seed to 1", "bool for int", "float value"])
def test_what_triton_specialises_on_takes_the_jit_path(monkeypatch, change):
    h = _Harness(monkeypatch)
    h(*_args())
    kw = {}
    buf = torch.zeros(65, dtype=torch.float16)
    a = {"int value": _args(n=101), "alignment": _args(x=buf[1:]), "dtype": _args(x=torch.zeros(64)),
         "seed to 16": _args(seed=16), "seed to 1": _args(seed=1), "bool for int": _args(stride=True),
         "float value": _args(scale=0.25)}.get(change)
    if change == "constexpr":
        a, kw = _args(), {"BLOCK": 128}
    if change == "option":
        a, kw = _args(), {"num_warps": 8}
    h(*a, **kw)
    assert len(h.slow) == 2 and h.fast.hits == 0
    h(*a, **kw)  # and that class is kept in turn
    assert len(h.slow) == 2 and h.fast.hits == 1


def test_non_volatile_ints_are_keyed_by_value(monkeypatch):
    h = _Harness(monkeypatch, volatile=())
    h(*_args(seed=5))
    h(*_args(seed=7))
    assert len(h.slow) == 2


@pytest.mark.parametrize("why", ["hook", "disabled", "keyword runtime argument", "unknown argument type"])
def test_calls_that_cannot_be_keyed_always_take_the_jit_path(monkeypatch, why):
    h = _Harness(monkeypatch)
    a, kw = _args(), {}
    if why == "hook":
        monkeypatch.setattr(h.fast._runtime, "launch_enter_hook", lambda *x: None)
    if why == "disabled":
        monkeypatch.setattr(L, "_ENABLED", [False])
    if why == "keyword runtime argument":
        a, kw = a[:-1], {"scale": 0.5}
    if why == "unknown argument type":
        a = a[:-1] + ([0.5],)
    for _ in range(3):
        h(*a, **kw)
    assert len(h.slow) == 3 and h.fast.hits == 0


def test_interpreted_functions_pass_through():
    calls = []

    class _Interp:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    f = L.FastLaunch(_Interp())
    f[(1,)](1, 2, BLOCK=3)
    f[(1,)](1, 2, BLOCK=3)
    assert calls == [((1,), (1, 2), {"BLOCK": 3})] * 2 and f.hits == 0


def test_the_kept_classes_are_bounded(monkeypatch):
    """Sizes are keyed by value (a decode loop grows N by one per step): the cache is cleared when full."""
    monkeypatch.setattr(L, "_MAX_ENTRIES", 3)
    h = _Harness(monkeypatch)
    for n in range(10):
        h(*_args(n=100 + n))
        assert len(h.fast._cache) <= 3
    h(*_args(n=109))
    assert h.fast.hits == 1
