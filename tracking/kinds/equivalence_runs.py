"""Logging of an equivalence report to MLflow (its plot: ``workbench.analysis.equivalence_figures``)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import mlflow

from workbench.analysis.equivalence_figures import plot_stage_differences
from workbench.equivalence import EquivalenceReport


def log_equivalence(report: EquivalenceReport, params: dict) -> None:
    """Params, per-stage metrics stepped by stage index, tables, plot and verdict tag."""
    mlflow.log_params(
        {**params, "tolerance": report.tolerance, "architecture": report.architecture}
    )
    table = report.stage_table()
    for row in table.itertuples():
        if not math.isnan(row.max_abs_diff):
            mlflow.log_metric("stage_max_abs_diff", row.max_abs_diff, step=row.index)
            mlflow.log_metric("stage_mean_abs_diff", row.mean_abs_diff, step=row.index)
    grads = report.gradients
    mlflow.log_metrics(
        {
            "stages_total": len(table),
            "stages_passed": report.stages_passed,
            "max_abs_diff": report.max_abs_diff,
            "source_tensors_used": report.audit.source_used,
            "target_tensors_filled": report.audit.target_filled,
            "parameters": report.audit.parameters,
            "gradients_total": len(grads),
            "gradients_passed": report.gradients_passed,
            "gradient_max_abs_diff": float(grads["max_abs_diff"].max())
            if len(grads)
            else float("nan"),
            "forward_passed": sum(row.passed for row in report.forward),
            "forward_max_abs_diff": report.forward_max_abs_diff,
            "intermediates_passed": sum(row.passed for row in report.intermediates),
            "intermediates_compared": len(report.intermediates),
            **{
                f"{name}_max_abs_diff": max(r.max_abs_diff for r in rows)
                for name, rows in report.fused.items()
            },
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table.to_csv(out / "stages.csv", index=False)
        (out / "stages.json").write_text(table.to_json(orient="records", indent=1))
        grads.to_csv(out / "gradients.csv", index=False)
        report.fused_table().to_csv(out / "fused_stages.csv", index=False)
        report.forward_table().to_csv(out / "forward.csv", index=False)
        (out / "mapping_audit.json").write_text(
            json.dumps({"summary": report.audit.summary(), "pairs": report.audit.pairs}, indent=1)
        )
        plot_stage_differences(report).savefig(out / "stage_differences.png", dpi=120)
        mlflow.log_artifacts(str(out), artifact_path="equivalence")
    mlflow.set_tags({"verdict": "pass" if report.passed else "fail", "summary": report.summary()})


def log_coverage(table, summary: dict[str, int], params: dict) -> None:
    """The coverage table (one row per architecture) as a CSV artifact and an MLflow table,
    its counts as metrics, and a verdict tag: pass when nothing differs or errs."""
    mlflow.log_params(params)
    mlflow.log_metrics({f"coverage.{k}": v for k, v in summary.items()})
    mlflow.log_table(
        table.astype(object).where(table.notna(), None),
        artifact_file="equivalence/coverage_table.json",
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "coverage.csv"
        table.to_csv(path, index=False)
        mlflow.log_artifact(str(path), artifact_path="equivalence")
    failed = int((table.verdict.isin(["differs", "error"])).sum())
    mlflow.set_tags(
        {
            "verdict": "pass" if failed == 0 else "fail",
            "summary": f"{summary.get('total.match', 0)} match, {summary.get('total.refused', 0)} refused by name, "
            f"{failed} differ or fail, of {summary['total']} architectures",
        }
    )
