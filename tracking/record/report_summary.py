"""The study's answer on its parent run: the report's comparisons as metrics, its result sentences as the description.

MLflow's UI shows a run's metrics and its description (the ``mlflow.note.content`` tag,
rendered as Markdown) on the run's page, and metrics as columns of the runs list. When a
report is built, its study's parent run gets, for every comparison the report makes, the
metrics ``cmp.<a>_vs_<b>.<split>.<stat>`` (``comparison_metrics``: mean_diff, t_low, t_high,
boot_low, boot_high, wins, n) and, at the top of its description, the report's Results
sentences and caveats; the protocol's description the parent was created with stays below,
after a rule. Each build replaces the block of the build before (the block starts with
``HEAD`` and ends at the first rule), values are rounded to ``DECIMALS`` (far below any digit
the report shows, and free of float noise in the UI), and a comparison an earlier build made
but this one does not gets NaN in each of its metrics, so the run shows no number the report
no longer states.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tracking.store import ui_links

PREFIX = "cmp."
STATS = ("mean_diff", "t_low", "t_high", "boot_low", "boot_high", "wins", "n")
NOTE_TAG = "mlflow.note.content"
HEAD = "### Results of the report"  # how the block this module puts at the top of the description starts
SEPARATOR = (
    "\n\n---\n\n"  # between the results block and the protocol's description (a rule in the UI)
)
DECIMALS = 6
BATCH = 1000  # MLflow's log_batch accepts at most 1,000 metrics per call
LIMIT = 8000  # MLflow's longest tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH); longer ones are cut or refused
CUT = "\n\n… (shortened to fit MLflow's 8,000-character description: the whole text is the protocol file's)"


def comparison_metrics(
    a: str,
    b: str,
    split: str,
    *,
    mean_diff: float,
    t_low: float,
    t_high: float,
    boot_low: float,
    boot_high: float,
    wins: int,
    n: int,
) -> dict[str, float]:
    """The metrics of one comparison a - b on ``split``, keyed ``cmp.<a>_vs_<b>.<split>.<stat>`` (NaN where absent)."""
    values = (mean_diff, t_low, t_high, boot_low, boot_high, wins, n)
    return {
        f"{PREFIX}{a}_vs_{b}.{split}.{stat}": round(float(v), DECIMALS)
        for stat, v in zip(STATS, values)
    }


def results_block(note: str) -> str:
    """The block an earlier build put at the top of ``note`` ("" if none)."""
    return note.split(SEPARATOR, 1)[0] if note.startswith(HEAD) else ""


def with_results(note: str, block: str) -> str:
    """``note`` with ``block`` at its top in place of an earlier build's block.

    The whole stays within MLflow's ``LIMIT``: the block comes first (``block`` itself must
    fit), the protocol's description below it is shortened, saying so, when it does not.
    """
    if len(block) > LIMIT:
        raise ValueError(
            f"a results block of {len(block)} characters does not fit MLflow's {LIMIT}"
        )
    base = (
        (note.split(SEPARATOR, 1)[1] if SEPARATOR in note else "")
        if note.startswith(HEAD)
        else note
    )
    was_cut = base.endswith(
        CUT
    )  # shortened by an earlier build: shorten it afresh, and say so again
    base = base[: -len(CUT)] if was_cut else base
    room = LIMIT - len(block) - len(SEPARATOR)
    if was_cut or len(base) > room:
        keep = room - len(CUT)
        base = base[:keep].rstrip() + CUT if keep > len(CUT) else ""
    return block + SEPARATOR + base if base else block


def kept_results(old_note: str, note: str) -> str:
    """The description a reattached parent should get: its new ``note`` with the last report's block still on top."""
    block = results_block(old_note)
    return with_results(note, block) if block else note


def log_summary(
    run_id: str, metrics: Mapping[str, float], block: str, client: MlflowClient | None = None
) -> tuple[int, str | None]:
    """Put a report's comparisons and result text on ``run_id``.

    Returns how many earlier comparisons' metrics went NaN, and the run's page in the UI (the
    runs view, no credentials; None for a local store, which has no UI address).
    """
    client = client or MlflowClient()
    run = client.get_run(run_id)
    stale = {
        k: math.nan
        for k in run.data.metrics
        if k.startswith(PREFIX) and k not in metrics and math.isfinite(run.data.metrics[k])
    }
    now = int(time.time() * 1000)
    entries = [Metric(k, float(v), now, 0) for k, v in {**metrics, **stale}.items()]
    for i in range(0, len(entries), BATCH):
        client.log_batch(run_id, metrics=entries[i : i + BATCH])
    if not block.startswith(HEAD):
        raise ValueError(
            f"a results block starts with {HEAD!r}, so the next build can find and replace it"
        )
    client.set_tag(run_id, NOTE_TAG, with_results(run.data.tags.get(NOTE_TAG, ""), block))
    page = ui_links.run_url(client.tracking_uri, run.info.experiment_id, run_id)
    return len({k.rsplit(".", 1)[0] for k in stale}), page
