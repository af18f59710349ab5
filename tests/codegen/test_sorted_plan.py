"""Recorded plans of ``hash``/``drop`` forwards that derive their layout on the device
(``attncomp.codegen.triton.backend._SortedPlan``, ``attncomp.codegen.triton.record``): a repeated call
replays the launches of a recorded one (the counting sort, the tile summaries and lists where the site
has padding, the forward) into one workspace, with the call's tensors and seed put in their places.

On the CPU every kernel involved is a ``FastLaunch`` over a stand-in whose "compiled" kernel runs the
real kernel under Triton's interpreter with exactly the arguments a launch passes; an address (what
replays pass for the call's tensors and the workspace's buffers) is read as the tensor memory there,
with the dtype the kernel was specialised for. So a wrong, stale or shared buffer in a replay shows
as a wrong result: every call has fresh random inputs, the replay's workspace and outputs are
poisoned, and outputs are compared with the float64 reference (and, bit for bit, with the full path).
``test_scfa_gpu.py`` and ``test_template_gpu.py`` run the real launches.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("numpy")
triton = pytest.importorskip("triton")
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from attncomp import ops  # noqa: E402
from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.triton import backend as TB  # noqa: E402
from attncomp.codegen.triton import launch, layout, record, schedule  # noqa: E402
from attncomp.policy import Drop, Hash, _stream_seed  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402
from tests.utils import assert_close, case_inputs, fresh_seed, qkv  # noqa: E402

_KERNELS = [(layout, "_layout_hist", ("q_seed", "k_seed")), (layout, "_layout_scan", ()),
            (layout, "_layout_scatter", ()), (schedule, "_tile_summaries", ()), (schedule, "_tile_lists", ()),
            (TB, "_attention_kernel", ("seed",))]
_BUFFERS: list = []  # tensors whose memory a launch may name by address


def _resolve(p: int, dtype: torch.dtype) -> torch.Tensor:
    """The memory at address ``p`` as a flat tensor of ``dtype`` (to the end of its buffer)."""
    constants = [r() for r in record._CONSTANTS.values() if r() is not None]
    for t in reversed(_BUFFERS + constants):
        s = t.untyped_storage()
        if s.data_ptr() <= p < s.data_ptr() + s.nbytes():
            raw = torch.empty(0, dtype=torch.uint8).set_(s)[p - s.data_ptr():]
            es = torch.empty((), dtype=dtype).element_size()
            return raw[:raw.numel() // es * es].view(dtype)
    raise AssertionError(f"a launch names address {p:#x}, which no live buffer holds")


class _Compiled:
    """Runs the interpreted kernel with the arguments a launch hands a compiled one; ``dtypes``: the
    pointer parameters' dtypes as specialised by the first call."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, interp, names, dtypes):
        self.interp, self.names, self.dtypes = interp, names, dtypes

    def run(self, g0, g1, g2, stream, function, meta, launch_meta, enter, exit_, *args):
        assert (stream, function, meta, launch_meta, enter, exit_) == (0, "fn", "meta", None, None, None)
        kw = dict(zip(self.names, args, strict=True))
        for name, dt in self.dtypes.items():
            a = kw[name]
            if type(a) is int:
                kw[name] = _resolve(a, dt)
            elif isinstance(a, TensorDescriptor) and not isinstance(a.base, torch.Tensor):  # a replay's
                base = _resolve(a.base.data_ptr(), dt).as_strided(a.shape, a.strides)
                kw[name] = TensorDescriptor(base, a.shape, a.strides, a.block_shape, a.padding)
        with _disable_current_modes():  # (the interpreter's own torch ops are not the call's)
            self.interp[(g0, g1, g2)](**kw)


