"""The ``attncomp::attention`` op: schema, fake kernel, autograd, predicate checks, and a host path
that never reads tensor data (every policy, through the functional API and the raw op, forward and
backward, under :func:`tests.sync_trap.sync_trap`)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import attncomp
from attncomp import ops
from attncomp.codegen import reference as R
from attncomp.functional import attention
from attncomp.policy import SPION, Drop, get_policy
from attncomp.spec import AttentionSpec, Predicates
from tests.sync_trap import SyncError, sync_trap
from tests.utils import assert_close, fresh_seed

F64 = torch.float64

SCHEMA = ("attncomp::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? q_aux, Tensor? k_aux, "
          "Tensor? block_pattern, Tensor? q_pos, Tensor? k_pos, Tensor? q_seg, Tensor? k_seg, Tensor? q_valid, "
          "Tensor? k_valid, str spec, float dropout_p, SymInt seed, Tensor? alibi_slopes=None, "
          "Tensor? rel_table=None, Tensor? sinks=None) -> (Tensor, Tensor)")


def test_schema_is_the_agreed_one():
    assert str(torch.ops.attncomp.attention.default._schema) == SCHEMA
    bw = str(torch.ops.attncomp.attention_backward.default._schema)
    assert "Tensor? block_pattern, Tensor? q_pos, Tensor? k_pos, Tensor? q_seg, Tensor? k_seg, Tensor? q_valid, " \
           "Tensor? k_valid, Tensor out, Tensor lse, str spec" in bw
    assert [n for n, i in sorted(ops.ARG_INDEX.items(), key=lambda t: t[1])] == [
        a.name for a in torch.ops.attncomp.attention.default._schema.arguments]
    assert ops.PRED_NAMES == Predicates._fields


def _case(policy, B=2, Hq=4, Hk=2, Nq=11, Nk=13, D=8, dtype=F64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype).requires_grad_(grad)  # noqa: E731
    q, k, v = mk(B, Hq, Nq, D), mk(B, Hk, Nk, D), mk(B, Hk, Nk, D)
    extra = {}
    if policy == "hash":
        extra = dict(q_buckets=torch.randint(0, 4, (B, Hq, Nq), generator=g),
                     k_buckets=torch.randint(0, 4, (B, Hk, Nk), generator=g))
    elif policy == "drop":
        extra = dict(q_keep=torch.rand(B, Hq, Nq, generator=g) < 0.7, k_keep=torch.rand(B, Hk, Nk, generator=g) < 0.7)
    elif policy == "spion":
        extra = dict(block_pattern=torch.rand(1, 1, 1, generator=g) < 0.5)
    return q, k, v, extra


def _preds(B, Nq, Nk, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return dict(q_seg=torch.sort(torch.randint(0, 2, (B, Nq), generator=g)).values,
                k_seg=torch.sort(torch.randint(0, 2, (B, Nk), generator=g)).values,
                k_valid=torch.rand(B, Nk, generator=g) < 0.8, q_valid=torch.rand(B, Nq, generator=g) < 0.9,
                q_pos=torch.arange(Nq)[None] + (Nk - Nq))


POLICIES = ("dense", "dfss", "hash", "drop", "spion", "et")
POLICY_OBJ = {"spion": SPION(block_size=16)}


@pytest.mark.parametrize("variant", ("plain", "causal_mask", "predicates", "dropout"))
@pytest.mark.parametrize("policy", POLICIES + ("hash_lsh", "drop_drawn"))
def test_functional_host_path_never_syncs(policy, variant):
    """Forward and backward of every policy through ``attncomp.functional.attention`` with every
    host-side data read trapped (derived LSH buckets and drawn keep masks included)."""
    seed = fresh_seed()
    base = policy.split("_")[0]
    q, k, v, extra = _case(base, seed=seed)
    if policy in ("hash_lsh", "drop_drawn"):
        extra = {}
    kw = dict(policy=POLICY_OBJ.get(base, base), enable_gqa=True, **extra)
    if variant == "causal_mask":
        kw.update(is_causal=True, attn_mask=torch.randn(11, 13, dtype=F64).requires_grad_(True))
    elif variant == "predicates":
        kw.update(_preds(2, 11, 13, seed), window=(5, 0), causal_align="bottom_right")
    elif variant == "dropout":
        kw.update(dropout_p=0.3, seed=seed)
    ref = attention(q, k, v, backend="reference", **kw)
    with sync_trap() as trap:
        out = attention(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert "attncomp.attention" in trap.seen_ops and "attncomp.attention_backward" in trap.seen_ops
    assert len([o for o in trap.seen_ops if o.startswith("aten.")]) > 3, "the trap must see inside the op"
    assert_close(out, ref, F64, msg=f"{policy} {variant} seed={seed}")
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for a, b in zip(grads, want):
        assert_close(a, b, F64, msg=f"grad {policy} {variant} seed={seed}")


def test_fresh_dropout_seed_is_allowed_host_scalar():
    """A dropout seed drawn from torch's CPU generator is host data, not device data: allowed by name."""
    q, k, v, _ = _case("dense", grad=False)
    with pytest.raises(SyncError, match="_fresh_seed"):
        with sync_trap():
            attention(q, k, v, policy="dense", enable_gqa=True, dropout_p=0.2)
    with sync_trap(allow=("functional.py:_fresh_seed",)):
        attention(q, k, v, policy="dense", enable_gqa=True, dropout_p=0.2)


