"""A run's whole record as plain JSON-able data, for publishing a study's evidence.

What ``workbench report --evidence`` writes to ``runs.json`` for every run a report reads:
its identity and status, start and end times, params, tags, the latest value of every
metric and every metric's full history (step, timestamp, value). Strings go out with
every secret replaced by ``***`` (``tracking.store.redact``, the one redaction) and every absolute
local path made relative to the working directory (``portable_text``): an export is
published, so it carries neither secrets nor the layout of the machine that made it.
"""

from __future__ import annotations

import math

from mlflow.tracking import MlflowClient

from tracking.store.redact import redact_text
from workbench.text.portable import portable_text


def json_number(value: float) -> float | str:
    """A metric value that strict JSON can hold: non-finite values as "NaN", "Infinity", "-Infinity"."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def clean_text(text: str) -> str:
    """``text`` fit to publish: credentials replaced by ``***``, absolute paths made relative."""
    return portable_text(redact_text(text))


def metric_histories(run_id: str) -> dict[str, list[list]]:
    """Every metric's full history, ``[[step, timestamp_ms, value], ...]`` in the order the report
    reads it (by step, then timestamp): a step logged twice keeps its later value."""
    client = MlflowClient()
    out = {}
    for key in sorted(client.get_run(run_id).data.metrics):
        points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        out[key] = [[int(m.step), int(m.timestamp), json_number(m.value)] for m in points]
    return out


def run_record(run_id: str) -> dict:
    """The run as published: ids, status, times (ms since the epoch), params, tags, metrics, histories."""
    run = MlflowClient().get_run(run_id)
    return {
        "run_id": run.info.run_id,
        "experiment_id": run.info.experiment_id,
        "run_name": clean_text(run.info.run_name or ""),
        "status": run.info.status,
        "start_time": int(run.info.start_time or 0),
        "end_time": int(run.info.end_time or 0),
        "params": {k: clean_text(v) for k, v in sorted(run.data.params.items())},
        "tags": {k: clean_text(v) for k, v in sorted(run.data.tags.items())},
        "metrics": {k: json_number(v) for k, v in sorted(run.data.metrics.items())},
        "metric_history": metric_histories(run_id),
    }
