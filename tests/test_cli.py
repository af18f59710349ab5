"""``python -m attncomp``: every command's ``--help``, ``report`` of a transformers family and of a module of
one's own, the errors a user gets for an unknown family or path, and ``bench``'s dispatch to the benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attncomp import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TinyAttention(torch.nn.Module):
    """A user's module: one self-attention written out by hand (``report tests.test_cli:TinyAttention``)."""

    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        return self.out((p @ v).transpose(1, 2).reshape(b, n, d))

    def example_inputs(self):
        return (torch.randn(2, 8, 32),)


def tiny_factory():
    """A factory returning ``(module, example_inputs)``."""
    m = TinyAttention()
    return m, {"x": torch.randn(1, 5, 32)}


def _run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv", [[], ["report"], ["bench"], ["zoo"], ["build-kernels"]],
                         ids=["top", "report", "bench", "zoo", "build-kernels"])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m attncomp")
    if not argv:  # the top level lists every command
        for name in ("report", "bench", "zoo", "build-kernels"):
            assert name in out
    if argv == ["bench"]:
        for name in cli.BENCHMARKS:
            assert name in out


def test_help_as_a_module():
    """``python -m attncomp --help`` in a process of its own (the entry point, not only :func:`cli.main`)."""
    r = subprocess.run([sys.executable, "-m", "attncomp", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "report" in r.stdout and "bench" in r.stdout and "zoo" in r.stdout


def test_no_command_prints_help(capsys):
    rc, out, _ = _run([], capsys)
    assert rc == 2 and "usage:" in out


@pytest.fixture
def fast_compile(monkeypatch):
    monkeypatch.setenv("ATTNCOMP_INDUCTOR", "0")  # Inductor's CPU compile is the slow part, not what is tested
    yield
    torch._dynamo.reset()


def test_report_family(fast_compile, capsys):
    rc, out, err = _run(["report", "gpt2", "--policy", "dense"], capsys)
    assert rc == 0, err
    assert "attncomp report: policy=dense" in out
    assert "2 attention site(s), 2 rewritten" in out  # the tiny GPT-2 has two layers
    assert "transformer.h.0.attn" in out


@pytest.mark.parametrize("target", ["tests.test_cli:TinyAttention", "tests.test_cli:tiny_factory",
                                    os.path.join("tests", "test_cli.py") + ":TinyAttention"],
                         ids=["class", "factory", "file"])
def test_report_user_module(target, fast_compile, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out, err = _run(["report", target, "--policy", "dfss", "--capture", "fx"], capsys)
    assert rc == 0, err
    assert "policy=dfss" in out and "1 attention site(s), 1 rewritten" in out


@pytest.mark.parametrize("argv, message", [
    (["report", "nosuchfamily"], "unknown model family 'nosuchfamily'"),
    (["report", "gpt"], "did you mean"),
    (["report", "tests.no_such_module:Model"], "cannot import module 'tests.no_such_module'"),
    (["report", "tests.test_cli:NoSuchName"], "has no attribute 'NoSuchName'"),
    (["report", "tests.test_cli:ROOT"], "neither an nn.Module class nor a function"),
    (["report", "gpt2", "--policy", "nosuchpolicy"], "nosuchpolicy"),
], ids=["family", "close", "module", "attribute", "not-a-model", "policy"])
def test_report_errors(argv, message, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert message in err and out == ""


def test_report_unknown_family_exit_code():
    """As a user sees it: exit status 2 and one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", "attncomp", "report", "nosuchfamily"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    assert "unknown model family 'nosuchfamily'" in r.stderr and "Traceback" not in r.stderr


def test_bench_reaches_main(monkeypatch, capsys):
    """``bench models --smoke`` calls ``benchmarks/models.py``'s ``main`` with the remaining arguments (the smoke
    run itself takes minutes on a 2-core CPU; CI runs it: .ci/run)."""
    mod = cli.load_benchmark("models")
    seen = []
    monkeypatch.setattr(mod, "main", lambda argv: seen.append(argv) or 0)
    rc, _, _ = _run(["bench", "models", "--smoke", "--only", "gpt2"], capsys)
    assert rc == 0 and seen == [["--smoke", "--only", "gpt2"]]
    monkeypatch.setattr(mod, "main", lambda argv: 3)
    assert cli.main(["bench", "models"]) == 3


@pytest.mark.parametrize("name", ["kernels", "models", "distributed"])
def test_bench_help_of_each_benchmark(name, capsys):
    rc, out, _ = _run(["bench", name, "--help"], capsys)
    assert rc == 0 and f"python -m attncomp bench {name}" in out


def test_bench_missing_module(monkeypatch, tmp_path, capsys):
    """A benchmark not in the checkout, and a checkout without benchmarks/ (an installed wheel), say so."""
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path / "benchmarks")
    rc, _, err = _run(["bench", "quality"], capsys)
    assert rc == 2 and "benchmark 'quality' is not in this checkout" in err
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path / "nothing")
    rc, _, err = _run(["bench", "kernels"], capsys)
    assert rc == 2 and "no benchmarks folder" in err and "installed package" in err


def test_bench_unknown_name(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "nosuch"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_zoo_forwards_arguments(monkeypatch):
    """``zoo`` runs the registry sweep (``tests/zoo``) with the remaining arguments."""
    import importlib

    sweep = importlib.import_module("tests.zoo.__main__")
    seen = []
    monkeypatch.setattr(sweep, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["zoo", "--families", "llama,bert", "--jobs", "1"]) == 0
    assert seen == [["--families", "llama,bert", "--jobs", "1"]]
    assert cli.main(["zoo", "--help-sweep"]) == 0 and seen[-1] == ["--help"]

