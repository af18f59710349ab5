"""The DFSS kernel on sparse tensor cores (``mma.sp``), checked without a GPU.

The CUDA kernel's schedule is also built for the CPU (``llvm``) with every warp instruction emulated
from the lanes' packed registers and the metadata by PTX's documented layouts
(:mod:`attncomp.codegen.tvm.sparse`); that build runs here against the reference on fresh random
inputs (odd sizes, causal or not, GQA, masks, float16 and bfloat16, 2:4 and 1:2) with poisoned
outputs. A hand-made tile checks the selection and the metadata encoding against the documented
rules; the CUDA build itself is checked to reach ptxas (sm_90 cubin) with ``mma.sp`` in it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("tvm")

from attncomp.codegen import reference as R  # noqa: E402
from attncomp.codegen.tvm import backend as TB  # noqa: E402
from attncomp.codegen.tvm import sparse as SP  # noqa: E402
from attncomp.codegen.tvm.kernels import Variant  # noqa: E402
from attncomp.policy import DFSS  # noqa: E402
from attncomp.spec import AttentionSpec, Predicates  # noqa: E402
from tests.utils import assert_close, draw_mask, fresh_generator, qkv  # noqa: E402


pytestmark = pytest.mark.usefixtures("tvm_poisoned")


# ---------------------------------------------------------------------------------------------
# PTX's documented layouts (ISA 9.7.16.5.x, 9.7.16.6.x) as the pure-Python helpers state them


def test_fragment_layouts_are_ptx_s():
    # m16n8k16 A / compressed m16n8k32 A: lane 5 is g=1, t=1
    assert SP.fragment_a(0, 0) == [(0, 0), (0, 1)]
    assert SP.fragment_a(5, 1) == [(9, 2), (9, 3)]
    assert SP.fragment_a(5, 2) == [(1, 10), (1, 11)]
    assert SP.fragment_a(31, 3) == [(15, 14), (15, 15)]
    # B (K x 8): register j holds rows 2t + 8j, +1 of column g
    assert SP.fragment_b(5, 0) == [(2, 1), (3, 1)]
    assert SP.fragment_b(30, 3) == [(28, 7), (29, 7)]
    # C/D
    assert [SP.fragment_c(6, i) for i in range(4)] == [(1, 4), (1, 5), (9, 4), (9, 5)]
    # every element of each fragment is held exactly once by the warp
    a = sorted(e for lane in range(32) for r in range(4) for e in SP.fragment_a(lane, r))
    assert a == [(i, j) for i in range(16) for j in range(16)]
    b = sorted(e for lane in range(32) for r in range(4) for e in SP.fragment_b(lane, r))
    assert b == [(i, j) for i in range(32) for j in range(8)]
    # sparsity selector 0 on m16n8k32 f16/bf16: threads 0 and 1 of each quad hold keys 0..15 and
    # 16..31, row g in the low half-word and row g + 8 in the high one
    assert SP.metadata_location(0, 0) == (0, 0)
    assert SP.metadata_location(0, 3) == (0, 12)
    assert SP.metadata_location(0, 4) == (1, 0)
    assert SP.metadata_location(8, 0) == (0, 16)
    assert SP.metadata_location(9, 7) == (5, 28)
    assert SP.metadata_location(7, 5) == (29, 4)
    cells = sorted(SP.metadata_location(r, q) for r in range(16) for q in range(8))
    assert cells == sorted((4 * g + p, b) for g in range(8) for p in range(2) for b in range(0, 32, 4))


def test_metadata_encoding_of_a_hand_made_tile():
    """Each group's nibble is ``i0 | i1 << 2`` (``i0 < i1``, one of PTX's meaningful values 0b0100,
    0b1000, 0b1001, 0b1100, 0b1101, 0b1110); a row's word has group q at bits 4q..4q+3; lane 4g + p
    carries half-word p of rows g (low) and g + 8 (high), lanes 4g + 2, 4g + 3 nothing."""
    pairs = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    nibbles = {(0, 1): 0b0100, (0, 2): 0b1000, (1, 2): 0b1001, (0, 3): 0b1100, (1, 3): 0b1101, (2, 3): 0b1110}
    rows = []
    for r in range(16):
        keep = [False] * 32
        for q in range(8):
            for p in pairs[(r + q) % 6]:
                keep[4 * q + p] = True
        rows.append(keep)
    vals, word = SP.compress_row(rows[0], list(range(32)))
    assert vals == [0, 1, 4, 6, 9, 10, 12, 15, 17, 19, 22, 23, 24, 25, 28, 30]
    # groups 0..7 of row 0 keep (0,1) (0,2) (1,2) (0,3) (1,3) (2,3) (0,1) (0,2): nibbles 4 8 9 C D E 4 8
    assert word == 0x84EDC984
    # row 8 keeps (1,2) (0,3) (1,3) (2,3) (0,1) (0,2) (1,2) (0,3): 0xC984EDC9
    assert SP.compress_row(rows[8], [0.0] * 32)[1] == 0xC984EDC9
    assert SP.metadata_word(rows, 0) == 0xEDC9C984
    assert SP.metadata_word(rows, 1) == 0xC98484ED
    for lane in range(32):
        g, p = lane // 4, lane % 4
        expect = 0 if p > 1 else sum(nibbles[pairs[(g + 8 * h + 4 * p + q) % 6]] << (16 * h + 4 * q)
                                     for h in range(2) for q in range(4))
        assert SP.metadata_word(rows, lane) == expect, lane
    with pytest.raises(ValueError):
        SP.compress_row([True] * 3 + [False] * 29, [0.0] * 32)


def test_kernel_registers_follow_the_documented_layouts():
    """The register expressions the CUDA kernel hands to ``mma.sp`` (metadata, packed P and V
    fragments), evaluated on the CPU for a hand-made tile, against the layouts above."""
    import tvm
    import tvm.script
    from tvm.script import tirx as T

    func = tvm.script.from_source(SP.register_probe_source(), extra_vars={"T": T})
    probe = tvm.compile(tvm.IRModule({"probe": func}), target={"kind": "llvm"})["probe"]
    g = fresh_generator()
    pairs = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    rows = []
    for r in range(16):
        choice = torch.randint(0, 6, (8,), generator=g).tolist()
        rows.append([4 * q + p in (4 * q + pairs[choice[q]][0], 4 * q + pairs[choice[q]][1])
                     for q in range(8) for p in range(4)])
    words = [SP.compress_row(rows[r], [0.0] * 32)[1] for r in range(16)]
    # uint32 buffers as int32 bit patterns (the same 32 bits)
    halves = [[w & 0xFFFF, w >> 16] for w in words]  # the kernel keeps one half-word per 16 keys
    md = torch.tensor(halves, dtype=torch.int32).view(torch.uint32)
    pc = torch.randn(16, 16, generator=g).half()
    vs = torch.randn(32, 8, generator=g).half()
    e, a, bv = (torch.zeros(*s, dtype=torch.int32).view(torch.uint32) for s in ((32,), (32, 4), (32, 4)))
    probe(md, pc, vs, e, a, bv)

    def u32(x):
        return [int(t) & 0xFFFFFFFF for t in x.view(torch.int32).flatten().tolist()]

    def pack(t, elems):
        (r0, c0), (r1, c1) = elems
        bits = t.view(torch.int16).to(torch.int64) & 0xFFFF
        return int(bits[r0, c0]) | int(bits[r1, c1]) << 16

    e, a, bv = u32(e), u32(a), u32(bv)
    for lane in range(32):
        assert e[lane] == SP.metadata_word(rows, lane), lane
        for r in range(4):
            assert a[4 * lane + r] == pack(pc, SP.fragment_a_sp(lane, r)), (lane, r)
            assert bv[4 * lane + r] == pack(vs, SP.fragment_b(lane, r)), (lane, r)


def test_hand_made_tile_keeps_the_documented_entries():
    """Logits chosen by hand (ties included), V the identity: the emulated kernel's output row i is the
    normalised kept probabilities of row i, so it shows exactly which keys the packed P and its
    metadata select."""
    g = fresh_generator()
    Nq, Nk = 16, 64
    levels = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    L = levels[torch.randint(0, 5, (Nq, Nk), generator=g)]  # exact in float16, many ties
    q = torch.eye(Nq, 16)[None, None].half()
    k = L.t().contiguous()[None, None].half()  # S[i, j] = q_i . k_j = L[i, j]
    v = torch.eye(Nk)[None, None].half()
    spec = AttentionSpec(policy=DFSS(2, 4), scale=1.0)
    out, lse = TB.sparse_emulated_forward(spec, q, k, v)
    keep = torch.zeros(Nq, Nk, dtype=torch.bool)
    for i in range(Nq):
        for c in range(0, Nk, 4):
            grp = L[i, c:c + 4].tolist()
            order = sorted(range(4), key=lambda p: (-grp[p], p))  # larger first, ties: lower key
            for p in order[:2]:
                keep[i, c + p] = True
    assert torch.equal(out[0, 0].float() > 0, keep)
    p = torch.where(keep, L.exp(), torch.zeros(()))
    assert_close(out[0, 0], p / p.sum(-1, keepdim=True), torch.float16, "hand-made tile")
    assert_close(lse[0, 0], p.sum(-1).log(), torch.float32, "lse")


CASES = [
    # (dtype, (n, m), causal, Nq, Nk, Hq, Hk, D, Dv, mask)
    (torch.float16, (2, 4), False, 77, 93, 2, 1, 32, 16, "none"),
    (torch.bfloat16, (1, 2), True, 70, 70, 2, 2, 32, 32, "none"),
    (torch.float16, (2, 4), True, 45, 131, 1, 1, 16, 8, "float"),
    (torch.float16, (1, 2), False, 65, 40, 2, 1, 32, 24, "bool"),
    (torch.bfloat16, (2, 4), False, 9, 200, 1, 1, 128, 128, "none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-{c[1][0]}:{c[1][1]}-"
                         f"{'causal' if c[2] else 'full'}-{c[3]}x{c[4]}-D{c[7]}-{c[9]}")
def test_emulated_sparse_kernel_matches_reference(case):
    dtype, nm, causal, Nq, Nk, Hq, Hk, D, Dv, mask = case
    B = 2
    q, k, v = qkv(B, Hq, Nq, D, Hk=Hk, Nk=Nk, Dv=Dv, dtype=dtype)
    am = draw_mask(mask, fresh_generator(), B, Nq, Nk)
    spec = AttentionSpec(causal=causal, policy=DFSS(*nm), causal_align="bottom_right" if causal and Nk > Nq else
                         "top_left", mask_kind=mask)
    out, lse = TB.sparse_emulated_forward(spec, q, k, v, am)
    qd, kd, vd = q.double(), k.double(), v.double()
    ref, rlse = R.attention(qd, kd, vd, am, spec=spec)
    assert out.dtype == dtype and out.shape == (B, Hq, Nq, Dv)
    assert_close(out, ref, dtype, "out")
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert_close(lse[fin], rlse[fin], torch.float32, "lse")


def test_emulated_sparse_kernel_with_predicates():
    """Segments, key validity and a window through the tile schedule's summaries."""
    g = fresh_generator()
    B, H, N, D = 2, 2, 90, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g).half() for _ in range(3))
    seg = torch.cumsum(torch.rand(B, N, generator=g) < 0.05, -1).to(torch.int32)
    kval = torch.rand(B, N, generator=g) > 0.1
    preds = Predicates(q_seg=seg, k_seg=seg, k_valid=kval)
    spec = AttentionSpec(causal=True, window_left=40, policy=DFSS(2, 4))
    out, lse = TB.sparse_emulated_forward(spec, q, k, v, None, preds)
    ref, rlse = R.attention(q.double(), k.double(), v.double(), None, spec=spec, preds=preds)
    assert_close(out, ref, torch.float16, "out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))


def test_selection_is_applied():
    """Negative twin: the emulated sparse kernel differs from dense attention on the same inputs."""
    g = fresh_generator()
    q, k, v = (torch.randn(1, 1, 64, 32, generator=g).half() for _ in range(3))
    out, _ = TB.sparse_emulated_forward(AttentionSpec(policy=DFSS(2, 4)), q, k, v)
    dense, _ = R.attention(q.double(), k.double(), v.double(), None, spec=AttentionSpec())
    assert (out.double() - dense).abs().max() > 0.05


def test_kernel_choice_and_build_command(monkeypatch):
    spec = AttentionSpec(causal=True, policy=DFSS(2, 4))
    q16, q32 = torch.empty(1, 2, 8, 64, dtype=torch.float16), torch.empty(1, 2, 8, 64)
    var = TB.cuda_kernel_variant(spec, q16, q16, None, None, 0.0)
    assert var.mma == "sp" and var.operand_dtype == "float16" and var.block_q == SP.SP_BLOCK_Q
    assert TB.build_command(var, "sm_90") == ("python -m attncomp build-kernels --arch sm_90 --policy dfss "
                                              "--head-dim 64 --nm 2:4 --dfss-kernel sp --operand-dtype float16 "
                                              "--causal")
    assert TB.cuda_kernel_variant(spec, q32, q32, None, None, 0.0).mma == ""  # float32: the scalar kernel
    assert TB.cuda_kernel_variant(spec, q16, q16, None, None, 0.1).mma == ""  # dropout: the scalar kernel
    monkeypatch.setenv("ATTNCOMP_TVM_DFSS_KERNEL", "scalar")
    assert TB.cuda_kernel_variant(spec, q16, q16, None, None, 0.0).mma == ""
    monkeypatch.setenv("ATTNCOMP_TVM_DFSS_KERNEL", "nope")
    with pytest.raises(ValueError, match="ATTNCOMP_TVM_DFSS_KERNEL"):
        TB.cuda_kernel_variant(spec, q16, q16, None, None, 0.0)
    with pytest.raises(ValueError, match="does not serve"):
        TB.sparse_emulated_forward(AttentionSpec(policy=DFSS(2, 4)), q32, q32, q32)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("od", ["float16", "bfloat16"])
def test_sparse_kernel_builds_to_an_sm90_cubin(od, tmp_path, monkeypatch):
    from attncomp.codegen.tvm import cuda
    from attncomp.runtime.cubin import CubinKernel

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    v = cuda.cuda_variant(Variant(head_dim=64, head_dim_v=64, policy="dfss", nm_n=2, nm_m=4, causal=True,
                                  mma="sp", operand_dtype=od))
    cubin, meta, src = cuda.build_cubin(v, "sm_90")
    ty = "f16" if od == "float16" else "bf16"
    assert f"mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{ty}.{ty}.f32" in src
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32" in src
    assert cubin[:4] == b"\x7fELF" and meta["block"] == [SP.SP_THREADS, 1, 1]
    assert meta["shared_mem"] <= 48 * 1024
    kinds = {p["name"]: p["kind"] for p in CubinKernel(cubin, dict(meta, cubin_sha256=meta["cubin_sha256"])).meta["params"]}
    assert kinds["Q_ptr"] == "pointer" and kinds["scale"] == "scalar"
