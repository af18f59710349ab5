import os

import pytest
import torch

# Tests that check rewrites compile without Inductor (its compile time would dominate the suite);
# tests/e2e/test_inductor.py compiles a representative set with it (inductor=True).
os.environ.setdefault("ATTNCOMP_INDUCTOR", "0")
# Without a GPU the Triton kernels run under the interpreter. Set here, before any test module is
# collected: the modules that set it themselves on import would otherwise depend on being collected
# before the first import of Triton (a subset collected in another order got compiled-mode kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    _sample(config, items)
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return
        # TRITON_INTERPRET=1, from the environment or from an interpreter test module collected in this
        # process (they set it on import): Triton kernels imported since are interpreted, and the GPU
        # tests would fail on them
        skip = pytest.mark.skip(reason="TRITON_INTERPRET=1 in this process (the environment, or an interpreter "
                                       "test module collected with these tests): run the GPU tests in a "
                                       "pytest run of their own (make test-gpu)")
    else:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _sample(config, items):
    """``@pytest.mark.sample(n)`` on a parametrized test: ``make test`` runs ``n`` of its cases, spread evenly
    over its list (the first and the last always), the same ones on every run and every xdist worker;
    ``ATTNCOMP_TEST_FULL=1`` (``make test-full``) runs them all. For the long combinatorial lists of the
    kernel interpreter tests, whose every case is a few seconds of interpreted Triton."""
    from tests.utils import FULL

    if FULL:
        return
    groups = {}
    for item in items:
        mark = item.get_closest_marker("sample")
        if mark is not None and getattr(item, "callspec", None) is not None:
            groups.setdefault((item.module.__name__, item.originalname), (mark.args[0], []))[1].append(item)
    drop = set()
    for n, group in groups.values():
        total = len(group)
        if total <= n:
            continue
        keep = {round(i * (total - 1) / (n - 1)) for i in range(n)} if n > 1 else {0}
        drop.update(id(it) for k, it in enumerate(group) if k not in keep)
    if drop:
        config.hook.pytest_deselected(items=[it for it in items if id(it) in drop])
        items[:] = [it for it in items if id(it) not in drop]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test uses a private kernel/autotune cache unless it sets its own."""
    if "ATTNCOMP_CACHE_DIR" not in os.environ or os.environ.get("ATTNCOMP_TEST_SHARED_CACHE") != "1":
        monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path_factory.mktemp("attncomp-cache")))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters cleared before and after the test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def tvm_cache_dir(tmp_path_factory):
    """One kernel cache folder for every test and (under xdist) every worker: TVM kernels build once."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-") else root
    d = root / "attncomp-tvm-kernels"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture
def tvm_poisoned(tvm_cache_dir, monkeypatch):
    """The session's TVM kernel cache, and the TVM backend's output buffers poisoned (NaN, or -12345 for
    integers) before its kernels write them."""
    from attncomp.codegen.tvm import backend as TB
    from tests.utils import poisoned_empty

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tvm_cache_dir))
    monkeypatch.setattr(TB, "_empty", poisoned_empty)


@pytest.fixture
def op_calls(monkeypatch):
    """The specs of the op's implementation calls (eager, or from compiled code after its first call)."""
    from attncomp import ops

    calls = []
    real = ops._attention_impl

    def counted(*args):
        calls.append(args[ops.ARG_INDEX["spec"]])
        return real(*args)

    monkeypatch.setattr(ops, "_attention_impl", counted)
    monkeypatch.setattr(ops, "_direct_impl", torch._disable_dynamo(counted))
    return calls
