"""`workbench models`: the model names a protocol arm and `workbench train --model` take."""

from __future__ import annotations

import click

from workbench.models.registry import STUDY_MODELS
from workbench.models.timm_arm import TIMM_PREFIX


@click.command("models")
@click.option(
    "--timm",
    "pattern",
    default=None,
    metavar="PATTERN",
    help="Also list timm's architectures matching PATTERN (wildcards, e.g. 'resnet*', '*convnext*'), "
    f"each as {TIMM_PREFIX}<name>.",
)
def models(pattern: str | None) -> None:
    """Model names for arms and `train --model`: the study models, and any timm model as timm/<name>."""
    import timm  # only now: `workbench --help` never imports it

    for name, cfg in STUDY_MODELS.items():
        click.echo(f"{name}  (study model: {type(cfg).__name__})")
    if pattern is None:
        click.echo(
            f"{TIMM_PREFIX}<name>  (any of the {len(timm.list_models())} architectures of timm "
            f"{timm.__version__}; `workbench models --timm 'resnet*'` lists those matching a pattern)"
        )
        return
    names = timm.list_models(pattern)
    for name in names:
        click.echo(f"{TIMM_PREFIX}{name}")
    if not names:
        raise click.ClickException(
            f"--timm {pattern!r}: no timm {timm.__version__} architecture matches"
        )
