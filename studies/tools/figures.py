"""Entry point: analysis figures of a finished protocol's runs, or of a timm ViT on images.

Protocol mode reads every finished cell run back from MLflow (config, best checkpoint,
predictions, curves), re-prepares the validation images from the runs' data params and
refuses unless the data and split fingerprints match what the runs recorded, builds the
study figures (``workbench.analysis.study``), writes them to a folder and logs them under
``figures/`` of the protocol's newest parent run.

timm mode maps a timm ViT's weights onto the glass-box model and draws rollout, per-head,
patch-grid and positional-embedding figures for the given images.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from tracking.kinds import figure_runs
from tracking.record.schema import IS_REFERENCE, TRUE
from workbench.analysis.artifacts import CRITERION
from workbench.analysis.common import DIAGNOSTIC, FILE_MODE, save_png
from workbench.analysis.panels import check_block
from workbench.analysis.study import RunInputs, StudyInputs, study_figures
from workbench.convert.checkpoints import atomic_write_bytes
from workbench.data import PreparedData
from workbench.models.registry import build_model, model_config
from workbench.train.config import DataSpec

DEFAULT_ROOT = Path("reports")
MANIFEST = "figures.json"


def resolve_protocol(protocol: str) -> tuple[str, str | None]:
    """(name, hash) for a protocol file, or (name, None) for a bare protocol name."""
    path = Path(protocol)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        from studies.runtime.study_protocol import ProtocolError, load_protocol

        try:
            spec = load_protocol(path)
        except ProtocolError as err:
            raise figure_runs.FiguresError(str(err)) from err
        return spec.name, spec.hash
    return protocol, None


def prepare_checked(
    cells: list[figure_runs.CellArtifacts], data_path: str | None, download: bool
) -> PreparedData:
    """Re-prepare the runs' data and refuse unless it is the data they were trained on.

    Raises:
        FiguresError: The runs disagree on their data, or the prepared data's fingerprints
            differ from the ones the runs logged.
    """
    from studies.runtime.study_execution import prepare_data

    recorded = {
        (c.run.data.params.get("data.fingerprint"), c.run.data.params.get("data.split_fingerprint"))
        for c in cells
    }
    if len(recorded) != 1:
        raise figure_runs.FiguresError(
            f"the runs were trained on {len(recorded)} different data/split fingerprints; "
            "give runs of one protocol execution"
        )
    fingerprint, split = recorded.pop()
    spec = dict(cells[0].config["data"])
    # Where the data lives is per machine: --data-path, else the training machine's path if
    # it exists here too, else the usual places (the fingerprint check catches a wrong copy).
    recorded_path = spec.get("path")
    spec["path"] = data_path or (
        recorded_path if recorded_path and Path(recorded_path).exists() else None
    )
    data = prepare_data(DataSpec(**spec), download=download)
    for what, logged, here in (
        ("data.fingerprint", fingerprint, data.data_fingerprint),
        ("data.split_fingerprint", split, data.split_fingerprint),
    ):
        if logged != here:
            raise figure_runs.FiguresError(
                f"{what} mismatch: the runs recorded {str(logged)[:16]}..., the data prepared here from "
                f"{data.source} has {here[:16]}...; these are not the images the models were trained and validated on "
                "(point --data-path at the same dataset copy)"
            )
    return data


def run_inputs(cell: figure_runs.CellArtifacts, reference_arms: set[str]) -> RunInputs:
    """The cell's best checkpoint as a CPU model, with its predictions and curves."""
    spec = cell.config["model"]
    model = build_model(model_config(spec["name"], **spec.get("overrides", {})))
    model.load_state_dict(cell.state_dict, strict=True)
    return RunInputs(
        cell.run.info.run_id,
        cell.arm,
        cell.seed,
        model.float().eval(),
        spec["name"],
        cell.predictions,
        cell.history,
        cell.arm in reference_arms,
    )