def _stand_in(orig, volatile, monkeypatch):
    interp = orig.fn  # the interpreted kernel
    jit = JITFunction(interp.fn)
    names = [p.name for p in jit.params]

    def run(*args, grid, warmup, **kwargs):
        bound = dict(zip(names, args))
        dtypes = {n: a.dtype for n, a in bound.items() if isinstance(a, torch.Tensor)}
        dtypes.update({n: a.base.dtype for n, a in bound.items() if isinstance(a, TensorDescriptor)})
        with _disable_current_modes():
            interp[grid](*args, **{k: v for k, v in kwargs.items() if k in names})
        return _Compiled(interp, names, dtypes)

    monkeypatch.setattr(jit, "run", run)
    fl = launch.FastLaunch(jit, volatile=volatile)
    monkeypatch.setattr(fl, "_device", lambda: 0)
    monkeypatch.setattr(fl, "_stream", lambda dev: 0)
    return fl


def _poisoned(shape, stride, dtype, device):
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    with _disable_current_modes():
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xA5)
    _BUFFERS.append(t)
    return t


@pytest.fixture
def kernels(monkeypatch):
    """Every kernel of the sorted forward as a stand-in; plans and memos empty; replays counted."""
    for mod, name, vol in _KERNELS:
        monkeypatch.setattr(mod, name, _stand_in(getattr(mod, name), vol, monkeypatch))
    monkeypatch.setattr(TB, "_PLANS", {})
    monkeypatch.setattr(TB, "_SEEN", {})
    monkeypatch.setattr(TB, "_config_memo", {})
    monkeypatch.setattr(TB, "_LAYOUT_CACHE", {})
    monkeypatch.setattr(ops, "_CALLS", {})
    monkeypatch.setattr(record, "_alloc", _poisoned)

    def ptr(t):
        _BUFFERS.append(t)
        return t.data_ptr()

    monkeypatch.setattr(TB, "_ptr", ptr)
    runs = []
    real = TB._SortedPlan.run
    monkeypatch.setattr(TB._SortedPlan, "run", lambda self, *a, **kw: runs.append(1) or real(self, *a, **kw))
    yield runs
    _BUFFERS.clear()


def _reference(spec, q, k, v, mask, preds, dropout_p, seed, aux=None):
    q_aux, k_aux = ops.materialize_aux(spec, q, k, seed=seed) if aux is None else aux  # (drop: the call's seed)
    d = torch.float64
    return R.attention(q.to(d), k.to(d), v.to(d), mask, spec=spec, q_aux=q_aux, k_aux=k_aux, dropout_p=dropout_p,
                       seed=seed, preds=preds)


CASES = {  # spec kwargs, (B, Hq, Hk, Nq, Nk, D), mask kind, padding, dropout
    "hash-causal": (dict(policy=Hash(n_buckets=4), causal=True), (2, 2, 2, 37, 37, 32), None, False, 0.0),
    "hash-gqa-decode": (dict(policy=Hash(n_buckets=6, seed=3), causal=True, causal_align="bottom_right"),
                        (1, 4, 2, 9, 41, 16), None, False, 0.0),
    "hash-full-bool-mask": (dict(policy=Hash(n_buckets=4), mask_kind="bool"), (2, 2, 2, 21, 30, 32), "bool", False,
                            0.0),
    "hash-padding": (dict(policy=Hash(n_buckets=4), causal=True), (2, 2, 1, 29, 29, 16), None, True, 0.0),
    "drop-causal": (dict(policy=Drop(q_rate=0.3, k_rate=0.4), causal=True), (2, 2, 2, 35, 35, 32), None, False, 0.0),
    "drop-dropout": (dict(policy=Drop(q_rate=0.5, k_rate=0.5)), (1, 2, 2, 24, 33, 16), None, False, 0.3),
}


def _inputs(case, g, call):
    return case_inputs(CASES[case], g, call)


