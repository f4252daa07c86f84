"""The layering rule, checked on the source: a subpackage of ``pardec`` imports only subpackages of its
own layer or below (``pardec.common`` at the bottom, ``pardec.cli``/``pardec.benchmarks`` at the top),
``pardec.common`` imports no other pardec subpackage, no two pardec modules import each other through
any chain (no cycles), and every module lives in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pardec"
LAYERS = {
    "common": 0,
    "recipes": 0,  # the Hydra configs, shipped as package data; no code
    "masks": 1,
    "losses": 1,
    "data_pipelines": 2,
    "models": 3,
    "methods": 4,
    "inference": 4,
    "trainers": 5,
    "evaluation": 5,  # lm-evaluation-harness model and tasks (the optional eval extra)
    "cli": 6,
    "benchmarks": 6,
}


def module_name(path: Path) -> str:
    """``pardec/masks/core.py`` -> ``masks.core`` (names are relative to the ``pardec`` package)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every pardec module ``path`` imports, at any depth of the file (lazy imports included), named
    relative to the ``pardec`` package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n.removeprefix("pardec.") for n in names if n.startswith("pardec.") and n.split(".")[1] in LAYERS)
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in LAYERS for p in (PACKAGE / package).rglob("*.py")}


def test_every_module_lives_in_a_layer():
    stray = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
             if p != PACKAGE / "__init__.py" and p.relative_to(PACKAGE).parts[0] not in LAYERS]
    assert not stray, f"modules outside every layer (add their package to LAYERS): {stray}"


def test_code_imports_pardec_modules_by_their_full_name():
    """A top-level ``import masks`` would only work from the repository root, not from an install."""
    bare = []
    for path in list(PACKAGE.rglob("*.py")) + list((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bare += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in LAYERS]
    assert not bare, "\n".join(bare)


def test_no_package_imports_a_higher_layer():
    violations = []
    for name, path in project_modules().items():
        layer = LAYERS[name.split(".")[0]]
        for target in imports_of(path):
            if LAYERS[target.split(".")[0]] > layer:
                violations.append(f"{name} imports {target}")
    assert not violations, "imports from a lower layer up to a higher one:\n" + "\n".join(sorted(set(violations)))


def test_methods_and_inference_do_not_import_each_other():
    crossing = [
        f"{name} imports {target}"
        for name, path in project_modules().items()
        for target in imports_of(path)
        if {name.split(".")[0], target.split(".")[0]} == {"methods", "inference"}
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: {t for t in imports_of(path) if t in modules and t != name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
