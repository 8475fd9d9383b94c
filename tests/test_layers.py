"""The guard's layers (docs/design.md, "Modules"): every import points down, and no module imports itself back.

Read from the source (``ast``), every import counted: at the top, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

GUARD = Path(__file__).resolve().parent.parent / "guard"

#: Layers, bottom first: a module may import its own layer's modules and those below, never one above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("guard.errors", "guard.files", "guard.protocol"),
    ("guard.contract", "guard.inside", "guard.core"),
    ("guard.observe",),
    ("guard.secure",),
    ("guard.preflight",),
    ("guard.run", "guard.watch"),
    ("guard", "guard.__main__"),  # the public API (protect, report, ...) and the entry point
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(GUARD.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in GUARD.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The guard modules that ``name`` imports (``from pkg import mod`` counts as ``pkg.mod`` when that is a
    module, else as ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "guard")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "guard":
                continue
            subs = {f"{target}.{alias.name}" for alias in node.names} & known
            found.update(subs or {target})
            if subs and len(subs) < len(node.names):
                found.add(target)
    return {mod for mod in found if mod != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(name: str) -> int:
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = index, len(prefix)
    assert best >= 0, f"{name} is in no layer: add it to LAYERS and to docs/design.md"
    return best


def test_every_import_points_down() -> None:
    upward = [f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})"
              for name, deps in sorted(_graph().items()) for dep in sorted(deps) if _layer(dep) > _layer(name)]
    assert not upward, "\n".join(upward)


def test_no_package_imports_its_own_package_init() -> None:
    # A submodule that imports its package's __init__ (which imports the submodule) is a circle.
    found = [f"{name} imports {dep}" for name, deps in sorted(_graph().items()) for dep in deps
             if name.startswith(dep + ".") and (GUARD.parent / Path(*dep.split(".")) / "__init__.py").exists()
             and dep != "guard"]
    assert not found, "\n".join(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycles() -> None:
    # The package "guard" itself is left out: its __init__ is the job's public API (it loads the agent lazily), and
    # "from guard import x" in a submodule names the module x, not the API.
    graph = {name: {dep for dep in deps if dep != "guard"} for name, deps in _graph().items() if name != "guard"}
    assert _cycles(graph) == []


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("guard.core.state") < _layer("guard.run.diagnose")
    assert _layer("guard.secure.securing") > _layer("guard.core.masking")


def test_the_design_doc_names_every_layer() -> None:
    text = (GUARD.parent / "docs" / "design.md").read_text()
    for prefixes in LAYERS:
        for prefix in prefixes:
            if prefix not in ("guard", "guard.__main__"):
                assert f"`{prefix.replace('.', '/')}" in text, prefix
