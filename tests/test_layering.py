"""Layering of remat_kit, read from the source with ``ast`` (nothing imported, no JAX).

The package is a core and five wings above it, ``cli > bench > planning > train > model > core``. The core
has floors of its own, lowest first: the root modules (``_jax_internals``, ``units``, ``names``, ...),
``policies`` (pure JAX) and ``step`` (the one training step and its mesh), the frontends ``linen`` and
``nnx``, then ``unedited``, ``analysis`` and the dispatcher ``wrap``. A module imports only its own room
(wing or core folder) or the floors below it, never a neighbour on its own floor; there is no import cycle
(``TYPE_CHECKING`` imports included), and an import of a public name through the lazy face (``from remat_kit
import apply``) counts as an import of the module behind it. No function-level import of remat_kit (the
usual dodge of a cycle) outside the CLI, whose commands import the library late on purpose (``--help``
imports no jax).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "remat_kit"

#: (module, imported module) -> why the import sits in a function. Each must be deliberate, never a cycle dodge.
LATE_ALLOWED: dict[tuple[str, str], str] = {
    ("remat_kit.policies.policy", "remat_kit.wrap"): "policy(target) is remat_kit.remat; a policy must not import Flax",
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lazy_names(root: Path) -> dict[str, str]:
    """The lazy face of ``root``'s ``__init__``: public name -> the module it loads (read from ``_LAZY``)."""
    init = root / "__init__.py"
    tree = ast.parse(init.read_text()) if init.exists() else ast.Module(body=[], type_ignores=[])
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return {k: v[0] for k, v in ast.literal_eval(node.value).items()}
    return {}


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str], lazy: dict[str, str]
) -> list[str]:
    """The remat_kit modules an import statement loads (``from pkg import sub`` names the submodule; a name
    of the package's lazy face names the module behind it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "remat_kit"]
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    if base.split(".")[0] != "remat_kit":
        return []
    out = []
    for a in node.names:
        if f"{base}.{a.name}" in known:
            out.append(f"{base}.{a.name}")
        elif base == "remat_kit" and a.name in lazy:
            out.append(lazy[a.name])
        else:
            out.append(base)
    return out


#: The wings, lowest first: a module may import its own wing and those before it in this tuple.
WINGS = ("core", "model", "train", "planning", "bench", "cli")

#: The floors of the core, lowest first; each holds rooms (a folder, or ``root`` for the modules at the
#: package root, or ``wrap``, the dispatcher that sits above the frontends it dispatches to).
CORE_FLOORS = (("root",), ("policies", "step"), ("linen", "nnx"), ("unedited", "analysis", "wrap"))


def wing_of(module: str) -> str:
    """The wing of a remat_kit module: its first sub-package if that is a wing, else ``core``."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in WINGS else "core"


def room_of(module: str) -> str:
    """The room of a remat_kit module: its wing, or inside the core its folder (``root`` at the package root)."""
    if wing_of(module) != "core":
        return wing_of(module)
    parts = module.split(".")
    rooms = {r for floor in CORE_FLOORS for r in floor}
    return parts[1] if len(parts) >= 2 and parts[1] in rooms else "root"


def rank_of(module: str) -> int:
    """The floor of a module over the whole house: the core's floors, then the wings above them."""
    room = room_of(module)
    for i, floor in enumerate(CORE_FLOORS):
        if room in floor:
            return i
    return len(CORE_FLOORS) - 1 + WINGS.index(room)


def _module_level(body: list[ast.stmt]):
    """Import statements outside functions (class bodies, ifs, trys and ``TYPE_CHECKING`` blocks included)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_level([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """``(module -> remat_kit modules imported at module level, [(module, line, imported) in functions]])``."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known, lazy = set(files), lazy_names(root)
    graph, late = {}, []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for node in _module_level(tree.body) for t in _targets(node, name, is_package, known, lazy)}
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in func.body:
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.Import, ast.ImportFrom)):
                            late += [(name, sub.lineno, t) for t in _targets(sub, name, is_package, known, lazy)]
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


