"""The parts every kind's evidence export shares (transfer, intervention, attribution).

Each kind's export (``reports/<kind>/<kind>_evidence.py``) writes its own cell files and says
them in its README; what is the same for all of them lives here: the protocol's files and the
parse-back that checks their hash, the ``runs.json`` document's common keys, the README's head and
foot, and the build options read back. The mechanics below them (cleaned run records, gzip without
a timestamp, sha256 checks, atomic writes) are ``reports.evidence``'s.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from reports.collect import ReportError
from reports.evidence import (
    EVIDENCE_DIR,
    RUNS_FILE,
    cell_entry,
    cell_record,
    read_document,
    write_document,
)
from reports.provenance import BuildInputs
from tracking.export import run_export
from tracking.export.acted_weights import WeightsExportError, export_weights, weights_readme_item
from tracking.kinds.intervention_runs import choose_cells
from tracking.record import queries
from workbench.protocol import ProtocolError


def protocol_files(protocol) -> dict[str, str]:
    """The protocol file and the acted-on protocol's file, by file name: what parses to the hash again."""
    path = Path(protocol.source_file)
    files = {path.name: path.read_text(encoding="utf-8")}
    if protocol.acts_on is not None:
        acted = path.parent / f"{protocol.acts_on.protocol}.yaml"
        files[acted.name] = acted.read_text(encoding="utf-8")
    return files


def protocol_entry(protocol, digest: str, inputs: BuildInputs) -> dict:
    """``runs.json``'s protocol of a kind that acts on trained models: its files, parsed again on load."""
    return {
        "name": protocol.name,
        "hash": digest,
        "source": inputs.protocol_source,
        "canonical": protocol.canonical,
        "files": protocol_files(protocol),
    }


def evidence_document(
    fmt: str,
    protocol: dict,
    *,
    tracking_uri: str,
    inputs: BuildInputs,
    logged_to: list[str],
    parents: list[str],
    cells: list[dict],
) -> dict:
    """``runs.json``'s keys every kind writes; ``protocol`` is the kind's protocol entry."""
    return {
        "format": fmt,
        "protocol": protocol,
        "store": {"tracking_uri": tracking_uri, "experiment": protocol["name"]},
        "build": {
            "hash_option": inputs.hash_option,
            "resamples": inputs.n_resamples,
            "bootstrap_seed": inputs.bootstrap_seed,
            "confidence": inputs.confidence,
            "strict": inputs.strict,
            "logged_to": list(logged_to),
            # only where asked for: exports without pairs keep the keys they always had
            **({"compare": [list(p) for p in inputs.compare]} if inputs.compare else {}),
        },
        "parents": [run_export.run_record(run_id) for run_id in parents],
        "cells": cells,
    }


def export_acted(
    folder: Path,
    fmt: str,
    study,
    inputs: BuildInputs,
    logged_to: list[str],
    write_cell: Callable[[Path, dict, queries.CellRecord, Any], set[Path]],
    readme: Callable[[str, str, int, int], str],
) -> set[Path]:
    """``runs.json`` and the README of a kind that acts on trained models (``write_document``).

    Every cell run of the hash gets an entry (``cell_entry``); for a reported cell
    ``write_cell(folder, entry, record, cell)`` writes its files, names them in the entry and
    returns their paths. ``readme(name, digest, reported cells, cell runs)`` is the README.
    Returns every path the cells wrote, so the caller can remove what an older export left.
    """
    cells, written, acted = [], set(), []
    reported = {r.run_id: key for key, r in study.chosen.items()}
    for record in sorted(study.records, key=lambda r: (r.arm, r.seed, r.run_id)):
        entry = cell_entry(record)
        if record.run_id in reported:
            written |= write_cell(folder, entry, record, study.cells[reported[record.run_id]])
            if source := record.params.get("source_run_id"):
                acted.append((record.arm, record.seed, source))
        cells.append(entry)
    if (
        study.protocol.acts_on is not None and acted
    ):  # a pretrained model's weights are pinned, not shipped
        try:
            written |= export_weights(folder, study.protocol.acts_on, acted)
        except WeightsExportError as err:
            raise ReportError(f"{folder}: the acted-on weights cannot be exported: {err}") from err
    document = evidence_document(
        fmt,
        protocol_entry(study.protocol, study.digest, inputs),
        tracking_uri=study.tracking_uri,
        inputs=inputs,
        logged_to=logged_to,
        parents=parent_ids(study.protocol.name, study.digest),
        cells=cells,
    )
    readme_text = readme(study.protocol.name, study.digest, len(study.chosen), len(cells))
    if acted and study.protocol.acts_on is not None:
        head, sep, tail = readme_text.partition("\nStrings carry no credentials")
        readme_text = f"{head.rstrip()}\n{weights_readme_item(len(acted))}{sep}{tail}"
    write_document(folder, document, readme_text)
    return written


def runs_item(fmt: str, digest: str, runs: int) -> str:
    """The README's ``runs.json`` bullet as every acting kind starts it, up to the metrics it
    names: the kind's text goes on from "among them "."""
    return f"""- `runs.json` (format `{fmt}`, JSON with sorted keys): the protocol (its hashed
  canonical content, hash `{digest}`, and the text of its file and of the acted-on
  protocol's file, which a rebuild parses again and checks against the hash), the tracking
  store and experiment as the report names them, the build options and the run the report
  was logged to, all {runs} cell runs of the hash (any status: run id, status, start and end
  times in ms since the epoch, params, tags, latest metrics, among them """


