"""The code's shape: each folder's import rule (written in its __init__ docstring) holds, no import
cycle among modules counting imports inside functions, nothing inside the package imports the
package face, and no source file is over 500 lines (a reader can hold each piece in mind)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flashrt

PKG = Path(flashrt.__file__).resolve().parent     # the installed package
MAX_FILE = 500

# folder -> flashrt folders (or top-level modules) it may import; "*" = any. A module may always
# import its own folder, flashrt.errors and flashrt.version.
RULES = {
    "native": set(),
    "kernels": set(),
    "assets": set(),
    "capsules": {"native"},
    "core": {"capsules", "native"},
    "nn": {"core.step", "native", "kernels"},
    "models": {"core.arena", "core.step", "core.rng", "nn", "native"},
    "lm": {"core", "models", "capsules"},
    "policy": {"core", "models", "capsules"},
    "speech": {"core", "models", "capsules"},
    "chat": set(),
    "voice": {"lm", "speech", "chat", "capsules"},
    "serve": {"lm", "capsules", "speech", "chat", "voice"},
    "dev": {"*"},
    "cli": {"lm", "serve", "dev", "models", "native"},
    "integrations": set(),
}
ALWAYS = {"errors", "version"}
FACES_ONLY = {"serve": {"lm", "speech", "voice"}, "voice": {"lm", "speech"}}   # through faces, not modules


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "assets" not in p.parts or p.name == "__init__.py")


def _module(p: Path) -> str:
    rel = p.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODS = {_module(p): p for p in _sources()}


def _imports(p: Path, mod: str) -> list[tuple[str, int, bool]]:
    """(flashrt module, line, names-imported-from-it) for every import in p, inside functions
    too. `from pkg import sub` depends on the submodule, `from pkg import name` on pkg."""
    out, pkg = [], mod if p.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(p.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, node.lineno, False) if sub in MODS else (base, node.lineno, True))
    return [(m, line, names) for m, line, names in out if m == "flashrt" or m.startswith("flashrt.")]


def _rel(p: Path) -> str:
    return str(p.relative_to(PKG.parent)) if p.is_relative_to(PKG.parent) else p.name


def _folder(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_states_its_rule():
    for d in sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or ""
        assert "Rule:" in doc, f"flashrt/{d.name}/__init__.py: its docstring states no 'Rule:'"
        assert d.name in RULES, f"flashrt/{d.name}/ has no entry in this test's RULES"


def test_imports_follow_the_folder_rules():
    bad = []
    for mod, p in MODS.items():
        folder = _folder(mod)
        if folder in ("", "__init__") or mod == "flashrt":
            continue
        allowed = RULES.get(folder, set())
        for target, line, _ in _imports(p, mod):
            if target == "flashrt":
                continue                                    # the face: test_no_import_of_the_face
            t = target.split(".")[1:]
            if t[0] in (folder, *ALWAYS) or "*" in allowed:
                continue
            ok = any(".".join(t[: len(r.split("."))]) == r for r in allowed)
            if ok and t[0] in FACES_ONLY.get(folder, ()) and len(t) > 1:
                ok = False
            if not ok:
                bad.append(f"{_rel(p)}:{line} imports {target} "
                           f"(flashrt/{folder}/ may import {sorted(allowed) or 'nothing of flashrt'})")
    assert not bad, "\n".join(bad)


def test_model_files_import_only_the_base():
    """A model file (one per model_type in the registry, and the speech models loaded from
    their packages) takes everything from flashrt.models.base: a new model touches nothing else."""
    from flashrt.models.registry import MODEL_TYPES
    files = set(MODEL_TYPES.values()) | {"silero_vad"}
    inner = {"loader", "registry", "checkpoint", "causal_lm", "protocol"}
    bad = []
    for name in sorted(files):
        mod = f"flashrt.models.{name}"
        for target, line, _ in _imports(MODS[mod], mod):
            t = target.split(".")
            if target != "flashrt.models.base" and (t[1] != "models" or len(t) < 3 or t[2] in inner):
                bad.append(f"{_rel(MODS[mod])}:{line} imports {target}")
    assert not bad, bad


def test_no_import_of_the_face():
    """Inside the package nothing imports `flashrt` itself (the face imports half the package
    lazily); `from flashrt import sub` naming a subpackage is a plain submodule import."""
    bad = [f"{_rel(p)}:{line}" for mod, p in MODS.items() if mod != "flashrt"
           for target, line, names in _imports(p, mod) if target == "flashrt"]
    assert not bad, f"imports of the package face: {bad}"


def test_no_import_cycle():
    """Counting imports inside functions: a lazy import hides a cycle, it does not remove it."""
    graph = {m: set() for m in MODS}
    for m, p in MODS.items():
        for target, _, _ in _imports(p, m):
            # a module depends on the packages above it being importable: only edges to modules
            if target in MODS and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    state, cycles = {}, []

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_file_sizes():
    big = [f"{p.relative_to(PKG)}: {p.read_text().count(chr(10))} lines" for p in _sources()
           if p.read_text().count("\n") > MAX_FILE]
    assert not big, big


@pytest.mark.parametrize("planted, folder", [("from flashrt.lm import load", "core"),
                                             ("from flashrt.core.session import Session", "serve"),
                                             ("import flashrt.serve", "capsules")])
def test_a_planted_import_against_a_rule_fails(planted, folder, tmp_path, monkeypatch):
    """The rule check sees what it should: one bad line in a folder is reported."""
    p = tmp_path / "planted.py"
    p.write_text(f"def f():\n    {planted}\n")
    mod = f"flashrt.{folder}.planted"
    monkeypatch.setitem(MODS, mod, p)
    with pytest.raises(AssertionError, match="planted.py:2 imports"):
        test_imports_follow_the_folder_rules()
