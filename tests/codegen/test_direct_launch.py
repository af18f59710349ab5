"""Kept launches call Triton's compiled C launcher directly (``launch.direct_launcher``): the C
launcher must get exactly what ``CudaLauncher.__call__`` would have given it, host tensor
descriptors expanded as Triton expands them, and an encoded descriptor reused only for the same
base address, shape, strides and padding. On a machine without a GPU the C launcher is a recorder
and the encoding a stand-in that names what it was given; the launcher object is Triton's own class,
its ``__call__`` (the oracle) unchanged."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
nv = pytest.importorskip("triton.backends.nvidia.driver")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from attncomp.codegen.triton import launch  # noqa: E402

_SIG_PLAIN = {0: "*fp16", 1: "i32", 2: "fp32", 3: "constexpr"}
# two host descriptors (one lowered to a TMA map, one to pointer/shape/strides), a pointer between
_SIG_DESC = {0: "tensordesc<fp16[64, 32]>", 1: "*fp32", 2: "tensordesc<fp16[64, 32]>", 3: "i32",
             4: "constexpr"}
_META = [{"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [64, 32], "fp4_padded": False}, None]


class _Kernel:
    """A compiled kernel as ``FastLaunch`` keeps it: ``run`` is Triton's ``CudaLauncher``."""

    function, packed_metadata = 0xF00, ("meta",)

    def __init__(self, signature, meta, scratch=0):
        self.calls = []
        run = object.__new__(nv.CudaLauncher)
        run.launch = nv.wrap_handle_tensordesc(lambda *a: self.calls.append(a), signature, meta)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, False
        run.global_scratch_size = run.profile_scratch_size = scratch
        run.global_scratch_align = run.profile_scratch_align = 128
        self.run = run


@pytest.fixture
def encodes(monkeypatch):
    """``make_tensordesc_arg`` with the encoding named by what it reads (base address, shape, strides,
    padding, metadata); counts encodings."""
    seen = []
    real = nv.make_tensordesc_arg

    def fake(arg, meta):
        if meta is None:
            return real(arg, meta)
        seen.append(1)
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding, id(meta)),
                *arg.shape, *arg.strides]

    monkeypatch.setattr(nv, "make_tensordesc_arg", fake)
    return seen


def _oracle(kernel, grid, args):
    kernel.run(*grid, 0x5, kernel.function, kernel.packed_metadata, None, None, None, *args)
    return kernel.calls.pop()


def _direct(kernel, grid, args):
    go = launch.direct_launcher(kernel)
    assert go is not None
    go(*grid, 0x5, args)
    return kernel.calls.pop()


def test_plain_kernel_gets_what_triton_would_pass():
    k = _Kernel(_SIG_PLAIN, None)
    for args in ((0x1000, 7, 0.5, 16), (0x2000, -3, 1.25, 16)):
        assert _direct(k, (3, 2, 1), args) == _oracle(k, (3, 2, 1), args)


def test_descriptors_expand_as_triton_expands_them(encodes):
    k = _Kernel(_SIG_DESC, _META)
    x = torch.randn(96, 32, dtype=torch.float16)
    y = torch.randn(128, 32, dtype=torch.float16)
    for a, b, n in ((x, y, 5), (y, x, 6), (x[:64], y[32:], 7)):
        da = TensorDescriptor(a, list(a.shape), list(a.stride()), [64, 32])
        db = TensorDescriptor(b, list(b.shape), list(b.stride()), [64, 32])
        args = (da, 0x3000, db, n, 32)
        want, got = _oracle(k, (4, 1, 1), args), _direct(k, (4, 1, 1), args)
        assert got == want
        assert got[13] == ("map", a.data_ptr(), tuple(a.shape), tuple(a.stride()), "zero", id(_META[0]))


def test_an_encoding_is_reused_only_for_what_it_encodes(encodes):
    k = _Kernel(_SIG_DESC, _META)
    x = torch.randn(256, 32, dtype=torch.float16)
    other = torch.randn(64, 32, dtype=torch.float16)
    db = TensorDescriptor(other, [64, 32], [32, 1], [64, 32])

    def call(t, shape, strides, padding="zero"):
        d = TensorDescriptor(t, shape, strides, [64, 32], padding=padding)
        got = _direct(k, (1, 1, 1), (d, 0, db, 1, 32))
        assert got == _oracle(k, (1, 1, 1), (d, 0, db, 1, 32))
        return got[13]

    call(x, [256, 32], [32, 1])
    n = len(encodes)
    first = call(x, [256, 32], [32, 1])
    assert len(encodes) == n + 1  # (the oracle's); the direct launch reused its map
    for t, shape, strides, padding in ((x[64:], [192, 32], [32, 1], "zero"), (x, [128, 32], [32, 1], "zero"),
                                       (x, [128, 32], [64, 1], "zero"), (x, [256, 32], [32, 1], "nan")):
        n = len(encodes)
        m = call(t, shape, strides, padding)
        assert len(encodes) == n + 2 and m != first  # encoded afresh


def test_kept_arguments_launch_what_triton_would_pass(encodes):
    """``launch.kept_launcher``: arguments expanded once (descriptors encoded, tensors as addresses)
    and launched again later give the C launcher what ``CudaLauncher.__call__`` gives it for the
    original arguments, every time, for plain and descriptor kernels; the caller's tensors are not
    held by what it keeps."""
    import weakref

    k = _Kernel(_SIG_DESC, _META)
    x = torch.randn(96, 32, dtype=torch.float16)
    y = torch.randn(128, 32, dtype=torch.float16)
    z = torch.randn(16, dtype=torch.float32)
    da = TensorDescriptor(x, list(x.shape), list(x.stride()), [64, 32])
    db = TensorDescriptor(y, list(y.shape), list(y.stride()), [64, 32])
    expand, go = launch.kept_launcher(k)
    kept = expand((da, z, db, 9, 32))
    assert not any(isinstance(a, torch.Tensor) for a in kept)
    # (the launcher takes a pointer argument as a tensor or as its address alike)
    want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in _oracle(k, (2, 3, 1), (da, z, db, 9, 32)))
    for _ in range(2):
        go(2, 3, 1, 0x5, kept)
        assert k.calls.pop() == want
    plain = _Kernel(_SIG_PLAIN, None)
    expand, go = launch.kept_launcher(plain)
    t = torch.randn(8, dtype=torch.float16)
    ref = weakref.ref(t)
    kept = expand((t, 7, 0.5, 16))
    go(1, 1, 1, 0x5, kept)
    assert plain.calls.pop() == _oracle(plain, (1, 1, 1), (t.data_ptr(), 7, 0.5, 16))
    del t
    assert ref() is None  # only its address was kept


def test_unknown_launchers_take_kernel_run():
    class Plain:  # not Triton's CudaLauncher (another driver, an older Triton, a test stand-in)
        function, packed_metadata = 1, ()
        run = staticmethod(lambda *a: None)

    assert launch.direct_launcher(Plain()) is None
    assert launch.direct_launcher(_Kernel(_SIG_PLAIN, None, scratch=64)) is None  # scratch: per launch
