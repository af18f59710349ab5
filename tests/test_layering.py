"""Imports inside ``attncomp`` go down the layers (DESIGN.md §2): no module imports one that imports it
back, directly or through others.

The import graph is read from the source with ``ast``: every ``import`` and ``from ... import`` in a file,
at module level or inside a function (a lazy import still ties the two modules together), relative
imports resolved against the package, and ``from pkg import name`` counted as an import of the submodule
``pkg.name`` where one exists, else of ``pkg`` itself (its ``__init__``). The parent packages that Python
imports implicitly before a submodule are not counted: every module would then import ``attncomp``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1] / "attncomp"


def _modules(root: Path) -> Dict[str, Tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        mods[".".join(parts)] = (path, package)
    return mods


def _known(name: str, mods) -> str:
    """The innermost module of the package that ``name`` (a module or an attribute of one) lies in, or ''."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def _imported(node, module: str, package: bool, mods) -> List[str]:
    if isinstance(node, ast.Import):
        return [m for m in (_known(a.name, mods) for a in node.names) if m]
    if node.level:
        base = module.split(".") if package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
    out = subs
    if len(subs) < len(node.names):  # names of the module itself (its functions, classes, constants)
        out = out + [_known(target, mods)]
    return [m for m in out if m]


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _imports(tree: ast.Module) -> Iterator[ast.stmt]:
    """Every import statement of a module, in any block (function bodies, branches, handlers): the
    walk descends through statements only (an import is one), which is most of the speed of this test."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, _BLOCKS))


Graph = Dict[str, Dict[str, List[str]]]  # module -> imported module -> the places (file:line) that import it


def import_graph(root: Path = ROOT) -> Graph:
    """Modules of the package as nodes; an edge per imported module, with the places that import it."""
    mods = _modules(root)
    g: Graph = {m: {} for m in mods}
    for module, (path, package) in mods.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for dep in _imported(node, module, package, mods):
                g[module].setdefault(dep, []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return g


def _components(g: Graph) -> List[Set[str]]:
    """Strongly connected components (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    comps: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return comps


def _cycle_in(g: Graph, comp: Set[str]) -> List[str]:
    """A cycle through the component's first module, as the list of modules (first == last)."""
    start = min(comp)
    parent = {start: None}
    queue = [start]
    for v in queue:  # breadth first: the shortest cycle back to ``start``
        for w in sorted(g[v]):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if w in comp and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def cycles(g: Graph) -> List[str]:
    """One line per strongly connected component of more than one module, and per self-import: its
    modules and one cycle through them, each step with the lines that import."""
    found = []
    for comp in _components(g):
        first = next(iter(comp))
        if len(comp) == 1 and first not in g[first]:
            continue
        path = _cycle_in(g, comp)
        steps = " -> ".join(f"{a} ({', '.join(g[a][b])})" for a, b in zip(path, path[1:]))
        found.append(f"{sorted(comp)}: {steps} -> {path[-1]}")
    return sorted(found)


def test_no_import_cycles():
    g = import_graph()
    assert len(g) > 50 and sum(map(len, g.values())) > 100  # the graph was read
    found = cycles(g)
    assert not found, "import cycles in attncomp/ (move what both sides need into a module below them):\n" + \
        "\n".join(found)


def test_graph_reads_every_form_of_import(tmp_path):
    """The resolution rules above, on a package made for the test: relative and absolute imports,
    ``from pkg import submodule``, lazy imports, and a self-import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from . import a\n",
        "a.py": "def f():\n    from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from .. import c\nfrom ..a import f\n",
        "c.py": "import pkg.sub.b\nfrom pkg import VERSION\n",
        "d.py": "from . import d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = import_graph(pkg)
    edges: Set[Tuple[str, str]] = {(a, b) for a in g for b in g[a]}
    assert edges == {("pkg", "pkg.a"), ("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.c"), ("pkg.sub.b", "pkg.a"),
                     ("pkg.c", "pkg.sub.b"), ("pkg.c", "pkg"), ("pkg.d", "pkg.d")}
    found = cycles(g)
    assert len(found) == 2
    assert found[0].startswith("['pkg', 'pkg.a', 'pkg.c', 'pkg.sub.b']") and found[1].startswith("['pkg.d']")


def test_version_has_one_source():
    """Modules below the package's ``__init__`` read the version from ``attncomp._version`` (importing
    ``attncomp`` would import every layer above them)."""
    import attncomp
    from attncomp import _version

    assert attncomp.__version__ == _version.__version__
    # the package re-exports it rather than spelling it a second time
    assigned = [t.id for node in ast.walk(ast.parse(Path(attncomp.__file__).read_text()))
                if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]
    assert "__version__" not in assigned