@pytest.mark.sample(1)
@pytest.mark.parametrize("case", list(CASES))
def test_repeated_sorted_forwards_replay_the_recording(kernels, case):
    g = torch.Generator().manual_seed(fresh_seed())
    spec = _inputs(case, g, 0)[0]
    outs = []
    # seeds whose words Triton specialises alike (not 1, not a multiple of 16)
    seeds = [s for s in range(1, 100) if TB._seed_word(s) & 15 and TB._seed_word(s) != 1][:4]
    for call in range(4):
        _, (q, k, v), mask, preds, p = _inputs(case, g, call)
        seed = seeds[call]
        out, lse = TB.attention_forward(spec, q, k, v, mask, p, seed, preds=preds)
        ro, rl = _reference(spec, q, k, v, mask, preds, p, seed)
        assert_close(out, ro, torch.float32, f"call {call}")
        fin = torch.isfinite(rl)
        assert torch.equal(fin, torch.isfinite(lse)), f"call {call}: rows with no kept key differ"
        torch.testing.assert_close(lse[fin].double(), rl[fin].double(), atol=1e-3, rtol=1e-3)
        outs.append(out)
    # the first call and the second (which recorded the plan) take the full path; then two replays
    assert len(kernels) == 2 and len(TB._PLANS) == 1
    (plan,) = TB._PLANS.values()
    # the sort's three launches, the lists' two where padding takes them (else the forward's query tiles
    # span their ranges), the forward
    assert type(plan) is TB._SortedPlan and len(plan.replay.launches) == (6 if CASES[case][3] else 4)
    assert not torch.equal(outs[2], outs[3])


def test_replay_matches_the_full_path_bit_for_bit_and_feeds_the_backward(kernels):
    """A replayed forward computes what the full path computes for the same tensors, and the backward
    of the call finds the replay's layout (views of its workspace) instead of deriving it again."""
    spec = AttentionSpec(policy=Hash(n_buckets=4, seed=11), causal=True)
    for _ in range(2):
        TB.attention_forward(spec, *qkv(1, 2, 30, 16))
    q, k, v = qkv(1, 2, 30, 16)
    derived = []
    real = TB.derive_layout
    TB.derive_layout, saved = (lambda *a, **kw: derived.append(1) or real(*a, **kw)), TB.derive_layout
    try:
        out, lse = TB.attention_forward(spec, q, k, v)
        assert len(kernels) == 1 and not derived
        g = torch.randn_like(out)
        dq, dk, dv = TB.attention_backward(spec, q, k, v, None, out, lse, g)
        assert not derived  # the replay's layout, found by the backward
        TB._LAYOUT_CACHE.clear()
        full_out, full_lse = TB._forward(spec, q, k, v, None, 0.0, 0, None, None, None, None, None, None)[:2]
        assert derived
        ref = TB.attention_backward(spec, q, k, v, None, full_out, full_lse, g)
    finally:
        TB.derive_layout = saved
    assert torch.equal(out, full_out) and torch.equal(lse, full_lse)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert torch.equal(a, b), name


def test_the_op_keeps_the_plan(kernels):
    """Called as compiled graphs call a hash site (no buckets), the op keeps the plan under its own key
    and goes straight to it."""
    spec = AttentionSpec(policy=Hash(n_buckets=4), causal=True, backend="triton")
    js = spec.to_json()
    for call in range(4):
        q, k, v = qkv(2, 2, 33, 16)
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None, js,
                                           0.0, 0)[0]
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32, f"call {call}")
    assert len(kernels) == 2 and len(ops._CALLS) == 1
    assert type(next(iter(ops._CALLS.values()))) is TB._SortedPlan


def test_a_call_with_a_host_computation_is_not_recorded(kernels):
    """A torch op that computes on the host path (here: the copy of a padding vector whose last stride
    is not 1) spoils the recording; every call then takes the full path and stays exact."""
    spec = AttentionSpec(policy=Hash(n_buckets=4), causal=True)
    for call in range(3):
        q, k, v = qkv(2, 2, 25, 16)
        kv = torch.ones(25, 2, dtype=torch.bool).t()  # strides (1, 2): the site copies it
        kv[1, 20 + call:] = False
        preds = Predicates(k_valid=kv)
        out, _ = TB.attention_forward(spec, q, k, v, preds=preds)
        assert_close(out, _reference(spec, q, k, v, None, preds, 0.0, 0)[0], torch.float32, f"call {call}")
    assert not kernels and not TB._PLANS


