"""The layers of the code base, read from the imports (README, "Architecture"): every module's imports are
walked with ``ast`` (lazy imports inside functions and ``TYPE_CHECKING`` imports count too: they are
dependencies all the same) and an import that goes the wrong way, or a cycle, fails naming both files."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("serving", "sluicegate", "tasks", "flows")
GENERATED = ("_pb2.py", "_pb2_grpc.py")

# Layer name -> the layers it may import. `serving` stands alone (its image carries only its own
# dependencies); the bottom layer is shared by every stage; `app` (CLI, demo, embedded stack) is the top.
ALLOWED: dict[str, set[str]] = {
    "serving": {"serving"},
    # The bottom layer may use the standalone server's leaf helpers (serving/redact.py masks secrets).
    "bottom": {"bottom", "serving"},
    "tasks": {"tasks", "bottom", "serving"},
    "flows": {"flows", "tasks", "bottom", "serving"},
    "app": {"app", "flows", "tasks", "bottom", "serving"},
}


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    if top == "sluicegate":
        return "app" if module == "sluicegate.app" or module.startswith("sluicegate.app.") else "bottom"
    return top


@dataclass(frozen=True)
class Import:
    source: Path
    line: int
    target: str


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(GENERATED) or "migrations/versions" in path.as_posix():
                continue
            found[module_name(path)] = path
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours an import names (``from a.b import c`` is ``a.b.c`` when that is a module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = resolve(name, modules)
            if target is not None and target != module_name(path):
                yield Import(path, node.lineno, target)


def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = our_modules()
    edges = [edge for path in modules.values() for edge in imports_of(path, modules)]
    return modules, edges


def wrong_way(modules: dict[str, Path], edges: list[Import]) -> list[str]:
    problems = []
    for edge in edges:
        source, target = layer_of(module_name(edge.source)), layer_of(edge.target)
        if target not in ALLOWED[source]:
            problems.append(
                f"{edge.source.relative_to(ROOT)}:{edge.line} ({source}) imports "
                f"{modules[edge.target].relative_to(ROOT)} ({target}): {source} may import only "
                f"{', '.join(sorted(ALLOWED[source]))}"
            )
    return problems


def cycles(modules: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a list of files.

    A package's ``__init__`` is not an edge to its own modules' importers: importing ``a.b`` runs
    ``a/__init__`` first, but that is Python's order, not a dependency either file states."""
    succ: dict[str, set[str]] = {name: set() for name in modules}
    for edge in edges:
        succ[module_name(edge.source)].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(succ[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(str(modules[m].relative_to(ROOT)) for m in component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def test_every_import_goes_down_the_layers() -> None:
    modules, edges = graph()
    assert len(modules) > 100, "the walk found too few modules: is ROOT right?"
    problems = wrong_way(modules, edges)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_module_cycles() -> None:
    modules, edges = graph()
    found = cycles(modules, edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(files) for files in found)


@pytest.mark.parametrize(
    ("source", "target", "ok"),
    [
        ("tasks.training", "sluicegate.settings", True),
        ("sluicegate.settings", "tasks.training", False),
        ("tasks.training", "flows.pipeline", False),
        ("flows.pipeline", "sluicegate.app.cli.main", False),
        ("sluicegate.app.cli.main", "flows.pipeline", True),
        ("serving.server", "sluicegate.errors", False),
        ("sluicegate.metadata.store", "sluicegate.app.stack", False),
        ("tasks.evaluation", "serving.preprocessing", True),
    ],
)
def test_the_rule_itself(source: str, target: str, ok: bool) -> None:
    assert (layer_of(target) in ALLOWED[layer_of(source)]) is ok


def test_a_planted_cycle_and_a_wrong_way_import_are_reported_with_both_files(tmp_path: Path) -> None:
    a, b = ROOT / "tasks" / "a_planted.py", ROOT / "tasks" / "b_planted.py"
    modules = {"tasks.a_planted": a, "tasks.b_planted": b, "flows.pipeline": ROOT / "flows" / "pipeline.py"}
    edges = [Import(a, 1, "tasks.b_planted"), Import(b, 3, "tasks.a_planted"), Import(b, 4, "flows.pipeline")]
    assert cycles(modules, edges) == [["tasks/a_planted.py", "tasks/b_planted.py"]]
    [problem] = wrong_way(modules, edges)
    assert problem.startswith("tasks/b_planted.py:4 (tasks) imports flows/pipeline.py (flows)")


def private_imports(paths: list[Path], ours: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """``from our.module import _name``: a private name used outside its module."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in ours:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    ours = (*PACKAGES, "tests", "benchmarks")
    paths = [p for top in ours for p in (ROOT / top).rglob("*.py") if not p.name.endswith(GENERATED)]
    found = private_imports(paths, ours)
    assert not found, "private names imported across modules (make them public or keep them home):\n" + "\n".join(found)


def test_a_planted_private_import_is_reported(tmp_path: Path) -> None:
    planted = tmp_path / "tests" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("from tasks.rollout.metrics import _hidden, histogram_quantile\nfrom x import _fine\n")
    assert private_imports([planted], ("tasks",), root=tmp_path) == [
        "tests/planted.py:1 imports tasks.rollout.metrics._hidden"
    ]