def protocol_figures(
    protocol: str | None,
    run_ids: tuple[str, ...],
    output_dir: str | None,
    data_path: str | None,
    download: bool,
    log: bool,
    n_images: int,
    tsne_points: int,
    block: int,
    seed: int,
) -> None:
    """Study figures of a protocol's finished runs (or of the given cell runs), written and logged."""
    runs = (
        figure_runs.runs_by_id(list(run_ids))
        if run_ids
        else figure_runs.find_protocol_runs(*resolve_protocol(protocol))
    )
    title = f"{runs.name}@{runs.protocol_hash[:12]}"
    click.echo(
        f"{title}: {len(runs.cells)} finished cell runs"
        + (f" ({len(runs.superseded)} older reruns not used)" if runs.superseded else "")
    )
    with tempfile.TemporaryDirectory() as tmp:
        cells = [figure_runs.load_cell(run, Path(tmp)) for run in runs.cells]
    for (
        cell
    ) in cells:  # the per-head figure is drawn for the ViT cells: refuse a block they lack first
        spec = cell.config["model"]
        depth = getattr(model_config(spec["name"], **spec.get("overrides", {})), "depth", None)
        if depth is not None:
            checked_block(block, depth)
    data = prepare_checked(cells, data_path, download)
    reference = {c.arm for c in cells if c.run.data.tags.get(IS_REFERENCE) == TRUE}
    inputs = StudyInputs(
        title,
        [run_inputs(c, reference) for c in cells],
        data.val.images,
        data.val.labels,
        data.class_names,
        data.norm,
        cells[0].config["data"].get("resize_to"),
        data.display_name,
    )
    built = study_figures(
        inputs, n_images=n_images, tsne_points=tsne_points, block=block, seed=seed
    )
    # Not reports/<protocol>/figures: the report builder owns that folder and embeds these
    # figures itself from the parent run.
    folder = Path(output_dir) if output_dir else DEFAULT_ROOT / runs.name / "analysis"
    names = write_figures(built, folder, title)
    if log:
        targets = [r for r in (runs.parent_run_id, figure_runs.launcher_run_id()) if r]
        if not runs.parent_run_id:
            click.echo(
                f"no parent run of {title} found: figures are not logged to its parent", err=True
            )
        for run_id in dict.fromkeys(targets):
            figure_runs.log_figures(run_id, folder, names)
            click.echo(
                f"logged {len(names)} files to run {run_id} (artifacts {figure_runs.FIGURES_ARTIFACT_PATH}/)"
            )


def timm_figures(
    model: str,
    weights: str,
    images: tuple[str, ...],
    output_dir: str | None,
    log: bool,
    block: int,
    seed: int,
) -> None:
    """Attention, patch-grid and positional-embedding figures of a timm ViT on image files."""
    from workbench.analysis.timm_inspect import inspect_timm
    from workbench.convert.timm_weights import load_timm_weights

    if not images:
        raise click.UsageError("--timm-model needs at least one --image")
    loaded = load_timm_weights(model, weights, seed=seed)
    checked_block(block, len(loaded.model.blocks))
    built = inspect_timm(loaded, images, block=block)
    folder = (
        Path(output_dir) if output_dir else DEFAULT_ROOT / "timm" / loaded.architecture / "figures"
    )
    names = write_figures(built, folder, loaded.label())
    if log:
        params = {
            "model": loaded.architecture,
            "weights": loaded.description,
            "weights_sha256": loaded.sha256 or "none",
            "pretrained": loaded.pretrained,
            "images": ",".join(Path(i).name for i in images)[:500],
            "block": block,
        }
        run_id = figure_runs.log_inspection(folder, names, params)
        click.echo(
            f"logged {len(names)} files to run {run_id} (artifacts {figure_runs.FIGURES_ARTIFACT_PATH}/)"
        )