@pytest.mark.parametrize("policy", POLICIES + ("hash_lsh", "drop_drawn"))
def test_raw_op_host_path_never_syncs(policy):
    """``torch.ops.attncomp.attention`` itself, with predicates, forward and backward; policy tensors
    given, or left to the op as compiled graphs leave them (LSH buckets, keep masks of the op's seed)."""
    seed = fresh_seed()
    base = policy.split("_")[0]
    q, k, v, extra = _case(base, seed=seed)
    pol = get_policy(POLICY_OBJ.get(base, base)).resolved(F64)
    spec = AttentionSpec(causal=True, window_left=4, causal_align="bottom_right", policy=pol).to_json()
    qa = ka = None
    if policy == base:
        qa = extra.get("q_buckets", extra.get("q_keep"))
        ka = extra.get("k_buckets", extra.get("k_keep"))
    P = _preds(2, 11, 13, seed)
    args = (q, k, v, None, qa, ka, extra.get("block_pattern"), P["q_pos"], None, P["q_seg"], P["k_seg"],
            P["q_valid"], P["k_valid"], spec, 0.0, seed)
    with sync_trap():
        out, lse = torch.ops.attncomp.attention(*args)
        out.sum().backward()
    if qa is None and base in ("hash", "drop"):
        qa, ka = ops.materialize_aux(AttentionSpec.from_json(spec), q.detach(), k.detach(), seed=seed)
    want, wlse = R.attention(q.detach(), k.detach(), v.detach(), spec=AttentionSpec.from_json(spec), q_aux=qa,
                             k_aux=ka, block_pattern=extra.get("block_pattern"),
                             preds=Predicates(P["q_pos"], None, P["q_seg"], P["k_seg"], P["q_valid"], P["k_valid"]))
    assert_close(out, want, F64, msg=f"{policy} seed={seed}")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(wlse))
    assert q.grad is not None and not q.grad.isnan().any()


def test_trap_catches_a_host_read_in_attncomp_code(monkeypatch):
    """Negative twin: the hash id range check reads data; it runs only under ATTNCOMP_DEBUG=1, and
    the trap catches it there."""
    q, k, v, extra = _case("hash", grad=False)
    monkeypatch.setenv("ATTNCOMP_DEBUG", "1")
    with pytest.raises(SyncError, match="ops.py"):
        with sync_trap():
            attention(q, k, v, policy="hash", enable_gqa=True, **extra)
    monkeypatch.setenv("ATTNCOMP_DEBUG", "0")
    with sync_trap():
        attention(q, k, v, policy="hash", enable_gqa=True, **extra)


def test_trap_catches_dispatch_level_reads():
    from attncomp import policy as P

    x = torch.arange(6)
    # code compiled under an attncomp file name counts as attncomp code
    for src, what in (("x.nonzero()", "nonzero"), ("x[x > 2]", "bool index"), ("x.unique()", "unique"),
                      ("int(x.sum())", "__int__"), ("x.tolist()", "tolist")):
        with pytest.raises(SyncError, match=what):
            with sync_trap():
                exec(compile(src, P.__file__, "exec"), {"x": x})
    with sync_trap():
        x.nonzero()                                           # test code may read data freely


