"""Build a transfer protocol's report: the same pipeline, files, provenance and checks as an ablation report.

The numbers come from a ``TransferReportData`` (``reports.transfer.transfer_data``: the newest finished
run of each (regime, seed) of the hash, for the source of the newest execution, read from the
store or from an evidence export); the cells' records give the provenance table, the compute
cost and the newer unfinished attempts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from reports import configuration, figures, provenance
from reports.calibration.calibration_blocks import transfer_calibration
from reports.collect import ReportError, newer_attempts, resolve_hash, shown_path
from reports.render import Block, Bullets, Heading, Para, Table
from reports.transfer import transfer_blocks
from reports.output import ReportResult, Summary, paired_metrics, results_text, write_report
from reports.transfer.transfer_data import TransferReportData, compute_section, load_data
from tracking.record import queries
from tracking.record.queries import CellRecord
from workbench.protocol import SHORT_HASH_LEN, TransferProtocol, kind_of, load_transfer_protocol
from workbench.bench.cost import arm_cost, training_cost
from workbench.transfer.report import TransferSection

FLAG = "⚠"
KIND = "transfer"  # the name the table of kinds (workbench.kinds) gives this report's kind


def _source_config(canonical: dict, num_classes: int):
    """The source ViT's config for trained-parameter counts; None when it cannot be known offline."""
    model = (canonical.get("source") or {}).get("model")
    if not model:
        return None
    try:
        from workbench.bench.cost import timm_vit_config

        return timm_vit_config(model, num_classes)
    except Exception:  # noqa: BLE001 - an unknown or non-ViT architecture: the table says n/a
        return None


def _regime_label(regime, reference: str) -> str:
    """A regime's name in the header; a scratch regime is said to be trained from scratch, never pretrained."""
    scratch = (
        " (trained from scratch: the source's architecture, seeded random init, not pretrained)"
    )
    return (
        regime.name
        + (" (reference)" if regime.name == reference else "")
        + (scratch if regime.kind == "scratch" else "")
    )


def cost_blocks(
    section: TransferSection,
    chosen: dict[tuple[str, int], CellRecord],
    regimes: list[str],
    config=None,
    source_cfg=None,
    epochs_run: dict[str, int] | None = None,
) -> list[Block]:
    """Per regime: training + selection wall time, epochs run, images/s, device, precision, trained parameters, FLOPs.

    ``epochs_run``: run id -> epochs logged (points of ``val_qwk``); default read from the store."""
    trained = {
        row["regime"].removesuffix(" (reference)"): row["trained parameters"]
        for row in (config.rows if config else [])
    }
    flops = "n/a"
    if source_cfg is not None:
        from reports.content.config_table import flops_text
        from workbench.bench.flops import vit_forward_flops

        flops = flops_text(vit_forward_flops(source_cfg)["total"])
    rows = []
    for regime in regimes:
        records = [
            r for (g, _), r in sorted(chosen.items(), key=lambda kv: kv[0][1]) if g == regime
        ]
        if not records:
            continue
        runs, epochs = [], []
        for r in records:
            n_epochs = (
                epochs_run[r.run_id]
                if epochs_run is not None and r.run_id in epochs_run
                else len(queries.metric_history(r.run_id, "val_qwk"))
            )
            epochs.append(str(n_epochs))
            seconds, train = (
                r.metrics.get("selection_seconds", 0.0),
                int(float(r.params.get("data.n_train", 0) or 0)),
            )
            if seconds and seconds > 0 and train:
                runs.append(
                    training_cost(
                        seconds,
                        n_epochs,
                        train_size=train,
                        device=provenance.device(r),
                        precision=provenance.precision(r),
                    )
                )
        if runs:
            c = arm_cost(runs)
            row = [
                regime,
                str(len(records)),
                f"{c.mean_wall_seconds:.1f} s",
                f"{c.total_wall_seconds:.1f} s",
                " / ".join(epochs),
                f"{c.mean_images_per_second:,.0f}",
                ", ".join(c.devices),
                ", ".join(c.precisions),
            ]
        else:
            row = [
                regime,
                str(len(records)),
                "n/a",
                "n/a",
                " / ".join(epochs),
                "n/a",
                ", ".join(sorted({provenance.device(r) for r in records})),
                ", ".join(sorted({provenance.precision(r) for r in records})),
            ]
        rows.append(row + [trained.get(regime, "n/a"), flops])
    return [
        Heading(2, "Compute cost"),
        Table(
            [
                "regime",
                "runs",
                "wall time / run",
                "wall time, all runs",
                "epochs run",
                "images/s",
                "device",
                "precision",
                "trained parameters",
                "FLOPs / image (forward)",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "l", "l", "r", "r"],
            [
                "Wall time: metric `selection_seconds` (training and selection on validation, feature caching included); "
                "images/s: training images (param `data.n_train`) x epochs run / that time. Epochs run per seed in seed "
                "order; n/a where the run did not log them."
            ],
        ),
    ]


