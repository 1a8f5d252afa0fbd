"""The core asks a backend's spec and names no backend (psarch/backend.py): no comparison, membership test or
lookup table in psarch/ outside the backend packages (psarch/ps/, psarch/single.py, psarch/dp/) uses a backend's kind:
not even `psarch report crossover`, which sets a study's runs with servers against its ring all-reduce runs by
asking each spec (BackendSpec.service_nodes, BackendSpec.all_reduce). Pure unit test: reads the source."""
from __future__ import annotations

import ast
from pathlib import Path

from psarch import registry

ROOT = Path(__file__).resolve().parent.parent
BACKEND_PACKAGES = ("psarch/ps/", "psarch/single.py", "psarch/dp/")


def core_files() -> list[Path]:
    return [p for p in sorted((ROOT / "psarch").rglob("*.py"))
            if not str(p.relative_to(ROOT)).startswith(BACKEND_PACKAGES)]


def kinds_named(tree: ast.AST, kinds: set[str]) -> list[tuple[int, str]]:
    """(line, kind) for each backend kind compared with, tested for membership (a literal, or a module's own
    name for one tested against a kind: `KINDS = ("ddp", "zero")` ... `b.kind in KINDS`), or used as a lookup
    key (`d["ps"]`, or a table looked up by kind: `{"ddp": ...}.get(kind)`, `{"ddp": ...}[kind]`)."""
    named = {t.id: node.value for node in getattr(tree, "body", []) if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}

    def strings(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for e in node.elts for s in strings(e)]
        return []

    def is_kind(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "kind") or (isinstance(node, ast.Name)
                                                                              and node.id == "kind")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                found += [(node.lineno, s) for s in strings(side) if s in kinds]
                if isinstance(side, ast.Name) and side.id in named and any(map(is_kind, sides)):
                    found += [(node.lineno, s) for s in strings(named[side.id]) if s in kinds]
            continue
        elif isinstance(node, ast.Subscript):
            found += [(node.lineno, s) for s in strings(node.slice) if s in kinds]
            table = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            table = node.func.value
        else:
            continue
        if isinstance(table, ast.Dict):
            found += [(table.lineno, s) for k in table.keys if k is not None for s in strings(k) if s in kinds]
    return found


def test_the_core_compares_no_backend_name():
    kinds = set(registry.kinds())
    files = core_files()
    assert len(files) > 40, "the core came out nearly empty: the walk is broken"
    named = {str(p.relative_to(ROOT)): hits for p in files if (hits := kinds_named(ast.parse(p.read_text()), kinds))}
    assert not named, f"backend names in the core: {named}"


def test_the_scan_sees_each_way_of_naming_a_backend():
    src = ('if b.kind == "ps": pass\nif kind in ("ddp", "zero"): pass\nx = {"torch_ddp": 1}.get(kind, "")\n'
           'y = d["single"]\nz = "ps" != kind\nok = "psarch" == name\ncolumns = {"ddp": 1}\n'
           'w = {"zero": 2}[kind]\nKINDS = ("dp", "single")\nif kind not in KINDS: pass\n')
    assert sorted(kinds_named(ast.parse(src), set(registry.kinds()))) == [
        (1, "ps"), (2, "ddp"), (2, "zero"), (3, "torch_ddp"), (4, "single"), (5, "ps"), (8, "zero"), (10, "dp"),
        (10, "single")]
