"""``workbench report --all``: a report for every protocol in the store, and an index page linking them.

Every experiment holding a protocol's parent runs is one entry; its newest execution's hash
is reported (by name: the protocol file under ``studies/protocols/`` when its hash matches,
else the ``protocol/canonical.json`` the parent logged). A protocol whose report cannot be
built is listed with the reason, never dropped. ``index.md`` and ``index.html`` go to the
output root beside the report folders, written like the reports (atomic, 0644).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reports.provenance import utc
from reports.render import Block, Bullets, Heading, Para, Table, to_html, to_markdown
from tracking.record import queries
from workbench.atomic import atomic_write_bytes
from workbench.protocol import SHORT_HASH_LEN


@dataclass(frozen=True)
class IndexEntry:
    entry: queries.ProtocolEntry
    report: Path | None  # report.html relative to the output root, when built
    outcome: str  # "built", or why not
    problems: int  # missing cells and stale runs (what --strict refuses)


def build_all(build, out_root: Path, **options) -> tuple[list[IndexEntry], Path]:
    """Build every protocol's report with ``build(name, out_root, hash_prefix=..., **options)``, then the index.

    ``build`` is ``reports.build.build_report`` (passed in: this module sits below it).
    """
    from reports.collect import ReportError
    from workbench.protocol import ProtocolError

    entries = []
    for entry in queries.protocol_entries():
        try:
            result = build(entry.name, out_root, hash_prefix=entry.newest_hash, **options)
            entries.append(
                IndexEntry(entry, result.html.relative_to(out_root), "built", len(result.problems))
            )
        except (ReportError, ProtocolError, queries.QueryError) as err:
            entries.append(IndexEntry(entry, None, f"not built: {str(err).splitlines()[-1]}", 0))
    return entries, write_index(entries, out_root)


def _status(e: queries.ProtocolEntry) -> str:
    cells = ", ".join(f"{n} {s.lower()}" for s, n in e.cell_status.items()) or "no cell runs"
    return f"execution {e.parent_status.lower()}; cells: {cells}"


def write_index(entries: list[IndexEntry], out_root: Path) -> Path:
    rows = []
    for item in entries:
        e = item.entry
        link = f"[report]({item.report.as_posix()})" if item.report else "–"
        rows.append(
            [
                f"`{e.name}`",
                e.kind,
                f"`{e.newest_hash[:SHORT_HASH_LEN]}`",
                str(e.hashes),
                utc(e.start_time),
                _status(e),
                item.outcome + (f" ({item.problems} missing or stale ⚠)" if item.problems else ""),
                link,
            ]
        )
    blocks: list[Block] = [
        Heading(1, "Reports"),
        Bullets(
            [
                f"Tracking store `{queries.tracking_uri()}` (credentials removed): {len(entries)} protocol(s) with a "
                "recorded execution.",
                "One row per protocol name: the newest execution's hash is reported; `hashes` counts the versions "
                "recorded under the name (report another with `workbench report --protocol NAME --hash PREFIX`).",
            ]
        ),
        Table(
            ["protocol", "kind", "hash", "hashes", "newest execution", "status", "report", "link"],
            rows,
            ["l", "l", "l", "r", "l", "l", "l", "l"],
        )
        if rows
        else Para("No protocol has been executed against this store."),
    ]
    out_root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_root / "index.md", to_markdown(blocks).encode("utf-8"), 0o666)
    atomic_write_bytes(out_root / "index.html", to_html(blocks, "Reports").encode("utf-8"), 0o666)
    return out_root / "index.html"
