"""The module map stays small and layered: no module of h5replay over 700 lines, no import cycle
below the storage, the clients, the server, the integrations or the package, no h5py below the clients or the protocol.

The import graph is read from the source (the AST of every module), so it sees every import:
module-level, inside functions, and under `if TYPE_CHECKING:` (a cycle of type hints is still a
cycle of modules). An edge goes to the module an import names, not to the parent packages Python
also runs (as import-linter and pydeps count them): `from a.b import c` is an edge to `a.b.c` when
that is a module, else to `a.b`, so a module importing a name from its own package's `__init__` is
an edge to that package. tests/unit/test_public_api.py checks what `import h5replay.client` loads
at run time; this checks every import, including those not yet run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import h5replay

PACKAGE = Path(h5replay.__file__).parent
MAX_LINES = 700


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, source: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module the module `name` imports (ours by module name, others by top-level package)."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name if alias.name in MODULES else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, one level up per extra dot
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base not in MODULES and base != "h5replay" and not base.startswith("h5replay."):
                yield base.split(".")[0]
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in MODULES else base


GRAPH: dict[str, set[str]] = {
    name: set(_imported(name, path.read_text(encoding="utf-8"), is_package=path.name == "__init__.py")) - {name}
    for name, path in MODULES.items()
}


# Imports made inside a function, on purpose, where a client reaches the storage: a learner on the
# file's host opens its own view of the file (client/_local.py), and only then loads h5py. Left
# out of the h5py check (`import h5replay.client` loads no h5py: tests/unit/test_public_api.py),
# and checked to stay inside functions (test_deferred_imports_stay_inside_functions).
DEFERRED = {("h5replay.client._local", "h5replay.storage._own_reader")}


def _reachable(start: str, skip: set[tuple[str, str]] | None = None) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        name = todo.pop()
        for target in GRAPH[name] & MODULES.keys():
            if skip and (name, target) in skip:
                continue
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _cycle(among: set[str]) -> list[str] | None:
    """One import cycle among `among` (its modules in import order, the first again at the end)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH[name] & among):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target, path)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(among):
        if name not in state:
            found = visit(name, [])
            if found:
                return found
    return None


@pytest.mark.timeout(30)
def test_no_module_is_over_700_lines() -> None:
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()}
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by job): " + ", ".join(
        f"{MODULES[name].relative_to(PACKAGE.parent)} ({n})" for name, n in over.items())


@pytest.mark.timeout(30)
def test_the_graph_sees_every_kind_of_import() -> None:
    """The graph's own check, on a module of h5replay.storage that imports in every way."""
    source = """
from typing import TYPE_CHECKING
import h5py
from h5replay.errors import StorageError
from h5replay.storage import indexing, HDF5Storage
from . import segment
from .replay import buffer
from ..spaces import Schema
if TYPE_CHECKING:
    from h5replay.storage.replay.journal import Journal
def opened() -> None:
    import h5replay.storage.export
    from h5replay import protocol as P
"""
    assert set(_imported("h5replay.storage.somewhere", source)) == {
        "typing", "h5py", "h5replay.errors",
        "h5replay.storage.indexing", "h5replay.storage",  # a submodule; a name of the package's __init__
        "h5replay.storage.segment", "h5replay.storage.replay.buffer", "h5replay.spaces",
        "h5replay.storage.replay.journal",  # under TYPE_CHECKING
        "h5replay.storage.export", "h5replay.protocol",  # inside a function
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start", ["h5replay.storage", "h5replay.client", "h5replay.client.aio", "h5replay.server",
                                   "h5replay.integrations", "h5replay"])
def test_no_import_cycle_below(start: str) -> None:
    cycle = _cycle(_reachable(start))
    assert cycle is None, f"import cycle below {start}: " + " -> ".join(cycle or [])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start", ["h5replay.client", "h5replay.client.aio", "h5replay.protocol"])
def test_no_h5py_below(start: str) -> None:
    """Actors, learners and DataLoader workers import the clients: no module they may reach imports h5py."""
    users = sorted(name for name in _reachable(start, DEFERRED) if "h5py" in GRAPH[name])
    assert not users, f"{start} reaches h5py through {users}"


@pytest.mark.timeout(30)
def test_deferred_imports_stay_inside_functions() -> None:
    """An edge left out of the h5py check is an import inside a function, never at module level."""
    for module, target in DEFERRED:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        at_top = {next(iter(_imported(module, ast.unparse(node))), "") for node in top}
        assert target not in at_top, f"{module} imports {target} at module level"
        assert target in GRAPH[module], f"{module} no longer imports {target}: drop it from DEFERRED"
