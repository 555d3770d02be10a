"""The layering of DESIGN.md ("Layout and layering"), checked on every import of every module.

Every ``import`` / ``from ... import`` is read with ``ast`` (function-level and
``TYPE_CHECKING`` imports included, relative imports resolved), and each module's
layer limits what it may import:

- core (``autoddl.sbp, graph, trace, ops, cluster, training, plan, program, loader,
  flops, atomic`` and any other ``autoddl`` module not named below): only the core;
- ``costmodel``: the core and itself;
- ``search``: the core, ``costmodel`` and itself;
- ``executor``: the core and itself;
- the top (``autoddl`` itself, ``autoddl.api``, ``autoddl.calibration``,
  ``autoddl.runs``, ``autoddl.scheduling``, ``autoddl.scheduling_run``, ``autoddl.cli``, ``autoddl.charts``, ``autoddl.__main__``):
  everything. ``benchmarks/``, ``tests/`` and ``notebooks/`` are not checked;
- the example model files (``examples/``) are standalone: none of these packages.

A violation fails naming the file, the line and the forbidden import. Known
violations being fixed elsewhere are in ``KNOWN``; it may only shrink (an entry
that no longer occurs fails too, so it gets deleted).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autoddl", "costmodel", "search", "executor")
TOP = ("autoddl", "autoddl.api", "autoddl.calibration", "autoddl.runs", "autoddl.scheduling",
       "autoddl.scheduling_run", "autoddl.cli", "autoddl.charts",
       "autoddl.__main__")
ALLOWED = {  # layer -> the layers it may import
    "core": {"core"},
    "costmodel": {"core", "costmodel"},
    "search": {"core", "costmodel", "search"},
    "executor": {"core", "executor"},
    "top": {"core", "costmodel", "search", "executor", "top"},
    "example": set(),
}

# (importing module, imported module) -> why it is still there, naming its issue; an entry is deleted once
# its import is gone. Empty since issue 9 (item 8, "Architecture") moved the CLI and its logic to the top.
KNOWN: dict[tuple[str, str], str] = {
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer(module: str) -> str | None:
    """The layer of a module of this project, or None for anything else (stdlib, torch, ...)."""
    top = module.split(".")[0]
    if top == "examples":
        return "example"
    if top not in PACKAGES:
        return None
    if top == "autoddl":
        if module == "autoddl" or any(_within(module, t) for t in TOP[1:]):
            return "top"
        return "core"
    return top


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file; ``from a import b`` is ``a.b`` when that
    is a module of this project, else ``a``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if _is_module(full) else base))
    return sorted(set(out))


def project_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return files + sorted((ROOT / "examples").rglob("*.py"))


def violations() -> list[tuple[str, str, int, str]]:
    """(importing module, imported module, line, file) for every import its layer forbids."""
    out = []
    for path in project_files():
        importer = _module_name(path)
        own = layer(importer)
        for line, imported in imports_of(path):
            theirs = layer(imported)
            if theirs is None or theirs in ALLOWED[own]:
                continue
            if own == "example" and theirs == "example":
                continue
            out.append((importer, imported, line, str(path.relative_to(ROOT))))
    return out


def test_imports_follow_the_layering():
    found = violations()
    new = [f"{file}:{line}: {importer} ({layer(importer)}) imports {imported} ({layer(imported)})"
           for importer, imported, line, file in found if (importer, imported) not in KNOWN]
    assert not new, "imports that break DESIGN.md's layering:\n" + "\n".join(new)


def test_known_violations_still_exist():
    """KNOWN only shrinks: an entry whose import is gone must be deleted."""
    found = {(importer, imported) for importer, imported, _, _ in violations()}
    stale = [f"{a} -> {b}" for a, b in KNOWN if (a, b) not in found]
    assert not stale, "fixed, delete from KNOWN in tests/test_layering.py:\n" + "\n".join(stale)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "autoddl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "graph.py").write_text("")
    (pkg / "sbp.py").write_text("from . import graph\n\ndef f():\n    from search.planner import search\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert imports_of(pkg / "sbp.py") == [(1, "autoddl.graph"), (4, "search.planner")]
    assert layer("autoddl.sbp") == "core" and layer("autoddl.cli.plan") == "top" and layer("autoddl") == "top"
    assert layer("search.planner") == "search" and layer("torch") is None
