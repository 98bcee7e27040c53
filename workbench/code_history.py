"""Fingerprints that name the same code: each announced move of how the code identity is computed.

The code fingerprints (``workbench.train.fingerprint`` and each kind's in ``tracking.kinds``) changed
twice for the same code: once when they moved from the files' text to their syntax trees, once when
they moved from fixed folders to the import closure of the code that computes results. ``SAME_CODE``
holds, per kind, the old fingerprint of the code at that move and the new fingerprint of the same
code; ``status``, ``ablate``, ``reproduce``, the reports and the acting kinds' cell keys go through
``same_code``, ``current_name`` and ``older_names``, so a cell stored under an old value still counts
as trained by the code the new value names. Every other pair of fingerprints means other code.

Fingerprints are 64-bit hashes, so no old value of one kind is a value of another: the lookups need
no kind (the kind column is for the reader and for ``scripts/repin_fingerprints.py``). No hashed
code imports this module: a table of fingerprints cannot be part of what it hashes.

``folder_fingerprints`` keeps the folder algorithm that computed the values stores hold from before
the import closure, so that the old side of a re-pin can be computed for any commit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from workbench.train.fingerprint import FINGERPRINT_CHARS, source_meaning

# (kind, old fingerprint, new fingerprint of the same code), at torch 2.14.1 and timm 1.0.31.
SAME_CODE = (
    # the last text fingerprint (main at aa84a9a) -> its syntax-tree fingerprint
    ("training", "f2c09a41af712f3e", "ff2ef10cdf4136e8"),
    # folders -> import closure: the folder fingerprints of main at 9e95af9 (what its cells hold)
    # -> the closure fingerprints of the code that publishes this move, for the kinds whose results
    # no change between them moved (python scripts/repin_fingerprints.py 9e95af9 <that commit>;
    # docs/study-record.md). The training closure's changes since 9e95af9 add methods and hook
    # checks to the model and change no forward; transfer's add protocol checks. Intervention and
    # attribution are not mapped: their results changed with that move (noising beside denoising,
    # the class-stratified sample, Adebayo et al.'s cascade), so their cells evaluate again.
    ("training", "cd75a476b2728c95", "1fdbd2ef63e1f7ae"),
    ("transfer", "e64a88a54d14a751", "7988119bd98e7e89"),
    # dataset.train_subset (data-size arms): the loader and the Trainer gained a branch that a
    # protocol without the key never takes; a config without it keeps its dict and config hash,
    # and the smoke protocol's cells trained by both commits are bitwise equal (weights,
    # predictions, history: docs/study-record.md, "Identity"). Main at b1ae23a -> 2877239; the
    # other kinds' closures hold the same two files and nothing else changed in them.
    ("training", "1fdbd2ef63e1f7ae", "28158c5e1d44db97"),
    ("transfer", "7988119bd98e7e89", "ae692760d78da714"),
    ("intervention", "8e64009d966ee359", "c7ef3f8c7ac22b81"),
    ("attribution", "bc0ff15d6c267429", "410ad7cdd0ca2be7"),
    # The transfer closure held every protocol kind's parser (workbench/protocol/transfer.py
    # imported the package, whose __init__ imports all kinds); it now imports
    # workbench.protocol.common alone, so only transfer's own parser and the shared checks are
    # hashed. Between main at 5645d99 and the commit that does this, the transfer closure's
    # changes are that import, the table of kinds loading parsers by path, and unused names
    # removed: nothing a transfer cell computes. The other kinds' closures hold none of these files.
    ("transfer", "ccfea45709afc491", "4dc46f9492dd9090"),
    # Refactors, each shown to compute the same: three unused names removed (files_key,
    # check_digest, MC_METHOD), config_from_timm split (the same configs and
    # refusals for all 163 timm ViT architectures), the transfer's cached regimes trained by the
    # Trainer (the published retina_transfer_local cells re-trained bit for bit), report text
    # moved out of the library (workbench/report_content -> reports/content, its estimates to
    # workbench/estimates.py). Main at fed1738 -> the commit that publishes them, closure to
    # closure, computed by importing each commit's code. The transfer value fed1738's files
    # give (98c365e1b554dacc, also 694f5af's) is not the 4dc46f9492dd9090 of the row above,
    # which no committed tree reproduces; this row maps the committed value.
    ("training", "28158c5e1d44db97", "85e570854701b488"),
    ("transfer", "98c365e1b554dacc", "f725e1875f353ef4"),
    ("intervention", "66ae047f73f2bc56", "7b051a291ca59977"),
    ("attribution", "d9ef7b21ccf5e85e", "415dd528d20a8328"),
)
_NEWER = {old: new for _, old, new in SAME_CODE}

# The folders (under workbench/) each kind hashed before the import closure, and single files
# added to attribution's: what ``folder_fingerprints`` recomputes.
_TRAINING_FOLDERS = ("data", "models", "train", "convert")
FOLDERS = (
    ("training", _TRAINING_FOLDERS),
    ("transfer", (*_TRAINING_FOLDERS, "transfer")),
    ("intervention", (*_TRAINING_FOLDERS, "interventions")),
    ("attribution", (*_TRAINING_FOLDERS, "interventions", "attribution")),
)
_ATTRIBUTION_FILES = ("analysis/rollout.py",)


def current_name(fingerprint: str | None) -> str | None:
    """The newest fingerprint that names the same code as ``fingerprint`` (itself when none does)."""
    seen = set()
    while fingerprint in _NEWER and fingerprint not in seen:
        seen.add(fingerprint)
        fingerprint = _NEWER[fingerprint]
    return fingerprint


def same_code(stored: str | None, current: str) -> bool:
    """Whether a stored cell's fingerprint names the code whose fingerprint is ``current``.

    True when equal, or when ``SAME_CODE`` leads from one to the other (cells trained before a
    move of how the fingerprint is computed).
    """
    return stored is not None and current_name(stored) == current_name(current)


def older_names(current: str) -> list[str]:
    """Every older fingerprint ``SAME_CODE`` leads from to ``current``, the latest move's first."""
    return [old for old in reversed(_NEWER) if old != current and same_code(old, current)]


def _folder_hash(root: Path, folders: tuple[str, ...], versions: dict[str, str]) -> str:
    files = sorted(
        (p for f in folders for p in (root / f).rglob("*.py") if "__pycache__" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    digest = hashlib.sha256()
    for path in files:
        relative = path.relative_to(root).as_posix()
        data = source_meaning(path.read_text(encoding="utf-8"), filename=relative).encode()
        digest.update(f"{relative}\0{len(data)}\0".encode())
        digest.update(data)
    for name, version in sorted(versions.items()):
        digest.update(f"{name}=={version}\0".encode())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def folder_fingerprints(library: Path, versions: dict[str, str]) -> dict[str, str]:
    """Each kind's fingerprint as computed before the import closure, of the ``workbench/`` at ``library``.

    The folders' syntax trees in sorted order, then the versions; attribution's is the sha256 of
    that hash extended by ``analysis/rollout.py`` (as ``tracking.kinds.attribution_runs`` had it).
    """
    out = {kind: _folder_hash(library, folders, versions) for kind, folders in FOLDERS}
    digest = hashlib.sha256(out["attribution"].encode())
    for name in _ATTRIBUTION_FILES:
        data = source_meaning((library / name).read_text(encoding="utf-8"), filename=name).encode()
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
    out["attribution"] = digest.hexdigest()[:FINGERPRINT_CHARS]
    return out