def test_given_buckets_replay_with_the_layout_of_each_call(kernels):
    """Buckets given to the site: each call's layout comes from the cache (or its own sort), and the
    replay reads that layout in place."""
    spec = AttentionSpec(policy=Hash(n_buckets=4), causal=True)
    for call in range(4):
        q, k, v = qkv(1, 2, 20, 16)
        qb, kb = ops.materialize_aux(spec, q, k)
        out, _ = TB.attention_forward(spec, q, k, v, q_aux=qb, k_aux=kb)
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32, f"call {call}")
    assert len(kernels) == 2
    (plan,) = TB._PLANS.values()
    assert plan.given and len(plan.replay.launches) == 1  # the forward, reading the call's layout


def test_a_shared_q_k_takes_the_full_path(kernels):
    spec = AttentionSpec(policy=Hash(n_buckets=4), causal=True)
    for _ in range(3):  # q is k: which one a launch read is ambiguous
        q, _, v = qkv(1, 2, 20, 16)
        out, _ = TB.attention_forward(spec, q, q, v)
        assert_close(out, _reference(spec, q, q, v, None, None, 0.0, 0)[0], torch.float32, "q is k")
    assert not kernels and not TB._PLANS


def test_recording_refuses_what_it_cannot_replay():
    a = torch.randn(8)
    with record.record() as rec:
        b = torch.empty(4)
        b.view(2, 2)
        assert not R.tracing()  # tensors made while recording are real: caches may keep them
    assert rec.why is None and [t.data_ptr() for t in rec.allocations] == [b.data_ptr()]
    with record.record() as rec:
        a.add(1)
    assert rec.why is not None and "add" in rec.why
    with pytest.raises(ValueError, match="nothing was launched"):
        record.Replay(record.Recording(), {}, {}, {})


def test_repeated_keep_draws_replay_the_recording(kernels, monkeypatch):
    """``drop``'s keep draws of a compiled site (a fresh seed per call): repeats replay the recorded
    counting sort, whose masks are those ``materialize_aux`` draws, and whose layout the site's
    forward and backward then find."""
    runs = []
    real = TB._DrawPlan.run
    monkeypatch.setattr(TB._DrawPlan, "run", lambda self, *a: runs.append(1) or real(self, *a))
    spec = AttentionSpec(policy=Drop(q_rate=0.4, k_rate=0.3), causal=True)
    w = TB._seed_word
    seeds = [s for s in range(1, 200) if all(x & 15 and x != 1 for x in (w(_stream_seed(s, 0)), w(_stream_seed(s, 1))))]
    sorted_ = []
    monkeypatch.setattr(TB, "counting_layout", lambda *a, **kw: sorted_.append(1) or layout.counting_layout(*a, **kw))
    for call in range(4):
        q, k, v = qkv(2, 4, 30, 16, Hk=2, Nk=30)
        q_keep, k_keep = TB.draw_keep(spec, q, k, seeds[call])
        rq, rk = ops.materialize_aux(spec, q, k, seed=seeds[call])
        assert torch.equal(q_keep, rq) and torch.equal(k_keep, rk), f"call {call}"
        out, lse = TB.attention_forward(spec, q, k, v, q_aux=q_keep, k_aux=k_keep)
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0, (rq, rk))[0], torch.float32, f"call {call}")
        g = torch.randn_like(out)
        TB.attention_backward(spec, q, k, v, None, out, lse, g, q_aux=q_keep, k_aux=k_keep)
    assert len(runs) == 2 and not sorted_  # the site's calls sorted nothing: the draws' layouts served them


