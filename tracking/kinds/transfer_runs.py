"""MLflow side of transfer studies: source URIs, cell runs, what each phase logs, the report section.

Layout: one experiment per protocol (as for ablations); a parent run per execution, tagged
``transfer=true`` with the source's identity; a child run per (regime, seed) cell tagged
``cell=true``, ``arm=<regime>``, ``seed``, ``run_key``. A child is FINISHED only after its test
evaluation; between the phases it stays RUNNING with ``phase=selected``.

Every write goes through a ``RunSink`` (``tracking.record.sink``), as for ablations: when the
tracking server dies mid-study, the parent and the cells continue in the local fallback
store and ``workbench sync`` merges them into their server runs later.
"""

from __future__ import annotations

import json
import math
import tempfile
from functools import lru_cache
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from tracking.kinds.training_runs import EPOCH_METRICS, MlflowTrainingObserver
from tracking.record import study_record
from tracking.record.queries import CellRecord, cell_records, download_artifact
from tracking.record.schema import (
    FINISHED,
    PROTOCOL_HASH,
    SOURCE_IDENTITY,
    TRANSFER,
    cell_filter,
    parent_filter,
)
from tracking.record.sink import RunSink
from tracking.store import health
from workbench.train.evaluate import read_predictions
from workbench.train.fingerprint import PROJECT_ROOT, TRAINING_ROOTS, closure_fingerprint
from workbench.transfer.report import CellPredictions, TransferSection, build_section
from workbench.transfer.runner import Selection, TestResult
from workbench.transfer.source_model import SourceError

TRANSFER_EPOCH_METRICS = EPOCH_METRICS + ("val_qwk", "val_macro_f1")
DEFAULT_RUN_ARTIFACT = "checkpoints/best.pt"


# Where the transfer kind's code identity starts (``workbench.train.fingerprint``): the training
# roots and the transfer library, whose import closure (the QWK of ``workbench.stats`` that
# selects the epoch, the protocol schema, the read-across code) is hashed with them. Its report
# section only reads logged predictions: it starts nothing (a commit of docs, reports or CLI
# text re-trains nothing).
TRANSFER_ROOTS = TRAINING_ROOTS + ("workbench/transfer",)
TRANSFER_READ_SIDE = ("workbench/transfer/report.py",)


def transfer_fingerprint(root: Path = PROJECT_ROOT, versions: dict[str, str] | None = None) -> str:
    """The transfer kind's fingerprint of the checkout at ``root`` (``closure_fingerprint``)."""
    return closure_fingerprint(TRANSFER_ROOTS, root, versions, TRANSFER_READ_SIDE)


@lru_cache(maxsize=1)
def transfer_code_fingerprint() -> str:
    """This checkout's transfer code identity, once per process (part of every transfer cell's key)."""
    return transfer_fingerprint()


class TransferEpochObserver(MlflowTrainingObserver):
    """Per-epoch metrics of a transfer cell (adds validation QWK and macro-F1), each epoch once, through its sink.

    Fenced: once another execution has taken the run over, the next epoch raises ``LeaseLost``.
    """

    def __init__(self, sink: RunSink) -> None:
        super().__init__(sink, fenced=True)

    def on_epoch(self, metrics: dict) -> None:
        epoch = int(metrics["epoch"])
        if epoch in self.logged_epochs():
            return
        self.check(sync=True)
        values = {k: float(metrics[k]) for k in TRANSFER_EPOCH_METRICS if k in metrics}
        self.sink.log_metrics(values, step=epoch)
        self._logged.add(epoch)


# ---------------------------------------------------------------- sources held in MLflow