def source_warnings(canonical: dict, execution: dict) -> list[str]:
    """A source given by ``--source`` instead of the protocol's ``source.weights``: the Configuration table
    shows the protocol's weights, so the report says which weights the cells really adapted, and what they are."""
    override = execution.get("tags", {}).get("source_override", "")
    weights = str((canonical.get("source") or {}).get("weights", ""))
    if not override or override == weights:
        return []
    source = {k: v for k, v in execution.get("params", {}).items() if k.startswith("source.")}
    return [
        f"the reported cells adapted the source given by `--source {override}`, not the protocol's source.weights "
        f"`{weights}` (as Configuration shows it): their weights are {transfer_blocks.source_provenance(source)}"
    ]


def build_blocks(
    data: TransferReportData,
    section: TransferSection,
    inputs: provenance.BuildInputs,
    log_targets: list[str],
) -> tuple[list[Block], list[str], list[str]]:
    """The report's blocks, its warnings and what ``--strict`` refuses (missing cells, stale runs); no store is read."""
    protocol, digest, records = data.protocol, data.digest, data.records
    short = digest[:SHORT_HASH_LEN]
    by_id = {r.run_id: r for r in records}
    kappa = section.kappa_table
    chosen = {
        (r["regime"], int(r["seed"])): by_id[r["run_id"]]
        for _, r in kappa.iterrows()
        if r["run_id"] in by_id
    }
    regimes = [r.name for r in protocol.regimes]
    canonical = protocol.canonical
    attempts = newer_attempts(records, chosen, tuple(regimes), tuple(protocol.seeds))
    missing = [f"{g}/seed{s}" for s in protocol.seeds for g in regimes if (g, s) not in chosen]
    source_cfg = _source_config(canonical, section.num_classes)
    config, conflicts = configuration.protocol_config(canonical, source_cfg)
    report = transfer_blocks.degenerate(section)
    warnings = [f"the description contradicts the hashed protocol: {c}" for c in conflicts]
    warnings += source_warnings(canonical, data.execution)
    warnings += (
        [
            f"{len(missing)} expected cell(s) have no finished run for this source: {', '.join(missing)}"
        ]
        if missing
        else []
    )
    warnings += [
        f"{r.arm}/seed{r.seed} has a newer {r.status} run {r.run_id} (started {provenance.utc(r.start_time)}); "
        "the report uses the older finished run (see Runs)"
        for r in attempts
    ]
    warnings += [
        f"the cell {m} disagrees with its own predictions file"
        for m in (
            f"{r['regime']}/seed{int(r['seed'])}"
            for _, r in kappa.iterrows()
            if not r["logged_equals_file"]
        )
    ]
    warnings += report.warnings if report else []
    expected = len(regimes) * len(protocol.seeds)
    rule = "one run per cell: its newest finished run for the source of the newest execution"
    header: list[Block] = [
        Heading(1, f"Report: {protocol.name}@{short}"),
        Para(protocol.description),  # what it contradicts is said in Warnings, not in its words
        Bullets(
            [
                f"Transfer protocol `{protocol.name}`, hash `{digest}` (from {inputs.protocol_source}).",
                f"Regimes: {', '.join(_regime_label(r, protocol.reference.name) for r in protocol.regimes)}; "
                f"seeds: {', '.join(map(str, protocol.seeds))} (paired by seed); metric: test QWK (quadratic weighted "
                "kappa), with accuracy and macro-F1.",
                *provenance.header_bullets(
                    inputs, protocol.name, rule, log_targets, data.tracking_uri, data.rebuilt_from
                ),
                f"Cells with a finished run: **{len(kappa)} of {expected}**"
                + ("." if len(kappa) == expected else f" {FLAG}"),
            ]
        ),
    ]
    if warnings:
        header += [Heading(2, "Warnings"), Bullets([f"{FLAG} {w}" for w in warnings])]
    curves = {
        g: {int(s): data.cells[(g, int(s))].curves for s in group["seed"]}
        for g, group in kappa.groupby("regime", sort=False)
    }
    epochs_run = {c.record.run_id: len(c.curves.get("val_qwk", {})) for c in data.cells.values()}
    rows = [(g, s, chosen[(g, s)]) for s in protocol.seeds for g in regimes if (g, s) in chosen]
    blocks = (
        header
        + transfer_blocks.results_blocks(section, protocol.reference.name, len(protocol.seeds))
        + configuration.configuration_blocks(config, conflicts)
        + transfer_blocks.section_blocks(section)
        + cost_blocks(section, chosen, regimes, config, source_cfg, epochs_run)
        + transfer_blocks.figure_blocks(section, curves, figures.report_png)
        + transfer_calibration(
            {key: cell.files for key, cell in data.cells.items() if key in chosen}, regimes
        )
        + provenance.provenance_blocks(rows, attempts, chosen, "regime", data.tracking_uri)
    )
    return blocks, warnings, provenance.stale_items(attempts, missing)


