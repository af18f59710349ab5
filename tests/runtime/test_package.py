"""The AOT package format: round trip in a fresh process, and every way a package is refused."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import Dim

import attncomp
from attncomp.runtime.package import FORMAT_VERSION, PackageError, load_package, read_manifest, save_package

REPO = Path(__file__).resolve().parents[2]
MARKER = "attncomp-test-pickle-marker"


class Toy(torch.nn.Module):
    """Self-attention through the functional API on projections of x."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.register_buffer("shift", torch.randn(dim))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = attncomp.functional.attention(q, k, v, is_causal=True, policy="dense")
        return self.out(y.transpose(1, 2).reshape(B, N, C)) + self.shift


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    torch.manual_seed(0)
    model = Toy().eval()
    x = torch.randn(2, 8, 32)
    dyn = {"x": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=4096)}}
    try:
        ep = torch.export.export(model, (x,), dynamic_shapes=dyn)
        dynamic = True
    except Exception as e:
        # the functional API's input checks turn symbolic sizes into ints (see test below)
        if "specialized" not in str(e):
            raise
        ep = torch.export.export(model, (x,))
        dynamic = False
    path = tmp_path_factory.mktemp("pkg") / "toy.acpkg"
    meta = {"sites": [{"spec": "dense causal", "backend": "reference"}], "report": "1 site rewritten"}
    digest = save_package(path, ep, meta)
    return types.SimpleNamespace(model=model, ep=ep, x=x, path=path, digest=digest, meta=meta, dynamic=dynamic)


def _copy(pkg, tmp_path) -> Path:
    p = tmp_path / "copy.acpkg"
    p.write_bytes(pkg.path.read_bytes())
    return p


def _read(path):
    with zipfile.ZipFile(path) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    return json.loads(entries.pop("manifest.json")), entries


def _write(path, manifest, entries, rehash=True):
    """Rewrite a package, recomputing the manifest's hashes: what a deliberate tamperer would do."""
    if rehash:
        manifest["entries"] = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in entries.items()}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
        for n, d in entries.items():
            zf.writestr(n, d)


@pytest.fixture
def no_pickle(monkeypatch):
    """Make every unpickling entry point raise, and record whether any was reached."""
    reached = []

    def refuse(*a, **k):
        reached.append(True)
        raise AssertionError("unpickling was reached")

    class NoUnpickler:
        def __init__(self, *a, **k):
            refuse()

    for mod in (pickle, sys.modules["_pickle"]):
        monkeypatch.setattr(mod, "Unpickler", NoUnpickler)
        monkeypatch.setattr(mod, "loads", refuse)
        monkeypatch.setattr(mod, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch._C, "_pickle_load_obj", refuse, raising=False)
    return reached