def test_a_compiled_drop_site_draws_in_the_op_and_replays(kernels):
    """As compiled graphs call a ``drop`` site: no keep masks, a fresh seed per call; the op draws the
    masks from it in the counting sort. Repeats replay the four launches with the call's seed words in
    the histogram launch (whatever their specialisation class: the kernel takes them unspecialised);
    every call matches the reference with the masks ``materialize_aux`` draws from its seed."""
    spec = AttentionSpec(policy=Drop(q_rate=0.5, k_rate=0.5), causal=True, backend="triton")
    js = spec.to_json()
    w = TB._seed_word
    start = fresh_seed() % 100000
    # the op's seed word in one class (not 1, not a multiple of 16), the draws' words in every class
    usable = [s for s in range(start, start + 4000) if w(s) & 15 and w(s) != 1]
    seeds = usable[:3] + [next(s for s in usable if w(_stream_seed(s, 0)) & 15 == 0)]
    outs = []
    for call, seed in enumerate(seeds):
        q, k, v = qkv(2, 4, 37, 16, Hk=2, Nk=37)
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                           js, 0.0, seed)[0]
        aux = ops.materialize_aux(spec, q, k, seed=seed)
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, seed, aux)[0], torch.float32, f"call {call}")
        outs.append(out)
    assert len(kernels) == 2  # the third and fourth calls: replays
    plans = [p for p in ops._CALLS.values() if type(p) is TB._SortedPlan]
    assert len(plans) == 1 and plans[0].draws and len(plans[0].replay.launches) == 4
    assert not torch.equal(outs[2], outs[3])


def test_policy_aux_draws_replay_and_feed_the_forward(kernels, monkeypatch):
    """``attncomp::policy_aux`` (keep masks for a caller, and graphs compiled before drop sites drew in
    the op) draws keep masks from a seed, then the op gets them. Repeats replay both: the draw's
    counting sort, and the forward that reads the draw's layout; results match the reference for
    every call's masks."""
    draws = []
    real = TB._DrawPlan.run
    monkeypatch.setattr(TB._DrawPlan, "run", lambda self, *a: draws.append(1) or real(self, *a))
    spec = AttentionSpec(policy=Drop(q_rate=0.5, k_rate=0.5), causal=True, backend="triton")
    js = spec.to_json()
    w = TB._seed_word
    seeds = [s for s in range(1, 300) if all(x & 15 and x != 1 for x in (w(_stream_seed(s, 0)), w(_stream_seed(s, 1))))]
    outs = []
    for call in range(4):
        q, k, v = qkv(2, 4, 37, 16, Hk=2, Nk=37)
        q_keep, k_keep = torch.ops.attncomp.policy_aux(q, k, js, seeds[call])
        out = torch.ops.attncomp.attention(q, k, v, None, q_keep, k_keep, None, None, None, None, None, None, None,
                                           js, 0.0, 0)[0]
        aux = ops.materialize_aux(spec, q, k, seed=seeds[call])
        assert torch.equal(q_keep, aux[0]) and torch.equal(k_keep, aux[1])
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0, aux)[0], torch.float32, f"call {call}")
        outs.append(out)
    assert len(draws) == 2 and len(kernels) == 2
    plans = [p for p in ops._CALLS.values() if type(p) is TB._SortedPlan]
    assert len(plans) == 1 and plans[0].given and len(plans[0].replay.launches) == 1
    assert not torch.equal(outs[2], outs[3])


class _FakeGraph:
    """Stands in for a captured CUDA graph: the launches as captured (their arguments fixed), each
    replayed by a launch of the graph."""

    def __init__(self, calls):
        self.calls = [(go, g0, g1, g2, list(args)) for go, g0, g1, g2, args in calls]
        self.size, self.launches = len(calls), 0

    def launch(self, stream):
        self.launches += 1
        for go, g0, g1, g2, args in self.calls:
            go(g0, g1, g2, stream, list(args))


