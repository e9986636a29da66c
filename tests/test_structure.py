"""The code's shape: no import cycle among flashrt/, capsules/ and models/, no source file over
500 lines, no class over 250 (issue 15's bounds: a reader can hold each piece in mind)."""
from __future__ import annotations

import ast
from pathlib import Path

import flashrt

PKG = Path(flashrt.__file__).resolve().parent     # the installed package: flashrt.capsules, .models
MAX_FILE, MAX_CLASS = 500, 250


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "assets" not in p.parts)


def _module(p: Path) -> str:
    rel = p.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(p: Path, mod: str, mods) -> set:
    """flashrt modules p imports at module level (imports inside functions are lazy: no cycle).
    `from pkg import sub` depends on the submodule only, `from pkg import name` on pkg."""
    out, pkg = set(), mod if p.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.parse(p.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
    return {m for m in out if m.startswith("flashrt")}


def test_no_import_cycle():
    mods = {_module(p): p for p in _sources()}
    graph = {m: {i for i in _imports(p, m, mods) if i in mods and i != m} for m, p in mods.items()}
    state, cycle = {}, []

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle.append(path + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, f"import cycles: {cycle[:3]}"


def test_file_and_class_sizes():
    big = []
    for p in _sources():
        text = p.read_text()
        n = text.count("\n")
        if n > MAX_FILE:
            big.append(f"{p.relative_to(PKG)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS:
                big.append(f"{p.relative_to(PKG)}: class {node.name} "
                           f"{node.end_lineno - node.lineno + 1} lines")
    assert not big, big