def checked_block(block: int, depth: int) -> None:
    """``--block`` in the model's range, refused before any figure is drawn."""
    try:
        check_block(block, depth)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="'--block'") from err


def write_figures(built, folder: Path, title: str) -> list[str]:
    """Write the PNGs and a ``figures.json`` manifest; say what the artifact check found.

    The manifest (captions, background-artifact counts, the criterion) lets the report
    builder caption the figures without knowing how they were made.

    Returns:
        The file names written, manifest last.
    """
    for message in built.messages:
        click.echo(message)
    for name, fig in built.figures.items():
        save_png(fig, folder / name)
    manifest = {
        "title": title,
        "figures": {name: {"caption": built.captions.get(name, "")} for name in built.figures},
        "background_artifact": {
            "criterion": CRITERION,
            "diagnostic": DIAGNOSTIC,
            "flagged": {n: {"flagged": f, "checked": c} for n, (f, c) in built.flagged.items()},
        },
    }
    atomic_write_bytes(folder / MANIFEST, json.dumps(manifest, indent=1).encode(), FILE_MODE)
    click.echo(
        f"wrote {len(built.figures)} figures and {MANIFEST} to {folder}: {', '.join(built.figures)}"
    )
    for name, (hits, checked) in built.flagged.items():
        verdict = (
            "maps concentrate on a few background patches (known ViT artifact)"
            if hits
            else "none flagged"
        )
        click.echo(
            f"background-artifact check, {name}: {hits} of {checked} maps flagged: {verdict}"
        )
    return [*built.figures, MANIFEST]


@click.command("figures")
@click.option(
    "--protocol",
    default=None,
    help="Protocol YAML file (its hash) or protocol name (newest parent's hash).",
)
@click.option(
    "--run-id",
    "run_ids",
    multiple=True,
    help="Cell run ids of one protocol hash, instead of --protocol.",
)
@click.option(
    "--timm-model",
    default=None,
    help="Inspect a timm ViT (architecture or pinned checkpoint name) on --image.",
)
@click.option(
    "--weights",
    default="random",
    show_default=True,
    help="timm mode: random, hub, or a safetensors file.",
)
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="timm mode: an image file.",
)
@click.option(
    "--output-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where to write the PNGs [default: reports/<protocol>/analysis or reports/timm/<model>/figures].",
)
@click.option("--data-path", default=None, help="Where this machine keeps the protocol's dataset.")
@click.option(
    "--download/--no-download", default=False, show_default=True, help="Allow a dataset download."
)
@click.option("--log/--no-log", default=True, show_default=True, help="Log the figures to MLflow.")
@click.option(
    "--examples",
    "n_images",
    type=int,
    default=6,
    show_default=True,
    help="Validation images in the attention figures (one per class first).",
)
@click.option(
    "--tsne-points",
    type=int,
    default=800,
    show_default=True,
    help="Validation images in the t-SNE.",
)
@click.option(
    "--block",
    type=int,
    default=-1,
    show_default=True,
    help="Block of the per-head figure (-1 = last).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="t-SNE seed; timm mode: random-init seed.",
)
def figures(
    protocol,
    run_ids,
    timm_model,
    weights,
    images,
    output_dir,
    data_path,
    download,
    log,
    n_images,
    tsne_points,
    block,
    seed,
):
    """Analysis figures: a finished protocol's study figures, or a timm ViT's attention on images."""
    modes = sum(bool(m) for m in (protocol, run_ids, timm_model))
    if modes != 1:
        raise click.UsageError("give exactly one of --protocol, --run-id or --timm-model")
    try:
        if timm_model:
            timm_figures(timm_model, weights, images, output_dir, log, block, seed)
        else:
            protocol_figures(
                protocol,
                run_ids,
                output_dir,
                data_path,
                download,
                log,
                n_images,
                tsne_points,
                block,
                seed,
            )
    except (figure_runs.FiguresError, ValueError, KeyError) as err:
        raise click.ClickException(str(err)) from err