def wing_violations(
    graph: dict[str, set[str]], late: list[tuple[str, int, str]], allowed: frozenset = frozenset()
) -> list[str]:
    """Every import, at module level or in a function, of a room on a floor above the importer's or of a
    neighbour on its own floor; ``allowed`` holds deliberate (module, imported) pairs. The package itself
    (``remat_kit``, the lazy face) is no room: what it loads is counted at each name imported from it."""
    edges = [(m, t) for m, targets in graph.items() for t in targets] + [(m, t) for m, _, t in late]
    return sorted(
        f"{m} ({room_of(m)}) imports {t} ({room_of(t)})"
        for m, t in edges
        if t != "remat_kit"
        and (m, t) not in allowed
        and (rank_of(t) > rank_of(m) or (rank_of(t) == rank_of(m) and room_of(t) != room_of(m)))
    )


def test_no_import_cycles():
    graph, _ = import_graph(PACKAGE)
    assert "remat_kit.model.transformer" in graph["remat_kit.model.lora"]  # the graph is real
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_wing_order_holds():
    graph, late = import_graph(PACKAGE)
    assert {wing_of(m) for m in graph} == set(WINGS)  # every wing exists and is seen
    assert {room_of(m) for m in graph} >= {r for floor in CORE_FLOORS for r in floor}  # every core room too
    assert wing_violations(graph, late, frozenset(LATE_ALLOWED)) == []


def test_the_package_root_holds_a_handful_of_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


@pytest.mark.parametrize(
    "module, wing",
    [
        ("remat_kit", "core"),
        ("remat_kit.policies.policy", "core"),
        ("remat_kit.model", "model"),
        ("remat_kit.model.transformer", "model"),
        ("remat_kit.cli.plan", "cli"),
    ],
    ids=["root", "core-module", "wing-face", "wing-module", "cli"],
)
def test_wing_of(module, wing):
    assert wing_of(module) == wing


def test_the_wing_checker_sees_an_upward_import(tmp_path):
    root = tmp_path / "remat_kit"
    (root / "model").mkdir(parents=True)
    (root / "train").mkdir()
    (root / "__init__.py").write_text("")
    (root / "model" / "__init__.py").write_text("")
    (root / "train" / "__init__.py").write_text("")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from remat_kit.train import t\n"
    (root / "model" / "m.py").write_text(type_only)
    (root / "train" / "t.py").write_text("from remat_kit.model import m\n")
    (root / "core.py").write_text("def f():\n    from remat_kit.model import m\n")
    graph, late = import_graph(root)
    assert wing_violations(graph, late) == [
        "remat_kit.core (root) imports remat_kit.model.m (model)",
        "remat_kit.model.m (model) imports remat_kit.train.t (train)",
    ]


