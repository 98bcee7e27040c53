"""The identity of the code that computes results: a hash of its syntax trees and versions.

A cell's run is the same run as long as the code that produces its numbers is the same.
That code is the library that builds data, models and training (``RESULT_PACKAGES``)
plus the torch and timm versions; documentation, reports, CLI text and tests are not
part of it, so a commit that touches only those does not re-train anything. The git
commit is still recorded on every run; it is just not part of the identity.

What is hashed is each file's meaning, not its text: the syntax tree without docstrings
(comments never reach the tree), so a comment, a docstring or a reformat (quotes, line
breaks, parentheses, trailing commas) changes no identity while a changed constant, name or
statement does. The tree is written out by ``canonical_tree`` rather than ``ast.dump``
because ``ast.dump`` prints the fields a Python release adds (``type_params`` in 3.12)
even when empty, which would give the same code another identity on another Python.

The fingerprint of stored cells changed once, when it moved from file text to syntax
trees (docs/training.md, "Code identity"); ``workbench.code_history`` maps the last text
fingerprint to its tree fingerprint so that cells trained on that code are still recognised
(it lives outside the hashed folders: a table of fingerprints cannot be part of what it hashes).
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

LIBRARY_ROOT = Path(__file__).resolve().parent.parent  # the workbench/ package
# The folders of workbench/ whose code decides what a trained model and its metrics are.
RESULT_PACKAGES = ("data", "models", "train", "convert")
FINGERPRINT_CHARS = 16
# Definitions whose first statement, when it is a string, is a docstring (never executed code).
_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Fields that carry no meaning: a string's u-prefix marker and the type comments ast keeps.
_IGNORED_FIELDS = frozenset({"kind", "type_comment", "type_ignores"})


def result_source_files(
    root: Path = LIBRARY_ROOT, packages: tuple[str, ...] = RESULT_PACKAGES
) -> list[Path]:
    """The ``.py`` files that compute results, in a fixed (sorted, root-relative) order."""
    files = [
        p for pkg in packages for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


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


def code_fingerprint(
    root: Path = LIBRARY_ROOT,
    packages: tuple[str, ...] = RESULT_PACKAGES,
    versions: dict[str, str] | None = None,
) -> str:
    """sha256 over (relative path, syntax tree) of every result file, then the library versions.

    ``versions`` defaults to the installed torch and timm; the result is the first
    ``FINGERPRINT_CHARS`` hex digits (64 bits: collisions are not a practical concern here).
    """
    if versions is None:
        import timm
        import torch

        versions = {"torch": torch.__version__, "timm": timm.__version__}
    digest = hashlib.sha256()
    for path in result_source_files(root, packages):
        relative = path.relative_to(root).as_posix()
        data = source_meaning(path.read_text(encoding="utf-8"), filename=relative).encode()
        # Path and length framed so moving code between files can never give the same hash.
        digest.update(f"{relative}\0{len(data)}\0".encode())
        digest.update(data)
    for name, version in sorted(versions.items()):
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


@lru_cache(maxsize=1)
def current_code_fingerprint() -> str:
    """This checkout's fingerprint, computed once per process (the files do not change under it)."""
    return code_fingerprint()
