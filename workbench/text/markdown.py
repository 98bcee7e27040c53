"""The one Markdown table writer, used by the reports, the transfer section and the benchmark report.

GitHub-flavoured: pipes inside cells are escaped and newlines become spaces, so a cell can
never break the table; columns are padded to a common width by default so the raw
Markdown reads as a table too.
"""

from __future__ import annotations

from collections.abc import Sequence


def cell(text: object) -> str:
    """One cell's text, safe inside a Markdown table row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    align: Sequence[str] = (),
    pad: bool = True,
) -> str:
    """A GitHub Markdown table.

    Args:
        header: Column titles.
        rows: One sequence of values per row (``str()`` of each), as many as the header.
        align: ``"l"`` or ``"r"`` per column (default all left).
        pad: Pad every column to its widest cell (``False``: minimal ``| a | b |`` rows).

    Raises:
        ValueError: A row has another number of cells than the header.
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(
                f"table row {list(row)!r} has {len(row)} cells for {len(header)} columns"
            )
    align = list(align) or ["l"] * len(header)
    cells = [[cell(c) for c in header]] + [[cell(c) for c in row] for row in rows]
    if not pad:
        return "\n".join(
            ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in cells[1:]]
        )
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
            for w, a in zip(widths, align)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