def download_run_source(rest: str, dst: Path) -> tuple[Path, str, str]:
    """Fetch a source from ``runs:/<run id>[/<artifact path>]``.

    The default artifact is the run's best checkpoint. ``model`` (the run's logged model)
    maps to the same checkpoint: ``tracking.kinds.training_runs.log_model`` exports exactly those
    weights, and the checkpoint is the trainable glass-box form of them. With a checkpoint,
    the run's ``config.json`` comes along (architecture and normalisation).

    Returns:
        (local path, run id, note for the provenance).
    """
    run_id, _, artifact = rest.partition("/")
    artifact, note = artifact.strip("/") or DEFAULT_RUN_ARTIFACT, ""
    if artifact == "model" or artifact.startswith("model/"):
        artifact, note = (
            DEFAULT_RUN_ARTIFACT,
            "the run's logged model, read from the checkpoint it was exported from",
        )
    try:
        MlflowClient().get_run(run_id)
    except Exception as err:  # MlflowException for unknown ids, connection errors for servers
        raise SourceError(
            f"runs:/{rest}: no such run in {mlflow.get_tracking_uri()} ({err})"
        ) from err
    folder = Path(dst) / run_id
    try:
        local = Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=artifact, dst_path=str(folder)
            )
        )
    except Exception as err:
        raise SourceError(
            f"runs:/{rest}: run {run_id} has no artifact {artifact!r} ({err})"
        ) from err
    if local.suffix in (".pt", ".pth"):
        try:
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="config.json", dst_path=str(folder)
            )
        except (
            Exception
        ):  # a timm weights file needs no config; a workbench checkpoint reports it missing
            pass
    return local, run_id, note


def run_param(run_id: str, key: str) -> str | None:
    """One param of a run (e.g. the source run's ``data.display_name``), or None."""
    return MlflowClient().get_run(run_id).data.params.get(key)


