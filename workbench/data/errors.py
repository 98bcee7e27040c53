"""Errors raised by the data layer.

Each error names the file, key or value at fault so a user can fix the input without
reading the code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """One place that source resolution looked at.

    Attributes:
        kind: Which rule produced this place, e.g. ``"explicit path"``,
            ``"$WORKBENCH_DATA_DIR"``, ``"user cache"``, ``"system-wide"``, ``"download"``.
        path: The file or folder looked at, or ``None`` when the rule had nothing to look at
            (no path given, variable not set, download not allowed).
        note: What was found there, or why it was not usable.
    """

    kind: str
    path: str | None
    note: str

    def describe(self) -> str:
        """One human-readable line, e.g. ``user cache: /root/.cache/... (missing ...)``."""
        where = self.path if self.path is not None else "-"
        return f"{self.kind}: {where} ({self.note})"


class DatasetNotFound(FileNotFoundError):
    """No usable copy of a dataset was found in any place looked.

    Attributes:
        name: The dataset name asked for.
        places: Every place looked, in order.
    """

    def __init__(self, name: str, places: Sequence[Place], hints: Sequence[str]):
        self.name = name
        self.places = tuple(places)
        lines = [f"Dataset {name!r} was not found. Places looked, in order:"]
        lines += [f"  {i}. {p.describe()}" for i, p in enumerate(self.places, 1)]
        lines.append("How to provide it:")
        lines += [f"  - {h}" for h in hints]
        super().__init__("\n".join(lines))


class ChecksumMismatch(ValueError):
    """A file that has a known official checksum does not match it.

    Attributes:
        path: The file checked.
        algorithm: ``"md5"`` or ``"sha256"``.
        expected: The official digest (or digests, joined by `` or ``).
        actual: The digest computed from the file.
    """

    def __init__(self, path: str, algorithm: str, expected: str, actual: str, hint: str = ""):
        self.path = path
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual
        msg = f"{algorithm} checksum mismatch for {path}: expected {expected}, got {actual}."
        if hint:
            msg += " " + hint
        super().__init__(msg)


class DataFormatError(ValueError):
    """A data file exists but its content is not in the expected format.

    Raised for a truncated file, a bad magic number, a missing key or a wrong array shape;
    the message names the file (and key) with what was found versus what was expected.
    """


class SplitSizeError(ValueError):
    """The split sizes asked for (``train_size``, ``val_size``) do not fit the dataset.

    The message names the size keys, the values and how many images there are, so a study
    can refuse its protocol in one line before any run opens.
    """
