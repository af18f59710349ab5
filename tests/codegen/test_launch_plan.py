"""Forward launch plans (``attncomp.codegen.triton.backend._ForwardPlan``): a repeated forward whose
kernel needs nothing built per call launches the kept compiled kernel with the plan's argument list,
the call's tensors and seed put in their places, without building a ``Site`` again.

On the CPU the "compiled" kernel is a stand-in that runs the real template under Triton's interpreter
with exactly the arguments the launch passes (positional ones, then the kept constexprs), so a wrong
or stale argument in a plan shows as a wrong result: every call has fresh random inputs, poisoned
outputs, and is compared with the float64 reference. ``test_template_gpu.py`` runs the real launches.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gc  # noqa: E402
import weakref  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from attncomp import ops  # noqa: E402
from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import configs, launch, template  # noqa: E402
from attncomp.policy import DFSS  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402
from tests.utils import assert_close, case_inputs, draw_mask, fresh_seed, poisoned_empty, qkv  # noqa: E402

_INTERP = template._attention_kernel
_NAMES = [p.name for p in JITFunction(_INTERP.fn).params]


_POINTERS = frozenset(_NAMES[:_NAMES.index("sqb")]) | frozenset(_NAMES[_NAMES.index("QPerm"):_NAMES.index("s_qpos")])
_ADDRESSES: dict = {}  # address -> tensor, of the tensors a plan launch passes as addresses


def _address(t: torch.Tensor) -> int:
    _ADDRESSES[t.data_ptr()] = t
    return t.data_ptr()


class _Compiled:
    """Runs the interpreted template with the arguments a launch hands a compiled kernel, read as
    Triton's launcher reads them: a pointer given as an address is the tensor there, and a null
    pointer (``None``) a NaN-filled buffer, so that a kernel reading it shows NaN."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launches = 0

    def run(self, g0, g1, g2, stream, function, meta, launch_meta, enter, exit_, *args):
        assert (stream, function, meta, launch_meta, enter, exit_) == (0, "fn", "meta", None, None, None)
        self.launches += 1
        kw = dict(zip(_NAMES, args, strict=True))
        null = torch.full((1 << 16,), float("nan"))
        for name in _POINTERS:
            if kw[name] is None:
                kw[name] = null
            elif type(kw[name]) is int:
                kw[name] = _ADDRESSES[kw[name]]
        _INTERP[(g0, g1, g2)](**kw)


@pytest.fixture
def kernel(monkeypatch):
    """The backend's kernel as a FastLaunch over a JITFunction whose first call per argument class
    runs the interpreter and hands out a :class:`_Compiled`."""
    jit = JITFunction(_INTERP.fn)
    slow = []

    def run(*args, grid, warmup, **kwargs):
        slow.append(1)
        _INTERP[grid](*args, **{k: v for k, v in kwargs.items() if k in _NAMES})
        return _Compiled()

    monkeypatch.setattr(jit, "run", run)
    fl = launch.FastLaunch(jit, volatile=("seed",))
    monkeypatch.setattr(fl, "_device", lambda: 0)
    monkeypatch.setattr(fl, "_stream", lambda dev: 0)
    monkeypatch.setattr(TB, "_attention_kernel", fl)
    monkeypatch.setattr(TB, "_PLANS", {})
    monkeypatch.setattr(TB, "_SEEN", {})
    monkeypatch.setattr(ops, "_CALLS", {})
    monkeypatch.setattr(TB, "_ptr", _address)
    monkeypatch.setattr(TB, "_config_memo", {})
    monkeypatch.setattr(TB, "_empty", poisoned_empty)
    fl.slow = slow
    fl.plan_runs = 0
    real = TB._ForwardPlan.run

    def counted(self, *a):
        fl.plan_runs += 1
        return real(self, *a)

    monkeypatch.setattr(TB._ForwardPlan, "run", counted)
    return fl