def find_finished_cell(protocol_name: str, protocol_hash: str, arm: str, seed: int) -> str:
    """Run id of the newest FINISHED cell (arm, seed) of a protocol hash, for ``protocol:`` sources."""
    client = MlflowClient()
    ids = study_record.record_ids(protocol_name, client)  # this account's record, renamed or not
    runs = (
        client.search_runs(
            ids,
            filter_string=cell_filter(protocol_hash, arm=arm, seed=seed, status=FINISHED),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if ids
        else []
    )
    if not runs:
        raise SourceError(
            f"protocol:{protocol_name}/{arm}/seed{seed}: no finished cell of hash {protocol_hash[:12]} "
            f"in {mlflow.get_tracking_uri()}; run `workbench ablate --protocol "
            f"studies/protocols/{protocol_name}.yaml` first"
        )
    return runs[0].info.run_id


# ---------------------------------------------------------------- what a cell logs


def _log_json(sink: RunSink, obj, name: str, artifact_path: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(obj, indent=1, default=str))
        sink.log_artifact(path, artifact_path=artifact_path)


def _finite(value: float) -> float:
    # MLflow stores no inf; -1 is impossible for a diff
    return value if math.isfinite(value) else -1.0


def log_selection(sink: RunSink, selection: Selection, log_checkpoint: bool) -> None:
    """Best epoch, its validation metrics, the assembly/reload proof, val predictions, checkpoint."""
    proof = selection.proof
    sink.log_metrics(
        {
            "best_epoch": selection.best_epoch,
            **{f"best_{k}": v for k, v in selection.best_val.items()},
            "selection_proof_passed": float(proof["passed"]),
            "selection_proof_max_abs_diff": _finite(proof["max_abs_prob_diff"]),
            "selection_seconds": selection.seconds,
            "trainable_parameters": selection.trainable_parameters,
        }
    )
    sink.set_tags(
        {
            "selection_proof": "passed" if proof["passed"] else "failed",
            "selection_proof_summary": f"{proof['what']}: {proof['summary']}",
            "stopped_early": str(selection.stopped_early).lower(),
        }
    )
    sink.log_artifact(selection.val_predictions, artifact_path="predictions")
    if log_checkpoint:
        sink.log_artifact(selection.checkpoint, artifact_path="checkpoints")
    _log_json(sink, selection.history, "history.json")
    # last: a selection is reused only once all of it is logged
    sink.set_tags({"phase": "selected"})


def log_test(sink: RunSink, result: TestResult, n_resamples: int, confidence: float) -> None:
    """Test metrics (in memory and recomputed from the file), their agreement, CIs, the predictions file."""
    values = {f"test_{k}": v for k, v in result.metrics.items()}
    values |= {f"test_file_{k}": v for k, v in result.metrics_from_file.items()}
    for name, ci in result.cis.items():
        values |= {f"test_{name}_ci_low": ci.low, f"test_{name}_ci_high": ci.high}
    values |= {
        "test_metrics_agree": float(result.agree),
        "test_metrics_max_abs_diff": _finite(result.max_abs_diff),
        "test_seconds": result.seconds,
    }
    sink.log_metrics({k: v for k, v in values.items() if not math.isnan(v)})
    verdict = "agree" if result.agree else "DIFFER"
    sink.set_tags(
        {
            "test_metrics_agreement": f"{verdict}: metrics recomputed from predictions/test.csv vs in memory, "
            f"max |difference| {result.max_abs_diff:.3g}"
        }
    )
    sink.log_params(
        {
            "evaluation.n_resamples": n_resamples,
            "evaluation.confidence": confidence,
            "evaluation.method": next(iter(result.cis.values())).method,
        }
    )
    sink.log_artifact(result.predictions, artifact_path="predictions")
    _log_json(
        sink,
        {
            "metrics": result.metrics,
            "metrics_from_file": result.metrics_from_file,
            "agree": result.agree,
            "cis": {k: vars(ci) for k, ci in result.cis.items()},
        },
        "test_metrics.json",
    )
    sink.set_tags({"phase": "tested"})


# ---------------------------------------------------------------- the report section


def _newest_parent(client: MlflowClient, experiment_ids: list[str], protocol_hash: str | None):
    where = parent_filter(protocol_hash=protocol_hash, kind=TRANSFER)
    parents = client.search_runs(
        experiment_ids, filter_string=where, order_by=["attributes.start_time DESC"], max_results=1
    )
    if not parents:
        raise LookupError(
            f"no transfer execution{' of hash ' + protocol_hash[:12] if protocol_hash else ''} recorded"
        )
    return parents[0]


def newest_execution(protocol_name: str, protocol_hash: str | None = None) -> dict:
    """The newest transfer execution (parent run) of the hash: ``run_id``, ``params`` and ``tags``.

    Its ``source_identity`` tag decides which cells a report shows; its ``transfer.*``,
    ``evaluation.*`` and ``source.*`` params are the section's settings and source.

    Raises:
        LookupError: No such experiment or no transfer execution of the hash.
    """
    client = MlflowClient()
    ids = study_record.record_ids(protocol_name, client)  # this account's record, renamed or not
    if not ids:
        raise LookupError(
            f"no experiment of yours holds protocol {protocol_name!r} in {mlflow.get_tracking_uri()}"
        )
    parent = _newest_parent(client, ids, protocol_hash)
    return {
        "run_id": parent.info.run_id,
        "params": dict(parent.data.params),
        "tags": dict(parent.data.tags),
    }


def choose_cells(
    records: list[CellRecord], source_identity: str
) -> dict[tuple[str, int], CellRecord]:
    """The run a report shows per (regime, seed): the newest FINISHED cell run of ``source_identity``.

    One rule for the store and for a rebuild from an evidence export (which holds every cell run).
    """
    chosen: dict[tuple[str, int], CellRecord] = {}
    for r in sorted(records, key=lambda r: (r.start_time, r.run_id), reverse=True):  # newest first
        if r.status == FINISHED and r.tags.get(SOURCE_IDENTITY) == source_identity:
            chosen.setdefault((r.arm, r.seed), r)
    return dict(sorted(chosen.items()))


def cell_predictions(record: CellRecord, table) -> CellPredictions:
    """A chosen cell's saved test predictions with what it logged when it was evaluated."""
    m = record.metrics
    logged = {
        k[len("test_") :]: v
        for k, v in m.items()
        if k.startswith("test_")
        and not k.startswith(("test_file_", "test_metrics_"))
        and "_ci_" not in k
        and k != "test_seconds"
    }
    return CellPredictions(
        record.arm,
        record.seed,
        table,
        logged,
        int(m.get("best_epoch", 0)),
        m.get("best_val_qwk", math.nan),
        record.run_id,
        m.get("selection_seconds", math.nan),
    )


def section_of(
    protocol_name: str,
    protocol_hash: str,
    params: dict[str, str],
    cells: list[CellPredictions],
    n_resamples: int | None = None,
    confidence: float | None = None,
    seed: int | None = None,
) -> TransferSection:
    """The section from the execution's params (``newest_execution``) and the chosen cells' predictions;
    no store is read (a rebuild from evidence calls it too)."""
    source = {k: v for k, v in params.items() if k.startswith("source.")}
    return build_section(
        cells,
        int(params["transfer.num_classes"]),
        params["transfer.regimes"].split(","),
        params["transfer.reference"],
        n_resamples or int(params["evaluation.n_resamples"]),
        confidence or float(params["evaluation.confidence"]),
        int(params["evaluation.seed"]) if seed is None else seed,
        source=source,
        title=f"Transfer study {protocol_name}@{protocol_hash[:12]}",
    )


def transfer_section(
    protocol_name: str,
    protocol_hash: str | None = None,
    source_identity: str | None = None,
    n_resamples: int | None = None,
    confidence: float | None = None,
    seed: int | None = None,
    download_dir: Path | None = None,
) -> TransferSection:
    """The transfer section (kappa table with CIs, summary over seeds, paired comparisons, Markdown).

    Args:
        protocol_name: The protocol (= experiment) name.
        protocol_hash: Full hash to report; default the newest execution's.
        source_identity: Report cells of this source (tag ``source_identity``: sha256, or
            ``random:<model>:seed<k>``); default the newest execution's source.
        n_resamples, confidence, seed: Bootstrap settings; default the protocol's.
        download_dir: Where predictions files are downloaded (default a temporary folder).

    Raises:
        LookupError: The protocol, an execution or finished cells are missing.
    """
    parent = newest_execution(protocol_name, protocol_hash)
    protocol_hash = protocol_hash or parent["tags"][PROTOCOL_HASH]
    source_identity = source_identity or parent["tags"][SOURCE_IDENTITY]
    newest = choose_cells(cell_records(protocol_name, protocol_hash), source_identity)
    if not newest:
        raise LookupError(
            f"{protocol_name}@{protocol_hash[:12]}: no finished cells for source {source_identity}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(download_dir or tmp)
        cells = [
            cell_predictions(
                r,
                read_predictions(
                    download_artifact(r.run_id, "predictions/test.csv", dst / r.run_id)
                ),
            )
            for r in newest.values()
        ]
    return section_of(
        protocol_name, protocol_hash, parent["params"], cells, n_resamples, confidence, seed
    )


def log_section(parent: RunSink, section: TransferSection, markdown: str) -> None:
    """The section's tables and its Markdown (rendered by ``reports.transfer.transfer_blocks``) on the execution's parent run."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "section.md").write_text(markdown)
        section.kappa_table.to_csv(folder / "kappa_table.csv", index=False)
        section.summary.to_csv(folder / "summary.csv", index=False)
        section.comparisons.to_csv(folder / "comparisons.csv", index=False)
        for name in ("section.md", "kappa_table.csv", "summary.csv", "comparisons.csv"):
            parent.log_artifact(folder / name, artifact_path="transfer")
    parent.log_metrics(
        {
            f"qwk_mean.{row['regime']}": float(row["qwk_mean"])
            for _, row in section.summary.iterrows()
        }
    )


def section_unavailable(err: BaseException) -> bool:
    """Whether building the section failed only because the tracking server is away now."""
    return health.is_unreachable(err)
