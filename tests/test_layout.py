"""The house a newcomer walks: every root module and package of ``src/gradckpt`` named in the
README's map (``## Layout``), and no import cycle among gradckpt's modules.

import-linter (``.ci/run``) holds the arrows between stages; these two checks hold what it does
not: a module added without a line in the map, and a circle inside one stage (two modules of
the engine importing each other, say), at module level or inside a function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gradckpt"


def _root_entries() -> list[str]:
    """``name.py`` for each root module, ``name/`` for each package (``__init__``, ``__main__``
    are the package itself)."""
    modules = [f"{p.name}" for p in PACKAGE.glob("*.py") if not p.name.startswith("__")]
    packages = [f"{p.name}/" for p in PACKAGE.iterdir()
                if p.is_dir() and (p / "__init__.py").exists()]
    return sorted(modules + packages)


def _layout_section() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    assert match, "README.md has no '## Layout' section (the map of src/gradckpt/)"
    return match.group(1)


@pytest.mark.parametrize("entry", _root_entries())
def test_every_root_module_and_package_is_in_the_readmes_map(entry: str) -> None:
    assert f"`{entry}`" in _layout_section(), (
        f"src/gradckpt/{entry} is not in README.md's '## Layout' map: add a line saying its "
        f"job, written `{entry}`")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The gradckpt modules ``path`` imports, wherever in the file (``from x import y`` counts
    as importing ``x.y`` when that is a module, else ``x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
                elif target in modules:
                    found.add(target)
    found.discard(name)
    return found


def test_no_import_cycle_among_gradckpts_modules() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(paths)) for name, path in paths.items()}
    # Depth-first; a module met again while still on the stack closes a cycle.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_tests_mirror_the_package() -> None:
    """``tests/<room>/test_<room>_<topic>.py`` for each package of src/gradckpt (and ``docs``,
    ``bench`` for the pages and scripts beside it); tests of a root module stay in tests/ as
    ``test_<module>[_<topic>].py``. Names stay unique, as pytest's default import mode needs."""
    tests = ROOT / "tests"
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"docs", "bench"}
    roots = {p.stem for p in PACKAGE.glob("*.py")} | {"docstrings", "layout"}
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        room = path.parent.name
        if path.parent == tests:
            if not any(path.stem == f"test_{name}" or path.stem.startswith(f"test_{name}_")
                       for name in roots):
                misplaced.append(f"{path.name}: no root module {path.stem[5:]!r}")
        elif room not in rooms or not path.stem.startswith(f"test_{room}_"):
            misplaced.append(f"{path.relative_to(tests)}: not tests/<package>/test_<package>_*")
    assert not misplaced, misplaced
    names = [path.name for path in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name"
