"""The import graph of ``ninfer_kv`` has no cycle — counting every import statement, also the
ones under ``if TYPE_CHECKING:`` and inside functions, so a command module cannot reach back
into the store even for a type (engine/txn.py is the surface they use instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import ninfer_kv

ROOT = Path(ninfer_kv.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from a.b import c`` counts a.b.c if that is a
    module, else a.b)."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules:
                    out.add(base)
    out.discard(me)
    return out


def graph(under: Path = ROOT) -> dict[str, set[str]]:
    paths = sorted(under.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def find_cycle(g: dict[str, set[str]], within: str) -> list[str] | None:
    """A cycle among modules whose name starts with ``within`` (package __init__ re-exports
    excluded: importing a package runs its __init__, which is not a back edge by itself)."""
    nodes = {m for m in g if m.startswith(within) and m != within}
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for n in sorted(g[m] & nodes):
            if color.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in color and (found := visit(n)):
                return found
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(nodes):
        if m not in color and (found := visit(m)):
            return found
    return None


def test_the_finder_sees_a_cycle_and_a_type_checking_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.a import X\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        g = graph(pkg)
    finally:
        ROOT = saved
    assert g["pkg.b"] == {"pkg.a"} and g["pkg.c"] == {"pkg.a"}
    assert find_cycle(g, "pkg") in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_the_engine_import_graph_has_no_cycle() -> None:
    g = graph()
    assert "ninfer_kv.engine.continuation" in g["ninfer_kv.engine.store"]  # the graph is real
    assert find_cycle(g, "ninfer_kv.engine") is None, find_cycle(g, "ninfer_kv.engine")


def test_the_package_import_graph_has_no_cycle() -> None:
    assert find_cycle(graph(), "ninfer_kv") is None, find_cycle(graph(), "ninfer_kv")


MAX_LINES = 400
"""#12: "no module over ~400 lines" — a file past it usually holds two ideas; split it by
idea (apply.py / apply_checkpoints.py / page_life.py are one example)."""


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