def test_fake_kernel_and_opcheck():
    q, k, v, _ = _case("dense", grad=True, dtype=torch.float32)
    P = _preds(2, 11, 13)
    spec = AttentionSpec(causal=True, causal_align="bottom_right").to_json()
    args = (q, k, v, None, None, None, None, P["q_pos"], None, P["q_seg"], P["k_seg"], P["q_valid"], P["k_valid"],
            spec, 0.0, 0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        out, lse = torch.ops.attncomp.attention(*fargs)
    assert out.shape == (2, 4, 11, 8) and lse.shape == (2, 4, 11) and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.attncomp.attention.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
def test_lse_is_float64_for_float64_inputs_else_float32(backend):
    """The op's lse dtype (opspec.lse_dtype): float64 for float64 inputs, float32 for float16, bfloat16 and
    float32; the real call and the fake report the same, and a float64 lse is the float64 reference's."""
    spec = AttentionSpec(causal=True, backend=backend).to_json()
    for dtype, want in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float32, torch.float32), (F64, F64)):
        q, k, v, _ = _case("dense", Nq=5, Nk=5, dtype=dtype, grad=False, seed=fresh_seed())
        args = (q, k, v) + (None,) * 10 + (spec, 0.0, 0)
        out, lse = torch.ops.attncomp.attention(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fout, flse = torch.ops.attncomp.attention(*(mode.from_tensor(t) for t in (q, k, v)), *args[3:])
        assert ops.lse_dtype(dtype) == lse.dtype == flse.dtype == want, (dtype, lse.dtype, flse.dtype)
        assert out.dtype == fout.dtype == dtype and lse.shape == flse.shape == (2, 4, 5)
    # float64 values: as the float64 reference's, which float32 rounding (about 1e-7 relative) would fail
    want_lse = R.attention(q, k, v, spec=AttentionSpec(causal=True))[1]
    torch.testing.assert_close(lse, want_lse, atol=1e-13, rtol=1e-13)
    torch.library.opcheck(torch.ops.attncomp.attention.default, args, test_utils=("test_faketensor",))


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
@pytest.mark.parametrize("q_layout", ["heads inner", "contiguous"])
def test_output_has_the_heads_inner_layout_the_fake_promises(backend, q_layout):
    """Every backend's output comes back as the transpose of a contiguous (B, N, H, Dv) tensor, the
    strides the fake kernel gives (compiled graphs assert them), whatever q's layout; values as the
    float64 reference."""
    B, H, N, D = 2, 3, 9, 8
    Dv = D if backend == "sdpa" else 16  # SDPA takes no other value head dim
    g = torch.Generator().manual_seed(fresh_seed())
    q = torch.randn(B, N, H, D, generator=g).transpose(1, 2)
    if q_layout == "contiguous":
        q = q.contiguous()
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, Dv, generator=g)
    spec = AttentionSpec(causal=True, backend=backend)
    out = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                       spec.to_json(), 0.0, 0)[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.attncomp.attention(*(mode.from_tensor(t) for t in (q, k, v)), None, None, None, None, None,
                                            None, None, None, None, None, spec.to_json(), 0.0, 0)[0]
    assert out.stride() == fake.stride() == (N * H * Dv, Dv, H * Dv, 1)
    want = R.attention(q.double(), k.double(), v.double(), spec=AttentionSpec(causal=True))[0]
    assert_close(out, want, torch.float32)
    assert out.transpose(1, 2).is_contiguous()  # a model's transpose(1, 2).contiguous() copies nothing


@pytest.mark.parametrize("policy", ["dense", "hash"])
def test_eager_backward_skips_the_dispatcher_traced_backward_records_the_op(monkeypatch, policy):
    """An eager backward calls the backward's implementation directly (same gradients as the
    float64 reference); a double backward and a traced one (make_fx, as AOT autograd traces) go
    through ``attncomp::attention_backward``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, _ = _case("dense", dtype=F64, seed=fresh_seed())
    spec = AttentionSpec(causal=True, causal_align="bottom_right", policy=get_policy(policy)).to_json()
    calls = []
    real = ops._attention_backward_op
    monkeypatch.setattr(ops, "_attention_backward_op", lambda *a: calls.append(1) or real(*a))

    def op(q, k, v):
        return torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                            spec, 0.0, 0)[0]

    g = torch.randn(2, 4, 11, 8, dtype=F64)
    got = torch.autograd.grad(op(q, k, v), (q, k, v), g)
    assert calls == []
    s = AttentionSpec.from_json(spec).replace(backend="reference")
    qa, ka = ops.materialize_aux(s, q, k)
    want = torch.autograd.grad(R.attention(q, k, v, spec=s, q_aux=qa, k_aux=ka)[0], (q, k, v), g)
    for a, b in zip(got, want):
        assert_close(a, b, F64)
    torch.autograd.grad(op(q, k, v), (q, k, v), g, create_graph=True)
    assert calls == [1]
    gm = make_fx(lambda q, k, v: torch.autograd.grad(op(q, k, v).sum(), (q, k, v)))(q, k, v)
    assert "attncomp.attention_backward.default" in {str(n.target) for n in gm.graph.nodes}


class _Seen(TorchDispatchMode):
    """Names the ops that reach the dispatcher while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_op_runs_its_implementation_directly_only_on_plain_tensors(monkeypatch):
    """Plain CPU tensors run the implementation without the dispatcher's redispatch; under a dispatch
    mode and on meta tensors the op still dispatches (the mode sees the op, meta gets the fake)."""
    if not ops.FAST_HOST_PATH:
        pytest.skip(f"torch {torch.__version__} keeps torch.library's kernels (overriding them is refused)")
    q, k, v, _ = _case("dense", dtype=torch.float32, grad=False, seed=fresh_seed())
    spec = AttentionSpec(causal=True).to_json()
    direct = []
    for name in ("_direct_impl", "_attention_impl"):  # with dynamo disabled, or run as is outside dynamo
        monkeypatch.setattr(ops, name, lambda *a, _f=getattr(ops, name), _n=name: direct.append(_n) or _f(*a))

    def op(q, k, v):
        return torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, None,
                                            spec, 0.0, 0)[0]

    want = op(q, k, v)
    assert direct == ["_attention_impl"]
    # while dynamo evaluates frames (eager code of a compiled function) it runs with dynamo disabled
    callback = ops._eval_frame_callback
    monkeypatch.setattr(ops, "_eval_frame_callback", lambda: object())
    assert torch.equal(op(q, k, v), want) and direct == ["_attention_impl", "_direct_impl"]
    monkeypatch.setattr(ops, "_eval_frame_callback", callback)
    assert_close(want, R.attention(q.double(), k.double(), v.double(), spec=AttentionSpec(causal=True))[0],
                 torch.float32)

    with _Seen() as seen:
        got = op(q, k, v)
    assert "attncomp.attention.default" in seen.ops and torch.equal(got, want)
    meta = op(*(t.to("meta") for t in (q, k, v)))
    assert meta.device.type == "meta" and meta.shape == want.shape
    assert direct == ["_attention_impl", "_direct_impl"]


