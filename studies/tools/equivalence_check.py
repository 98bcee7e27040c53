"""Entry point: prove the glass-box ViT equals timm's, stage by stage, and log it to MLflow."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import click

from studies.runtime.options import FiniteFloat
from workbench.convert.timm_weights import load_timm_weights, resolve_architecture

# --weights values that build the model from a seed rather than load a checkpoint.
RANDOM_SOURCES = ("random", "timm-init")


@click.command("equivalence")
@click.option(
    "--model",
    "models",
    multiple=True,
    default=["vit_base_patch16_224"],
    show_default=True,
    help="timm architecture or pinned checkpoint name; repeat for several (one MLflow run each).",
)
@click.option(
    "--weights",
    default="random",
    show_default=True,
    help="'random' (every tensor given its own seeded random values, labelled not pretrained), "
    "'timm-init' (timm's own init: constant norms, biases and LayerScale gammas, blind to swapped "
    "tensors; kept to reproduce a plain timm-built model), 'hub' (pinned checkpoint) or a local "
    "safetensors file/folder.",
)
@click.option(
    "--model-kwargs",
    "model_kwargs",
    default=None,
    metavar="JSON",
    help="Keyword arguments timm builds the model with, as a JSON object (a trained timm arm's "
    'model overrides, e.g. \'{"img_size": 32, "patch_size": 4, "depth": 2}\'): the weights '
    "must fit the model they build.",
)
@click.option("--batch", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--tolerance",
    default=0.0,
    show_default=True,
    type=FiniteFloat(min=0.0),
    help="Largest allowed |difference| at any stage and any gradient.",
)
@click.option(
    "--input",
    "input_kind",
    type=click.Choice(["gaussian", "uniform"]),
    default="gaussian",
    show_default=True,
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--gradients/--no-gradients",
    default=True,
    show_default=True,
    help="Also compare parameter gradients.",
)
@click.option("--experiment", default="equivalence", show_default=True)
@click.option(
    "--all",
    "run_all",
    is_flag=True,
    help="Coverage mode: every architecture of timm's vision_transformer, vision_transformer_hybrid and deit "
    "modules at reduced width/depth (same options, checked), one table logged to MLflow.",
)
def equivalence(
    models,
    weights,
    model_kwargs,
    batch,
    seed,
    tolerance,
    input_kind,
    device,
    gradients,
    experiment,
    run_all,
):
    """Compare glass-box and timm ViTs at every stage; exit 1 if any stage exceeds the tolerance."""
    from tracking.kinds.equivalence_runs import log_equivalence
    from tracking.store.session import environment_tags, start_run
    from workbench.convert.checkpoints import CheckpointError
    from workbench.convert.timm_vit import UnsupportedTimmModel
    from workbench.equivalence import randomize_every_tensor, run_equivalence
    from workbench.equivalence_coverage import config_from_name
    from workbench.models.registry import UnknownModel

    if run_all:
        if weights not in RANDOM_SOURCES:
            raise click.BadParameter(
                f"{weights!r}: --all compares reduced models, so weights must be "
                f"{' or '.join(RANDOM_SOURCES)}",
                param_hint="'--weights'",
            )
        return _coverage(
            batch, seed, tolerance, experiment, input_kind, device, randomize=weights == "random"
        )
    kwargs = _kwargs(model_kwargs)
    if kwargs and run_all:
        raise click.BadParameter(
            "--all builds its own reduced models", param_hint="'--model-kwargs'"
        )
    failed = []
    for name in models:
        try:
            # Options are read off a meta-device build first: an unsupported model is refused
            # in a second, before a full build, an init or a checkpoint download.
            config_from_name(timm_name(name), **kwargs)
            loaded = load_timm_weights(
                name, "random" if weights in RANDOM_SOURCES else weights, seed=seed, **kwargs
            )
            if weights == "random":
                count = randomize_every_tensor(loaded.model, seed)
                loaded = replace(
                    loaded,
                    description=f"{loaded.architecture}: all {count} tensors randomised (seed {seed})",
                )
            elif weights == "timm-init":
                loaded = replace(
                    loaded,
                    source="timm-init",
                    description=f"{loaded.architecture} timm's own init (seed {seed}; constant norms, biases, gammas)",
                )
            click.echo(f"{name}: weights = {loaded.label()}")
            report = run_equivalence(
                loaded.model,
                loaded.architecture,
                batch=batch,
                seed=seed,
                tolerance=tolerance,
                input_kind=input_kind,
                device=device,
                gradients=gradients,
            )
        except UnsupportedTimmModel as err:
            raise click.ClickException(f"{name}: {err}") from err
        except CheckpointError as err:
            raise click.ClickException(_short(str(err), bool(kwargs))) from err
        except UnknownModel as err:
            raise click.ClickException(str(err)) from err
        except TypeError as err:  # timm refused a keyword argument
            raise click.BadParameter(f"{name}: {err}", param_hint="'--model-kwargs'") from err
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
            worst = sorted(
                report.stages,
                key=lambda s: -s.max_abs_diff if s.max_abs_diff == s.max_abs_diff else -1e9,
            )[:5]
            for s in worst:
                click.echo(
                    f"  stage {s.index} {s.stage}: max {s.max_abs_diff:.3g} mean {s.mean_abs_diff:.3g}"
                )
    if failed:
        click.echo(f"equivalence FAILED for: {', '.join(failed)}", err=True)
        sys.exit(1)


def timm_name(name: str) -> str:
    """The timm model name ``load_timm_weights`` builds for a model or pinned checkpoint name:
    a pin's "arch.tag" (the tag sets head and image size), else the architecture."""
    architecture, pin_name = resolve_architecture(name)
    return pin_name if pin_name and pin_name.split(".", 1)[0] == architecture else architecture


