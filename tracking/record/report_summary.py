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

The answer on the runs list (``log_arm_rows``): one summary run per arm beside the parent, with
the arm's mean accuracy, its interval and its paired difference to the reference as metrics
(``arm_metrics``: ``<split>.n`` seeds, ``<split>.acc`` with ``.acc.low`` and ``.acc.high``,
``<split>.diff`` with ``.diff.low`` and ``.diff.high``), and a shared view of the experiment's runs
list (``tracking.store.ui_links.share_view``) that shows only these rows, sorted by the first
split's mean, with these columns: the address ``make ui`` and ``report`` print opens on it. The
rows carry the tags ``summary_of`` (the parent), ``summary_arm`` and ``reference`` and none of
the cell or parent markers, so no lookup of cells or parents finds them. A rebuild finds them by
those tags and logs the new values (an arm no longer reported gets NaN), so each arm has one row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from mlflow.entities import Metric, Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record.create_once import ordered
from tracking.record.schema import (
    FINISHED,
    RUN_NAME,
    SUMMARY_ARM,
    SUMMARY_OF,
    SUMMARY_REFERENCE,
    tag_is,
)
from tracking.store import ui_links

PREFIX = "cmp."
STATS = ("mean_diff", "t_low", "t_high", "boot_low", "boot_high", "wins", "n")
NOTE_TAG = "mlflow.note.content"
HEAD = "### Results of the report"  # how the block this module puts at the top of the description starts
# between the results block and the protocol's description (a rule in the UI)
SEPARATOR = "\n\n---\n\n"
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
    # shortened by an earlier build: shorten it afresh, and say so again
    was_cut = base.endswith(CUT)
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


def arm_metrics(
    split: str,
    *,
    n: int,
    acc: tuple[float, float, float],
    diff: tuple[float, float, float] | None = None,
) -> dict[str, float]:
    """One arm's row on ``split``: ``n`` seeds, mean accuracy with its interval, difference to the reference with its interval.

    ``acc`` and ``diff`` are (mean, low, high), as the report states them; the reference arm
    has no ``diff``. Rounded to ``DECIMALS`` (no float noise in the UI).
    """
    named = {f"{split}.n": n, f"{split}.acc": acc[0], f"{split}.acc.low": acc[1]}
    named[f"{split}.acc.high"] = acc[2]
    if diff is not None:
        named |= {f"{split}.diff": diff[0], f"{split}.diff.low": diff[1]}
        named[f"{split}.diff.high"] = diff[2]
    return {k: round(float(v), DECIMALS) for k, v in named.items()}


def answer_view(parent_run_id: str, split: str) -> dict:
    """The runs-list view of the arms' rows of ``parent_run_id``: best mean on ``split`` first, their columns only."""
    keys = ["n", "acc", "acc.low", "acc.high", "diff", "diff.low", "diff.high"]
    # The reference is in its row's name ("vit (reference)"); the runs' tags (lease.* included) stay out.
    columns = [ui_links.column("metrics", f"{split}.{k}") for k in keys]
    return {
        "searchFilter": tag_is(SUMMARY_OF, parent_run_id),
        "orderByKey": ui_links.column("metrics", f"{split}.acc"),
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": columns,
        # each header whole ("val.diff.high"; the UI cuts a longer one), all columns on one screen
        "columnWidths": {c: 28 + 8 * len(c.split("`")[1]) for c in columns},
    }


def log_arm_rows(
    parent_run_id: str,
    rows: Mapping[str, Mapping[str, float]],
    reference: str,
    notes: Mapping[str, str],
    split: str,
    client: MlflowClient | None = None,
) -> tuple[int, str | None]:
    """One summary run per arm of ``rows`` (arm -> ``arm_metrics``), beside the parent, and the view showing them.

    The view sorts by the mean on ``split`` and shows its columns; ``notes`` gives each arm's
    run its description (what the columns mean). Returns how many arms' earlier rows went NaN
    (arms no longer reported) and the view's address in the UI (None for a local store, whose
    address ``make ui`` prints from the experiment's ``ANSWER_VIEW`` tag).
    """
    client = client or MlflowClient()
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    found = client.search_runs([experiment_id], tag_is(SUMMARY_OF, parent_run_id), max_results=1000)
    rows_of: dict[str, Run] = {}
    # The oldest row of an arm is its row (two builds at once may each have added one).
    for run in ordered(found):
        rows_of.setdefault(run.data.tags.get(SUMMARY_ARM, ""), run)
    for arm, metrics in rows.items():
        name = f"{arm} (reference)" if arm == reference else arm
        tags = {RUN_NAME: name, SUMMARY_REFERENCE: reference, NOTE_TAG: notes.get(arm, "")}
        run = rows_of.get(arm)
        if run is None:
            run_id = client.create_run(
                experiment_id,
                run_name=name,
                tags={**tags, SUMMARY_OF: parent_run_id, SUMMARY_ARM: arm},
            ).info.run_id
            _log_values(client, run_id, metrics, {})
            client.set_terminated(run_id, FINISHED)
        else:
            _log_values(client, run.info.run_id, metrics, run.data.metrics, tags)
    dropped = [run for arm, run in rows_of.items() if arm not in rows]
    for run in dropped:
        _log_values(client, run.info.run_id, {}, run.data.metrics)
    key = ui_links.share_view(client, experiment_id, answer_view(parent_run_id, split))
    client.set_experiment_tag(experiment_id, ui_links.ANSWER_VIEW, key)
    return len(dropped), ui_links.view_url(client.tracking_uri, experiment_id, key)


def _log_values(
    client: MlflowClient,
    run_id: str,
    metrics: Mapping[str, float],
    before: Mapping[str, float],
    tags: Mapping[str, str] | None = None,
) -> None:
    """``metrics`` on ``run_id``, NaN for any earlier finite value it no longer has, and ``tags``."""
    stale = {k: math.nan for k, v in before.items() if k not in metrics and math.isfinite(v)}
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in {**metrics, **stale}.items()],
        tags=[RunTag(k, v) for k, v in (tags or {}).items()],
    )