def stored_protocol(name: str, digest: str) -> tuple[TransferProtocol, str] | None:
    """The transfer protocol of ``digest`` as its parent run logged it (``protocol/<name>.yaml``), hash-checked,
    with the file's text.

    None when the hash is not a transfer protocol's or no parent run holds its file.
    """
    for parent in queries.parent_runs(name, digest):
        if not queries.has_artifact(parent.run_id, "protocol/canonical.json"):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            canonical = json.loads(
                queries.download_artifact(
                    parent.run_id, "protocol/canonical.json", Path(tmp)
                ).read_text(encoding="utf-8")
            )
            if kind_of(canonical) != KIND:
                return None
            for suffix in (".yaml", ".yml"):
                artifact = f"protocol/{name}{suffix}"
                if queries.has_artifact(parent.run_id, artifact):
                    local = queries.download_artifact(parent.run_id, artifact, Path(tmp))
                    loaded = load_transfer_protocol(local)
                    if loaded.hash == digest:
                        return loaded, local.read_text(encoding="utf-8")
    return None


def stored_by_name(name: str, hash_prefix: str | None) -> TransferProtocol | None:
    """A transfer protocol given by name only (no file here): the one its parent runs logged, else None."""
    counts = queries.hash_counts(name)
    stored = stored_protocol(name, resolve_hash(name, counts, hash_prefix, None))
    return None if stored is None else stored[0]


def load_study(
    protocol: TransferProtocol, hash_prefix: str | None, from_store: bool = False
) -> TransferReportData:
    """What the report of the hash to report is computed from, with the protocol of that hash.

    Another recorded hash than the file's is reported with the protocol file its parent run
    logged (hash-checked), so the configuration, regimes and seeds are that version's.
    ``from_store``: ``protocol`` itself came from a parent run (given by name, no file here).
    """
    counts = queries.hash_counts(protocol.name)
    digest = resolve_hash(protocol.name, counts, hash_prefix, protocol.hash)
    if digest == protocol.hash and not from_store:
        source, stored = (
            f"file {shown_path(Path(protocol.source_file))}",
            (protocol, Path(protocol.source_file).read_text(encoding="utf-8")),
        )
    else:
        source, stored = (
            f"protocol/{protocol.name}.yaml logged on its parent run",
            stored_protocol(protocol.name, digest),
        )
    try:  # a missing execution or cell is said before a missing protocol file
        data = load_data(*(stored or (protocol, "")), digest, source)
    except LookupError as err:
        recorded = ", ".join(h[:SHORT_HASH_LEN] for h in counts) or "none"
        raise ReportError(
            f"{err} (recorded hashes of {protocol.name!r}: {recorded}; pick one with --hash)"
        ) from err
    if stored is None:
        raise ReportError(
            f"{protocol.name}@{digest[:SHORT_HASH_LEN]}: no parent run holds the protocol file of that "
            "hash (protocol/<name>.yaml); report it with its file"
        )
    return data


def render_transfer_study(
    data: TransferReportData, inputs: provenance.BuildInputs, out_root: Path, log_targets: list[str]
) -> ReportResult:
    """Compute the section and write the report files of ``data`` (from the store or an evidence export)."""
    protocol, short = data.protocol, data.digest[:SHORT_HASH_LEN]
    section = compute_section(data, inputs.n_resamples)
    blocks, warnings, problems = build_blocks(data, section, inputs, log_targets)
    folder = Path(out_root) / protocol.name
    figure_paths = write_report(folder, blocks, f"{protocol.name}@{short} transfer report")
    expected = len(protocol.regimes) * len(protocol.seeds)
    messages = [
        f"{protocol.name}@{short}: {len(section.kappa_table)} of {expected} cells have a finished run "
        "(transfer protocol)"
    ] + [f"warning: {w}" for w in warnings]
    metrics = {
        k: v
        for (a, b, metric), (paired, boot) in section.paired.items()
        for k, v in paired_metrics(a, b, f"test_{metric}", paired, boot, scale=1.0).items()
    }
    summary = Summary(
        metrics,
        results_text(
            blocks,
            f": {protocol.name}@{short}, {len(section.kappa_table)} of {expected} cells",
            "QWK differences (test_qwk) as the report shows them",
        ),
    )
    return ReportResult(
        folder,
        folder / "report.md",
        folder / "report.html",
        figure_paths,
        messages=messages,
        section=section,
        problems=problems,
        summary=summary,
    )