def _two_buffers_in_turn(monkeypatch, n=2):
    """Replays' workspaces and outputs from ``n`` poisoned buffers per shape, handed out in turn (as a
    caching allocator hands freed blocks back)."""
    pool: dict = {}

    def alloc(shape, stride, dtype, device):
        bufs = pool.setdefault((shape, stride, dtype), [_poisoned(shape, stride, dtype, device) for _ in range(n)])
        t = bufs.pop(0)
        bufs.append(t)
        with _disable_current_modes():
            t.fill_(float("nan")) if dtype.is_floating_point else t.view(torch.uint8).fill_(0xA5)
        return t

    monkeypatch.setattr(record, "_alloc", alloc)


@pytest.mark.sample(1)
@pytest.mark.parametrize("case,seeded,run_len", [("hash", (), 4), ("drop", (0,), 3), ("drop-dropout", (0, 3), 2),
                                                ("drop-kv", (0,), 3), ("drop-kv-tma", (0,), 3),
                                                ("drop-kv-dropout", (0, 3), 2)])
def test_runs_of_a_replay_launch_as_graphs_of_their_addresses(kernels, monkeypatch, case, seeded, run_len):
    """On a GPU a replay launches its launches with no seed word as one CUDA graph per set of addresses
    (the call's tensors, workspace and outputs) once that set comes back. Here the graph is a stand-in
    that replays the launches as captured, and the allocator hands out two poisoned buffers in turn:
    inputs and outputs come back at addresses seen before in every combination, with fresh values
    and fresh seeds, and every call must match the reference (a graph of other addresses, or with a
    seed word fixed in it, would not). ``-kv``: drop's sorted K/V copies, outputs of each replay that
    its forward reads (``-tma``: through descriptors, rebuilt at each replay's addresses)."""
    from attncomp.codegen.triton import configs, cugraph

    copies = "-kv" in case
    if copies:
        monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 0)
    if case.endswith("-tma"):
        monkeypatch.setattr(configs, "fwd_candidates",
                            lambda *a, **kw: [dict(configs.interpret_config(1), TMA=1)])
    graphs = []
    monkeypatch.setattr(record, "_capturable", lambda go: True)
    monkeypatch.setattr(cugraph, "usable", lambda device: True)
    monkeypatch.setattr(cugraph, "capture", lambda calls, device: (graphs.append(_FakeGraph(calls)) or graphs[-1], ""))
    _two_buffers_in_turn(monkeypatch)
    policy = Hash(n_buckets=4) if case == "hash" else Drop(q_rate=0.5, k_rate=0.5)
    spec = AttentionSpec(policy=policy, causal=True, backend="triton")
    p = 0.3 if case.endswith("dropout") else 0.0
    js = spec.to_json()
    g = torch.Generator().manual_seed(fresh_seed())
    triples = [qkv(1, 4, 29, 16, Hk=2, Nk=29) for _ in range(2)]
    w = TB._seed_word
    start = fresh_seed() % 100000
    seeds = [s for s in range(start, start + 4000) if w(s) & 15 and w(s) != 1]
    for call in range(12):
        q, k, v = triples[(call // 2) % 2]  # with the allocator's turns: every pairing, each seen again
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g))
        seed = seeds[call] if case != "hash" else 0
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                           js, p, seed)[0]
        aux = ops.materialize_aux(spec, q, k, seed=seed)
        assert_close(out, _reference(spec, q, k, v, None, None, p, seed, aux)[0], torch.float32, f"call {call}")
    (plan,) = [p for p in ops._CALLS.values() if type(p) is TB._SortedPlan]
    steps = plan.replay.steps
    runs = [s for s in steps if type(s) is record._Run]
    assert len(runs) == 1 and len(runs[0].launches) == run_len and len(steps) == 4 - run_len + 1
    assert [i for i, s in enumerate(steps) if s is not runs[0]] == [i if i == 0 else i - run_len + 1 for i in seeded]
    # the run's key: every address its launches read (with dropout the forward is not in it: the layout's
    # launches read only the workspace)
    # (the copies' scatter reads k and v and writes the copies)
    names = {"ws", "k", "v", "k_sorted", "v_sorted"} if copies else {"ws"}
    assert set(runs[0].names) == (names if p else names | {"q", "k", "v", "ws", "out", "lse"})
    fwd = plan.replay.launches[-1]
    assert len(fwd[6]) == (2 if case.endswith("-tma") else 0)  # the forward's descriptors, of the copies
    assert {d[1] for d in fwd[6]} <= {"k_sorted", "v_sorted"}
    # ten replays over four address sets (two where only the workspace counts): each captured at its
    # second sighting and launched then, and again at each later one
    n_sets = 2 if p and not copies else 4
    assert runs[0].captures == n_sets and len(graphs) == n_sets
    assert all(gr.size == run_len for gr in graphs) and sum(gr.launches for gr in graphs) == 10 - n_sets


