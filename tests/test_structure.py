"""The shape of the house (docs/architecture.md, "The rooms"), checked from the code's own imports.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``; ``from pkg import name``
counts as an import of ``pkg`` and, where ``name`` is a module, of ``pkg.name``.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dp"
CORE = "lightning_dp.privacy"
ENGINE_MACHINERY = ("lightning_dp.grad_sample",)
MAX_CYCLE = 3
MAX_CORE_LINES = 3000
MAX_ROOM_SHARE = 0.35


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, module_level_only: bool = False) -> set[str]:
    """The package's modules that ``module`` imports (all of them, or only those at module level outside
    ``TYPE_CHECKING``)."""
    path = _modules()[module]
    return _imports_in(path.read_text(), module, path.name == "__init__.py", _resolve, module_level_only)


def _imports_in(source: str, module: str, is_package: bool, resolve, module_level_only: bool = False) -> set[str]:
    found: set[str] = set()

    def named(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        return [source] + [f"{source}.{alias.name}" for alias in node.names]

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in named(child):
                    target = resolve(name) if name.startswith("lightning_dp") else None
                    if target is not None and target != module:
                        found.add(target)
            elif module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif module_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                walk(child)

    walk(ast.parse(source))
    return found


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = graph.get(node, [])
            for j in range(i, len(edges)):
                nxt = edges[j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return out


def _lines(paths: list[Path]) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_the_checker_sees_every_kind_of_import_and_finds_a_planted_ring():
    sources = {"lightning_dp.a": "import lightning_dp.b\n",
               "lightning_dp.b": "def f():\n    import lightning_dp.c\n",
               "lightning_dp.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_dp.a import x\n",
               "lightning_dp.d": "from lightning_dp import a\n"}
    resolve = lambda name: name if name in sources or name == "lightning_dp" else name.rpartition(".")[0] or None  # noqa: E731
    graph = {m: sorted(_imports_in(src, m, False, resolve)) for m, src in sources.items()}
    assert graph == {"lightning_dp.a": ["lightning_dp.b"], "lightning_dp.b": ["lightning_dp.c"],
                     "lightning_dp.c": ["lightning_dp.a"], "lightning_dp.d": ["lightning_dp", "lightning_dp.a"]}
    assert _cycles(graph) == [["lightning_dp.a", "lightning_dp.b", "lightning_dp.c"]]
    assert _imports_in(sources["lightning_dp.b"], "lightning_dp.b", False, resolve, module_level_only=True) == set()
    assert _imports_in(sources["lightning_dp.c"], "lightning_dp.c", False, resolve, module_level_only=True) == set()


def test_no_import_cycle_longer_than_three_modules():
    long = [c for c in _cycles({m: sorted(_imports(m)) for m in _modules()}) if len(c) > MAX_CYCLE]
    assert not long, f"import cycles over {MAX_CYCLE} modules: {long}"


def test_no_room_imports_from_a_room_above_it():
    """Rooms are the package's top-level folders and modules: their imports form no loop, so each stands on a floor
    above everything it imports (docs/architecture.md, "The rooms")."""

    def room(module: str) -> str:
        return module.split(".")[1] if module.count(".") else "__init__"

    graph: dict[str, set[str]] = {}
    for module in _modules():
        graph.setdefault(room(module), set()).update(room(t) for t in _imports(module) if room(t) != room(module))
    loops = _cycles({r: sorted(ts) for r, ts in graph.items()})
    assert not loops, f"rooms that import each other: {loops}"


def test_the_privacy_core_is_small_and_imports_no_engine_machinery():
    core = [p for name, p in _modules().items() if name == CORE or name.startswith(CORE + ".")]
    assert core and _lines(core) <= MAX_CORE_LINES, f"lightning_dp/privacy/ has {_lines(core)} lines"
    for module_level_only in (True, False):  # what importing the core loads; and what any of its code may import
        seen: set[str] = set()
        todo = [name for name in _modules() if name == CORE or name.startswith(CORE + ".")]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo.extend(_imports(name, module_level_only=module_level_only))
        reached = sorted(n for n in seen if n.startswith(ENGINE_MACHINERY))
        assert not reached, f"the privacy core reaches engine machinery by import: {reached}"


def test_no_room_holds_more_than_a_third_of_the_package():
    total = _lines(list(_modules().values()))
    rooms: dict[str, int] = {}
    for path in _modules().values():
        room = path.relative_to(PACKAGE).parts[0]
        rooms[room] = rooms.get(room, 0) + len(path.read_text().splitlines())
    big = {room: f"{lines / total:.0%}" for room, lines in rooms.items() if lines > MAX_ROOM_SHARE * total}
    assert not big, f"rooms over {MAX_ROOM_SHARE:.0%} of the package's {total} lines: {big}"


def test_nothing_cites_design_files_outside_the_repository():
    outside = ("ALGORITHMS" + ".md", "ARCHITECTURE" + ".md", "../" + "shared/")
    cited = []
    for folder in ("lightning_dp", "tests", "docs", "examples", "benchmarks", "configs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".yaml", ".yml", ".cfg", ".toml"} and path.is_file():
                text = path.read_text(errors="replace")
                cited += [f"{path.relative_to(ROOT)}: {o}" for o in outside if o in text]
    for name in ("README.md", "setup.cfg", "pyproject.toml", "Makefile"):
        text = (ROOT / name).read_text()
        cited += [f"{name}: {o}" for o in outside if o in text]
    assert not cited, cited


def test_the_readme_is_short_and_keeps_no_journal():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "session" not in text.lower() and "commit " not in text.lower()