def test_policy_aux_runs_its_implementation_directly_only_on_plain_tensors(monkeypatch):
    """``attncomp::policy_aux`` (a compiled drop site's keep draws) takes the attention op's short path:
    plain tensors, with grad or not, run the implementation directly and draw what
    ``materialize_aux`` draws; a dispatch mode still sees the op, and meta tensors get the fake."""
    if not ops.FAST_HOST_PATH:
        pytest.skip(f"torch {torch.__version__} keeps torch.library's kernels (overriding them is refused)")
    q, k, _, _ = _case("dense", dtype=torch.float32, grad=True, seed=fresh_seed())
    spec = AttentionSpec(causal=True, policy=Drop(q_rate=0.5, k_rate=0.5))
    seed = fresh_seed()
    direct = []
    monkeypatch.setattr(ops, "_policy_aux_impl", lambda *a, _f=ops._policy_aux_impl: direct.append(1) or _f(*a))
    got = torch.ops.attncomp.policy_aux(q, k, spec.to_json(), seed)
    want = ops.materialize_aux(spec, q.detach(), k.detach(), seed=seed)
    assert direct == [1] and all(torch.equal(a, b) and not a.requires_grad for a, b in zip(got, want))

    with _Seen() as seen:
        again = torch.ops.attncomp.policy_aux(q, k, spec.to_json(), seed)
    assert "attncomp.policy_aux.default" in seen.ops and all(map(torch.equal, again, want))
    meta = torch.ops.attncomp.policy_aux(q.to("meta"), k.to("meta"), spec.to_json(), seed)
    assert meta[0].device.type == "meta" and meta[0].shape == want[0].shape and direct == [1]


