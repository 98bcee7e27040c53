"""Entry point: every attribution method of a frozen attribution protocol scored on every acted-on model.

For each cell (an arm at a seed of the acted-on ablation protocol, or the one pretrained model)
the execution finds the trained cell's newest finished run, keys the attribution cell by it (a
rerun skips finished cells before downloading anything), reloads the best checkpoint and
re-verifies it against the cell's saved validation predictions (the reload proof, first), then
scores every method against the exact causal effect of each patch token on the protocol's
images (``workbench.attribution.score_cell``) and logs the outcome
(``tracking/kinds/attribution_runs.py``). Cells run under the study's one parent run with
leases, as ``intervene`` does.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import torch
from tqdm.auto import tqdm

from studies.runtime.cell_end import end_after_error, end_cell
from studies.runtime.options import threads_option
from studies.runtime.preflight import remove_abandoned_cache_files
from studies.runtime.stop_signals import sigterm_raises
from studies.runtime.study_execution import held_parent, prepare_protocol_data
from studies.runtime.study_protocol import ProtocolError, check_clean, check_frozen
from tracking.kinds import attribution_runs, intervention_runs
from tracking.kinds.transfer_runs import find_finished_cell
from tracking.record.lease import HEARTBEATS, LeaseLost, lease_tags, new_token
from tracking.record.protocol_runs import STARTED_TAG, frozen_hashes
from tracking.record.sink import RunSink
from tracking.store.session import configure_tracking, environment_tags
from workbench.attribution import AttributionError, score_cell
from workbench.data import DatasetNotFound, PreparedData, PreparedSplit, prepare
from workbench.interventions import InterventionError
from workbench.interventions.evaluate import Inputs
from workbench.interventions.sources import ActedModel, model_labels, pretrained_model, reload_proof, trained_cell_model
from workbench.models.vit import ViTConfig
from workbench.precision import resolve_amp
from workbench.protocol import AttributionProtocol, InterventionCell, load_attribution_protocol
from workbench.train.loop import resolve_device
from workbench.transfer.source_model import SourceError, adapt_split

DEFAULT_PROTOCOL = "studies/protocols/smoke_faithfulness.yaml"
STATUSES = ("finished", "skipped", "failed", "busy", "lost")
USER_ERRORS = (ProtocolError, SourceError, DatasetNotFound, InterventionError, AttributionError)


@dataclass
class CellOutcome:
    cell: InterventionCell
    status: str  # one of STATUSES
    message: str
    run_id: str | None = None
    seconds: float = 0.0  # scoring wall time (0 when nothing was scored)


@dataclass
class Execution:
    """What one execution shares across its cells: the data, its scored images, the device."""

    protocol: AttributionProtocol
    data: PreparedData
    images: PreparedSplit  # the protocol's images: the first ``attribution.images`` of its split
    device: torch.device
    workdir: Path
    parent: str = ""
    pretrained: ActedModel | None = None


def open_attribution_protocol(path: str, allow_dirty: bool) -> AttributionProtocol:
    protocol = load_attribution_protocol(path)
    check_clean(path, allow_dirty)
    configure_tracking()
    check_frozen(protocol, frozen_hashes(protocol.name))
    return protocol


def scored_images(protocol: AttributionProtocol, data: PreparedData) -> PreparedSplit:
    """The first ``attribution.images`` images of the split, the same for every cell (the pairing)."""
    s = protocol.settings
    split = data.test if s.split == "test" else data.val
    if split is None:
        raise ProtocolError(f"{protocol.source_file}: attribution.split=test but {data.display_name} has no test split")
    if s.images > len(split):
        raise ProtocolError(f"{protocol.source_file}: attribution.images={s.images}: the {s.split} split of "
                            f"{data.display_name} has only {len(split)} images")
    n = s.images
    return PreparedSplit(split.images[:n], split.labels[:n], split.indices[:n], split.source_split)


def _pretrained_data(protocol: AttributionProtocol, data_path: str | None, download: bool):
    """The pinned timm ViT and its dataset, with labels mapped to the model's outputs (as ``intervene`` does)."""
    spec = protocol.pretrained
    acted = pretrained_model(spec.model, spec.weights, spec.seed, spec.timm_kwargs)
    remove_abandoned_cache_files()
    data = prepare(spec.dataset, path=data_path, download=download, split_seed=spec.split_seed,
                   val_size=spec.val_size, subset=spec.subset)
    cfg = acted.model.cfg
    to_model = model_labels(data.class_names, spec.class_index, cfg.num_classes)
    splits = {}
    for name in ("train", "val", "test"):
        split = getattr(data, name)
        if split is not None:  # the model's channels and output classes, the dataset's images
            split = adapt_split(split, cfg.in_channels)
            splits[name] = PreparedSplit(split.images, to_model[split.labels], split.indices, split.source_split)
    return acted, replace(data, norm=acted.norm, **splits)


