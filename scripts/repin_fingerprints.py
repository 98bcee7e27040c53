"""The ``SAME_CODE`` rows of a re-pin: old code fingerprints of one commit, new ones of another.

    python scripts/repin_fingerprints.py OLD_COMMIT [NEW_COMMIT]      (NEW_COMMIT: HEAD)

For each kind (training, transfer, intervention, attribution) it prints one row of
``workbench.code_history.SAME_CODE``: the folder fingerprint (the algorithm before the import
closure, ``folder_fingerprints``) of the files at OLD_COMMIT, which is what the stores hold for
cells trained by that code, and the import-closure fingerprint (this checkout's
``closure_fingerprint`` and kinds' roots) of the files at NEW_COMMIT, with the installed torch
and timm. Each commit's files are read with ``git archive``, so neither needs checking out.

A row says that cells trained by OLD_COMMIT's code count as trained by NEW_COMMIT's: only give
commits between which no change moved a result (a refactor, a moved rule, the fingerprint's own
code); otherwise the old cells must train again. docs/study-record.md, "Identity", says more.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

import timm
import torch

from tracking.kinds.attribution_runs import attribution_fingerprint
from tracking.kinds.intervention_runs import intervention_fingerprint
from tracking.kinds.transfer_runs import transfer_fingerprint
from workbench.code_history import folder_fingerprints
from workbench.train.fingerprint import PROJECT_PACKAGES, PROJECT_ROOT, code_fingerprint

CLOSURES = (
    ("training", code_fingerprint),
    ("transfer", transfer_fingerprint),
    ("intervention", intervention_fingerprint),
    ("attribution", attribution_fingerprint),
)


def extract(commit: str, dst: Path) -> Path:
    """The project's packages at ``commit`` written under ``dst`` (``git archive``)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, *PROJECT_PACKAGES],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dst, filter="data")
    return dst


def repin_rows(
    old_commit: str, new_commit: str, versions: dict[str, str]
) -> list[tuple[str, str, str]]:
    """(kind, folder fingerprint at ``old_commit``, closure fingerprint at ``new_commit``) per kind."""
    with tempfile.TemporaryDirectory() as tmp:
        old = extract(old_commit, Path(tmp) / "old")
        new = extract(new_commit, Path(tmp) / "new")
        before = folder_fingerprints(old / "workbench", versions)
        return [(kind, before[kind], closure(new, versions)) for kind, closure in CLOSURES]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_commit", help="the commit whose code the stored cells were trained by")
    parser.add_argument("new_commit", nargs="?", default="HEAD", help="the commit that re-pins")
    args = parser.parse_args(argv)
    versions = {"torch": torch.__version__, "timm": timm.__version__}
    print(f"# {args.old_commit} (folders) -> {args.new_commit} (import closure), {versions}")
    for kind, old, new in repin_rows(args.old_commit, args.new_commit, versions):
        print(f'    ("{kind}", "{old}", "{new}"),')


if __name__ == "__main__":
    main()