def _coverage(
    batch: int,
    seed: int,
    tolerance: float,
    experiment: str,
    input_kind: str,
    device: str,
    randomize: bool,
) -> None:
    """Every architecture of timm's ViT modules: match at the tolerance, or refused by name."""
    from tqdm import tqdm

    from tracking.kinds.equivalence_runs import log_coverage
    from tracking.store.session import environment_tags, start_run
    from workbench.equivalence_coverage import (
        check_architecture,
        coverage_architectures,
        coverage_summary,
        coverage_table,
    )

    rows = []
    progress = tqdm(coverage_architectures(), desc="equivalence --all", unit="arch")
    for name, module in progress:
        progress.set_postfix_str(name)
        rows.append(
            check_architecture(
                name,
                module,
                batch=batch,
                seed=seed,
                tolerance=tolerance,
                input_kind=input_kind,
                device=device,
                randomize=randomize,
            )
        )
    table = coverage_table(rows)
    summary = coverage_summary(table)
    params = {
        "mode": "coverage",
        "batch": batch,
        "seed": seed,
        "input_kind": input_kind,
        "reduced": True,
        "dtype": "float32",
        "reference": "timm unfused attention (fused_attn=False)",
        "weights": f"every tensor randomised (seed {seed})"
        if randomize
        else f"timm's own init (seed {seed})",
    }
    with start_run(experiment, run_name="equivalence-coverage", tags=environment_tags(device)):
        log_coverage(table, summary, params)
    with pd_display():
        click.echo(table.drop(columns=["reduced"]).to_string(index=False, max_colwidth=60))
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(summary.items())))
    bad = table[table.verdict.isin(["differs", "error"])]
    if len(bad):
        click.echo(
            f"equivalence --all: {len(bad)} architecture(s) differ or failed: {', '.join(bad.architecture)}",
            err=True,
        )
        sys.exit(1)


def pd_display():
    import pandas as pd

    return pd.option_context("display.width", 250, "display.max_rows", None)


def _kwargs(text: str | None) -> dict:
    """``--model-kwargs`` as a dict; anything but a JSON object is refused in one line."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.BadParameter(
            f"{text[:80]!r} is not JSON ({err.msg} at character {err.pos})",
            param_hint="'--model-kwargs'",
        ) from None
    if not isinstance(value, dict):
        raise click.BadParameter(
            f"{text[:80]!r}: must be a JSON object of keyword arguments",
            param_hint="'--model-kwargs'",
        )
    return value


def _short(message: str, given_kwargs: bool) -> str:
    """A state dict that does not fit the model, in one short line: torch lists every key.

    Counts of missing and unexpected keys and of size mismatches, the first mismatch, and the
    likely cause: a model built with other keyword arguments than the trained one.
    """
    head, _, detail = message.partition("Error(s) in loading state_dict")
    if not detail:
        return " ".join(message.split())[:400]
    missing = re.search(r"Missing key\(s\) in state_dict: (.*?)(?:\.\s|$)", detail, re.S)
    unexpected = re.search(r"Unexpected key\(s\) in state_dict: (.*?)(?:\.\s|$)", detail, re.S)
    sizes = re.findall(
        r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) "
        r"from checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))",
        detail,
    )
    parts = []
    for what, found in (("missing", missing), ("unexpected", unexpected)):
        if found:
            keys = re.findall(r'"([^"]+)"', found.group(1))
            parts.append(f"{len(keys)} {what} key(s) (first {keys[0]})" if keys else f"{what} keys")
    if sizes:
        key, have, want = sizes[0]
        strip = lambda s: s.removeprefix("torch.Size(").removesuffix(")")  # noqa: E731
        parts.append(
            f"{len(sizes)} size mismatch(es) (first {key}: file {strip(have)}, model {strip(want)})"
        )
    hint = (
        "check that --model-kwargs are the trained model's"
        if given_kwargs
        else "a model built with keyword arguments (a trained timm arm's overrides) needs them: "
        "pass --model-kwargs JSON"
    )
    return f"{head.strip().rstrip(':')}: {'; '.join(parts)}; {hint}"