def _hash_calls_in_place(monkeypatch, capture, calls: int, buffers: int):
    """``calls`` op calls of a hash site on one q, k, v refilled each call, graphs captured by ``capture``
    and the replays' buffers from ``buffers`` in turn, each call against the reference; the plan's run."""
    from attncomp.codegen.triton import cugraph

    monkeypatch.setattr(record, "_capturable", lambda go: True)
    monkeypatch.setattr(cugraph, "usable", lambda device: True)
    monkeypatch.setattr(cugraph, "capture", capture)
    _two_buffers_in_turn(monkeypatch, n=buffers)
    spec = AttentionSpec(policy=Hash(n_buckets=4), causal=True, backend="triton")
    js = spec.to_json()
    q, k, v = qkv(1, 2, 21, 16)
    for call in range(calls):
        for t in (q, k, v):
            t.normal_()
        out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                           js, 0.0, 0)[0]
        assert_close(out, _reference(spec, q, k, v, None, None, 0.0, 0)[0], torch.float32, f"call {call}")
    (plan,) = ops._CALLS.values()
    (run,) = plan.replay.steps
    return run


def test_a_refused_capture_leaves_the_run_launching_kernel_by_kernel(kernels, monkeypatch):
    tried = []
    run = _hash_calls_in_place(monkeypatch, lambda calls, device: (tried.append(1), (None, "refused here"))[1],
                               calls=6, buffers=2)
    assert tried == [1] and run.why == "refused here" and not run.graphs


def test_a_run_whose_addresses_come_back_too_rarely_stops_capturing(kernels, monkeypatch):
    """More sets of addresses in turn than graphs kept: each capture would be dropped before its set
    came back, so after that many captures with no launch served the run stops capturing."""
    monkeypatch.setattr(record, "_MAX_GRAPHS", 2)
    graphs = []
    run = _hash_calls_in_place(monkeypatch, lambda calls, device: (graphs.append(_FakeGraph(calls)) or graphs[-1], ""),
                               calls=10, buffers=3)
    # replays A B C A B C A B: A and B captured at their second sighting; at C's, two captures have
    # served no launch but their own: no more captures (C launches kernel by kernel), A and B's kept
    assert run.captures == 2 and run.why == "more than 2 sets of addresses in turn"
    assert [gr.launches for gr in graphs] == [2, 2]


def test_graphs_are_off_where_no_driver_or_the_switch_says_so(monkeypatch):
    from attncomp.codegen.triton import cugraph

    assert not cugraph.usable(torch.device("cpu"))
    monkeypatch.setenv("ATTNCOMP_CUDA_GRAPHS", "0")
    assert not cugraph.enabled()
    monkeypatch.setenv("ATTNCOMP_CUDA_GRAPHS", "1")
    assert cugraph.enabled() and not cugraph.enabled(False) and not cugraph.enabled()
    cugraph.enabled(True)
    if cugraph._driver() is None:  # this machine: the capture says why it made nothing
        assert cugraph.capture([], 0) == (None, "no CUDA driver")