def _raises(match, **kw):
    q, k, v, _ = _case("dense", grad=False)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, policy="dense", enable_gqa=True, **kw)


def test_predicate_checks():
    _raises("q_pos must have shape", q_pos=torch.arange(10)[None])
    _raises("k_pos must be a integer", k_pos=torch.zeros(1, 13))
    _raises("k_valid must be a bool", k_valid=torch.ones(2, 13, dtype=torch.long))
    _raises("q_valid must have shape", q_valid=torch.ones(3, 11, dtype=torch.bool))
    _raises("both q_seg and k_seg", q_seg=torch.zeros(2, 11, dtype=torch.long))
    _raises("window must be a", window=(1,))
    _raises("window must be a", window=(1.5, None))
    _raises("causal_align", causal_align="middle")
    _raises("allows no key", window=(-3, 1))


def test_spec_fields_and_words():
    s = AttentionSpec(causal=True, causal_align="bottom_right", window_left=128)
    assert AttentionSpec.from_json(s.to_json()) == s
    assert s.bounds() == (128, 0)
    assert "causal (bottom-right)" in s.describe() and "window(128, inf)" in s.describe()
    d = s.describe(Predicates(k_valid=torch.ones(1, 3, dtype=torch.bool), q_seg=torch.zeros(1, 2),
                              k_seg=torch.zeros(1, 3)))
    assert "segments" in d and "key padding" in d
    assert AttentionSpec(causal=True).describe().endswith("causal")
    old = '{"backend":"auto","causal":true,"dropout_p":0.0,"dtype":null,"gqa_groups":1,"head_dim":null,' \
          '"mask_kind":"none","policy":{"name":"dense"},"scale":null}'
    assert AttentionSpec.from_json(old) == AttentionSpec(causal=True)     # specs from before still load
    assert not Predicates.none().any() and Predicates(q_valid=torch.ones(1, 1, dtype=torch.bool)).any()
    with pytest.raises(ValueError, match="window_left"):
        AttentionSpec(window_left=2.5)
    with pytest.raises(ValueError, match="causal_align"):
        AttentionSpec(causal_align="bottom-right")


def test_predicate_tensors_get_no_gradient_and_mask_does():
    q, k, v, _ = _case("dense", dtype=F64)
    m = torch.randn(11, 13, dtype=F64, requires_grad=True)
    kv = torch.rand(2, 13) < 0.8
    out = attention(q, k, v, attn_mask=m, k_valid=kv, policy="dense", enable_gqa=True)
    gm, = torch.autograd.grad(out.sum(), (m,))
    ref = attention(q, k, v, attn_mask=m, k_valid=kv, policy="dense", enable_gqa=True, backend="reference")
    want, = torch.autograd.grad(ref.sum(), (m,))
    assert_close(gm, want, F64)


@pytest.mark.skipif(os.environ.get("ATTNCOMP_DEBUG") not in (None, "", "0"), reason="debug checks read data")
def test_ops_attention_python_entry_takes_preds_or_keywords():
    q, k, v, _ = _case("dense", grad=False)
    spec = AttentionSpec(causal=True, causal_align="bottom_right")
    kv = torch.rand(2, 13) < 0.7
    a = ops.attention(q, k, v, spec=spec, k_valid=kv)
    b = ops.attention(q, k, v, spec=spec, preds=Predicates(k_valid=kv))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not both"):
        ops.attention(q, k, v, spec=spec, k_valid=kv, preds=Predicates(k_valid=kv))


# -- GPU (run by `make test-gpu` / the GPU issue) ------------------------------------------------

