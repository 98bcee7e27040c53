"""A transfer study's evidence export: written, read back offline, the same numbers as the store's.

Default tier (well under 2 s): a hand-made ``TransferReportData`` (the records, logged files and
execution that ``workbench transfer`` writes, no MLflow) exported and read back with the
store forbidden gives back the same cells and, computed again, every number of the section
with a difference of exactly 0; a changed file or protocol is refused naming it; the source
is called pretrained only for a published checkpoint. Slow tier: the hand-made MLflow store
of ``test_report_transfer`` reported with ``--evidence``, rebuilt from the export with the
store forbidden: report.md equal but for the one rebuilt line, every number at its place, the
figures byte for byte, and ``rebuild_checks.transfer_differences`` (the published-evidence check) clean.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rebuild_checks import (
    forbid_store,
    number_differences,
    transfer_differences,
    without_rebuilt_line,
)
from test_report_transfer import (
    CORRECT,
    LABELS,
    PROTOCOL,
    SOURCE,
    K,
    log_transfer_store,
    predictions,
)

from reports.build import build_from_evidence, build_report
from reports.collect import ReportError
from reports.provenance import BuildInputs
from reports.transfer.transfer_blocks import source_text
from reports.transfer.transfer_data import ReportedCell, TransferReportData, compute_section
from reports.transfer.transfer_evidence import (
    FORMAT,
    export_transfer_evidence,
    load_transfer_evidence,
)
from tracking.record.queries import CellRecord
from workbench.protocol import load_transfer_protocol

TOLERANCE = 0.0  # the same predictions through the same code: bit-identical numbers
# enough to exercise every interval; the store test below uses the report's own count
RESAMPLES = 100
EXECUTION_PARAMS = {
    **SOURCE,
    "transfer.regimes": "linear_probe,full_ft",
    "transfer.reference": "linear_probe",
    "transfer.num_classes": str(K),
    "evaluation.n_resamples": "1000",
    "evaluation.confidence": "0.95",
    "evaluation.seed": "0",
}


def _csv(pred: np.ndarray) -> bytes:
    rows = [
        f"{i},{y},{p},0.5," + ",".join("0.9" if j == p else "0.025" for j in range(K))
        for i, (y, p) in enumerate(zip(LABELS, pred))
    ]
    return (
        "index,label,predicted,loss,"
        + ",".join(f"prob_{j}" for j in range(K))
        + "\n"
        + "\n".join(rows)
        + "\n"
    ).encode()


def _record(
    run_id: str, regime: str, seed: int, status: str, start: int, metrics: dict
) -> CellRecord:
    tags = {
        "cell": "true",
        "arm": regime,
        "seed": str(seed),
        "source_identity": "s1",
        "git_commit": "c" * 40,
        "git_dirty": "false",
        "device": "cpu",
        "mlflow.parentRunId": "p" * 32,
    }
    return CellRecord(
        run_id=run_id,
        arm=regime,
        seed=seed,
        status=status,
        commit="c" * 40,
        dirty="false",
        start_time=start,
        end_time=start + 10 if status == "FINISHED" else 0,
        parent_run_id="p" * 32,
        params={"data.n_train": "100"},
        metrics=metrics,
        tags=tags,
        experiment_id="1",
    )


def tiny_data(tmp_path: Path) -> TransferReportData:
    """Four reported cells, an older finished run and a newer KILLED attempt the choice must skip."""
    path = tmp_path / "tiny_transfer.yaml"
    path.write_text(PROTOCOL)
    protocol = load_transfer_protocol(path)
    records, cells = [], {}
    for n, (regime, seed) in enumerate(CORRECT):
        pred = predictions(regime, seed)
        metrics = {
            "test_accuracy": float((pred == LABELS).mean()),
            "best_epoch": 3.0,
            "best_val_qwk": 0.5,
            "selection_seconds": 10.0 + seed,
        }
        record = _record(f"{n:032x}", regime, seed, "FINISHED", 1000 + n, metrics)
        records.append(record)
        # older: not chosen
        records.append(_record(f"{n + 10:032x}", regime, seed, "FINISHED", 10 + n, {}))
        curves = {"val_qwk": {1: 0.1, 2: 0.3, 3: 0.5}, "val_loss": {1: 1.0, 2: float("nan")}}
        cells[(regime, seed)] = ReportedCell(
            record, {"test": _csv(pred), "val": _csv(pred[:10])}, curves
        )
    # newer, unfinished: listed, not used
    records.append(_record(f"{99:032x}", "full_ft", 1, "KILLED", 5000, {}))
    execution = {
        "run_id": "p" * 32,
        "params": dict(EXECUTION_PARAMS),
        "tags": {"source_identity": "s1"},
    }
    return TransferReportData(
        protocol,
        PROTOCOL,
        protocol.hash,
        "file tiny_transfer.yaml",
        execution,
        [],
        records,
        cells,
        "sqlite:///mlflow.db",
    )


def inputs_of(data: TransferReportData) -> BuildInputs:
    return BuildInputs(data.source, data.digest, None, None, [], RESAMPLES, 0, 0.95, False)


def max_difference(a: pd.DataFrame, b: pd.DataFrame) -> float:
    """Largest |a - b| over the numeric columns (NaN equal to NaN); inf where the tables differ otherwise."""
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return float("inf")
    worst = 0.0
    for column in a.columns:
        x, y = a[column].to_numpy(), b[column].to_numpy()
        if np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number):
            x, y = x.astype(float), y.astype(float)
            both_nan = np.isnan(x) & np.isnan(y)
            diff = np.where(both_nan, 0.0, np.abs(x - y))
            worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0)))
        elif not (x == y).all():
            return float("inf")
    return worst


def section_differences(a, b) -> dict[str, float]:
    out = {
        name: max_difference(getattr(a, name), getattr(b, name))
        for name in ("kappa_table", "summary", "comparisons")
    }
    out["confusion"] = (
        max(
            (float(np.abs(a.confusion[r] - b.confusion[r]).max()) for r in a.confusion), default=0.0
        )
        if a.confusion.keys() == b.confusion.keys()
        else float("inf")
    )
    return out


def test_export_reads_back_offline_to_the_same_numbers(tmp_path, monkeypatch):
    data = tiny_data(tmp_path)
    folder = export_transfer_evidence(
        tmp_path / "out" / "tiny_transfer" / "evidence", data, inputs_of(data), []
    )
    doc = json.loads((folder / "runs.json").read_text())
    assert doc["format"] == FORMAT and len(doc["cells"]) == 9
    assert doc["source"]["kind"] == "timm-random" and doc["source"]["pretrained"] == "False"
    assert sorted(p.name for p in (folder / "predictions").iterdir())[:2] == [
        "full_ft.seed0.test.csv.gz",
        "full_ft.seed0.val.csv.gz",
    ]
    forbid_store(monkeypatch, tmp_path)
    loaded = load_transfer_evidence(folder)
    back = loaded.data
    assert back.chosen == data.chosen, "the rebuild chose other runs than the store build"
    assert {k: c.files for k, c in back.cells.items()} == {
        k: c.files for k, c in data.cells.items()
    }
    # NaN
    assert (
        back.cells[("full_ft", 1)].curves["val_loss"][2]
        != back.cells[("full_ft", 1)].curves["val_loss"][2]
    )
    by_id = lambda records: sorted(records, key=lambda r: r.run_id)  # noqa: E731 - the export sorts by regime, seed
    assert (by_id(back.records), back.execution, back.tracking_uri) == (
        by_id(data.records),
        data.execution,
        data.tracking_uri,
    )
    assert back.rebuilt_from == "tiny_transfer/evidence" and loaded.inputs == inputs_of(data)
    diffs = section_differences(compute_section(data, RESAMPLES), compute_section(back, RESAMPLES))
    assert max(diffs.values()) <= TOLERANCE, (
        f"rebuilt numbers differ from the store's (tolerance 0): max |diff| {diffs}"
    )


def test_a_changed_file_or_protocol_is_refused_by_name(tmp_path, monkeypatch):
    data = tiny_data(tmp_path)
    folder = export_transfer_evidence(tmp_path / "evidence", data, inputs_of(data), [])
    forbid_store(monkeypatch, tmp_path)
    victim = folder / "predictions" / "linear_probe.seed0.test.csv.gz"
    original = victim.read_bytes()
    victim.write_bytes(
        gzip.compress(gzip.decompress(original).replace(b"\n0,0,", b"\n0,1,", 1), mtime=0)
    )
    with pytest.raises(ReportError, match="linear_probe.seed0.test.csv.gz: sha256 differs"):
        load_transfer_evidence(folder)
    victim.write_bytes(original)
    doc = json.loads((folder / "runs.json").read_text())
    doc["protocol"]["file"]["text"] = PROTOCOL.replace("seeds: [0, 1]", "seeds: [0, 1, 2]")
    (folder / "runs.json").write_text(json.dumps(doc))
    with pytest.raises(ReportError, match="runs.json: the exported protocol file hashes to"):
        load_transfer_evidence(folder)


@pytest.mark.parametrize(
    "kind, pretrained",
    [
        ("timm-hub", True),
        ("timm-local", False),
        ("workbench-checkpoint", False),
        ("timm-random", False),
    ],
)
def test_only_a_published_checkpoint_is_called_pretrained(kind, pretrained):
    from workbench.transfer.source_model import SourceInfo

    info = SourceInfo(
        kind=kind,
        uri="w",
        path="",
        run_id="r1" if kind == "workbench-checkpoint" else "",
        sha256="ab",
        pretrained=kind == "timm-hub",
        description="d",
        architecture="a",
        norm_from="n",
    )
    text = source_text(info.as_params())
    # runs before it
    legacy = source_text({k: v for k, v in info.as_params().items() if k != "source.provenance"})
    for shown in (text, legacy):
        claims = "published pretrained checkpoint" in shown and "not a published" not in shown
        assert claims == pretrained, shown
    if kind == "workbench-checkpoint":
        assert "trained with this workbench (run r1), not a published one" in text, text


@pytest.mark.slow  # builds the report twice from a hand-made store (bootstraps, figures): 5 to 40 s by load
def test_store_report_and_its_rebuild_from_evidence_agree_number_for_number(
    tmp_path, mlflow_store, monkeypatch
):
    store = log_transfer_store(tmp_path)
    built = build_report(str(store["path"]), tmp_path / "out", n_resamples=1000, evidence=True)
    folder = built.folder / "evidence"
    assert any("wrote the evidence of 4 cells" in m for m in built.messages), built.messages
    forbid_store(monkeypatch, tmp_path)
    rebuilt = build_from_evidence(folder, tmp_path / "rebuilt")
    diffs = section_differences(built.section, rebuilt.section)
    assert max(diffs.values()) <= TOLERANCE, (
        f"rebuilt numbers differ from the store's (tolerance 0): max |diff| {diffs}"
    )
    published, again = built.markdown.read_text(), rebuilt.markdown.read_text()
    compared, places = number_differences(published, again)
    assert compared > 100 and not places, f"{len(places)} places differ: {places[:20]}"
    assert without_rebuilt_line(again) == without_rebuilt_line(published), (
        "report.md differs beyond the rebuilt line"
    )
    assert [p.read_bytes() for p in rebuilt.figures] == [p.read_bytes() for p in built.figures], (
        "a figure differs"
    )
    # what test_published_evidence checks of a published one
    checked, problems = transfer_differences(built.folder)
    # test_qwk, test_accuracy logged
    assert checked == 4 * 2 + 4 * 3 + 2 * 4 and not problems, problems


def test_a_source_given_by_option_is_said_with_what_it_is():
    from reports.transfer.transfer_report import source_warnings
    from workbench.transfer.source_model import SourceInfo

    canonical = {"source": {"weights": "hub", "model": "vit_base_patch16_224"}}
    local = SourceInfo(
        kind="timm-local",
        uri="w.safetensors",
        path="",
        run_id="",
        sha256="ab",
        pretrained=False,
        description="d",
        architecture="a",
        norm_from="n",
    ).as_params()
    assert source_warnings(canonical, {"tags": {"source_override": ""}, "params": local}) == []
    assert source_warnings(canonical, {"tags": {"source_override": "hub"}, "params": local}) == []
    (warning,) = source_warnings(
        canonical, {"tags": {"source_override": "w.safetensors"}, "params": local}
    )
    assert "`--source w.safetensors`, not the protocol's source.weights `hub`" in warning, warning
    assert warning.endswith(
        "a local weights file, not a published checkpoint (what it holds is what its sha256 names)"
    )
