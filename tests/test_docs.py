"""The code in README.md and docs/*.md runs.

Every ```python block of a file runs, in order, in one namespace per file (later blocks use the names of
earlier ones), on CPU, in a temporary working directory. A block may opt out only as ```python no-run,
with the reason in an HTML comment on the line before it (``<!-- no-run: needs two processes -->``).

Shell blocks (```bash, ```sh) are not run; every ``python -m attncomp <command>`` and ``make <target>``
that they (or inline code in the text) name must exist: the commands of ``attncomp.cli.COMMANDS`` and the
targets of the Makefile.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
#: the command line's subcommands (DESIGN.md §2), accepted while ``COMMANDS`` does not register them all yet
CLI_COMMANDS = ("report", "bench", "zoo", "build-kernels")

_FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
_SHELL = ("bash", "sh", "shell", "console")
_NO_RUN_REASON = re.compile(r"^<!--\s*no-run:\s*\S.*-->\s*$")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def blocks(text: str) -> List[Tuple[int, str, str, str]]:
    """``(line, language, options, code)`` of every fenced block; ``line`` is the fence's (1-based)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, opts = i, m.group(1), m.group(2).strip()
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"line {start + 1}: unclosed code block")
        out.append((start + 1, lang, opts, "\n".join(body) + "\n"))
        i += 1
    return out


def _reason_before(text: str, line: int) -> bool:
    lines = text.splitlines()
    return line >= 2 and bool(_NO_RUN_REASON.match(lines[line - 2].strip()))


def test_blocks_parse():
    text = "a\n<!-- no-run: two ranks -->\n```python no-run\nx = 1\n```\n```bash\nmake demo\n```\n"
    got = blocks(text)
    assert [(b[0], b[1], b[2]) for b in got] == [(3, "python", "no-run"), (6, "bash", "")]
    assert got[0][3] == "x = 1\n"
    assert _reason_before(text, 3) and not _reason_before(text, 6)


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_python_blocks_run(path, tmp_path, monkeypatch, fresh_dynamo):
    text = path.read_text()
    code = []
    for line, lang, opts, body in blocks(text):
        if lang not in ("python", "py"):
            continue
        if opts == "no-run":
            assert _reason_before(text, line), \
                f"{path.name}:{line}: a no-run block needs its reason on the line before (<!-- no-run: why -->)"
            continue
        assert not opts, f"{path.name}:{line}: unknown block option {opts!r} (only 'no-run')"
        code.append((line, body))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    # a module of its own, importable while the page runs: dynamo looks up the module of the classes it traces
    module = types.ModuleType(f"attncomp_docs_{path.stem.replace('-', '_')}")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        for line, body in code:
            try:
                exec(compile(body, f"{path.name}:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{path.name}: the block at line {line} raised {type(e).__name__}: {e}") from e
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a page that failed before its cleanup block
            dist.destroy_process_group()


def _make_targets() -> set:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))
    for phony in re.findall(r"^\.PHONY:(.*)$", text, flags=re.M):
        targets |= set(phony.split())
    return targets


def _cli_commands() -> set:
    from attncomp.cli import COMMANDS

    return set(COMMANDS) | set(CLI_COMMANDS)


_CLI_USE = re.compile(r"python3? -m attncomp(?:\s+([A-Za-z][\w-]*))?")
_MAKE_USE = re.compile(r"(?:^|[\s`;&|(])make\s+([A-Za-z][\w.-]*)")


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_shell_commands_exist(path):
    text = path.read_text()
    shell = [body for _, lang, _, body in blocks(text) if lang in _SHELL]
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    commands, targets = _cli_commands(), _make_targets()
    bad = []
    for snippet in shell + inline:
        for line in snippet.splitlines():
            line = line.split("#", 1)[0]
            for m in _CLI_USE.finditer(line):
                if m.group(1) is None or m.group(1) not in commands:
                    bad.append(f"python -m attncomp {m.group(1) or ''}: not one of {sorted(commands)}")
            for m in _MAKE_USE.finditer(line):
                if m.group(1) not in targets:
                    bad.append(f"make {m.group(1)}: not a Makefile target ({sorted(targets)})")
    assert not bad, f"{path.name}: " + "; ".join(bad)


def test_docs_exist():
    names = {p.name for p in DOCS}
    for name in ("how-it-works.md", "generation.md", "distributed.md", "spion.md", "performance.md"):
        assert name in names, f"docs/{name} is missing"
