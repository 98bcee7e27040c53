"""Compare re-trained cells in a tracking store with a study's published evidence, number for number.

    MLFLOW_TRACKING_URI=sqlite:///retrain.db python scripts/compare_with_evidence.py \
        --evidence docs/results/fmnist_seed_recipe/evidence [--arms vit] [--json out.json]

For every published cell (docs/results/<study>/evidence/runs.json) that the store has a finished run
of (same protocol hash, arm and seed; the newest one), it compares every logged metric (latest
value) and every point of every metric history, exactly and as the largest absolute difference,
and the logged prediction files: the file's sha256 against the one the evidence recorded (a
byte-for-byte match includes per-example losses and probabilities) and, row by row, the predicted
class. It prints one line per cell and a total, and exits 1 when anything differs. Why a script and
not a test: re-training the published cells takes hours; this is what you run after it.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from tracking.record.protocol_runs import cell_runs


def published_cells(evidence: Path) -> tuple[dict, list[dict]]:
    runs = json.loads((evidence / "runs.json").read_text())
    return runs["protocol"], runs["cells"]


def newest_finished(runs, arm: str, seed: int):
    mine = [
        r
        for r in runs
        if r.info.status == "FINISHED"
        and r.data.tags.get("arm") == arm
        and r.data.tags.get("seed") == str(seed)
    ]
    return max(mine, key=lambda r: r.info.start_time, default=None)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _published_history(points) -> list[tuple[int, float]]:
    return sorted(
        (int(step), float(value)) for step, _timestamp, value in points
    )  # [step, timestamp ms, value]


def compare_cell(client: MlflowClient, evidence: Path, cell: dict, run) -> dict:
    """Every metric, history point and prediction of one cell: counts of equal and differing values."""
    out = {
        "arm": cell["tags"]["arm"],
        "seed": int(cell["tags"]["seed"]),
        "run_id": run.info.run_id,
        "metrics": 0,
        "metrics_equal": 0,
        "metric_max_abs_diff": 0.0,
        "differing_metrics": [],
        "history_points": 0,
        "history_equal": 0,
        "history_max_abs_diff": 0.0,
        "prediction_files": 0,
        "prediction_files_identical": 0,
        "predicted_rows": 0,
        "predicted_equal": 0,
    }
    skip = {"epoch_seconds", "images_per_second"}  # wall-clock figures: never expected to repeat
    for key, value in cell["metrics"].items():
        if key in skip or any(s in key for s in ("seconds", "per_second")):
            continue
        mine = run.data.metrics.get(key)
        out["metrics"] += 1
        if mine == value:
            out["metrics_equal"] += 1
        else:
            out["differing_metrics"].append(key)
            diff = abs(mine - value) if mine is not None else float("inf")
            out["metric_max_abs_diff"] = max(out["metric_max_abs_diff"], diff)
    for key, points in cell.get("metric_history", {}).items():
        if key in skip or any(s in key for s in ("seconds", "per_second")):
            continue
        theirs, mine = _published_history(points), history(client, run.info.run_id, key)
        out["history_points"] += len(theirs)
        mine_by_step = dict(mine)
        for step, value in theirs:
            other = mine_by_step.get(step)
            if other == value:
                out["history_equal"] += 1
            else:
                diff = abs(other - value) if other is not None else float("inf")
                out["history_max_abs_diff"] = max(out["history_max_abs_diff"], diff)
    for meta in (cell.get("predictions") or {}).values():
        local = Path(client.download_artifacts(run.info.run_id, meta["logged_file"]))
        data = local.read_bytes()
        out["prediction_files"] += 1
        out["prediction_files_identical"] += (
            hashlib.sha256(data).hexdigest() == meta["logged_sha256"]
        )
        mine = {
            row["index"]: row["predicted"] for row in csv.DictReader(io.StringIO(data.decode()))
        }
        with gzip.open(evidence / meta["file"], "rt") as f:
            theirs = {row["index"]: row["predicted"] for row in csv.DictReader(f)}
        out["predicted_rows"] += len(theirs)
        out["predicted_equal"] += sum(mine.get(i) == p for i, p in theirs.items())
    return out


def line(c: dict) -> str:
    return (
        f"{c['arm']}/seed{c['seed']}: metrics {c['metrics_equal']}/{c['metrics']} equal (max |diff| "
        f"{c['metric_max_abs_diff']:.3g}{'; ' + ', '.join(c['differing_metrics']) if c['differing_metrics'] else ''}), "
        f"history {c['history_equal']}/{c['history_points']} (max |diff| {c['history_max_abs_diff']:.3g}), "
        f"prediction files byte-identical {c['prediction_files_identical']}/{c['prediction_files']}, "
        f"predicted class {c['predicted_equal']}/{c['predicted_rows']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evidence", type=Path, required=True, help="docs/results/<study>/evidence")
    ap.add_argument(
        "--arms", nargs="*", default=None, help="only these arms (default: every published cell)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the per-cell comparison here")
    args = ap.parse_args(argv)
    protocol, cells = published_cells(args.evidence)
    runs = cell_runs(protocol["name"], protocol["hash"])
    client = MlflowClient()
    compared, missing = [], []
    for cell in cells:
        arm, seed = cell["tags"]["arm"], int(cell["tags"]["seed"])
        if args.arms and arm not in args.arms:
            continue
        run = newest_finished(runs, arm, seed)
        if run is None:
            missing.append(f"{arm}/seed{seed}")
            continue
        compared.append(compare_cell(client, args.evidence, cell, run))
        print(line(compared[-1]))
    total = {
        k: sum(c[k] for c in compared)
        for k in (
            "metrics",
            "metrics_equal",
            "history_points",
            "history_equal",
            "prediction_files",
            "prediction_files_identical",
            "predicted_rows",
            "predicted_equal",
        )
    }
    print(
        f"{len(compared)} cells compared ({len(missing)} not in the store{': ' + ', '.join(missing) if missing else ''}): "
        f"metrics {total['metrics_equal']}/{total['metrics']}, history {total['history_equal']}/"
        f"{total['history_points']}, prediction files {total['prediction_files_identical']}/"
        f"{total['prediction_files']} byte-identical, predicted class {total['predicted_equal']}/"
        f"{total['predicted_rows']}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"protocol": protocol, "cells": compared, "missing": missing, "total": total},
                indent=1,
            )
        )
    same = (
        total["metrics_equal"] == total["metrics"]
        and total["history_equal"] == total["history_points"]
        and total["prediction_files_identical"] == total["prediction_files"]
        and total["predicted_equal"] == total["predicted_rows"]
    )
    return 0 if same and compared and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
