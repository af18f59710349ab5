"""End to end: ahead-of-time packages, ``attncomp.export`` then ``attncomp.load``.

A loaded package reproduces the compiled model's outputs (in this process and in a fresh one that
only imports attncomp: no tracing, no model code), runs new sequence lengths, carries the report,
and is refused with a clear error when tampered with (DESIGN.md §7).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.nn as nn

import attncomp
from tests.e2e.toys import Stack as _Stack, keep_mask, tiny_bert
from tests.utils import rel_err

TOL = 1e-4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MHA(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h, self.dh = h, d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, keep):
        B, N, C = x.shape
        q, k, v = (lin(x).view(B, N, self.h, self.dh).transpose(1, 2) for lin in (self.q, self.k, self.v))
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


def Toy(n=2):
    return _Stack(MHA, n)


_keep = keep_mask


def _bert():
    return tiny_bert().eval()


def _bert_inputs(b, n):
    am = torch.ones(b, n, dtype=torch.long)
    am[1:, int(torch.randint(n // 2, n, (1,))):] = 0
    return dict(input_ids=torch.randint(3, 100, (b, n)), attention_mask=am)


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


# ---------------------------------------------------------------------------------------------
# Packages are built once per module: exporting BERT is the slow part


@pytest.fixture(scope="module")
def toy_pkg(tmp_path_factory):
    model = Toy().eval()
    x, keep = torch.randn(2, 9, 32), _keep(2, 9)
    fast = attncomp.compile(model, example_inputs=(x, keep))
    path = str(tmp_path_factory.mktemp("pkg") / "toy.acpkg")
    assert attncomp.export(fast, path, example_inputs=(x, keep)) == path
    return model, fast, path


@pytest.fixture(scope="module")
def bert_pkg(tmp_path_factory):
    model = _bert()
    x = _bert_inputs(2, 12)
    fast = attncomp.compile(model, example_inputs=x)
    path = str(tmp_path_factory.mktemp("pkg") / "bert.acpkg")
    attncomp.export(fast, path, example_inputs=x)
    return model, fast, path


def _check_loaded_toy(loaded, model):
    with torch.no_grad():
        for b, n in ((2, 9), (3, 14), (2, 5)):   # the export shape, then new sequence lengths and batch
            x, keep = torch.randn(b, n, 32), _keep(b, n)
            err = rel_err(_first(loaded(x, keep)), model(x, keep))
            assert err < TOL, f"loaded package differs from eager at ({b}, {n}): {err:.3g}"


def test_toy_roundtrip_same_process(toy_pkg):
    model, fast, path = toy_pkg
    loaded = attncomp.load(path)
    assert isinstance(loaded, nn.Module)
    _check_loaded_toy(loaded, model)
    rep = attncomp.report(loaded)
    assert [s.name for s in rep.sites] == [s.name for s in attncomp.report(fast).sites] == ["layers.0", "layers.1"]
    assert rep.rewritten == 2 and "layers.0" in str(rep)


def test_load_does_not_trace_or_compile(toy_pkg, monkeypatch):
    """Loading runs no capture and no pass: the package is the compiled program."""
    import attncomp.api
    import attncomp.passes.pipeline

    def boom(*a, **k):
        raise AssertionError("load() must not trace or run passes")

    monkeypatch.setattr(attncomp.api, "capture", boom)
    monkeypatch.setattr(attncomp.api, "run_passes", boom)
    monkeypatch.setattr(attncomp.passes.pipeline, "run_passes", boom)
    monkeypatch.setattr(torch.fx, "symbolic_trace", boom)
    monkeypatch.setattr(torch.export, "export", boom)
    model, _, path = toy_pkg
    _check_loaded_toy(attncomp.load(path), model)


def test_bert_roundtrip_same_process(bert_pkg):
    model, fast, path = bert_pkg
    loaded = attncomp.load(path)
    with torch.no_grad():
        for b, n in ((2, 12), (3, 17), (2, 6)):
            x = _bert_inputs(b, n)
            err = rel_err(_first(loaded(**x)), model(**x).last_hidden_state)
            assert err < TOL, f"loaded BERT differs from eager at ({b}, {n}): {err:.3g}"
    rep = attncomp.report(loaded)
    assert rep.rewritten == 2
    assert [s.name for s in rep.sites] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]


_CHILD = textwrap.dedent("""
    import sys, torch
    import attncomp
    assert "transformers" not in sys.modules
    path, data, out = sys.argv[1:4]
    loaded = attncomp.load(path)
    cases = torch.load(data, weights_only=True)
    outs = []
    with torch.no_grad():
        for args, kwargs in cases:
            y = loaded(*args, **kwargs)
            y = y if isinstance(y, torch.Tensor) else (y.last_hidden_state if hasattr(y, "last_hidden_state") else y[0])
            outs.append(y)
    torch.save(outs, out)
    print("sites", len(attncomp.report(loaded).sites), attncomp.report(loaded).rewritten)
    print("modules", sorted(m for m in sys.modules if m.split(".")[0] == "tests"))
    print("output", type(loaded(*cases[0][0], **cases[0][1])).__name__)