class _Evil:
    """A pickle that would create a marker file when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


# ---------------------------------------------------------------------------------------------
# round trip

def test_roundtrip_in_fresh_process(pkg, tmp_path):
    """Load in a process that only imported attncomp, with every unpickler disabled."""
    inputs = [pkg.x]
    if pkg.dynamic:
        inputs += [torch.randn(3, 13, 32), torch.randn(1, 64, 32)]  # new batch and sequence lengths
    for i, x in enumerate(inputs):
        np.save(tmp_path / f"in{i}.npy", x.numpy())
    script = textwrap.dedent("""
        import json, pickle, sys, _pickle
        import numpy as np, torch
        def refuse(*a, **k):
            raise AssertionError("unpickling was reached")
        class NoUnpickler:
            def __init__(self, *a, **k): refuse()
        for m in (pickle, _pickle):
            m.Unpickler, m.loads, m.load = NoUnpickler, refuse, refuse
        torch.load = refuse
        torch._C._pickle_load_obj = refuse
        import attncomp
        from attncomp.runtime.package import load_package
        ep, meta = load_package(sys.argv[1])
        mod = ep.module()
        for i in range(int(sys.argv[3])):
            x = torch.from_numpy(np.load(f"{sys.argv[2]}/in{i}.npy", allow_pickle=False))
            np.save(f"{sys.argv[2]}/out{i}.npy", mod(x).detach().numpy())
        print(json.dumps(meta))
    """)
    r = subprocess.run([sys.executable, "-c", script, str(pkg.path), str(tmp_path), str(len(inputs))],
                       env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == pkg.meta
    with torch.no_grad():
        for i, x in enumerate(inputs):
            got = torch.from_numpy(np.load(tmp_path / f"out{i}.npy"))
            torch.testing.assert_close(got, pkg.model(x), rtol=0, atol=0)


def test_export_with_dynamic_batch_and_sequence(pkg):
    assert pkg.dynamic, "the export with dynamic batch and sequence sizes failed"
    ep, _ = load_package(pkg.path)
    x = torch.randn(5, 31, 32)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), pkg.model(x), rtol=0, atol=0)


def test_roundtrip_in_process(pkg, no_pickle):
    ep, meta = load_package(pkg.path, expected_digest=pkg.digest)
    assert meta == pkg.meta and not no_pickle
    assert set(ep.state_dict) == set(pkg.ep.state_dict)
    for k, v in pkg.ep.state_dict.items():
        assert type(ep.state_dict[k]) is type(v) and torch.equal(ep.state_dict[k], v)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "attncomp.attention.default" in targets
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(pkg.x), pkg.model(pkg.x), rtol=0, atol=0)
    ep2, _ = load_package(pkg.path, map_location="cpu")
    assert all(t.device.type == "cpu" for t in ep2.state_dict.values())


def test_save_is_deterministic(pkg, tmp_path):
    d = save_package(tmp_path / "again.acpkg", pkg.ep, pkg.meta)
    assert d == pkg.digest and (tmp_path / "again.acpkg").read_bytes() == pkg.path.read_bytes()
    m = read_manifest(pkg.path)
    assert m["format_version"] == FORMAT_VERSION and m["meta"] == pkg.meta
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["attncomp"] == attncomp.__version__


def test_shape_guards_survive_the_checks(tmp_path):
    """A program whose guards .module() compiles: real guard code passes the safety checks."""

    class Branchy(torch.nn.Module):
        def forward(self, x, y):
            if x.shape[1] > 4:
                return x[:, :4] * 2 + y.sum()
            return x

    n = Dim("n", min=5, max=100)
    ep = torch.export.export(Branchy(), (torch.randn(3, 8), torch.randn(3, 8)),
                             dynamic_shapes={"x": {1: n}, "y": {1: n}})
    assert ep._guards_code, "expected torch.export to record guard code for this program"
    save_package(tmp_path / "b.acpkg", ep)
    ep2, meta = load_package(tmp_path / "b.acpkg")
    assert meta == {} and ep2._guards_code == ep._guards_code
    x, y = torch.randn(3, 9), torch.randn(3, 9)
    torch.testing.assert_close(ep2.module()(x, y), x[:, :4] * 2 + y.sum())


def test_save_refuses_bad_input(pkg, tmp_path):
    with pytest.raises(PackageError, match="JSON-serialisable"):
        save_package(tmp_path / "x.acpkg", pkg.ep, {"bad": object()})
    with pytest.raises(TypeError, match="ExportedProgram"):
        save_package(tmp_path / "x.acpkg", pkg.model, {})
    assert not (tmp_path / "x.acpkg").exists()


# ---------------------------------------------------------------------------------------------
# damaged and tampered packages

def test_flipped_byte_in_any_entry_names_the_entry(pkg, tmp_path):
    raw = pkg.path.read_bytes()
    with zipfile.ZipFile(pkg.path) as zf:
        infos = zf.infolist()
    assert {"manifest.json", "program.json", "tensors.json"} <= {i.filename for i in infos}
    for info in infos:
        # data starts after the local header: 30 fixed bytes, the name and the extra field
        name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
            int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
        start = info.header_offset + 30 + name_len + extra_len
        bad = bytearray(raw)
        bad[start + info.compress_size // 2] ^= 0x01
        p = tmp_path / "flipped.acpkg"
        p.write_bytes(bytes(bad))
        with pytest.raises(PackageError, match=repr(info.filename).replace(".", r"\.")):
            load_package(p)


@pytest.mark.parametrize("entry", ["program.json", "tensors.json", "tensors.safetensors"])
def test_changed_entry_with_valid_zip_checksum_fails_sha256(pkg, tmp_path, entry):
    manifest, entries = _read(pkg.path)
    data = bytearray(entries[entry])
    data[len(data) // 2] ^= 0x01
    entries[entry] = bytes(data)
    p = tmp_path / "t.acpkg"
    _write(p, manifest, entries, rehash=False)
    with pytest.raises(PackageError, match=rf"entry '{entry}': sha256 does not match"):
        load_package(p)


@pytest.mark.parametrize("keep", [0, 100, 0.5, -1, -30])
def test_truncated_file(pkg, tmp_path, keep):
    raw = pkg.path.read_bytes()
    n = int(len(raw) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(raw) + keep)
    p = tmp_path / "trunc.acpkg"
    p.write_bytes(raw[:n])
    with pytest.raises(PackageError, match="truncated"):
        load_package(p)


def test_wrong_format_version(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    manifest["format_version"] = FORMAT_VERSION + 1
    _write(tmp_path / "v.acpkg", manifest, entries)
    with pytest.raises(PackageError, match=f"format version {FORMAT_VERSION + 1} is not supported"):
        load_package(tmp_path / "v.acpkg")
    manifest["format"] = "something-else"
    _write(tmp_path / "v.acpkg", manifest, entries)
    with pytest.raises(PackageError, match="does not describe"):
        load_package(tmp_path / "v.acpkg")


def test_torch_version_mismatch(pkg, tmp_path, caplog):
    manifest, entries = _read(pkg.path)
    major, minor = torch.__version__.split(".")[:2]
    manifest["versions"]["torch"] = f"{major}.{int(minor) + 1}.0"
    p = tmp_path / "tv.acpkg"
    _write(p, manifest, entries)
    with pytest.raises(PackageError, match=rf"torch {major}\.{int(minor) + 1}\.0.*major\.minor"):
        load_package(p)
    ep, _ = load_package(p, allow_version_mismatch=True)  # the caller may choose to try
    assert "loading anyway" in caplog.text
    manifest["versions"]["export_schema"] = [999, 0]
    _write(p, manifest, entries)
    with pytest.raises(PackageError, match="export schema"):
        load_package(p, allow_version_mismatch=True)


def test_expected_digest(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    manifest["meta"]["report"] = "something else"
    p = tmp_path / "d.acpkg"
    _write(p, manifest, entries)
    load_package(p)  # self-consistent, so only a known digest can tell
    with pytest.raises(PackageError, match="digest does not match"):
        load_package(p, expected_digest=pkg.digest)


def test_missing_entry(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    del entries["tensors.safetensors"]
    _write(tmp_path / "m.acpkg", manifest, entries, rehash=False)
    with pytest.raises(PackageError, match=r"\['tensors.safetensors'\] are missing"):
        load_package(tmp_path / "m.acpkg")


# ---------------------------------------------------------------------------------------------
# pickles are refused, never loaded

def test_listed_pickle_entry_is_refused(pkg, tmp_path, no_pickle):
    manifest, entries = _read(pkg.path)
    marker = tmp_path / MARKER
    entries["weights.pkl"] = pickle.dumps(_Evil(str(marker)))
    _write(tmp_path / "p.acpkg", manifest, entries)
    with pytest.raises(PackageError, match="'weights.pkl' is not part of the attncomp-package format"):
        load_package(tmp_path / "p.acpkg")
    assert not marker.exists() and not no_pickle


def test_unlisted_pickle_entry_is_refused(pkg, tmp_path, no_pickle):
    manifest, entries = _read(pkg.path)
    marker = tmp_path / MARKER
    _write(tmp_path / "p.acpkg", manifest, entries)
    with zipfile.ZipFile(tmp_path / "p.acpkg", "a") as zf:
        zf.writestr("data.pkl", pickle.dumps(_Evil(str(marker))))
    with pytest.raises(PackageError, match=r"unexpected entries \['data.pkl'\]"):
        load_package(tmp_path / "p.acpkg")
    assert not marker.exists() and not no_pickle


def test_pickle_in_place_of_json_is_refused(pkg, tmp_path, no_pickle):
    manifest, entries = _read(pkg.path)
    marker = tmp_path / MARKER
    entries["tensors.json"] = pickle.dumps(_Evil(str(marker)))
    _write(tmp_path / "p.acpkg", manifest, entries)
    with pytest.raises(PackageError, match="'tensors.json' is not valid JSON"):
        load_package(tmp_path / "p.acpkg")
    assert not marker.exists() and not no_pickle


def test_torch_export_archive_is_refused(pkg, tmp_path, no_pickle):
    p = tmp_path / "model.pt2"
    torch.export.save(pkg.ep, p)
    with pytest.raises(PackageError, match="not an attncomp package"):
        load_package(p)
    assert not no_pickle


# ---------------------------------------------------------------------------------------------
# strings torch's deserialiser would evaluate are checked, even in a self-consistent package

def _mutate_program(pkg, tmp_path, fn) -> Path:
    manifest, entries = _read(pkg.path)
    prog = json.loads(entries["program.json"])
    fn(prog)
    entries["program.json"] = json.dumps(prog).encode()
    p = tmp_path / "evil.acpkg"
    _write(p, manifest, entries)
    return p


def _nodes(prog):
    return prog["graph_module"]["graph"]["nodes"]


def _retarget(new):
    def fn(prog):
        node = next(n for n in _nodes(prog) if n["target"].startswith("torch.ops.attncomp."))
        node["target"] = new
    return fn


@pytest.mark.parametrize("target", ["torch.load", "builtins.eval", "torch.hub.load", "os.system",
                                    "torch.ops.aten.__class__.__init__"])
def test_unsafe_operator_target_is_refused(pkg, tmp_path, target, no_pickle):
    p = _mutate_program(pkg, tmp_path, _retarget(target))
    with pytest.raises(PackageError, match="not an aten/prims/higher_order/attncomp operator"):
        load_package(p)


def test_unknown_operator_is_refused(pkg, tmp_path):
    p = _mutate_program(pkg, tmp_path, _retarget("torch.ops.attncomp.no_such_op.default"))
    with pytest.raises(PackageError, match=r"torch\.ops\.attncomp\.no_such_op\.default.*not registered"):
        load_package(p)


def _first_expr(prog):
    stack = [prog]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if "expr_str" in o:
                return o
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return None


@pytest.mark.parametrize("expr", [
    "__import__('os').makedirs('{marker}')",
    "Symbol('s0').__class__",
    "lambdify([], 'x')",
    "Integer(open('{marker}', 'w').write('x'))",
    "[c for c in ().__class__.__base__.__subclasses__()]",
])
def test_unsafe_symbolic_expression_is_refused(pkg, tmp_path, expr):
    marker = tmp_path / MARKER

    def fn(prog):
        o = _first_expr(prog)
        if o is None:  # a static export has no symbolic sizes: plant one where torch reads it
            o = prog["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]
            o.clear()
            o["as_expr"] = o = {"hint": {"as_int": 2}}
        o["expr_str"] = expr.format(marker=marker)

    p = _mutate_program(pkg, tmp_path, fn)
    with pytest.raises(PackageError, match="symbolic expression"):
        load_package(p)
    assert not marker.exists()


@pytest.mark.parametrize("guard", [
    "L['x'].size()[0] == 2 or __import__('os').makedirs('{marker}')",
    "L['x'].size()[0] == 'a\") or __import__(\"os\").makedirs(\"{marker}\") or (\"'",
    "L['x'].size()[0] == 2\nimport os",
    "open('{marker}', 'w')",
    "L['x'].size()[0] == L.get('x')",
    "(lambda: 1)()",
])
def test_unsafe_guard_code_is_refused(pkg, tmp_path, guard):
    marker = tmp_path / MARKER

    def fn(prog):
        prog["guards_code"] = [guard.format(marker=marker)]

    p = _mutate_program(pkg, tmp_path, fn)
    with pytest.raises(PackageError, match="guard"):
        ep, _ = load_package(p)
        ep.module()
    assert not marker.exists()


def test_size_builtins_in_guards_pass_the_checks():
    """torch 2.11's export writes guards such as ``min(a, a*b) == a``: pure size arithmetic."""
    from attncomp.runtime.package import _check_guard

    _check_guard("min(L['x'].size()[2], L['x'].size()[1]*L['x'].size()[2]) == L['x'].size()[2]", "g")
    _check_guard("max(L['x'].size()[0], 1) >= abs(L['x'].size()[1] - 3)", "g")
    for bad in ("min(open('f'), 1) == 1", "min.__self__", "getattr(min, 'x')"):
        with pytest.raises(PackageError):
            _check_guard(bad, "g")


