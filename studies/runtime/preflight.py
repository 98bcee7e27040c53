"""Checks a training command makes before any work: bad input is refused in one line up front.

Each check names the option, file or value at fault. They run before data is decoded or a
run is opened where they can (output folder), or as soon as the data is known (class
count, batch size against the training split), never after an epoch has been spent.
"""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import click

from workbench.atomic import remove_abandoned_temp_files
from workbench.data import PreparedData
from workbench.data.cache import cache_dir
from workbench.protocol import Protocol, ProtocolError
from workbench.train.config import TrainConfig
from workbench.train.fits import DataShape, misfits, patch_note


def check_writable_folder(
    folder: str | Path, option: str = "--output-dir", create: bool = True
) -> None:
    """Create ``folder`` if needed and prove a file can be written in it.

    ``create=False``: leave nothing behind; the folder, or the nearest folder above it that
    exists (where it would be made), must take a file (a command refused later makes no folder).

    Raises:
        click.BadParameter: naming the option, the folder and what the system said.
    """
    folder = Path(folder)
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
            where = folder
        else:
            where = next(p for p in (folder, *folder.parents) if p.exists())
            if not where.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{where} is a file")
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-check-"):
            pass
    except OSError as err:
        why = err.strerror or str(err)
        raise click.BadParameter(
            f"{folder}: cannot write there ({why}); give a writable folder",
            param_hint=f"'{option}'",
        ) from err


def trainable_problem(cfg: TrainConfig, data: PreparedData) -> str | None:
    """Why ``cfg`` cannot train on ``data`` as asked, or None.

    Fewer than two classes gives a classifier nothing to learn (accuracy is 1.0 whatever it
    does); a batch larger than the training split silently trains on one short batch per
    epoch, not the recipe asked for.
    """
    classes = data.class_names
    if len(classes) < 2:
        return (
            f"{data.source}: {len(classes)} class{'' if len(classes) == 1 else 'es'} "
            f"({', '.join(classes) or 'none'}); a classifier needs at least 2"
        )
    n_train = len(data.train.labels)
    if cfg.run.batch_size > n_train:
        return (
            f"batch_size {cfg.run.batch_size} is larger than the training split ({n_train} images of "
            f"{data.display_name}); use a batch size of at most {n_train} or more training images"
        )
    subset = cfg.data.train_subset
    if subset is not None and subset > n_train:
        return (
            f"dataset.train_subset={subset}: more than the training split's {n_train} images of "
            f"{data.display_name}"
        )
    return None


def check_trainable(cfg: TrainConfig, data: PreparedData) -> None:
    """``trainable_problem`` as an error.

    Raises:
        ValueError: naming the data or the batch size.
    """
    problem = trainable_problem(cfg, data)
    if problem:
        raise ValueError(problem)


def protocol_misfits(protocol: Protocol, data: PreparedData) -> list[str]:
    """Every reason an arm of ``protocol`` cannot train on ``data``, one line each, naming the protocol key.

    Classes, channels and (for a ViT) image size against the model, then the class count and
    the batch size against the training split (``trainable_problem``); a problem of the base
    model that several arms inherit is said once.
    """
    if len(data.class_names) < 2:  # no model fits: say that, not "set num_classes: 1"
        return [trainable_problem(protocol.arms[0].config, data)]
    shape, lines = DataShape.of(data), []
    for i, arm in enumerate(protocol.arms):
        cfg, over = arm.config, arm.overrides.get("model", {})
        for m in misfits(cfg.model.name, cfg.model.overrides, shape, cfg.data.resize_to):
            in_arm = "name" in over or m.field in over  # the arm's own model, or a field it sets
            lines.append(
                m.line(f"arms[{i}].overrides.model.{m.field}" if in_arm else f"model.{m.field}")
            )
        problem = trainable_problem(cfg, data)
        own = "batch_size" in arm.overrides.get("run", {})
        key = f"{f'arms[{i}].overrides.run' if own else 'run'}.batch_size"
        if problem and problem.startswith("batch_size"):
            problem = f"{key.removesuffix('.batch_size')}.{problem}"
        lines += [problem] if problem else []
        if not problem and not lines:
            lone = lone_image_problem(cfg, data, key)
            lines += [f"arms[{i}] ({arm.name}): {lone}"] if lone else []
    return list(dict.fromkeys(lines))


def lone_image_problem(cfg: TrainConfig, data: PreparedData, key: str) -> str | None:
    """Why the last training batch of one image fails the model (batch norm), or None.

    Training keeps every image (no dropped last batch unless mixup pairs them), so a training
    split one image over a multiple of the batch size ends each epoch on a batch of one. A
    batch-norm layer that then sees one value per channel (after global pooling, or a feature
    map of 1 x 1) fails mid-epoch; one forward of one image on the meta device, in training
    mode, finds it before any run opens.
    """
    n, size = len(data.train.labels), cfg.run.batch_size
    if n % size != 1 or cfg.recipe.mixes:
        return None
    import torch  # here: `workbench --help` loads no torch

    from workbench.models.registry import build_model, model_config

    _, c, h, w = data.train.images.shape
    hw = (cfg.data.resize_to,) * 2 if cfg.data.resize_to else (h, w)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = build_model(model_config(cfg.model.name, **cfg.model.overrides)).train()
            model(torch.zeros((1, c, *hw)))
    except ValueError as err:
        if "more than 1 value per channel" not in str(err):
            return None  # any other refusal is the fit checks' to say
        fits = next(b for b in range(size - 1, 0, -1) if n % b != 1)
        return (
            f"{key}={size} leaves 1 image in the last training batch ({n} training images): its "
            f"batch norm cannot train on one image ({err}); use a batch size of {fits} or another "
            "that leaves no single image"
        )
    except Exception:  # noqa: BLE001 - a forward that fails otherwise is the fit checks' to say
        return None
    return None


def check_protocol_fits(protocol: Protocol, data: PreparedData, log=click.echo) -> None:
    """Refuse a protocol whose arms do not fit the loaded data, before the study's parent run opens.

    Raises:
        ProtocolError: ``<file>: does not fit <data>: <problem>; <problem>`` (one line).
    """
    lines = protocol_misfits(protocol, data)
    if lines:
        raise ProtocolError(
            f"{protocol.source}: does not fit {DataShape.of(data).describe()}: " + "; ".join(lines)
        )
    notes = {patch_note(a.config.model.name, a.config.model.overrides) for a in protocol.arms} - {
        None
    }
    for note in sorted(notes):
        log(f"note: {protocol.source}: {note}")


def outcome_line(status: str, message: str, run_id: str) -> str:
    """One console line for a training outcome, saying its status and run once each."""
    line = message if message.split(": ", 1)[-1].startswith(status) else f"{status}: {message}"
    return line if run_id in line else f"{line} (run {run_id})"


def remove_abandoned_cache_files() -> None:
    """Before data is loaded: a cache write killed with SIGKILL left its temp file (12 MB for Fashion-MNIST)."""
    for folder in (cache_dir(), cache_dir() / "decoded"):
        for tmp in remove_abandoned_temp_files(folder):
            click.echo(
                f"removed {tmp}: the temp file of a data cache write that was killed", err=True
            )
