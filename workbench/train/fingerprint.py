"""The identity of the code that computes results: a hash of its source files and versions.

A cell's run is the same run as long as the code that produces its numbers is the same.
That code is the library that builds data, models and training (``RESULT_PACKAGES``)
plus the torch and timm versions; documentation, reports, CLI text and tests are not
part of it, so a commit that touches only those does not re-train anything. The git
commit is still recorded on every run; it is just not part of the identity.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

LIBRARY_ROOT = Path(__file__).resolve().parent.parent  # the workbench/ package
# The folders of workbench/ whose code decides what a trained model and its metrics are.
RESULT_PACKAGES = ("data", "models", "train", "convert")
FINGERPRINT_CHARS = 16


def result_source_files(root: Path = LIBRARY_ROOT, packages: tuple[str, ...] = RESULT_PACKAGES) -> list[Path]:
    """The ``.py`` files that compute results, in a fixed (sorted, root-relative) order."""
    files = [p for pkg in packages for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def code_fingerprint(root: Path = LIBRARY_ROOT, packages: tuple[str, ...] = RESULT_PACKAGES,
                     versions: dict[str, str] | None = None) -> str:
    """sha256 over (relative path, content) of every result file, then the library versions.

    ``versions`` defaults to the installed torch and timm; the result is the first
    ``FINGERPRINT_CHARS`` hex digits (64 bits: collisions are not a practical concern here).
    """
    if versions is None:
        import timm
        import torch

        versions = {"torch": torch.__version__, "timm": timm.__version__}
    digest = hashlib.sha256()
    for path in result_source_files(root, packages):
        # Path and length framed so moving bytes between files can never give the same hash.
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    for name, version in sorted(versions.items()):
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


@lru_cache(maxsize=1)
def current_code_fingerprint() -> str:
    """This checkout's fingerprint, computed once per process (the files do not change under it)."""
    return code_fingerprint()
