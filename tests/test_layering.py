"""Layering of remat_kit, read from the source with ``ast`` (nothing imported, no JAX).

No cycles among module-level imports, and no function-level import of remat_kit (the usual dodge of a
cycle) outside the CLI, whose commands import the library late on purpose (``--help`` imports no jax).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "remat_kit"

#: (module, imported module) -> why the import sits in a function. Each must be deliberate, never a cycle dodge.
LATE_ALLOWED: dict[tuple[str, str], str] = {
    ("remat_kit.policies", "remat_kit.wrap"): "a policy is data: building one must not import Flax",
    ("remat_kit.policies", "remat_kit.wrap_nnx"): "a policy is data: building one must not import Flax",
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The remat_kit modules an import statement loads (``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "remat_kit"]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    if base.split(".")[0] != "remat_kit":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def _is_type_checking(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _module_level(body: list[ast.stmt]):
    """Import statements that run when the module is imported (class bodies, ifs and trys included)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_type_checking(node):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_level([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """``(module -> remat_kit modules imported at module level, [(module, line, imported) in functions]])``."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph, late = {}, []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for node in _module_level(tree.body) for t in _targets(node, name, is_package, known)}
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in func.body:
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.Import, ast.ImportFrom)):
                            late += [(name, sub.lineno, t) for t in _targets(sub, name, is_package, known)]
    return graph, sorted(set(late))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "remat_kit"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_no_import_cycles():
    graph, _ = import_graph(PACKAGE)
    assert "remat_kit.model" in graph["remat_kit.lora"]  # the graph is real: lora sits above the model
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_late_imports_of_remat_kit_outside_the_cli():
    _, late = import_graph(PACKAGE)
    found = {(m, t) for m, _, t in late if not m.startswith("remat_kit.cli")}
    assert found - set(LATE_ALLOWED) == set(), [x for x in late if (x[0], x[2]) in found - set(LATE_ALLOWED)]
    assert set(LATE_ALLOWED) <= found, f"allow-list entries no longer needed: {set(LATE_ALLOWED) - found}"


@pytest.mark.parametrize(
    "files, cycle",
    [
        ({"__init__.py": "", "a.py": "from remat_kit import b\n", "b.py": "import remat_kit.a\n"}, True),
        ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "from .a import x\n"}, True),
        (
            {
                "__init__.py": "",
                "a.py": "try:\n    from remat_kit import b\nexcept ImportError:\n    pass\n",
                "b.py": "class C:\n    from remat_kit import a\n",
            },
            True,
        ),
        (
            {"__init__.py": "", "a.py": "from remat_kit import b\n", "b.py": "def f():\n    from remat_kit import a\n"},
            False,
        ),
        (
            {
                "__init__.py": "",
                "a.py": "from remat_kit import b\n",
                "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from remat_kit import a\n",
            },
            False,
        ),
    ],
    ids=["absolute", "relative", "try-and-class-body", "function-level", "type-checking"],
)
def test_the_checker_sees_cycles(tmp_path, files, cycle):
    graph, late = import_graph(_package(tmp_path, files))
    assert (find_cycle(graph) is not None) == cycle
    assert bool(late) == ("def f" in files["b.py"])


def test_modules_over_400_lines_say_why_at_the_top():
    long = {p.name: ast.get_docstring(ast.parse(p.read_text())) or "" for p in PACKAGE.rglob("*.py")
            if len(p.read_text().splitlines()) > 400}  # fmt: skip
    assert [name for name, doc in long.items() if "over 400 lines" not in doc] == []
