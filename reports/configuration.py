"""What was run and what it cost: the configuration table from the hashed protocol, and compute per arm.

The configuration is rendered from the protocol's canonical (hashed) content through
``reports.content.config_table``, never from its free-text description; where the
description contradicts the hash (e.g. "3 epochs" for a 2-epoch protocol) the report says so
as a warning. The cost table reads each reported run: the per-epoch ``epoch_seconds`` history
(training wall time), epochs run, training images, device and precision.
"""

from __future__ import annotations

import statistics

from reports.collect import StudyData
from reports.provenance import device, precision
from reports.render import Block, Heading, Table
from tracking.record.schema import RESUMED, TRUE
from workbench.kinds import BY_NAME
from reports.content.config_table import ConfigTable, config_table, description_conflicts
from workbench.bench.cost import arm_cost, training_cost

FLAG = "⚠"


def protocol_config(canonical: dict, source_cfg=None) -> tuple[ConfigTable | None, list[str]]:
    """The table (None when the canonical form cannot be read) and the description's conflicts."""
    if not canonical:
        return None, []
    try:
        return config_table(canonical, source_cfg), description_conflicts(canonical)
    except ValueError as err:
        return None, [f"no configuration table: {err}"]


def configuration_blocks(table: ConfigTable | None, conflicts: list[str]) -> list[Block]:
    if table is None:
        return []
    unit = BY_NAME[table.kind].unit
    notes = [
        f"Rendered from the hashed protocol content (canonical JSON), not from its description. One row per {unit}; "
        "parameters and FLOPs per image (forward pass, multiply-accumulates x 2) counted on the built model."
    ]
    notes += [n for n in table.notes if n not in conflicts]
    notes += [f"{FLAG} The description contradicts the hashed protocol: {c}." for c in conflicts]
    return [
        Heading(2, "Configuration"),
        Table(["setting", "value"], [[k, v] for k, v in table.common], ["l", "l"]),
        Table(
            list(table.columns),
            [[row[c] for c in table.columns] for row in table.rows],
            ["l", "l"]
            + [
                "r" if c in ("parameters", "FLOPs / image", "trained parameters", "epochs") else "l"
                for c in table.columns[2:]
            ],
            notes,
            css_class="wide",
        ),
    ]


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


def run_layout(spans: list[tuple[int, int]]) -> str:
    """How the runs shared the wall clock: the first-to-last span is the study's wall time only if none overlapped."""
    ordered = sorted(spans)
    if any(start < end for (_, end), (start, _) in zip(ordered, ordered[1:])):
        return "some of them at the same time, as `ablate --jobs` or several workers run them"
    return "one after another: the study's wall time when one execution ran them all"


def cost_blocks(study: StudyData, table: ConfigTable | None) -> list[Block]:
    """Per arm: training wall time, epochs run, images per second, device, precision, size and FLOPs."""
    by_arm = {row["arm"].removesuffix(" (reference)"): row for row in (table.rows if table else [])}
    rows, notes, resumed = [], [], []
    for arm in study.spec.arms:
        cells = [
            c for (a, _), c in sorted(study.cells.items(), key=lambda kv: kv[0][1]) if a == arm
        ]
        if not cells:
            continue
        runs = []
        for cell in cells:
            r, walls = cell.record, list(cell.curves.get("epoch_seconds", {}).values())
            epochs = len(cell.curves.get("val_accuracy", {}))
            train = int(float(r.params.get("data.train_images", 0) or 0))
            if walls and sum(walls) > 0 and train:
                runs.append(
                    training_cost(
                        sum(walls),
                        epochs,
                        train_size=train,
                        device=device(r),
                        precision=precision(r),
                    )
                )
        epochs_run = " / ".join(str(len(c.curves.get("val_accuracy", {}))) for c in cells)
        info = by_arm.get(arm, {})
        spans = [
            (c.record.end_time - c.record.start_time) / 1000
            for c in cells
            if c.record.end_time and c.record.start_time
        ]
        run_time = _seconds(statistics.fmean(spans)) if spans else "n/a"
        resumed.extend(
            f"{arm}/seed{c.record.seed}" for c in cells if c.record.tags.get(RESUMED) == TRUE
        )
        if runs:
            cost = arm_cost(runs)
            row = [
                arm,
                str(len(cells)),
                _seconds(cost.mean_wall_seconds),
                _seconds(cost.total_wall_seconds),
                run_time,
                epochs_run,
                f"{cost.mean_images_per_second:,.0f}",
                ", ".join(cost.devices),
                ", ".join(cost.precisions),
            ]
            if len(cost.devices) > 1 or len(cost.precisions) > 1:
                notes.append(
                    f"{FLAG} {arm}: runs on different devices or precisions; their times are not comparable"
                )
        else:
            row = [
                arm,
                str(len(cells)),
                "n/a",
                "n/a",
                run_time,
                epochs_run,
                "n/a",
                ", ".join(sorted({device(c.record) for c in cells})),
                ", ".join(sorted({precision(c.record) for c in cells})),
            ]
        rows.append(row + [info.get("parameters", "n/a"), info.get("FLOPs / image", "n/a")])
    if not rows:
        return []
    notes.insert(
        0,
        "Training time: the sum of the run's per-epoch `epoch_seconds` (training batches only; "
        "evaluation, checkpointing and the reload proof excluded), mean per run and total over the arm's runs. "
        "Images/s: training images x epochs run / that time, mean over runs. Epochs run per seed in seed order "
        "(early stopping ends sooner). n/a: the runs did not log per-epoch times.",
    )
    records = [c.record for c in study.cells.values() if c.record.start_time and c.record.end_time]
    span = ""
    if records:
        first, last = min(r.start_time for r in records), max(r.end_time for r in records)
        how = run_layout([(r.start_time, r.end_time) for r in records])
        span = (
            f" From the first reported run's start to the last one's end: {_seconds((last - first) / 1000)} "
            f"({len(records)} runs, {how})."
        )
    notes.insert(
        1,
        "Run time: the MLflow run's start to its end, mean per run: training plus evaluation, "
        "checkpoints, the reload proof, the test pass (where the protocol has one) and the logged model."
        + span
        + (
            f" {FLAG} Resumed runs ({', '.join(resumed)}): their run time includes the time they were stopped."
            if resumed
            else ""
        ),
    )
    return [
        Heading(2, "Compute cost"),
        Table(
            [
                "arm",
                "runs",
                "training time / run",
                "training time, all runs",
                "run time / run",
                "epochs run",
                "images/s",
                "device",
                "precision",
                "parameters",
                "FLOPs / image",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "l", "l", "r", "r"],
            notes,
        ),
    ]
