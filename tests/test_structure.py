"""The shape of the library, checked: no import cycle between its modules, no private
name imported across packages, ``parallel/`` against ``collectives`` only, and every
``COLLECTIVES_*`` variable read through the one table of ``collectives.settings``.

Imports are read from the source (module-level and function-level alike, and those
under ``TYPE_CHECKING``), so a cycle hidden inside a function still fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collectives", "backends", "parallel")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, the names taken from it, line) for every import statement."""
    package = _package_of(module, path)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, [a.name for a in node.names], node.lineno))
    return out


def _resolve(name: str, modules: dict) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for base, names, _ in _imports(module, path):
            for target in [base] + [f"{base}.{n}" for n in names]:
                found = _resolve(target, modules)
                # a package's own __init__ is not a cycle with its modules
                if found and found != module and not module.startswith(found + "."):
                    graph[module].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules_of_the_library():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_import_graph_finds_a_cycle(tmp_path):
    """The check itself: a cycle made of two modules is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_is_imported_across_packages():
    """``from x import _name`` only between modules of one package (a package's private
    names are its own business, another package's are not)."""
    modules = _modules()
    bad = []
    for module, path in modules.items():
        mine = _package_of(module, path)
        for base, names, line in _imports(module, path):
            target = _resolve(base, modules)
            if not target:
                continue  # another library's module
            theirs = _package_of(target, modules[target])
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and theirs != mine:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {private} from {base}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_parallel_imports_collectives_only():
    """The strategies are written against ``collectives``: never a backend, mpi4py, zmq
    or torch.distributed (DESIGN.md's layering rule)."""
    modules = _modules()
    bad = []
    for module, path in modules.items():
        if not module.startswith("parallel"):
            continue
        for base, _, line in _imports(module, path):
            if base.split(".")[0] in ("backends", "mpi4py", "zmq") or \
                    base.startswith("torch.distributed"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {base}")
    assert not bad, "\n".join(bad)


_VARIABLE = re.compile(r"COLLECTIVES_[A-Z]")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def variable_names_outside_settings() -> list[str]:
    """Every string in library code (not a docstring) that spells a ``COLLECTIVES_*``
    name, outside ``collectives/settings.py``: how a variable read around the table, or a
    name built with an f-string, shows."""
    found = []
    for module, path in _modules().items():
        if module == "collectives.settings":
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings and _VARIABLE.search(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return found


def test_every_variable_is_read_through_the_settings_table():
    found = variable_names_outside_settings()
    assert not found, ("COLLECTIVES_* spelled outside collectives/settings.py (read it "
                       "through its row, name it with setting.name):\n" + "\n".join(found))
