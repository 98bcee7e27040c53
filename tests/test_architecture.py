"""The layout shows the architecture: static checks of every import in the four layers (docs/architecture.md).

Parsed with ``ast``, nothing imported (well under a second): function-level imports count like
top-level ones, since a cycle broken by importing "when called" is still a cycle.

- Layers: workbench/ imports none of mlflow, click, optuna or the other layers; only tracking/
  imports mlflow; only studies/ imports click; reports/ never imports studies/.
- No import cycle between project modules.
- No import of another module's private name (``from x import _y``, ``x._y``).
- No module alias for a project module (``from tracking import sink as rs``): file names are
  unique enough that none is needed (tests included).
- No folder of more than 12 modules.
- Every module path and file path the docs name exists.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("workbench", "tracking", "studies", "reports")
# What each layer may not import (top-level package names).
FORBIDDEN = {
    "workbench": {"mlflow", "click", "optuna", "tracking", "studies", "reports"},
    "tracking": {"click", "studies", "reports"},
    "reports": {"mlflow", "click", "optuna", "studies"},
    "studies": {"mlflow"},
}
MAX_MODULES = 12
# workbench/data's file paths are part of the code fingerprint (workbench/train/fingerprint.py):
# splitting it re-trains every stored cell, so it waits for a change that alters the fingerprint
# anyway. It may not grow meanwhile.
GRANDFATHERED = {"workbench/data": 15}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the project module (or third-party package) it reaches
    name: str | None  # the name taken from it, for `from target import name`
    alias: str | None
    line: int
    is_module: bool  # whether what is bound is a module
    bound: str  # the name the import binds in the importing module


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for layer in LAYERS
        for p in sorted((ROOT / layer).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@lru_cache(maxsize=None)
def imports_of(path: Path, name: str) -> list[Import]:
    known = modules()
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append(
                    Import(
                        name,
                        a.name,
                        None,
                        a.asname,
                        node.lineno,
                        True,
                        a.asname or a.name.split(".")[0],
                    )
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against the importing package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module]
                )
            for a in node.names:
                full = f"{base}.{a.name}"
                is_module = full in known
                found.append(
                    Import(
                        name,
                        full if is_module else base,
                        None if is_module else a.name,
                        a.asname,
                        node.lineno,
                        is_module,
                        a.asname or a.name,
                    )
                )
    return found


@lru_cache(maxsize=1)
def all_imports() -> list[Import]:
    return [i for name, path in modules().items() for i in imports_of(path, name)]


def test_each_layer_imports_only_what_it_may():
    problems = []
    for i in all_imports():
        layer, top = i.module.split(".")[0], i.target.split(".")[0]
        if top in FORBIDDEN[layer]:
            problems.append(
                f"{modules()[i.module].relative_to(ROOT)}:{i.line}: {layer}/ imports {i.target}"
            )
    assert not problems, "layer rule broken (docs/architecture.md, Four layers):\n" + "\n".join(
        problems
    )


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in all_imports():
        if i.target in known and i.target != i.module:
            graph[i.module].add(i.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = [
        " <-> ".join(c)
        + "\n    "
        + "\n    ".join(f"{a} imports {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_name():
    known = modules()
    problems = []
    for name, path in known.items():
        bound = {}
        for i in imports_of(path, name):
            if i.target.split(".")[0] not in LAYERS:
                continue
            if _private(i.name) or (i.is_module and _private(i.target.rpartition(".")[2])):
                problems.append(
                    f"{path.relative_to(ROOT)}:{i.line}: imports {i.target}.{i.name or ''}".rstrip(
                        "."
                    )
                )
            if i.is_module:
                bound[i.bound] = i.target
        for node in ast.walk(parsed(path)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                problems.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: uses {bound[node.value.id]}.{node.attr}"
                )
    assert not problems, "private names used from another module:\n" + "\n".join(problems)


def test_no_module_alias_for_a_project_module():
    known = set(modules())
    problems = []
    aliased = re.compile(
        r"^\s*(?:from|import) (?:workbench|tracking|studies|reports)\b.* as ", re.MULTILINE
    )
    tests = [
        (p.stem, p)
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if aliased.search(p.read_text(encoding="utf-8"))
    ]
    for name, path in [*modules().items(), *tests]:  # only the tests that write `as` are parsed
        for i in imports_of(path, name):
            if (
                i.is_module
                and i.alias
                and i.target in known
                and i.alias != i.target.rpartition(".")[2]
            ):
                problems.append(
                    f"{path.relative_to(ROOT)}:{i.line}: {i.target} imported as {i.alias}"
                )
    assert not problems, "module aliases (a file name unique enough needs none):\n" + "\n".join(
        problems
    )


def test_no_folder_holds_more_than_a_dozen_modules():
    problems = []
    for layer in LAYERS:
        for folder in sorted(
            {p.parent for p in (ROOT / layer).rglob("*.py") if "__pycache__" not in p.parts}
        ):
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            where = folder.relative_to(ROOT).as_posix()
            if count > GRANDFATHERED.get(where, MAX_MODULES):
                problems.append(f"{where}/: {count} modules")
    assert not problems, f"folders of more than {MAX_MODULES} modules:\n" + "\n".join(problems)


# a dotted module path; not a file name such as reports.md or studies.yaml
DOTTED = re.compile(
    r"(?<![\w./-])((?:workbench|tracking|studies|reports)(?:\.(?!(?:md|py|yaml|html|json|csv)\b)[A-Za-z_]\w*)+)"
)
PATH = re.compile(r"(?<![\w./-])((?:workbench|tracking|studies|reports)/[\w/]+\.py)\b")


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def stale_reference(reference: str) -> str | None:
    """Why a dotted reference (``tracking.record.sink.RunSink``) names nothing, else None."""
    known = modules()
    parts = reference.split(".")
    longest = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known), default=0)
    if longest == 0 or (longest == 1 and len(parts) > 1):
        return f"no module {'.'.join(parts[:2])}"
    if longest < len(parts) and parts[longest] not in top_level_names(
        known[".".join(parts[:longest])]
    ):
        return f"{'.'.join(parts[:longest])} has no {parts[longest]}"
    return None


def test_the_docs_name_modules_and_files_that_exist():
    problems = []
    for doc in [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "MLproject",
        ROOT / "Makefile",
        ROOT / "pyproject.toml",
    ]:
        text = doc.read_text(encoding="utf-8")
        for match in DOTTED.finditer(text):
            why = stale_reference(match.group(1).rstrip("."))
            if why:
                problems.append(f"{doc.relative_to(ROOT)}: {match.group(1)}: {why}")
        for match in PATH.finditer(text):
            if not (ROOT / match.group(1)).is_file():
                problems.append(f"{doc.relative_to(ROOT)}: {match.group(1)}: no such file")
    assert not problems, "the docs point at modules that are not there:\n" + "\n".join(
        sorted(set(problems))
    )


def test_no_source_file_of_the_four_layers_is_ignored_by_git():
    """.gitignore keeps generated reports (reports/<study>/) out by a pattern with named
    exceptions; a new code package under reports/ needs its own exception, or its files never
    reach a commit (and a fresh clone fails to import it)."""
    import shutil
    import subprocess

    import pytest

    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    files = [
        str(p.relative_to(root))
        for layer in ("workbench", "tracking", "studies", "reports")
        for p in (root / layer).rglob("*.py")
        if "__pycache__" not in p.parts
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *files], cwd=root, capture_output=True, text=True
    ).stdout.split()
    assert not ignored, f"source files git ignores (add an exception to .gitignore): {ignored}"


# Two classes named Evaluation stay: renaming either moves a code fingerprint (the transfer
# runner's in workbench/transfer, the intervention evaluator's in workbench/interventions) and so
# the identity of every published transfer or intervention cell; they wait for a change that moves
# those fingerprints anyway.
SHARED_CLASS_NAMES = {"Evaluation": 2}


def test_class_names_are_unique_across_the_layers():
    seen: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(name)
    repeated = {
        cls: where
        for cls, where in seen.items()
        if len(where) > 1 and len(where) != SHARED_CLASS_NAMES.get(cls)
    }
    assert not repeated, f"class names defined in more than one module: {repeated}"


# The one table of kinds: nothing else tells kinds apart by their names.
KINDS_TABLE = "workbench.kinds"


def kind_dispatch(tree: ast.AST, kinds: frozenset[str]) -> list[str]:
    """Where code is keyed by a kind's name: a dict literal with two or more kind names as keys,
    a comparison with a kind name (``kind == "transfer"``, ``kind in ("ablation", ...)``) or a
    ``match`` case on one. A subscript by a kind's name is not counted: the ``attribution``
    section of a protocol file is read as ``top["attribution"]``."""

    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in kinds
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None and named(k)]
            if len(keys) >= 2:
                found.append(f"line {node.lineno}: a dict keyed by kind names")
        elif isinstance(node, ast.Compare):
            if any(named(side) for side in (node.left, *node.comparators)):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case):
            if any(
                isinstance(p, ast.MatchValue) and named(p.value) for p in ast.walk(node.pattern)
            ):
                found.append(f"line {node.pattern.lineno}: a match case on a kind name")
    return found


def _kind_names() -> frozenset[str]:
    from workbench.kinds import KINDS

    return frozenset(KINDS)


def test_no_dispatch_on_a_kind_name_outside_the_table_of_kinds():
    kinds = _kind_names()
    found = {
        name: hits
        for name, path in modules().items()
        if name != KINDS_TABLE and (hits := kind_dispatch(parsed(path), kinds))
    }
    assert not found, (
        "code keyed by a protocol kind's name outside workbench/kinds.py (name the part in the "
        "table and load it, or give the table a column):\n"
        + "\n".join(f"  {name}: {hit}" for name, hits in sorted(found.items()) for hit in hits)
    )


def test_the_kind_dispatch_check_finds_what_the_table_replaced():
    kinds = _kind_names()
    # the shapes the table replaced (workbench/protocol/__init__.py's _PARSE, reports/build.py)
    old = ast.parse(
        "_PARSE = {'ablation': a, 'transfer': t}\n"
        "if kind == 'transfer':\n    pass\n"
        "if canonical.get('kind') != 'transfer':\n    pass\n"
        "unit = 'arm' if table.kind in ('ablation',) else 'regime'\n"
        "match kind:\n    case 'intervention':\n        pass\n"
    )
    assert len(kind_dispatch(old, kinds)) == 5, kind_dispatch(old, kinds)
    # what is not dispatch: a kind's own name assigned, a table lookup through a variable
    fine = ast.parse("KIND = 'transfer'\nrow = BY_NAME[kind]\nx = {'attribution': 1, 'seeds': 2}\n")
    assert kind_dispatch(fine, kinds) == []