def _reference(spec, q, k, v, mask, preds, dropout_p, seed):
    d = torch.float64
    return R.attention(q.to(d), k.to(d), v.to(d), mask, spec=spec, dropout_p=dropout_p, seed=seed, preds=preds)


def _seed_of_one_class(g) -> int:
    """A random seed whose kernel seed word Triton specialises like most (not 1, not a multiple of 16):
    the seed is part of a launch's argument class only through that."""
    while True:
        seed = int(torch.randint(0, 2 ** 31, (1,), generator=g))
        w = TB._seed_word(seed)
        if w != 1 and w & 15:
            return seed


CASES = {  # spec kwargs, (B, Hq, Hk, Nq, Nk, D), mask kind, padding, dropout
    "dense-causal": (dict(causal=True), (2, 2, 2, 37, 37, 32), None, False, 0.0),
    "dense-gqa-cross": (dict(), (1, 4, 2, 21, 45, 48), None, False, 0.0),
    "dfss-bool-mask": (dict(policy=DFSS(n=2, m=4), mask_kind="bool"), (2, 2, 2, 33, 40, 32), "bool", False, 0.0),
    "dense-float-mask": (dict(mask_kind="float"), (1, 2, 2, 30, 30, 64), "float", False, 0.0),
    "dense-padding": (dict(causal=True), (2, 2, 2, 29, 29, 32), None, True, 0.0),
    "dense-dropout": (dict(), (1, 2, 2, 24, 24, 32), None, False, 0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_repeated_forwards_launch_the_plan(kernel, case):
    g = torch.Generator().manual_seed(fresh_seed())
    spec = AttentionSpec(**CASES[case][0])  # one spec object: plans are keyed by its identity
    outs = []
    for call in range(4):
        _, (q, k, v), mask, preds, p = case_inputs(CASES[case], g, call)
        seed = _seed_of_one_class(g)
        out, lse = TB.attention_forward(spec, q, k, v, mask, p, seed, preds=preds)
        ro, rl = _reference(spec, q, k, v, mask, preds, p, seed)
        assert_close(out, ro, torch.float32, f"call {call}")
        fin = torch.isfinite(rl)
        torch.testing.assert_close(lse[fin].double(), rl[fin].double(), atol=1e-3, rtol=1e-3)
        outs.append(out)
    # one launch through run, one short launch (which made the plan: the second of its key), then two
    # plan launches of the kept kernel
    assert len(kernel.slow) == 1 and kernel.plan_runs == 2 and kernel.hits == 3 and len(TB._PLANS) == 1
    assert not torch.equal(outs[2], outs[3])


def test_tma_descriptors_are_rebuilt_per_call(kernel, monkeypatch):
    """A configuration reading K/V through TMA: each plan launch describes the call's own K and V."""
    monkeypatch.setattr(configs, "fwd_candidates",
                        lambda *a: [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "TMA": True}])
    spec = AttentionSpec(causal=True)
    for call in range(4):
        q, k, v = qkv(1, 2, 40, 32)
        out, _ = TB.attention_forward(spec, q, k, v)
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32, f"call {call}")
    assert len(kernel.slow) == 1 and kernel.plan_runs == 2
    (plan,) = TB._PLANS.values()
    assert plan.tma_blocks is not None and {"kd", "vd"} <= {n for _, n in plan.slots}


@pytest.mark.parametrize("change", ["spec", "strides", "alignment", "dtype", "size", "mask", "dropout",
                                    "seed to 16", "short path off", "config given"])