def parent_ids(name: str, digest: str) -> list[str]:
    """The run ids of every parent run of the protocol's hash."""
    return [p.run_id for p in queries.parent_runs(name, digest)]


def evidence_readme(name: str, digest: str, what: str, items: str, foot: str = "") -> str:
    """The README of an export: how to rebuild the ``what`` report, then ``items`` (its files, in
    Markdown bullets), then what no string holds and ``foot``."""
    return f"""# Evidence of {name}@{digest[:12]}

What the {what} report beside this folder (`../report.md`) was computed from, exported
by `workbench report --evidence` from the runs the report was built from, so that anyone can
check every number and rebuild the report (its tables, paragraphs and figures) without the
MLflow store:

```bash
workbench report --from-evidence {name}/evidence --out-dir rebuilt  # run from the folder that holds {name}/
```

The rebuilt `report.md` equals `../report.md` except for one added header line
("Rebuilt offline from the evidence export ...").

{items.strip()}

Strings carry no credentials and no absolute paths: paths are relative to the directory
the report was built from.{foot}
"""


def exported_protocol(where: str, p: dict, load: Callable[[Path], object]):
    """The protocol parsed again from the exported files by ``load``, its hash checked against the
    recorded one; an export holds ``files`` (by name) or one ``file`` (name and text)."""
    if "files" in p:
        files, main = p["files"], f"{p['name']}.yaml"
    else:
        files, main = {p["file"]["name"]: p["file"]["text"]}, p["file"]["name"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            if Path(name).name != name:
                raise ReportError(f"{where}: protocol file name {name!r} is not a plain file name")
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        try:
            protocol = load(Path(tmp) / main)
        except ProtocolError as err:
            raise ReportError(f"{where}: the exported protocol does not parse ({err})") from err
    if protocol.hash != p["hash"] or protocol.canonical != p["canonical"]:
        raise ReportError(
            f"{where}: the exported protocol file hashes to {protocol.hash[:12]}, not protocol.hash "
            f"{p['hash'][:12]}"
        )
    return protocol


def exported_records(folder: Path, doc: dict) -> tuple[dict[str, dict], list]:
    """Every exported cell's entry by run id, and its record."""
    where = str(folder / RUNS_FILE)
    return {e["run_id"]: e for e in doc["cells"]}, [cell_record(e, where) for e in doc["cells"]]


def check_exported(where: str, chosen: dict, entries: dict[str, dict], key: str) -> None:
    """Refuse an export with no finished cell, or a reported cell whose ``key`` (its files) is absent."""
    if not chosen:
        raise ReportError(f"{where}: no finished cell run: nothing to rebuild")
    lacking = [
        f"{r.arm}/seed{r.seed} ({r.run_id})"
        for r in chosen.values()
        if key not in entries[r.run_id]
    ]
    if lacking:
        raise ReportError(
            f"{where}: reported cells whose {key} were not exported: {', '.join(lacking)}"
        )


def exported_inputs(p: dict, build: dict, seed: int, confidence: float) -> BuildInputs:
    """The build options the report was built with, read back (bootstrap seed and confidence given)."""
    return BuildInputs(
        p["source"],
        p["hash"],
        build["hash_option"],
        None,
        [(a, b) for a, b in build.get("compare", [])],
        int(build["resamples"]),
        seed,
        confidence,
        bool(build["strict"]),
    )


@dataclass
class ExportedReadout:
    """A readout read back from its evidence export, with what the report was built with."""

    study: object  # the kind's readout (reports.common.readout.Readout)
    inputs: BuildInputs
    logged_to: list[str]


class ExportKind(NamedTuple):
    """How a kind that acts on trained models reads its export back."""

    load: Callable[[Path], object]  # the protocol file's loader
    readout: type  # the kind's readout class
    key: str  # the key of a reported cell's files in its entry
    read_cell: Callable  # (folder, record, entry) -> what the cell logged

    def read(self, folder: Path, fmt: str) -> ExportedReadout:
        """The study and build options of an export of this kind (format ``fmt``); no MLflow
        store is opened.

        Raises:
            ReportError: A file is missing, damaged or of another format; the message names it.
        """
        return read_document(Path(folder), fmt, functools.partial(exported_readout, kind=self))


def exported_readout(folder: Path, doc: dict, *, kind: ExportKind) -> ExportedReadout:
    """The readout of an export of ``kind``, one run per cell chosen by the rule the store build
    uses; a reported cell whose files are absent is refused by name."""
    where = str(folder / RUNS_FILE)
    p, build = doc["protocol"], doc["build"]
    protocol = exported_protocol(where, p, kind.load)
    entries, records = exported_records(folder, doc)
    chosen = choose_cells(records)
    check_exported(where, chosen, entries, kind.key)
    cells = {k: kind.read_cell(folder, r, entries[r.run_id]) for k, r in chosen.items()}
    study = kind.readout(
        protocol,
        p["hash"],
        chosen,
        records,
        cells,
        doc["store"]["tracking_uri"],
        f"{protocol.name}/{EVIDENCE_DIR}",
    )
    # the bootstrap seed and confidence are the protocol's: its hash is checked
    e = protocol.evaluation
    return ExportedReadout(
        study, exported_inputs(p, build, e.seed, e.confidence), list(build["logged_to"])
    )
