"""Fingerprints that name the same training code: the one-time move from text to syntax trees.

Until commit "Code identity from the syntax tree" the training code fingerprint
(``workbench.train.fingerprint``) hashed the files' text; since then it hashes their syntax
trees without docstrings. Every fingerprint changed once then, for the same code. This table
lets ``status``, ``ablate`` and ``reproduce`` recognise cells stored under the last text
fingerprint as trained by the code that has the tree fingerprint it maps to. It is kept outside
the hashed folders (data, models, train, convert), since it holds the hash of those folders.
"""

from __future__ import annotations

# The last text fingerprint (torch 2.14.1, timm 1.0.31: main at aa84a9a) -> the tree
# fingerprint of the same files at the same versions.
TEXT_TO_TREE = {"f2c09a41af712f3e": "ff2ef10cdf4136e8"}


def same_code(stored: str | None, current: str) -> bool:
    """Whether a stored cell's fingerprint names the code whose fingerprint is ``current``.

    True when equal, or when ``stored`` is the text fingerprint that ``TEXT_TO_TREE`` maps to
    ``current`` (cells trained before the fingerprint moved to syntax trees).
    """
    return stored is not None and (stored == current or TEXT_TO_TREE.get(stored) == current)
