"""Every exception class we define sits under one of the two roots (``SluicegateError`` for the platform,
``ServingError`` for the model server), so the CLI's one handler reports each as a one-line error with
exit code 1 and the server's one status table maps each; read from the source with ``ast``."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from tests.test_layers import GENERATED, PACKAGES, ROOT

ROOTS = {"SluicegateError", "ServingError"}
BUILTIN_ERRORS = {name for name, value in vars(builtins).items() if isinstance(value, type)}
BUILTIN_ERRORS = {name for name in BUILTIN_ERRORS if issubclass(getattr(builtins, name), BaseException)}


def base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def our_classes() -> dict[str, tuple[Path, list[str]]]:
    found: dict[str, tuple[Path, list[str]]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(GENERATED):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    found[node.name] = (path, base_names(node))
    return found


def strays(classes: dict[str, tuple[Path, list[str]]]) -> list[str]:
    """Exception classes whose ancestry reaches a builtin exception without passing a root."""

    def reaches(name: str, seen: frozenset[str]) -> tuple[bool, bool]:  # (is an exception, under a root)
        if name in ROOTS:
            return True, True
        if name in BUILTIN_ERRORS:
            return True, False
        if name not in classes or name in seen:
            return False, False
        results = [reaches(base, seen | {name}) for base in classes[name][1]]
        return any(r[0] for r in results), any(r[1] for r in results)

    out = []
    for name, (path, _) in sorted(classes.items()):
        is_error, rooted = reaches(name, frozenset())
        if is_error and not rooted and name not in ROOTS:
            out.append(f"{path.relative_to(ROOT)}: {name}")
    return out


def test_every_exception_class_is_under_a_root() -> None:
    classes = our_classes()
    assert {"ConversionError", "PlatformError", "MetricsError", "RolloutFailed", "RepositoryError"} <= set(classes)
    found = strays(classes)
    assert not found, "exceptions outside SluicegateError/ServingError:\n" + "\n".join(found)


def test_a_stray_is_reported() -> None:
    path = ROOT / "tasks" / "planted.py"
    classes = {
        "SluicegateError": (path, ["Exception"]),
        "Good": (path, ["SluicegateError"]),
        "Stray": (path, ["ValueError"]),
        "StrayChild": (path, ["Stray"]),
        "NotAnError": (path, ["object"]),
    }
    assert strays(classes) == ["tasks/planted.py: Stray", "tasks/planted.py: StrayChild"]
