"""The import graph of ``recipe/`` and ``kernels/`` has no cycle, read from the source with ``ast`` (nothing imported).

Nodes are the packages (``recipe.model``, ``recipe.target``, ``recipe.train``, …, ``kernels``; a top-level module of
``recipe/`` such as ``recipe.config`` is its own node). Every import counts, at module level or inside a function: a
lazy import hides a cycle from Python's import machinery, not from the design. Between modules, the module-level
imports must form no cycle either. docs/architecture.md draws the layers this enforces.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every project import of the file (relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # ``from recipe.model import draft`` imports the submodule recipe.model.draft
            names = [f"{base}.{alias.name}" if (ROOT / Path(*f"{base}.{alias.name}".split("."))).with_suffix(".py")
                     .is_file() else base for alias in node.names]
        else:
            continue
        names = [n for n in names if n.split(".")[0] in ("recipe", "kernels")]
        found += [(n, id(node) in top_level) for n in names]
    return found


def node_of(module: str) -> str:
    """The package a module belongs to: ``recipe.train.loop`` -> ``recipe.train``, ``recipe.config`` ->
    ``recipe.config``, ``kernels.ring_attention`` -> ``kernels``."""
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    return ".".join(parts[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a node list ``[a, b, ..., a]``, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def project_files() -> list[Path]:
    return sorted(p for d in ("recipe", "kernels") for p in (ROOT / d).rglob("*.py"))


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_resolve_relative_and_submodule_forms(tmp_path):
    assert node_of("recipe.train.loop") == "recipe.train" and node_of("kernels.x") == "kernels"
    assert node_of("recipe.config") == "recipe.config"
    found = dict(imports_of(ROOT / "recipe" / "model" / "ttt.py"))
    assert found.get("recipe.model.draft") is True and found.get("kernels.ttt_attention") in (True, None)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for path in project_files():
        src = node_of(module_name(path))
        for module, _ in imports_of(path):
            dst = node_of(module)
            if dst != src:
                graph.setdefault(src, set()).add(dst)
                where.setdefault((src, dst), f"{path.relative_to(ROOT)} imports {module}")
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
        where[(a, b)] for a, b in zip(cycle, cycle[1:]))


def test_no_cycle_between_modules_at_module_level():
    graph: dict[str, set[str]] = {}
    for path in project_files():
        src = module_name(path)
        for module, top in imports_of(path):
            if top and module != src and not src.startswith(module + "."):  # a package's own __init__ is not a cycle
                graph.setdefault(src, set()).add(module)
    cycle = find_cycle(graph)
    assert cycle is None, "module cycle " + " -> ".join(cycle)
