"""The transfer kind's report builder: the same pipeline, files, logging and evidence export as
an ablation report's, for regimes from one source checkpoint (``reports.output.ReportRequest``
says what a builder answers)."""

from __future__ import annotations

from pathlib import Path

from reports.collect import ReportError, check_rebuild_folder
from reports.evidence import EVIDENCE_DIR
from reports.output import ReportRequest, ReportResult, log_report, refuse_interactions
from reports.provenance import BuildInputs
from reports.transfer import transfer_report
from reports.transfer.transfer_evidence import (
    FORMAT,
    export_transfer_evidence,
    load_transfer_evidence,
)
from workbench.protocol import SHORT_HASH_LEN, TransferProtocol, load_transfer_protocol


class TransferReport:
    """Reports of transfer protocols, from their file, from the store by name, or from evidence."""

    evidence_format = FORMAT

    def build(self, path: Path, request: ReportRequest) -> ReportResult:
        refuse_interactions(request, "a transfer")
        return self.report(load_transfer_protocol(path), request, from_store=False)

    def by_name(self, name: str, request: ReportRequest) -> ReportResult | None:
        """A transfer protocol known only to the store (its parent recorded the file); None when
        the store holds no transfer study of that name."""
        stored = transfer_report.stored_by_name(name, request.hash_prefix)
        if stored is None:
            return None
        refuse_interactions(request, "a transfer")
        return self.report(stored, request, from_store=True)

    def rebuild(self, evidence_dir: Path, out_root: Path) -> ReportResult:
        transferred = load_transfer_evidence(evidence_dir)
        check_rebuild_folder(evidence_dir, out_root, transferred.data.protocol.name)
        return transfer_report.render_transfer_study(
            transferred.data, transferred.inputs, Path(out_root), transferred.logged_to
        )

    def report(
        self, protocol: TransferProtocol, request: ReportRequest, from_store: bool
    ) -> ReportResult:
        """Cells are the newest finished run of each (regime, seed) of the hash, for the source of
        the hash's newest execution. ``--commit`` and ``--compare`` are refused in one line (every
        regime pair is compared already; cells are chosen per source, not per commit)."""
        if request.commit:
            raise ReportError(
                f"--commit {request.commit}: not supported for transfer protocols ({protocol.name}); "
                "the newest finished run of each cell is reported"
            )
        if request.compare:
            raise ReportError(
                f"--compare: not needed for transfer protocols ({protocol.name}); "
                "every pair of regimes is compared already"
            )
        data = transfer_report.load_study(protocol, request.hash_prefix, from_store)
        log_targets = data.parents[:1] if request.log else []
        inputs = BuildInputs(
            data.source,
            data.digest,
            request.hash_prefix,
            None,
            [],
            request.n_resamples,
            data.protocol.evaluation.seed,
            float(data.execution["params"]["evaluation.confidence"]),
            request.strict,
        )
        result = transfer_report.render_transfer_study(data, inputs, request.out_root, log_targets)
        if request.log and not data.parents:
            result.messages.append(
                f"no parent run of {data.protocol.name}@{data.digest[:SHORT_HASH_LEN]} found: "
                "the report is not logged to MLflow"
            )
        log_report(result, result.folder, log_targets if request.log else None)
        if request.evidence:
            folder = export_transfer_evidence(
                result.folder / EVIDENCE_DIR, data, inputs, log_targets
            )
            result.messages.append(
                f"wrote the evidence of {len(data.cells)} cells to {folder} "
                f"(rebuild: workbench report --from-evidence {folder} --out-dir DIR)"
            )
        return result


TRANSFER_REPORT = TransferReport()
