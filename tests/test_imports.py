"""Dependencies point one way: no import cycle among the project's modules (psarch, collective, zero).
Imports inside functions count as much as module-level ones: hiding one in a function only defers the cycle.
Importing a.b.c runs a/__init__.py and a/b/__init__.py first, so it imports those packages too. Imports under
`if TYPE_CHECKING:` never run (the type checker's alone), so they do not count."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("psarch", "collective", "zero")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from a import b` is a.b when that is a module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    parents = {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)}
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}   # run before `name` itself
    return {m for m in out | (parents - own) if m in modules and m != name}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    modules = project_modules()
    graph = {m: imports_of(m, p, set(modules)) for m, p in modules.items()}
    assert sum(map(len, graph.values())) > 50, "the import graph came out nearly empty: the parser is broken"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    """The checker itself: a cycle closed by an import inside a function is found."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    graph = {m: imports_of(m, tmp_path / f"{m}.py", {"a", "b"}) for m in ("a", "b")}
    assert find_cycle(graph) == ["a", "b", "a"]


def test_the_cycle_finder_sees_a_parent_package_run_by_an_import(tmp_path):
    """The checker itself: `from p.leaf import x` runs p/__init__.py, which imports the importer back (the cycle
    psarch.config -> psarch.cluster.device -> psarch/cluster/__init__.py -> psarch.config)."""
    (tmp_path / "p").mkdir()
    files = {"a": tmp_path / "a.py", "p": tmp_path / "p" / "__init__.py", "p.leaf": tmp_path / "p" / "leaf.py"}
    files["a"].write_text("def f():\n    from p.leaf import x\n")
    files["p"].write_text("import a\n")
    files["p.leaf"].write_text("x = 1\n")
    graph = {m: imports_of(m, path, set(files)) for m, path in files.items()}
    assert find_cycle(graph) == ["a", "p", "a"]