""")


def _run_child(path, cases, tmp_path):
    data, out = str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")
    torch.save(cases, data)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, data, out], capture_output=True, text=True,
                          cwd=str(tmp_path), env=env, timeout=180)
    assert proc.returncode == 0, f"fresh process failed to load/run the package:\n{proc.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return torch.load(out, weights_only=True), lines


def test_toy_fresh_process(toy_pkg, tmp_path):
    model, _, path = toy_pkg
    cases = [((torch.randn(b, n, 32), _keep(b, n)), {}) for b, n in ((2, 9), (3, 15))]
    outs, lines = _run_child(path, cases, tmp_path)
    assert lines["sites"] == "2 2"
    assert lines["modules"] == "[]"
    with torch.no_grad():
        for (args, _), y in zip(cases, outs, strict=True):
            assert rel_err(y, model(*args)) < TOL


def test_bert_fresh_process(bert_pkg, tmp_path):
    model, _, path = bert_pkg
    cases = [((), _bert_inputs(b, n)) for b, n in ((2, 12), (3, 7))]
    outs, lines = _run_child(path, cases, tmp_path)
    assert lines["sites"] == "2 2"
    assert lines["modules"] == "[]", "loading imported the test's code"
    # the output class is rebuilt from its installed library (transformers), never from the package
    assert lines["output"] == "BaseModelOutputWithPoolingAndCrossAttentions"
    with torch.no_grad():
        for (_, kwargs), y in zip(cases, outs, strict=True):
            assert rel_err(y, model(**kwargs).last_hidden_state) < TOL


# ---------------------------------------------------------------------------------------------
# Refusals


def _rewrite_zip(src, dst, change):
    """Copy the package, letting ``change(name, data) -> data | None`` edit (or drop) each entry."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = change(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info, data)
    return dst


def _flip_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def _tamper_cases():
    def weight(name, data):
        return _flip_byte(data) if name.endswith((".bin", ".safetensors")) and len(data) > 64 else data

    def program(name, data):
        if name != "program.json":
            return data
        return data.replace(b"attncomp", b"attncomq", 1)

    def drop_entry(name, data):
        return None if name.endswith((".bin", ".safetensors")) else data

    return {"weight-bytes": weight, "program-json": program, "missing-entry": drop_entry}


@pytest.mark.parametrize("case", list(_tamper_cases()))
def test_tampered_package_refused(toy_pkg, tmp_path, case):
    _, _, path = toy_pkg
    bad = _rewrite_zip(path, str(tmp_path / "bad.acpkg"), _tamper_cases()[case])
    with pytest.raises(ValueError) as ei:
        attncomp.load(bad)
    assert "tamper" in str(ei.value) or "missing" in str(ei.value) or "sha256" in str(ei.value), str(ei.value)


def test_extra_pickle_entry_refused(toy_pkg, tmp_path):
    import pickle

    _, _, path = toy_pkg
    bad = str(tmp_path / "extra.acpkg")
    _rewrite_zip(path, bad, lambda n, d: d)
    with zipfile.ZipFile(bad, "a") as z:
        z.writestr("data.pkl", pickle.dumps({"x": 1}))
    with pytest.raises(ValueError, match="data.pkl"):
        attncomp.load(bad)


def test_manifest_rewritten_with_a_foreign_operator_refused(toy_pkg, tmp_path):
    """Even with a consistent manifest, a graph calling something other than an operator is refused."""
    import hashlib

    _, _, path = toy_pkg
    with zipfile.ZipFile(path) as z:
        files = {i.filename: z.read(i.filename) for i in z.infolist()}
    program = files["program.json"].decode()
    assert "torch.ops.aten.linear.default" in program
    program = program.replace("torch.ops.aten.linear.default", "os.system", 1).encode()
    files["program.json"] = program
    manifest = json.loads(files["manifest.json"])
    manifest["entries"]["program.json"] = {"sha256": hashlib.sha256(program).hexdigest(), "size": len(program)}
    files["manifest.json"] = json.dumps(manifest).encode()
    bad = str(tmp_path / "foreign.acpkg")
    with zipfile.ZipFile(bad, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    with pytest.raises(ValueError, match="os.system"):
        attncomp.load(bad)


def test_not_a_package_refused(tmp_path):
    p = tmp_path / "junk.acpkg"
    p.write_bytes(os.urandom(256))
    with pytest.raises(ValueError, match="package"):
        attncomp.load(str(p))


def test_export_requires_a_compiled_module(tmp_path):
    with pytest.raises(TypeError):
        attncomp.export(Toy(), str(tmp_path / "x.acpkg"), example_inputs=(torch.randn(1, 3, 32), _keep(1, 3)))
