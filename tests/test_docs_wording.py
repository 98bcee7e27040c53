"""The docs speak of the project, not of how it was made: no issue tags, stops, rounds or sessions."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Phrases about the project's making that a user has no use for (case-insensitive). Published
# reports under docs/results/ are evidence and stay as they were generated.
FORBIDDEN = (
    r"\bstop \d+\b",
    r"\b(that|this|the next) stop's\b",
    r"\bthe CI of that stop\b",
    r"\[[A-Z]{1,2}\](/\[[A-Z]{1,2}\])? (merges?|items?)\b",
    r"\bissue \d+\b",
    r"\bthe issue's\b",
    r"\boutside the project\b",
    r"\b(this|that|an earlier|the) session's\b",
    r"\b(this|that|earlier) session\b",
    r"\bthis round\b",
    r"\ba round ago\b",
    r"\bother engineers\b",
    r"\bthe lead\b",
    r"\bthe one-forward redesign\b",
    r"\buntil this change\b",
    r"\bthe change that added it\b",
)


def making_of(text: str) -> list[str]:
    """Each forbidden phrase found in ``text``, as ``line N: phrase``."""
    found = []
    for pattern in FORBIDDEN:
        for m in re.finditer(pattern, text, flags=re.IGNORECASE):
            found.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    return found


def test_the_docs_contain_no_word_of_how_the_project_was_made():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(docs) > 10, [d.name for d in docs]
    problems = [f"{d.relative_to(ROOT)} {hit}" for d in docs for hit in making_of(d.read_text())]
    assert not problems, "the docs speak of the project's making:\n" + "\n".join(problems)


def test_the_check_finds_the_phrases_it_is_for():
    bad = (
        "Measured after stop 26, after the [S]/[V] merges.\n"
        "Hence auto (the issue's own measurement outside the project).\n"
        "Done as [T] item 5b on this session's machine; the slow tier grew this round.\n"
    )
    hits = " ".join(making_of(bad))
    for phrase in ("stop 26", "[S]/[V] merges", "[T] item", "the issue's", "outside the project",
                   "this session's", "this round"):  # fmt: skip
        assert repr(phrase) in hits, (phrase, hits)
    assert making_of("Stop the server, then a session of its own; merge the runs.") == []