@pytest.mark.parametrize(
    "files, violation",
    [
        ({"policies/p.py": "from remat_kit.linen import s\n"}, "remat_kit.policies.p (policies) imports"),
        ({"linen/t.py": "from remat_kit.nnx import s\n"}, "remat_kit.linen.t (linen) imports remat_kit.nnx.s (nnx)"),
        ({"policies/p.py": "from remat_kit import apply\n"}, "remat_kit.policies.p (policies) imports remat_kit.u"),
        ({"model/m.py": "from remat_kit import apply\n"}, None),
    ],
    ids=["upward-floor", "neighbour", "through-the-lazy-face", "wing-through-the-face"],
)
def test_the_floor_checker_sees_core_violations(tmp_path, files, violation):
    root = tmp_path / "remat_kit"
    for folder in ("policies", "linen", "nnx", "unedited", "model"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
        (root / folder / "s.py").write_text("")
    (root / "__init__.py").write_text('_LAZY = {"apply": ("remat_kit.unedited.s", "apply")}\n')
    for name, text in files.items():
        (root / name).write_text(text)
    graph, late = import_graph(root)
    found = wing_violations(graph, late)
    assert (found == []) if violation is None else (len(found) == 1 and found[0].startswith(violation)), found


#: The generic planning engine: neither these modules nor what they import loads the built-in model or its
#: training. The built-in model's side (planning/builtin.py, tensors.py, analysis.py) and the entry above both
#: (planning/fit.py, ``remat_kit.fit`` and ``remat_kit.auto``) import it at module level: no late import.
GENERIC_PLANNING = tuple(
    f"remat_kit.planning.{m}"
    for m in ("planner", "budget", "engine", "solve", "limits", "cost", "pareto", "user_model")
)


def loaded_by(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` loads at import: its module-level imports, theirs, and so on, packages included."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for name in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:  # importing a.b.c runs a and a.b too
            if name not in seen:
                seen.add(name)
                todo += sorted(graph.get(name, ()))
    return seen


@pytest.mark.parametrize("module", GENERIC_PLANNING, ids=lambda m: m.rsplit(".", 1)[-1])
def test_the_generic_planner_loads_no_built_in_model(module):
    graph, _ = import_graph(PACKAGE)
    assert module in graph  # the module is real
    found = sorted(m for m in loaded_by(graph, module) if wing_of(m) in ("model", "train"))
    assert found == [], f"{module} loads {found}"


def test_the_load_checker_sees_a_built_in_model_two_imports_away(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from remat_kit import b\n", "b.py": "import remat_kit.c\n"})
    (root / "model").mkdir()
    (root / "model" / "__init__.py").write_text("")
    (root / "c.py").write_text("from remat_kit.model import m\n")
    (root / "model" / "m.py").write_text("")
    graph, _ = import_graph(root)
    assert {m for m in loaded_by(graph, "remat_kit.a") if wing_of(m) == "model"} == {
        "remat_kit.model",
        "remat_kit.model.m",
    }


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
            True,
        ),
    ],
    ids=["absolute", "relative", "try-and-class-body", "function-level", "type-checking"],
)
def test_the_checker_sees_cycles(tmp_path, files, cycle):
    graph, late = import_graph(_package(tmp_path, files))
    assert (find_cycle(graph) is not None) == cycle
    assert bool(late) == ("def f" in files["b.py"])


def test_each_module_says_its_one_job_in_its_first_line():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n", 1)[0]
        if not first or not first.endswith((".", ":")) or len(first) > 120:
            missing.append(f"{path.relative_to(PACKAGE)}: {first!r}")
    assert missing == []


EXAMPLES = PACKAGE.parent / "examples"


def example_imports(path: Path) -> list[str]:
    """Every module or name a script imports (``from a import b`` gives ``a.b``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.module}.{a.name}" for a in node.names]
    return found


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_import_public_names_only(path):
    text = path.read_text()
    ours = [m for m in example_imports(path) if m.split(".")[0] in ("remat_kit", "tests")]
    bad = [m for m in ours if m.startswith("tests") or any(p.startswith("_") for p in m.split("."))]
    assert bad == [] and "sys.path" not in text, f"{path.name}: a user who copies it cannot run {bad or 'sys.path'}"


def _exists(name: str) -> bool:
    """Whether ``name`` is an importable module, or an attribute of one."""
    import importlib

    try:
        importlib.import_module(name)
        return True
    except ImportError:
        parent, _, attr = name.rpartition(".")
        try:
            return hasattr(importlib.import_module(parent), attr)
        except ImportError:
            return False


def missing_names(path: Path) -> list[str]:
    """The ``remat_kit`` names a script imports that do not exist (a module moved by a re-house)."""
    return [m for m in example_imports(path) if m.split(".")[0] == "remat_kit" and not _exists(m)]


SCRIPTS = sorted([*EXAMPLES.glob("*.py"), *(PACKAGE.parent / "benchmarks").glob("*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scripts_import_names_that_exist(path):
    # Benchmarks run by hand, not in the suite: a moved module must still fail here, not months later.
    assert missing_names(path) == [], path.name


def test_the_name_checker_sees_a_moved_module(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("from remat_kit.train import step\nfrom remat_kit.units import fmt_bytes, fmt_nothing\n")
    assert missing_names(script) == ["remat_kit.train.step", "remat_kit.units.fmt_nothing"]


#: Longest function body in the core (code lines after the docstring) without a reason for its length.
MAX_CORE_FUNCTION_LINES = 80


def long_core_functions(root: Path) -> list[str]:
    """Core functions over :data:`MAX_CORE_FUNCTION_LINES` whose first statements carry no ``# Long: why`` line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root.parent / root.name)
        if wing_of(module) != "core":
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            start = first.end_lineno if docstring else node.body[0].lineno - 1
            if node.end_lineno - start > MAX_CORE_FUNCTION_LINES:
                head = lines[max(start - 2, 0) : start + 3]  # the lines around the first statement
                if not any(line.strip().startswith("# Long:") for line in head):
                    found.append(f"{module}.{node.name} ({node.end_lineno - start} lines)")
    return found


def test_core_functions_are_short_or_say_why():
    assert long_core_functions(PACKAGE) == []


def test_the_length_checker_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CORE_FUNCTION_LINES + 1))
    root = _package(
        tmp_path, {"__init__.py": "", "a.py": f"def f():\n{body}", "b.py": f"def g():\n    # Long: why\n{body}"}
    )
    assert long_core_functions(root) == ["remat_kit.a.f (81 lines)"]
