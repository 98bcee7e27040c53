"""The identity of the code that computes results: a hash of its syntax trees and versions.

A cell's run is the same run as long as the code that produces its numbers is the same.
That code is every project module the library that builds data, models and training
(``TRAINING_ROOTS``) imports, transitively (its import closure, ``import_closure``), plus the
torch and timm versions; documentation, reports, CLI text, logging and tests are not part of
it unless that code imports them, so a commit that touches only those does not re-train
anything. The git commit is still recorded on every run; it is just not part of the identity.
Following the imports rather than hashing fixed folders means a module the training loop
imports from elsewhere (``workbench/precision.py``) is part of the identity too.

What is hashed is each file's meaning, not its text: the syntax tree without docstrings
(comments never reach the tree), so a comment, a docstring or a reformat (quotes, line
breaks, parentheses, trailing commas) changes no identity while a changed constant, name or
statement does. The tree is written out by ``canonical_tree`` rather than ``ast.dump``
because ``ast.dump`` prints the fields a Python release adds (``type_params`` in 3.12)
even when empty, which would give the same code another identity on another Python.

The fingerprint of stored cells changed twice for the same code: when it moved from file
text to syntax trees, and when it moved from fixed folders to import closures (docs/study-record.md,
"Identity"); ``workbench.code_history`` maps each old fingerprint to the new one of the same code
so that cells trained on that code are still recognised (no hashed code imports it: a table of
fingerprints cannot be part of what it hashes).
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

LIBRARY_ROOT = Path(__file__).resolve().parent.parent  # the workbench/ package
PROJECT_ROOT = LIBRARY_ROOT.parent  # the checkout: the folder holding the project's packages
# The project's own top-level packages: imports of these are followed; any other import is an
# installed library (torch and timm enter by version, the rest is not the project's code).
PROJECT_PACKAGES = ("workbench", "tracking", "studies", "reports")
# Where the training kind's closure starts: the library folders that build data, models and
# training (and convert weights). Everything they import is added by ``import_closure``.
TRAINING_ROOTS = ("workbench/data", "workbench/models", "workbench/train", "workbench/convert")
FINGERPRINT_CHARS = 16
# Definitions whose first statement, when it is a string, is a docstring (never executed code).
_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Fields that carry no meaning: a string's u-prefix marker and the type comments ast keeps.
_IGNORED_FIELDS = frozenset({"kind", "type_comment", "type_ignores"})


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_OWNERS) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:]
    return tree


def canonical_tree(node: object) -> str:
    """One line for a syntax tree: node types, non-empty fields by name, constants by repr.

    Empty fields (None, []) are left out, so a field a newer Python adds empty leaves the
    text unchanged; ``Constant(None)`` is a node, not an empty field, so ``return`` and
    ``return None`` stay apart. Positions are not fields (they live in ``_attributes``).
    """
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            if name in _IGNORED_FIELDS:
                continue
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            parts.append(f"{name}={canonical_tree(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical_tree(item) for item in node) + "]"
    return repr(node)  # str, bytes, int, float, complex, bool, Ellipsis: repr is exact


def source_meaning(source: str, filename: str = "<source>") -> str:
    """The canonical text of a module's syntax tree without docstrings; what the fingerprint hashes."""
    return canonical_tree(_strip_docstrings(ast.parse(source, filename=filename)))


def _module_file(root: Path, name: str) -> Path | None:
    """The file of project module ``name`` under ``root`` (a package's ``__init__.py``), or None."""
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _module_name(root: Path, path: Path) -> tuple[str, str]:
    """(module name, the package its relative imports start from) of a file under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name an ``import`` anywhere in ``tree`` may load.

    Function-level imports count (they run when the function does); a relative import is
    resolved from ``package``; ``from m import x`` names both ``m`` and ``m.x`` (``x`` may be a
    submodule; a name that is no module resolves to no file). The packages above an imported
    module are not named: their ``__init__.py`` only gathers names, and code that uses one of
    those names imports the package itself.
    """
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@lru_cache(maxsize=4096)
def _parsed(source: str, relative: str, package: str) -> tuple[str, frozenset]:
    # Keyed by the text itself: reading a file is cheap, parsing it is what the cache saves, and
    # an edited file (a test's copy) is parsed again.
    tree = ast.parse(source, filename=relative)
    names = frozenset(imported_names(tree, package))
    return canonical_tree(_strip_docstrings(tree)), names


def _read(root: Path, path: Path) -> tuple[str, frozenset]:
    """(syntax tree without docstrings, imported names) of one project file, parsed once per text."""
    _, package = _module_name(root, path)
    relative = path.relative_to(root).as_posix()
    return _parsed(path.read_text(encoding="utf-8"), relative, package)


def root_files(
    roots: tuple[str, ...], root: Path = PROJECT_ROOT, read_side: tuple[str, ...] = ()
) -> list[Path]:
    """The ``.py`` files of ``roots`` (folders or files, relative to ``root``) but ``read_side``."""
    files: list[Path] = []
    for entry in roots:
        path = root / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        else:
            raise FileNotFoundError(f"{path}: a fingerprint root that does not exist")
    return [p for p in files if p.relative_to(root).as_posix() not in read_side]


def import_closure(
    roots: tuple[str, ...], root: Path = PROJECT_ROOT, read_side: tuple[str, ...] = ()
) -> list[str]:
    """The project files ``roots`` are made of and import, transitively, as sorted root-relative paths.

    Only the project's packages (``PROJECT_PACKAGES``) are followed. ``read_side`` names files
    inside a root folder that only read results (a report section, figures, a benchmark): they
    do not start the closure, but are in it when result code imports them.
    """
    seen: set[Path] = set()
    todo: list[Path | None] = [*root_files(roots, root, read_side)]
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        todo.extend(_module_file(root, n) for n in _read(root, path)[1])
    return sorted(p.relative_to(root).as_posix() for p in seen)


def closure_fingerprint(
    roots: tuple[str, ...] = TRAINING_ROOTS,
    root: Path = PROJECT_ROOT,
    versions: dict[str, str] | None = None,
    read_side: tuple[str, ...] = (),
) -> str:
    """sha256 over (relative path, syntax tree) of every file in the import closure of ``roots``,
    then the library versions.

    ``versions`` defaults to the installed torch and timm; the result is the first
    ``FINGERPRINT_CHARS`` hex digits (64 bits: collisions are not a practical concern here).
    """
    if versions is None:
        import timm
        import torch

        versions = {"torch": torch.__version__, "timm": timm.__version__}
    digest = hashlib.sha256()
    for relative in import_closure(roots, root, read_side):
        data = _read(root, root / relative)[0].encode()
        # Path and length framed so moving code between files can never give the same hash.
        digest.update(f"{relative}\0{len(data)}\0".encode())
        digest.update(data)
    for name, version in sorted(versions.items()):
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def code_fingerprint(root: Path = PROJECT_ROOT, versions: dict[str, str] | None = None) -> str:
    """The training kind's fingerprint: the import closure of ``TRAINING_ROOTS`` under ``root``."""
    return closure_fingerprint(TRAINING_ROOTS, root, versions)


@lru_cache(maxsize=1)
def current_code_fingerprint() -> str:
    """This checkout's fingerprint, computed once per process (the files do not change under it)."""
    return code_fingerprint()
