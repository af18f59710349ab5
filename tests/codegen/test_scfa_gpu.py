"""``hash``/``drop`` on the kernel template on a CUDA GPU at realistic sizes, against the reference.

Run in a process of their own (``pytest -m gpu tests/codegen/test_scfa_gpu.py``): a test module
that sets ``TRITON_INTERPRET=1`` makes every Triton kernel of its process interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                       reason="Triton kernels are interpreted in this process; run GPU tests on their own"),
]

from tests.utils import assert_close, poisoned_empty, qkv  # noqa: E402


@pytest.fixture
def scfa(monkeypatch):
    pytest.importorskip("triton")
    from attncomp.codegen.triton import backend as mod

    monkeypatch.setattr(mod, "_empty", poisoned_empty)
    return mod


def _grads_close(got, ref, dtype):
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert not torch.isnan(a).any(), name
        scale = max(1.0, b.abs().max().item())
        atol = {torch.float32: 5e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
        torch.testing.assert_close(a.float(), b.float(), atol=atol * scale, rtol=atol, msg=lambda m: f"{name}\n{m}")


def _run(scfa, spec, q, k, v, qa, ka, mask=None, p=0.0, seed=0):
    from attncomp.codegen import reference as R

    be = scfa.TritonBackend()
    out, lse = be.forward(spec, q, k, v, mask, qa, ka, None, p, seed)
    f = torch.float32
    ro, rl = R.attention(q.to(f), k.to(f), v.to(f), mask, spec=spec, q_aux=qa, k_aux=ka, dropout_p=p, seed=seed)
    assert_close(out, ro, q.dtype, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    go = torch.randn_like(out)
    got = be.backward(spec, q, k, v, mask, qa, ka, None, p, seed, out, lse, go)[:3]
    ref = R.attention_backward(q.to(f), k.to(f), v.to(f), mask, go.to(f), spec=spec, q_aux=qa, k_aux=ka,
                               dropout_p=p, seed=seed)[:3]
    _grads_close(got, ref, q.dtype)


def test_hash_causal_bf16_16_buckets(scfa):
    from attncomp.policy import Hash
    from attncomp.spec import AttentionSpec

    q, k, v = qkv(2, 4, 2047, 64, dtype=torch.bfloat16, device="cuda")
    qb = torch.randint(0, 16, (2, 4, 2047), device="cuda", dtype=torch.int32)
    kb = torch.randint(0, 16, (2, 4, 2047), device="cuda", dtype=torch.int32)
    _run(scfa, AttentionSpec(causal=True, policy=Hash(n_buckets=16)), q, k, v, qb, kb)


def test_drop_gqa_cross_dropout_fp16_d128(scfa):
    from attncomp.policy import Drop
    from attncomp.spec import AttentionSpec

    q, k, v = qkv(2, 8, 1500, 128, Hk=2, Nk=1800, dtype=torch.float16, device="cuda")
    qk_ = torch.rand(2, 8, 1500, device="cuda") >= 0.5
    kk_ = torch.rand(2, 2, 1800, device="cuda") >= 0.5
    spec = AttentionSpec(causal=True, dropout_p=0.1, policy=Drop())
    _run(scfa, spec, q, k, v, qk_, kk_, p=0.1, seed=1234)


def test_hash_exclude_self_padding_mask_fp32_d96(scfa):
    from attncomp.policy import Hash
    from attncomp.spec import AttentionSpec

    B, H, N = 2, 4, 1000
    q, k, v = qkv(B, H, N, 96, dtype=torch.float32, device="cuda")
    lens = torch.tensor([N, 777], device="cuda")
    mask = (torch.arange(N, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    qb = torch.randint(0, 8, (B, H, N), device="cuda", dtype=torch.int32)
    kb = torch.randint(0, 8, (B, H, N), device="cuda", dtype=torch.int32)
    spec = AttentionSpec(mask_kind="bool", policy=Hash(n_buckets=8, exclude_self=True))
    _run(scfa, spec, q, k, v, qb, kb, mask=mask)


def test_counting_sort_layout_equals_torch_sort(scfa):
    """The Triton counting-sort layout and the torch.sort/searchsorted one agree exactly (GQA, Nq != Nk)."""
    from attncomp.codegen.triton import layout as L

    g = torch.Generator(device="cuda").manual_seed(0)
    qb = torch.randint(0, 16, (2, 8, 16384), device="cuda", dtype=torch.int32, generator=g)
    kb = torch.randint(0, 16, (2, 2, 9000), device="cuda", dtype=torch.int32, generator=g)
    a = L.counting_layout(qb, kb, 16, kind=L.GK_IDS, q_shape=tuple(qb.shape), k_shape=tuple(kb.shape))
    b = L.sorted_layout(qb, kb)
    for name in ("q_perm", "k_perm", "lo", "hi"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("policy", ["hash", "drop", "drop-aux", "drop-kv"])
def test_replayed_sorted_forwards_and_their_backward(policy, monkeypatch):
    """The op called as compiled graphs call a hash/drop site, five times with fresh inputs (no policy
    tensors; drop: a fresh seed each time, from which the op draws the keep masks; ``drop-aux``: masks
    drawn first by ``attncomp::policy_aux``; ``drop-kv``: the forward reads sorted K/V copies, which the
    replays allocate poisoned): from the third call the draw and the forward replay
    recorded launches (``backend._SortedPlan``/``_DrawPlan``) into poisoned workspaces; outputs and the
    backward's gradients (which read the replayed layout) match the float32 reference. The seeds'
    words fall in different specialisation classes (the histogram kernel takes them unspecialised)."""
    pytest.importorskip("triton")
    from attncomp import ops
    from attncomp.codegen import reference as R
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import configs, record
    from attncomp.policy import Drop, Hash
    from attncomp.spec import AttentionSpec
    from tests.utils import poison

    # sorted copies where the site reads them (drop-kv), else none
    monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 0 if policy == "drop-kv" else 1 << 40)

    def poisoned(shape, stride, dtype, device):
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return t.fill_(0xA5) if dtype == torch.uint8 else poison(t)  # (the workspace: bytes)

    monkeypatch.setattr(record, "_alloc", poisoned)
    replays = []
    real = TB._SortedPlan.run
    monkeypatch.setattr(TB._SortedPlan, "run", lambda self, *a, **kw: replays.append(1) or real(self, *a, **kw))
    pol = Hash(n_buckets=16) if policy == "hash" else Drop(q_rate=0.5, k_rate=0.5)
    spec = AttentionSpec(causal=True, policy=pol, backend="triton")
    js = spec.to_json()
    f = torch.float32
    w = TB._seed_word
    # the op's seed words in one class (not 1, not a multiple of 16); the draws' words in every class
    usable = [s for s in range(1000, 5000) if w(s) & 15 and w(s) != 1]
    seeds = usable[:4] + [next(s for s in usable if TB.draw_words(s)[0] & 15 == 0)]
    for call, seed in enumerate(seeds):
        q, k, v = qkv(2, 8, 1000, 64, Hk=2, Nk=1000, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        qa = ka = None
        if policy == "drop-aux":
            qa, ka = torch.ops.attncomp.policy_aux(q, k, js, seed)
        out = torch.ops.attncomp.attention(q, k, v, None, qa, ka, None, None, None, None, None, None, None, js,
                                           0.0, seed if policy in ("drop", "drop-kv") else 0)[0]
        go = torch.randn_like(out)
        out.backward(go)
        aux = ops.materialize_aux(spec, q.detach(), k.detach(), seed=seed)
        qd, kd, vd = (t.detach().to(f) for t in (q, k, v))
        ro = R.attention(qd, kd, vd, None, spec=spec, q_aux=aux[0], k_aux=aux[1])[0]
        assert_close(out.detach(), ro, q.dtype, f"call {call}")
        ref = R.attention_backward(qd, kd, vd, None, go.to(f), spec=spec, q_aux=aux[0], k_aux=aux[1])[:3]
        _grads_close((q.grad, k.grad, v.grad), ref, q.dtype)
    assert len(replays) == 3


@pytest.mark.parametrize("policy,p", [("hash", 0.0), ("drop", 0.0), ("drop", 0.2), ("drop-kv", 0.0), ("drop-kv", 0.2)])
def test_replays_launch_as_cuda_graphs(policy, p, monkeypatch):
    """On the default stream a replay launches its runs of launches without seed words as CUDA graphs
    once their addresses come back (``record._Run``, ``cugraph``): twelve op calls over two input sets
    refilled with fresh values (drop: a fresh seed each call), the replays' workspaces and outputs
    from two poisoned buffers in turn (as the caching allocator hands freed blocks back). Every call
    and its backward (which reads the layout a graph wrote) match the float32 reference; graphs were
    captured and launched, and back-to-back calls launch them; the last call equals, bit for bit, the
    same call with graphs off; and a capture of the op by the caller (``torch.cuda.graph``) takes the
    launches as they are. ``drop-kv``: the forward reads sorted K/V copies (through TMA descriptors,
    the H100's default), outputs of the replays from the same poisoned buffers in turn."""
    pytest.importorskip("triton")
    from attncomp import ops
    from attncomp.codegen import reference as R
    from attncomp.codegen.triton import backend as TB
    from attncomp.codegen.triton import configs, cugraph, record
    from attncomp.policy import Drop, Hash
    from attncomp.spec import AttentionSpec
    from tests.utils import poison

    monkeypatch.setattr(ops, "_CALLS", {})
    monkeypatch.setattr(configs, "SORTED_KV_MIN_Q", 0 if policy == "drop-kv" else 1 << 40)
    pool: dict = {}

    def two_in_turn(shape, stride, dtype, device):  # the replays' workspaces and outputs: poisoned, in turn
        bufs = pool.setdefault((shape, stride, dtype), [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                                                        for _ in range(2)])
        t = bufs.pop(0)
        bufs.append(t)
        return t.fill_(0xA5) if dtype == torch.uint8 else poison(t)

    monkeypatch.setattr(record, "_alloc", two_in_turn)
    launched = []
    real = cugraph.Graph.launch
    monkeypatch.setattr(cugraph.Graph, "launch", lambda self, s: launched.append(self.size) or real(self, s))
    pol = Hash(n_buckets=16) if policy == "hash" else Drop(q_rate=0.5, k_rate=0.5)
    spec = AttentionSpec(causal=True, policy=pol, backend="triton")
    js = spec.to_json()
    w = TB._seed_word
    seeds = [s for s in range(2000, 9000) if w(s) & 15 and w(s) != 1]
    sets = [qkv(2, 8, 700, 64, Hk=2, Nk=700, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2 ** 30, (1,))))

    def call(q, k, v, seed):
        return torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None, js,
                                            p, seed)[0]

    f = torch.float32
    for i in range(12):
        q, k, v = sets[(i // 2) % 2]
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
                t.grad = None
        seed = 0 if policy == "hash" else seeds[i]
        out = call(q, k, v, seed)
        go = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
        out.backward(go)  # (reads the layout the replay wrote into its workspace)
        qd, kd, vd = (t.detach().to(f) for t in (q, k, v))
        aux = ops.materialize_aux(spec, q.detach(), k.detach(), seed=seed)
        kw = dict(spec=spec, q_aux=aux[0], k_aux=aux[1], dropout_p=p, seed=seed)
        assert_close(out.detach().float(), R.attention(qd, kd, vd, None, **kw)[0], q.dtype, f"call {i}")
        _grads_close((q.grad, k.grad, v.grad), R.attention_backward(qd, kd, vd, None, go.to(f), **kw)[:3], q.dtype)
    (plan,) = [x for x in ops._CALLS.values() if type(x) is TB._SortedPlan]
    runs = [s for s in plan.replay.steps if type(s) is record._Run]
    assert len(runs) == 1 and runs[0].why is None and runs[0].captures >= 2 and len(launched) >= 4
    copies = {"k_sorted", "v_sorted"} & {o[0] for o in plan.replay.outputs}
    assert len(copies) == (2 if policy == "drop-kv" else 0)
    # the forward's TMA descriptors (of the copies), rebuilt at each replay's addresses
    assert len(plan.replay.launches[-1][6]) == (2 if copies and plan.config.get("TMA") else 0)
    with torch.no_grad():  # (the same tensors: the op keeps one plan)
        n = len(launched)
        for _ in range(4):  # back to back, as a model's steady state
            got = call(q, k, v, seed)
        assert len(launched) == n + 4
        cugraph.enabled(False)
        try:
            direct = call(q, k, v, seed)
        finally:
            cugraph.enabled(True)
        assert torch.equal(got, direct)
        n = len(launched)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(q, k, v, seed)
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert len(launched) == n  # (under the caller's capture: no graph of the plan's own)
        assert torch.equal(out, call(q, k, v, seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_lsh_buckets_on_the_tensor_cores_match_the_reference(dtype, d):
    """The counting sort's LSH buckets (``layout._lsh_hist_side``: ``xR`` on the tensor cores from
    bfloat16 parts with exact products) against ``attncomp.policy.lsh_buckets`` (normalised vectors,
    float32): equal but where the two best projections of a token are within rounding of each other;
    GQA, a length that is not a multiple of the block, head dims that are not powers of two."""
    pytest.importorskip("triton")
    from attncomp.codegen.triton import layout as L
    from attncomp.policy import Hash, lsh_buckets
    from attncomp.spec import AttentionSpec

    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2 ** 30, (1,))))
    q = torch.randn(2, 8, 3001, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(2, 2, 3001, d, generator=g, device="cuda").to(dtype)
    pol = Hash(n_buckets=16, seed=int(torch.randint(0, 1000, (1,))))
    lay = L.derive_layout(AttentionSpec(policy=pol), q, k)
    qb, kb = lsh_buckets(q, k, 16, pol.seed)
    for name, got, want, x, hk in (("q", lay.q_groups, qb, q, 8), ("k", lay.k_groups, kb, k, 2)):
        bad = got != want
        if bad.any():  # only near ties: the reference's two best projections within float32 rounding
            R = L._rotation_on(d, 16, 2, pol.seed, q.device).float().sum(0).repeat_interleave(hk // 2, dim=0)
            xr = torch.einsum("bhnd,hdc->bhnc", torch.nn.functional.normalize(x.float(), dim=-1), R)
            both = torch.cat([xr, -xr], dim=-1)[bad]
            top = both.topk(2, dim=-1).values
            assert ((top[:, 0] - top[:, 1]) <= 1e-5 * top[:, 0].abs().clamp_min(1)).all(), name
        assert bad.float().mean() < 1e-3, name
        counts = torch.bincount(got.flatten(), minlength=16)
        assert counts.sum() == got.numel() and got.min() >= 0 and got.max() < 16
    # the sorted order is the buckets' stable order
    for perm, grp in ((lay.q_perm, lay.q_groups), (lay.k_perm, lay.k_groups)):
        sg = torch.gather(grp, 2, perm.long())
        assert (sg[..., 1:] >= sg[..., :-1]).all()
        same = sg[..., 1:] == sg[..., :-1]
        assert (perm[..., 1:][same] > perm[..., :-1][same]).all()