def test_what_the_plan_does_not_cover_takes_the_site_path(kernel, change):
    spec = AttentionSpec(causal=True)
    q, k, v = qkv(1, 2, 32, 32)
    assert TB._seed_word(5) & 15 and TB._seed_word(7) & 15
    for _ in range(2):
        TB.attention_forward(spec, q, k, v, None, 0.0, 5)
    n_plans, runs = len(TB._PLANS), kernel.plan_runs
    assert n_plans == 1
    mask, p, seed, config, sp = None, 0.0, 7, None, spec
    if change == "spec":
        sp = AttentionSpec(causal=True)  # an equal but distinct spec object counts as new
    elif change == "strides":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "alignment":
        buf = torch.randn(q.numel() + 1)
        q = buf[1:].view(q.shape)
    elif change == "dtype":
        q, k, v = (t.half() for t in (q, k, v))
    elif change == "size":
        q, k, v = qkv(1, 2, 33, 32)
    elif change == "mask":
        mask = torch.ones(32, 32, dtype=torch.bool)
    elif change == "dropout":
        p = 0.2
    elif change == "seed to 16":
        seed = next(s for s in range(1000) if TB._seed_word(s) & 15 == 0)  # another class of seed word
    elif change == "config given":
        config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if change == "short path off":
        launch.enabled(False)
    try:
        for _ in range(2):
            out, _ = TB.attention_forward(sp, q, k, v, mask, p, seed, config=config)
            assert kernel.plan_runs == runs, "a call the plan does not cover launched a plan"
            assert_close(out, _reference(sp, q.float(), k.float(), v.float(), mask, None, p, seed)[0], q.dtype)
    finally:
        launch.enabled(True)
    if change not in ("short path off", "config given"):
        assert len(TB._PLANS) == n_plans + 1  # and makes its own plan, the second time


def test_plans_hold_no_tensor(kernel):
    spec = AttentionSpec(policy=DFSS(n=1, m=2), mask_kind="bool")
    q, k, v = qkv(1, 2, 24, 32)
    mask = torch.rand(1, 1, 24, 24) > 0.5
    kv = torch.ones(1, 24, dtype=torch.bool)
    refs = [weakref.ref(t) for t in (q, k, v, mask, kv)]
    for _ in range(2):
        out, lse = TB.attention_forward(spec, q, k, v, mask, preds=Predicates(k_valid=kv))
    refs += [weakref.ref(out), weakref.ref(lse)]
    assert len(TB._PLANS) == 1
    del q, k, v, mask, kv, out, lse
    gc.collect()
    assert all(r() is None for r in refs), "a plan keeps a call's tensor alive"


def test_the_op_takes_the_plan(kernel):
    """Calls through ``attncomp::attention`` (as compiled graphs make them) reach the plan."""
    spec = AttentionSpec(causal=True, backend="triton")
    sj = spec.to_json()
    for call in range(4):
        q, k, v = qkv(2, 2, 20, 32)
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                           sj, 0.0, 0)[0]
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32)
    assert len(kernel.slow) == 1 and kernel.plan_runs == 2


def test_calls_that_never_repeat_build_no_plan(kernel):
    """Calls that grow by one key each (a loop of speculative steps longer than the decode kernels take) each
    see their key once: no plan is built."""
    spec = AttentionSpec(causal=True)
    for n in range(20, 24):
        q, k, v = qkv(1, 2, 17, 32, Nk=n)
        out, _ = TB.attention_forward(spec, q, k, v)
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32)
    assert len(TB._PLANS) == 0 and len(TB._SEEN) == 4 and kernel.plan_runs == 0


def _op(spec_json, q, k, v, mask=None, kv=None, seed=0):
    return torch.ops.attncomp.attention(q, k, v, mask, None, None, None, None, None, None, None, None, kv,
                                        spec_json, 0.0, seed)[0]


@pytest.fixture
def selections(monkeypatch):
    """Counts the op's backend selections (the full path; a call the op's kept plan serves makes none)."""
    n = []
    real = ops._backend_for
    monkeypatch.setattr(ops, "_backend_for", lambda *a, **kw: n.append(1) or real(*a, **kw))
    return n


