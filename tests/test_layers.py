"""DESIGN.md's layers, read off the source: no import cycles, no import upwards from the core
or the engine, no module taking another module's private names.

The layers: 1 the core twins, their scripts, errors and settings; 2 the engine; 3 the lock
clients; 4 the job decorator, its policy and the framework adapters; 5 the tools.
"""

from __future__ import annotations

import ast
from pathlib import Path

import joblock

PACKAGE = Path(joblock.__file__).parent

LAYERS = {
    "joblock._core": 1, "joblock._core_py": 1, "joblock._core_c": 1, "joblock._scripts": 1,
    "joblock._slot_tags": 1,
    "joblock.errors": 1, "joblock.settings": 1, "joblock.metrics": 1,
    "joblock._engine": 2,
    "joblock._client": 3, "joblock.locks": 3, "joblock.aio": 3, "joblock.cluster": 3,
    "joblock.redlock": 3, "joblock.compat": 3,
    "joblock.jobs": 4, "joblock.frameworks": 4, "joblock.renew": 4, "joblock.celery": 4, "joblock.rq": 4,
    "joblock.dramatiq": 4, "joblock.huey": 4, "joblock.arq": 4, "joblock.taskiq": 4,
    "joblock._tools": 5,
    "joblock": 6, "joblock.__main__": 6,
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(name: str) -> int:
    while name not in LAYERS:
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports(name: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import ``name`` runs, lazy ones too."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("joblock")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("joblock"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # `from . import errors`: the module itself
                    found.append((sub, []))
                else:
                    found.append((target, [alias.name]))
    return found


def test_the_sources_are_all_read():
    assert {"joblock.locks", "joblock._engine.sync", "joblock._engine.aio", "joblock._tools.cli"} <= set(
        MODULES
    )


def test_no_import_cycles():
    graph = {name: {target for target, _ in imports(name) if target in MODULES} for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for target in graph[name]:
            if target != name and not name.startswith(target + "."):  # a package's own __init__
                visit(target, [*path, name])
        done.add(name)

    for name in MODULES:
        visit(name, [])


def test_the_core_and_the_engine_import_nothing_above_them_and_only_tools_import_tools():
    wrong = []
    for name in MODULES:
        for target, _ in imports(name):
            if target == "joblock" or (target not in MODULES and target.rsplit(".", 1)[0] not in MODULES):
                continue
            if (layer(name) <= 2 and layer(target) > layer(name)) or (layer(target) == 5 and layer(name) < 5):
                wrong.append(f"{name} imports {target}")
    assert wrong == []


def test_no_module_takes_another_modules_private_names():
    taken = [
        f"{name} takes {target}.{n}"
        for name in MODULES
        for target, names in imports(name)
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != name
    ]
    assert taken == []