def _gpu_case(policy, dtype=torch.bfloat16, B=2, Hq=8, Hk=2, N=300, D=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g).requires_grad_(True)  # noqa: E731
    q, k, v = mk(B, Hq, N, D), mk(B, Hk, N, D), mk(B, Hk, N, D)
    extra = {}
    if policy == "spion":
        extra = dict(block_pattern=torch.rand(1, -(-N // 64), -(-N // 64), device="cuda", generator=g) < 0.5)
    return q, k, v, extra


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_gpu_host_path_never_syncs(policy):
    """Every policy, forward and backward, derived LSH buckets and drawn keep masks included, under
    ``torch.cuda.set_sync_debug_mode("error")``; equal to the float32 reference."""
    q, k, v, extra = _gpu_case(policy)
    # the policy resolved for the inputs' dtype: the float32 reference must run the same one (dfss
    # defaults to 2:4 in bf16 but 1:2 in float32)
    pol = SPION(block_size=64) if policy == "spion" else get_policy(policy).resolved(q.dtype)
    kv = torch.rand(2, 300, device="cuda") < 0.9
    kw = dict(policy=pol, enable_gqa=True, is_causal=True, k_valid=kv, **extra)
    attention(q, k, v, **kw).sum().backward()            # warm-up: autotuning may synchronise once
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attention(q, k, v, **kw)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    f = [t.detach().float() for t in (q, k, v)]
    ref = attention(*f, backend="reference", **kw)
    assert_close(out.float(), ref, torch.bfloat16, msg=policy)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ("dense", "dfss", "hash", "drop"))
def test_gpu_op_captured_in_cuda_graph(policy):
    """The op as compiled graphs call it (hash buckets and drop's keep masks left to the op) captured
    in a CUDA graph; a replay after q changed computes what a fresh call computes."""
    q, k, v, _ = _gpu_case(policy)
    q, k, v = (t.detach() for t in (q, k, v))
    spec = AttentionSpec(causal=True, policy=get_policy(policy).resolved(q.dtype)).to_json()
    kv = torch.rand(2, 300, device="cuda") < 0.9
    seed = fresh_seed()

    def call():
        return torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, kv,
                                            spec, 0.0, seed)[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out.float(), call().float(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["flash", "gqa", "top_left Nq<Nk", "padding", "float32"])
def test_gpu_op_keeps_the_sdpa_plan(monkeypatch, case):
    """Repeated dense op calls on SDPA's kernels (``backend="sdpa"``) go from the op to the kept plan
    (FlashAttention called alone where its outputs are the op's), each with fresh inputs laid out as a
    model's projections give them, against the float64 reference."""
    from attncomp.codegen import reference as R

    monkeypatch.setattr(ops, "_CALLS", {})
    n = []
    real = ops._backend_for
    monkeypatch.setattr(ops, "_backend_for", lambda *a, **kw: n.append(1) or real(*a, **kw))
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    nq, nk, hk = (40, 300, 4) if case == "top_left Nq<Nk" else (300, 300, 2 if case == "gqa" else 4)
    spec = AttentionSpec(causal=True, backend="sdpa", gqa_groups=4 // hk, head_dim=64)
    sj = spec.to_json()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, (1,))))
    for call in range(4):
        q = torch.randn(2, nq, 4, 64, generator=g).to("cuda", dtype).transpose(1, 2)
        k, v = (torch.randn(2, nk, hk, 64, generator=g).to("cuda", dtype).transpose(1, 2) for _ in range(2))
        kv = None
        if case == "padding":
            kv = torch.ones(2, nk, dtype=torch.bool, device="cuda")
            kv[call % 2, nk - 50 - call:] = False
        out, lse = torch.ops.attncomp.attention(q, k, v, None, None, None, None, None, None, None, None, None, kv,
                                                sj, 0.0, 0)
        want, want_lse = R.attention(q.double(), k.double(), v.double(), None, spec=spec,
                                     preds=None if kv is None else Predicates(k_valid=kv))
        assert_close(out.double(), want, dtype, msg=f"{case}, call {call}")
        assert (lse.double() - want_lse).abs().max() < 2e-3, (case, call)
        assert out.stride() == ops.output_strides(*out.shape)
    assert len(n) == 1 and len(ops._CALLS) == 1
    plan = next(iter(ops._CALLS.values()))
    # (grouped k/v heads: FlashAttention reads them as they are, see sdpa._grouped_flash)
    assert type(plan).__name__ == "_Plan" and (plan.flash is not None) == (case in ("flash", "gqa")), case
