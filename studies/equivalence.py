"""Entry point: prove the glass-box ViT equals timm's, stage by stage, and log it to MLflow."""

from __future__ import annotations

import sys

import click

from workbench.convert.timm_weights import load_timm_weights


@click.command("equivalence")
@click.option("--model", "models", multiple=True, default=["vit_base_patch16_224"], show_default=True,
              help="timm architecture or pinned checkpoint name; repeat for several (one MLflow run each).")
@click.option("--weights", default="random", show_default=True,
              help="'random' (seeded init, labelled not pretrained), 'hub' (pinned checkpoint) or a local safetensors file/folder.")
@click.option("--batch", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--tolerance", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Largest allowed |difference| at any stage and any gradient.")
@click.option("--input", "input_kind", type=click.Choice(["gaussian", "uniform"]), default="gaussian", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--gradients/--no-gradients", default=True, show_default=True, help="Also compare parameter gradients.")
@click.option("--experiment", default="equivalence", show_default=True)
@click.option("--all", "run_all", is_flag=True,
              help="Coverage mode: every architecture of timm's vision_transformer, vision_transformer_hybrid and deit "
                   "modules at reduced width/depth (same options, checked), one table logged to MLflow.")
def equivalence(models, weights, batch, seed, tolerance, input_kind, device, gradients, experiment, run_all):
    """Compare glass-box and timm ViTs at every stage; exit 1 if any stage exceeds the tolerance."""
    from tracking.equivalence import log_equivalence
    from tracking.runs import environment_tags, start_run
    from workbench.convert.checkpoints import CheckpointError
    from workbench.convert.timm_vit import UnsupportedTimmModel
    from workbench.equivalence import run_equivalence
    from workbench.models.registry import UnknownModel

    if run_all:
        return _coverage(batch, seed, tolerance, experiment, input_kind, device)
    failed = []
    for name in models:
        try:
            loaded = load_timm_weights(name, weights, seed=seed)
            click.echo(f"{name}: weights = {loaded.label()}")
            report = run_equivalence(
                loaded.model, loaded.architecture, batch=batch, seed=seed, tolerance=tolerance,
                input_kind=input_kind, device=device, gradients=gradients,
            )
        except UnsupportedTimmModel as err:
            raise click.ClickException(f"{name}: {err}") from err
        except (UnknownModel, CheckpointError) as err:
            raise click.ClickException(str(err)) from err
        params = {
            "model": name,
            "weight_source": loaded.source,
            "weight_description": loaded.description,
            "pretrained": loaded.pretrained,
            "sha256": loaded.sha256 or "none",
            "dtype": "float32",
            "batch": batch,
            "seed": seed,
            "input_kind": input_kind,
            "reference": "timm unfused attention (fused_attn=False)",
            "fused_compared": "timm fused vs glass-box fast path and vs written path (reported only)",
        }
        with start_run(experiment, run_name=f"equivalence-{name}", tags=environment_tags(device)):
            log_equivalence(report, params)
        click.echo(report.summary())
        if not report.passed:
            failed.append(name)
            worst = sorted(report.stages, key=lambda s: -s.max_abs_diff if s.max_abs_diff == s.max_abs_diff else -1e9)[:5]
            for s in worst:
                click.echo(f"  stage {s.index} {s.stage}: max {s.max_abs_diff:.3g} mean {s.mean_abs_diff:.3g}")
    if failed:
        click.echo(f"equivalence FAILED for: {', '.join(failed)}", err=True)
        sys.exit(1)


def _coverage(batch: int, seed: int, tolerance: float, experiment: str, input_kind: str, device: str) -> None:
    """Every architecture of timm's ViT modules: match at the tolerance, or refused by name."""
    from tqdm import tqdm

    from tracking.equivalence import log_coverage
    from tracking.runs import environment_tags, start_run
    from workbench.equivalence_coverage import check_architecture, coverage_architectures, coverage_summary, coverage_table

    rows = []
    progress = tqdm(coverage_architectures(), desc="equivalence --all", unit="arch")
    for name, module in progress:
        progress.set_postfix_str(name)
        rows.append(check_architecture(name, module, batch=batch, seed=seed, tolerance=tolerance,
                                       input_kind=input_kind, device=device))
    table = coverage_table(rows)
    summary = coverage_summary(table)
    params = {"mode": "coverage", "batch": batch, "seed": seed, "input_kind": input_kind, "reduced": True, "dtype": "float32",
              "reference": "timm unfused attention (fused_attn=False)", "weights": "seeded random init"}
    with start_run(experiment, run_name="equivalence-coverage", tags=environment_tags(device)):
        log_coverage(table, summary, params)
    with pd_display():
        click.echo(table.drop(columns=["reduced"]).to_string(index=False, max_colwidth=60))
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(summary.items())))
    bad = table[table.verdict.isin(["differs", "error"])]
    if len(bad):
        click.echo(f"equivalence --all: {len(bad)} architecture(s) differ or failed: {', '.join(bad.architecture)}", err=True)
        sys.exit(1)


def pd_display():
    import pandas as pd

    return pd.option_context("display.width", 250, "display.max_rows", None)