def prepare_execution(protocol: AttributionProtocol, device: str, data_path: str | None, download: bool,
                      workdir: Path) -> Execution:
    """The data every cell shares and its scored images (checked before any run opens); a pretrained model once."""
    dev = resolve_device(device)
    if protocol.acts_on is not None:
        data = prepare_protocol_data(protocol.source, data_path, download)
        return Execution(protocol, data, scored_images(protocol, data), dev, workdir)
    acted, data = _pretrained_data(protocol, data_path, download)
    return Execution(protocol, data, scored_images(protocol, data), dev, workdir, pretrained=acted)


def cell_key(ex: Execution, cell: InterventionCell, identity: str) -> str:
    """Protocol hash, arm, seed, the acted-on weights, data and split, and the code that computes the results."""
    parts = [ex.protocol.hash, cell.arm, str(cell.seed), identity, ex.data.data_fingerprint, ex.data.split_fingerprint,
             f"code={attribution_runs.attribution_code_fingerprint()}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _inputs(ex: Execution, cfg: ViTConfig, batch_size: int, amp: str, resize_to: int | None) -> Inputs:
    if resize_to is None and ex.data.train.images.shape[-1] != cfg.image_hw[-1]:
        resize_to = cfg.image_hw[-1]  # a pretrained model's input size
    return Inputs(ex.data.norm, batch_size, ex.device, resize_to, resolve_amp(amp, ex.device))


def _acted(ex: Execution, cell: InterventionCell, run_id: str | None):
    """(model, proof inputs, scoring inputs, saved predictions, description) of a cell."""
    p, s = ex.protocol, ex.protocol.settings
    if ex.pretrained is not None:
        cfg = ex.pretrained.model.cfg
        return ex.pretrained.model, None, _inputs(ex, cfg, s.batch_size, "off", None), None, ex.pretrained.description
    trained = intervention_runs.trained_cell(p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed, ex.workdir / "sources")
    params = trained.run.data.params
    for key, here in (("data.fingerprint", ex.data.data_fingerprint), ("data.split_fingerprint", ex.data.split_fingerprint)):
        if params.get(key) != here:
            raise AttributionError(f"the trained run {run_id} has {key} {str(params.get(key))[:12]}, the data here "
                                   f"{here[:12]}: not the data the cell was trained and validated on")
    model = trained_cell_model(trained.config, trained.state_dict).to(ex.device)
    arm = next(a for a in p.source.arms if a.name == cell.arm).config
    proof = _inputs(ex, model.cfg, arm.run.eval_batch_size, arm.run.amp, arm.data.resize_to)
    # Scored in float32 whatever the cell trained with: the drops' effects are differences of log-probabilities.
    inputs = _inputs(ex, model.cfg, s.batch_size, "off", arm.data.resize_to)
    description = f"{p.acts_on.protocol} cell {cell.key}, best checkpoint of run {run_id}"
    return model, proof, inputs, trained.predictions["val"], description


def model_inputs(split: PreparedSplit, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The scored images as the model sees them (normalised, resized, on the device), labels and indices."""
    xs, ys, idx = [], [], []
    for x, y, i in inputs.loader(split.images, split.labels, split.indices):
        xs.append(x.to(inputs.device))
        ys.append(y.to(inputs.device))
        idx.append(i.cpu())
    return torch.cat(xs), torch.cat(ys), torch.cat(idx).numpy()


def run_cell(ex: Execution, cell: InterventionCell, allow_dirty: bool) -> CellOutcome:
    """Skip, or score and log one cell; any error fails this cell only."""
    p = ex.protocol
    try:
        run_id = None if ex.pretrained else find_finished_cell(p.acts_on.protocol, p.acts_on.hash, cell.arm, cell.seed)
    except SourceError as err:
        return CellOutcome(cell, "failed", f"{cell.key}: {err}")
    identity = ex.pretrained.identity if ex.pretrained else run_id
    token = new_token()
    tags = {"cell": "true", "attribution": "true", "protocol_name": p.name, "protocol_hash": p.hash, "arm": cell.arm,
            "seed": str(cell.seed), "source_run_id": run_id or "", "source_identity": identity,
            "allow_dirty": str(allow_dirty).lower(), **lease_tags(token)}
    opened = attribution_runs.open_cell_run(p.name, cell_key(ex, cell, identity), f"{cell.arm}-seed{cell.seed}",
                                            ex.parent, tags)
    if opened.status == "FINISHED":
        return CellOutcome(cell, "skipped", f"{cell.key}: already finished in run {opened.run_id}", opened.run_id)
    if opened.status == "BUSY":
        return CellOutcome(cell, "busy", f"{cell.key}: not touched ({opened.why}, run {opened.run_id})", opened.run_id)
    sink = opened.sink
    if opened.continues:
        tqdm.write(f"{cell.key}: continuing in a new run {sink.run_id}: the holder of run {opened.continues} "
                   "may still write to that one")
    if opened.status is not None:
        sink.set_tags(lease_tags(token))
    HEARTBEATS.hold(sink.run_id, sink.uri, token)
    try:
        return _score_cell(ex, cell, sink, token, run_id)
    except LeaseLost as err:  # another execution holds the run now: not one more write to it
        HEARTBEATS.release(sink.run_id)
        return CellOutcome(cell, "lost", f"{cell.key}: stopped without logging more: {err}", sink.run_id)
    except BaseException as err:  # a failing cell must not take the others down; Ctrl-C goes up
        return CellOutcome(cell, "failed", f"{cell.key}: {end_after_error(sink, token, err)}", sink.run_id)


def _score_cell(ex: Execution, cell: InterventionCell, sink: RunSink, token: str, run_id: str | None) -> CellOutcome:
    s = ex.protocol.settings
    model, proof_inputs, inputs, saved, description = _acted(ex, cell, run_id)
    fingerprint = attribution_runs.attribution_code_fingerprint()
    sink.set_tags({**environment_tags(str(ex.device)), "code_fingerprint": fingerprint,
                   "threads": str(torch.get_num_threads()), "acted_on": description[:500], STARTED_TAG: "true"})
    sink.log_params({"arm": cell.arm, "seed": cell.seed, "split": s.split, "images": s.images,
                     "batch_size": s.batch_size, "methods": ",".join(s.methods), "norm_threshold": s.norm_threshold,
                     "random_seed": s.random_seed, "examples": s.examples, "code_fingerprint": fingerprint,
                     "source_run_id": run_id or "", "data.fingerprint": ex.data.data_fingerprint,
                     "data.split_fingerprint": ex.data.split_fingerprint, "data.display_name": ex.data.display_name})
    proof = None
    if saved is not None:  # first: the checkpoint must be the one that made the cell's predictions
        proof = reload_proof(model, ex.data.val, saved, proof_inputs)
        if not proof.passed:
            raise AttributionError(f"{proof.summary()}: the checkpoint of run {run_id} is not the one that made "
                                   "its saved predictions; nothing scored")
    x, y, indices = model_inputs(ex.images, inputs)
    with tqdm(total=1, desc=f"{cell.key}: {len(s.methods)} methods, {len(y)} images, every patch token dropped",
              unit="cell", leave=False) as bar:
        scored = score_cell(model, x, y, s.methods, s.random_seed, s.norm_threshold, image_index=indices,
                            batch_size=s.batch_size)
        bar.update(1)
    HEARTBEATS.check(sink.run_id, verify=True)
    examples = ex.images.images[: s.examples].numpy()  # uint8, as in the dataset, for the report's example row
    metrics = attribution_runs.log_cell(sink, scored, examples, proof, {"acted_on": description, "split": s.split},
                                        check=lambda: HEARTBEATS.check(sink.run_id, verify=True))
    end_cell(sink, token, "FINISHED")
    rhos = ", ".join(f"{m} {metrics[f'rho/{m}']:+.3f}" for m in s.methods if f"rho/{m}" in metrics)
    proof_text = f"; {proof.summary()}" if proof else ""
    where = f" [logged locally, run {sink.local_run_id}: `workbench sync` copies it to the server]" if sink.offline else ""
    return CellOutcome(cell, "finished", (
        f"{cell.key}: intact {s.split} accuracy {scored.intact_accuracy:.4f} on {len(y)} images; "
        f"{len(s.methods)} methods and {scored.causal.effects.shape[1]} single-token drops in {scored.seconds:.1f} s "
        f"({scored.forwards:,} sequences); Spearman rho {rhos}{proof_text}{where}"), sink.run_id, scored.seconds)


def run_attribution_protocol(protocol: AttributionProtocol, protocol_file: Path, output_dir: Path,
                             device: str = "auto", data_path: str | None = None, allow_dirty: bool = False,
                             download: bool = False) -> list[CellOutcome]:
    """Every cell of ``protocol`` under the study's one parent run; returns the outcomes."""
    configure_tracking()
    ex = prepare_execution(protocol, device, data_path, download, Path(output_dir) / protocol.name)
    acted = (f"{protocol.acts_on.protocol}@{protocol.acts_on.hash[:12]} arms {', '.join(protocol.arms)}"
             if protocol.acts_on else ex.pretrained.description)
    cells = protocol.cells()
    tqdm.write(f"{protocol.name}@{protocol.short_hash}: acts on {acted}; {len(cells)} cells; "
               f"{ex.data.display_name}, the first {len(ex.images)} {protocol.settings.split} images")
    extra = {"attribution": "true", "acts_on": acted[:500]}
    started = time.perf_counter()
    outcomes: list[CellOutcome] = []
    with sigterm_raises(), held_parent(protocol, protocol_file, allow_dirty, extra) as held:
        ex.parent = held.run_id
        with tqdm(total=len(cells), desc=f"{protocol.name} cells", unit="cell") as bar:
            for cell in cells:
                bar.set_postfix_str(cell.key)
                outcome = run_cell(ex, cell, allow_dirty)
                tqdm.write(f"[{outcome.status}] {outcome.message}")
                outcomes.append(outcome)
                bar.update(1)
        scored = sum(o.seconds for o in outcomes)
        held.sink.log_metrics({"evaluation_seconds": scored, "execution_seconds": time.perf_counter() - started,
                               "cells_evaluated": sum(o.status == "finished" for o in outcomes)})
    return outcomes


def tally_line(outcomes: list[CellOutcome]) -> str:
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    held = (f", {counts['busy']} held by another live execution (not touched)" if counts["busy"] else "") + \
        (f", {counts['lost']} taken over by another execution" if counts["lost"] else "")
    return (f"cells: {counts['finished']} run, {counts['skipped']} already finished (skipped), "
            f"{counts['failed']} failed{held}")


@click.command("attribute")
@click.option("--protocol", "protocol_path", default=DEFAULT_PROTOCOL, show_default=True,
              type=click.Path(exists=True, dir_okay=False), help="Attribution protocol YAML file.")
@click.option("--allow-dirty", is_flag=True, help="Run a protocol file with uncommitted changes (recorded on the runs).")
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None, help="Where this machine keeps the dataset, if not in the usual places.")
@click.option("--download/--no-download", default=False, show_default=True)
@click.option("--output-dir", type=click.Path(file_okay=False), default="outputs/attribute", show_default=True,
              help="Downloaded checkpoints of the acted-on cells.")
@threads_option
def attribute(protocol_path, allow_dirty, device, data_path, download, output_dir, threads):
    """Score an attribution protocol: every method against exact token-drop effects on every acted-on model, as MLflow child runs."""
    started = time.perf_counter()
    try:
        protocol = open_attribution_protocol(protocol_path, allow_dirty)
        outcomes = run_attribution_protocol(protocol, Path(protocol_path), Path(output_dir), device, data_path,
                                            allow_dirty, download)
    except USER_ERRORS as err:
        raise click.ClickException(str(err)) from err
    click.echo(tally_line(outcomes))
    used = torch.get_num_threads()  # --threads was applied when it was parsed
    click.echo(f"time: {sum(o.seconds for o in outcomes):.1f} s scoring attributions ({used} thread"
               f"{'s' if used != 1 else ''}), {time.perf_counter() - started:.1f} s in all; "
               f"report: workbench report --protocol {protocol_path}")
    for o in outcomes:
        if o.status == "failed":
            click.echo(f"  FAILED {o.message}", err=True)
    if any(o.status == "failed" for o in outcomes):
        sys.exit(1)
