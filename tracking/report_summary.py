"""The study's answer on its parent run: the report's comparisons as metrics, its result sentences as the description.

MLflow's UI shows a run's metrics and its description (the ``mlflow.note.content`` tag,
rendered as Markdown) on the run's page, and metrics as columns of the runs list. When a
report is built, its study's parent run gets, for every comparison the report makes, the
metrics ``cmp.<a>_vs_<b>.<split>.<stat>`` (``comparison_metrics``: mean_diff, t_low, t_high,
boot_low, boot_high, wins, n) and, at the top of its description, the report's Results
sentences and caveats; the protocol's description the parent was created with stays below.
Each build replaces the block of the build before (kept apart in the tag ``report.results``
so it can be found again), and a comparison an earlier build made but this one does not
gets NaN in each of its metrics, so the run shows no number the report no longer states.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

PREFIX = "cmp."
STATS = ("mean_diff", "t_low", "t_high", "boot_low", "boot_high", "wins", "n")
NOTE_TAG = "mlflow.note.content"
RESULTS_TAG = "report.results"  # the block this module put at the top of the description, to find and replace it
SEPARATOR = "\n\n---\n\n"  # between the results block and the protocol's description (a rule in the UI)
BATCH = 1000  # MLflow's log_batch accepts at most 1,000 metrics per call
LIMIT = 8000  # MLflow's longest tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH); longer ones are cut or refused
CUT = "\n\n… (shortened to fit MLflow's 8,000-character description: the whole text is the protocol file's)"


def comparison_metrics(a: str, b: str, split: str, *, mean_diff: float, t_low: float, t_high: float,
                       boot_low: float, boot_high: float, wins: int, n: int) -> dict[str, float]:
    """The metrics of one comparison a - b on ``split``, keyed ``cmp.<a>_vs_<b>.<split>.<stat>`` (NaN where absent)."""
    values = (mean_diff, t_low, t_high, boot_low, boot_high, wins, n)
    return {f"{PREFIX}{a}_vs_{b}.{split}.{stat}": float(v) for stat, v in zip(STATS, values)}


def with_results(note: str, previous_block: str, block: str) -> str:
    """``note`` with ``block`` at its top in place of ``previous_block`` (or of nothing the first time).

    The whole stays within MLflow's ``LIMIT``: the block comes first (``block`` itself must
    fit), the protocol's description below it is shortened, saying so, when it does not.
    """
    if len(block) > LIMIT:
        raise ValueError(f"a results block of {len(block)} characters does not fit MLflow's {LIMIT}")
    head = previous_block + SEPARATOR
    base = note[len(head):] if previous_block and note.startswith(head) else note
    if previous_block and base == previous_block:  # a note that was only the block
        base = ""
    was_cut = base.endswith(CUT)  # shortened by an earlier build: shorten it afresh, and say so again
    base = base[:-len(CUT)] if was_cut else base
    room = LIMIT - len(block) - len(SEPARATOR)
    if was_cut or len(base) > room:
        keep = room - len(CUT)
        base = base[:keep].rstrip() + CUT if keep > len(CUT) else ""
    return block + SEPARATOR + base if base else block


def kept_results(tags: Mapping[str, str], note: str) -> str:
    """The description a reattached parent should get: ``note`` with the last report's block still on top."""
    block = tags.get(RESULTS_TAG, "")
    return with_results(note, "", block) if block and not note.startswith(block) else note


def log_summary(run_id: str, metrics: Mapping[str, float], block: str, client: MlflowClient | None = None) -> int:
    """Put a report's comparisons and result text on ``run_id``; returns how many earlier comparisons' metrics went NaN."""
    client = client or MlflowClient()
    run = client.get_run(run_id)
    stale = {k: math.nan for k in run.data.metrics if k.startswith(PREFIX) and k not in metrics
             and math.isfinite(run.data.metrics[k])}
    now = int(time.time() * 1000)
    entries = [Metric(k, float(v), now, 0) for k, v in {**metrics, **stale}.items()]
    for i in range(0, len(entries), BATCH):
        client.log_batch(run_id, metrics=entries[i:i + BATCH])
    tags = run.data.tags
    note = with_results(tags.get(NOTE_TAG, ""), tags.get(RESULTS_TAG, ""), block)
    client.set_tag(run_id, RESULTS_TAG, block)
    client.set_tag(run_id, NOTE_TAG, note)
    return len({k.rsplit(".", 1)[0] for k in stale})