def test_bad_tensor_records_are_refused(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    doc = json.loads(entries["tensors.json"])
    name = next(iter(doc["state_dict"]))
    for change, msg in [({"dtype": "object"}, "unsupported dtype"), ({"shape": [10 ** 6]}, "does not match"),
                        ({"dtype": "float16"}, "does not match"),
                        ({"shape": [-1]}, "invalid shape"), ({"entry": "../etc/passwd"}, "does not hold")]:
        bad = json.loads(entries["tensors.json"])
        bad["state_dict"][name].update(change)
        e = dict(entries, **{"tensors.json": json.dumps(bad).encode()})
        _write(tmp_path / "bt.acpkg", dict(manifest), e)
        with pytest.raises(PackageError, match=msg):
            load_package(tmp_path / "bt.acpkg")


def test_no_pickle_fixture_catches_torch_export_load(pkg, tmp_path, no_pickle):
    """The guard used above is effective: torch's own loader does reach an unpickler."""
    p = tmp_path / "model.pt2"
    torch.export.save(pkg.ep, p)
    with pytest.raises(Exception):
        torch.export.load(p)
    assert no_pickle


def test_tied_weights_stay_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    m = Tied()
    ep = torch.export.export(m, (torch.randn(2, 4),))
    save_package(tmp_path / "t.acpkg", ep)
    # one tensor for the shared weight, one for the example input
    from safetensors.torch import load as st_load

    _, entries = _read(tmp_path / "t.acpkg")
    assert len(st_load(entries["tensors.safetensors"])) == 2
    ep2, _ = load_package(tmp_path / "t.acpkg")
    sd = ep2.state_dict
    assert sd["a.weight"] is sd["b.weight"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(ep2.module()(x), m(x))


# ---------------------------------------------------------------------------------------------
# format version 2: safetensors, kernel artefacts; version 1 still read

def _as_version_1(manifest, entries):
    """The same package in format version 1 (raw ``tensors/<i>.bin`` entries), as older attncomp wrote."""
    from safetensors.torch import load as st_load

    from attncomp.runtime.package import _tensor_bytes

    tensors = st_load(entries.pop("tensors.safetensors"))
    names = {key: f"tensors/{key[1:]}.bin" for key in tensors}
    for key, t in tensors.items():
        entries[names[key]] = _tensor_bytes(t)
    doc = json.loads(entries["tensors.json"])

    def rename(d):
        if isinstance(d, dict) and "entry" in d:
            d["entry"] = names[d["entry"]]
        return d

    for part in ("state_dict", "constants"):
        for d in doc[part].values():
            rename(d)
    if doc.get("example_inputs"):
        for d in doc["example_inputs"]["args"] + list(doc["example_inputs"]["kwargs"].values()):
            rename(d)
    entries["tensors.json"] = json.dumps(doc).encode()
    manifest["format_version"] = 1
    return manifest, {n: d for n, d in entries.items() if not n.startswith("kernels/")}


def test_format_version_1_still_loads(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    assert FORMAT_VERSION == 2 and "tensors.safetensors" in entries
    m1, e1 = _as_version_1(manifest, entries)
    _write(tmp_path / "v1.acpkg", m1, e1)
    ep, meta = load_package(tmp_path / "v1.acpkg")
    assert meta == pkg.meta
    torch.testing.assert_close(ep.module()(pkg.x), pkg.model(pkg.x))
    # a version 1 package cannot smuggle version 2 entries (kernels) in
    e1["kernels/" + "A" * 52 + "/kernel.cubin"] = b"\x7fELF"
    _write(tmp_path / "v1k.acpkg", dict(m1), e1)
    with pytest.raises(PackageError, match="not part of the attncomp-package format version 1"):
        load_package(tmp_path / "v1k.acpkg")


def test_unknown_format_version_names_what_is_read(pkg, tmp_path):
    manifest, entries = _read(pkg.path)
    manifest["format_version"] = 3
    _write(tmp_path / "v3.acpkg", manifest, entries)
    with pytest.raises(PackageError, match="reads versions 1, 2 and writes 2"):
        load_package(tmp_path / "v3.acpkg")


def test_kernel_artefacts_travel_into_the_cache(pkg, tmp_path, monkeypatch):
    from attncomp.runtime.cache import DiskCache, cache_key

    key = cache_key(kind="test-kernel", arch="sm_90")
    p = tmp_path / "k.acpkg"
    save_package(p, pkg.ep, pkg.meta, kernels={f"{key}/kernel.cubin": b"\x7fELF cubin bytes",
                                               f"{key}/launch.json": b'{"grid": [1, 1, 1]}'})
    assert f"kernels/{key}/kernel.cubin" in read_manifest(p)["entries"]
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    ep, _ = load_package(p)
    store = DiskCache(tmp_path / "cache")
    assert store.get(key, "kernel.cubin") == b"\x7fELF cubin bytes"
    assert store.get_json(key, "launch.json") == {"grid": [1, 1, 1]}
    # tampering with a kernel is caught like any other entry
    manifest, entries = _read(p)
    entries[f"kernels/{key}/kernel.cubin"] = b"\x7fELF evil bytes!"
    _write(tmp_path / "kt.acpkg", manifest, entries, rehash=False)
    with pytest.raises(PackageError, match="kernel.cubin': (size|sha256)"):
        load_package(tmp_path / "kt.acpkg")
    with pytest.raises(PackageError, match="cache key"):
        save_package(tmp_path / "bad.acpkg", pkg.ep, kernels={"../../etc/passwd": b""})


def test_tampered_safetensors_are_refused(pkg, tmp_path):
    from safetensors.torch import load as st_load, save as st_save

    manifest, entries = _read(pkg.path)
    tensors = st_load(entries["tensors.safetensors"])
    extra = dict(tensors, evil=torch.zeros(3))
    _write(tmp_path / "x.acpkg", dict(manifest), dict(entries, **{"tensors.safetensors": st_save(extra)}))
    with pytest.raises(PackageError, match="does not name"):
        load_package(tmp_path / "x.acpkg")
    _write(tmp_path / "g.acpkg", dict(manifest), dict(entries, **{"tensors.safetensors": b"\xff" * 64}))
    with pytest.raises(PackageError, match="not a valid safetensors"):
        load_package(tmp_path / "g.acpkg")
    k = next(iter(tensors))
    unused = dict(tensors, t999=torch.zeros(2))
    _write(tmp_path / "u.acpkg", dict(manifest), dict(entries, **{"tensors.safetensors": st_save(unused)}))
    with pytest.raises(PackageError, match="not referenced"):
        load_package(tmp_path / "u.acpkg")
    assert k.startswith("t")


def test_package_of_tvm_sites_carries_their_cuda_kernels(tmp_path, monkeypatch):
    """A package whose sites run on backend "tvm" carries the cached cubins that serve them."""
    pytest.importorskip("tvm")
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from attncomp.cli import main
    from attncomp.runtime.cache import DiskCache

    class TvmSite(torch.nn.Module):
        def forward(self, q, k, v):
            return attncomp.functional.attention(q, k, v, is_causal=True, policy="dense", backend="tvm")

    q = torch.randn(1, 2, 8, 32)
    ep = torch.export.export(TvmSite(), (q, q, q))
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path / "build"))
    assert main(["build-kernels", "--arch", "sm_90", "--policy", "dense,dfss", "--head-dim", "32", "--causal"]) == 0
    save_package(tmp_path / "tvm.acpkg", ep)
    kernels = [n for n in read_manifest(tmp_path / "tvm.acpkg")["entries"] if n.startswith("kernels/")]
    assert len(kernels) == 2 and {n.rsplit("/", 1)[1] for n in kernels} == {"kernel.cubin", "launch.json"}
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path / "gpu-machine"))
    load_package(tmp_path / "tvm.acpkg")
    key = kernels[0].split("/")[1]
    assert DiskCache(tmp_path / "gpu-machine").get(key, "kernel.cubin")[:4] == b"\x7fELF"
    # a package of sites on other backends carries none
    save_package(tmp_path / "plain.acpkg", torch.export.export(Toy(), (torch.randn(2, 8, 32),)))
    assert not [n for n in read_manifest(tmp_path / "plain.acpkg")["entries"] if n.startswith("kernels/")]