def test_the_op_keeps_the_plan_its_calls_take(kernel, selections):
    """From the third call of one signature the op goes to the plan without selecting a backend; every
    call has fresh inputs (bool mask, padding) and matches the reference."""
    spec = AttentionSpec(mask_kind="bool", backend="triton")
    sj = spec.to_json()
    g = torch.Generator().manual_seed(fresh_seed())
    for call in range(5):
        q, k, v = qkv(2, 2, 23, 32, seed=int(torch.randint(0, 2 ** 30, (1,), generator=g)))
        mask = draw_mask("bool", g, 2, 23, 23)
        kv = torch.ones(2, 23, dtype=torch.bool)
        kv[0, 20 - call:] = False
        out = _op(sj, q, k, v, mask, kv)
        want = _reference(spec, q, k, v, mask, Predicates(k_valid=kv), 0.0, 0)[0]
        assert_close(out, want, torch.float32, f"call {call}")
    # call 1 seen, call 2 builds the plan (the op keeps it), calls 3-5 through the op's plan
    assert len(selections) == 2 and kernel.plan_runs == 3 and len(ops._CALLS) == 1


@pytest.mark.parametrize("change", ["tuning flag", "seed class", "short path off", "provisional choice",
                                    "copied inputs"])
def test_the_op_takes_the_full_path_where_its_plan_does_not_hold(kernel, selections, monkeypatch, change):
    spec = AttentionSpec(causal=True, backend="triton")
    sj = spec.to_json()
    assert TB._seed_word(5) & 15
    if change == "provisional choice":  # every selection provisional: the op keeps nothing
        real = ops._backend_for

        def provisional(*a, **kw):
            from attncomp.runtime import dispatch

            dispatch._provisional[0] += 1
            return real(*a, **kw)

        monkeypatch.setattr(ops, "_backend_for", provisional)
    if change == "copied inputs":  # q with a last stride of 2: the backend copies it, the op keeps nothing
        def inputs():
            q, k, v = qkv(1, 2, 30, 32)
            return torch.stack([q, q], -1)[..., 0], k, v
    else:
        def inputs():
            return qkv(1, 2, 30, 32)

    for _ in range(2):
        out = _op(sj, *inputs(), seed=5)
    if change in ("provisional choice", "copied inputs"):
        for _ in range(2):
            q, k, v = inputs()
            assert_close(_op(sj, q, k, v, seed=5), _reference(spec, q, k, v, None, None, 0.0, 5)[0], torch.float32)
        assert not ops._CALLS
        return
    assert len(ops._CALLS) == 1 and len(selections) == 2
    seed = 5
    if change == "tuning flag":  # (measuring allowed from now on: the tuned configuration may differ)
        monkeypatch.setenv("ATTNCOMP_AUTOTUNE", "1")
    elif change == "seed class":
        seed = next(s for s in range(1000) if TB._seed_word(s) & 15 == 0)
    elif change == "short path off":
        launch.enabled(False)
    try:
        q, k, v = inputs()
        out = _op(sj, q, k, v, seed=seed)
    finally:
        launch.enabled(True)
    assert len(selections) == 3, "the op's plan served a call it does not hold for"
    assert_close(out, _reference(spec, q, k, v, None, None, 0.0, seed)[0], torch.float32)


def test_the_op_keeps_one_plan_per_seed_class(kernel, selections):
    """Dropout with a fresh seed per call (training): seeds whose kernel words specialise differently
    each keep their own plan at the op, so alternating them takes the full path no more."""
    spec = AttentionSpec(backend="triton")
    sj = spec.to_json()
    a = [s for s in range(200) if TB._seed_word(s) & 15 and TB._seed_word(s) != 1][:4]
    b = [s for s in range(2000) if TB._seed_word(s) & 15 == 0][:4]
    for seed in (a[0], a[1], b[0], b[1]):  # each class: seen, then planned
        torch.ops.attncomp.attention(*qkv(1, 2, 19, 32), None, None, None, None, None, None, None, None, None, None,
                                     sj, 0.25, seed)
    n = len(selections)
    for seed in (a[2], b[2], a[3], b[3]):
        q, k, v = qkv(1, 2, 19, 32)
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                           sj, 0.25, seed)[0]
        assert_close(out, _reference(spec, q, k, v, None, None, 0.25, seed)[0], torch.float32, f"seed {seed}")
    assert len(selections) == n and len(ops._CALLS) == 2
