"""Where every number came from: the runs table, later attempts, the report's own build inputs.

Shared by the ablation and the transfer report. Every cell's row names its MLflow run (a
link to the run's page when the store is a server), the code (commit and, when the run
logged one, the code fingerprint), the data (data and split fingerprints, 16 hex
characters, and the dataset source), the device and the start time in UTC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from reports.render import Block, Heading, Para, Table
from tracking.record import queries
from tracking.record.queries import CellRecord
from tracking.store import ui_links
from workbench.kernel_identity import kernel_summary, recorded_identity
from workbench.text.portable import portable_text

FLAG = "⚠"
REBUILT_PREFIX = "Rebuilt offline from the evidence export"  # the one line a rebuilt report adds
# at least 12 hex characters: enough to tell any two data versions apart by eye
FINGERPRINT_CHARS = 16
# param or tag, whichever the run has
CODE_FINGERPRINT_KEYS = (
    "code_fingerprint",
    "code.fingerprint",
)


def utc(ms: int) -> str:
    """Milliseconds since the epoch as ``2026-12-01 06:44:10 UTC`` ("n/a" when unknown)."""
    if not ms:
        return "n/a"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def short(value: str | None, n: int = FINGERPRINT_CHARS) -> str:
    return f"`{value[:n]}`" if value else "n/a"


def code_fingerprint(record: CellRecord) -> str | None:
    for key in CODE_FINGERPRINT_KEYS:
        value = record.params.get(key) or record.tags.get(key)
        if value:
            return value
    return None


def device(record: CellRecord) -> str:
    """The device the run trained on, with the GPU's name when it logged one."""
    name = record.tags.get("device", "n/a")
    return f"{name} ({record.tags['device_name']})" if record.tags.get("device_name") else name


def precision(record: CellRecord) -> str:
    amp = record.params.get("run.amp", record.params.get("amp", "off"))
    return "fp32" if amp in ("off", "None", "") else f"{amp.replace('torch.', '')} autocast"


def run_ref(record: CellRecord, store: str | None = None) -> str:
    """The run id, as a link to its page when the store (default: the configured one) is a server."""
    url = (
        queries.run_url(record)
        if store is None
        else ui_links.run_url(store, record.experiment_id, record.run_id)
    )
    return f"[`{record.run_id}`]({url})" if url else f"`{record.run_id}`"


def dataset_source(record: CellRecord) -> str:
    """Where the run's data came from, with no absolute path of the machine that ran it."""
    return portable_text(
        record.params.get("data.source") or record.params.get("data.display_name") or "n/a"
    )


def threads(record: CellRecord) -> str:
    """The torch thread count the run trained with: part of its numbers (a resume with another count is marked)."""
    started = record.params.get("threads") or record.tags.get("threads") or "n/a"
    changed = record.tags.get("threads_changed")
    return f"{started} ({changed})" if changed else started


def kernel_cell(record: CellRecord) -> str:
    """The run's kernel identity in one line, with ``kernel_changed`` when a resume ran on other kernels."""
    text = kernel_summary(recorded_identity(record.params))
    changed = record.tags.get("kernel_changed")
    return f"{text} ({FLAG} resumed on other kernels: {changed})" if changed else text


def runs_table(
    rows: list[tuple[str, int, CellRecord]], unit: str = "arm", store: str | None = None
) -> Table:
    """One row per reported cell: (arm or regime, seed, its run)."""
    # The kernels column only when a run recorded its kernel identity: reports of runs that
    # predate it keep their bytes.
    kernels = any(recorded_identity(r.params) for _, _, r in rows)
    body = []
    for name, seed, r in rows:
        body.append(
            [
                name,
                str(seed),
                run_ref(r, store),
                utc(r.start_time),
                short(r.commit, 10),
                r.dirty,
                short(code_fingerprint(r)),
                short(r.params.get("data.fingerprint")),
                short(r.params.get("data.split_fingerprint")),
                dataset_source(r),
                device(r),
                threads(r),
            ]
            + ([kernel_cell(r)] if kernels else [])
        )
    notes = [
        f"Fingerprints: first {FINGERPRINT_CHARS} hex characters of the sha256 logged by the run (params "
        "`data.fingerprint`: the examples and labels; `data.split_fingerprint`: which examples went to which "
        "split; code fingerprint: param or tag `code_fingerprint`, n/a for runs that predate it). Dirty: "
        "the checkout had uncommitted changes (tag `git_dirty`). Threads: torch's intra-op threads the run "
        "trained with (param `threads`); the count changes the order of floating-point sums, so a cell "
        "reproduces bit for bit only at its own count, and a run resumed with another count says so."
    ]
    if kernels:
        notes.append(
            "Kernels: the kernel identity the run recorded (params `kernel.*`: CPU model, ATen's CPU "
            "capability, the instruction set oneDNN dispatched to, MKL's CBWR mode, torch; on a GPU the "
            "card, CUDA and cuDNN). A re-training reproduces the cell bit for bit only where every "
            "`kernel.*` field is equal; `workbench reproduce` compares them. A run resumed on other "
            "kernels says so (tag `kernel_changed`)."
        )
    return Table(
        [
            unit,
            "seed",
            "run id",
            "started",
            "commit",
            "dirty",
            "code fingerprint",
            "data fingerprint",
            "split fingerprint",
            "dataset source",
            "device",
            "threads",
        ]
        + (["kernels"] if kernels else []),
        body,
        ["l", "r", "l", "l", "l", "l", "l", "l", "l", "l", "l", "r"] + (["l"] if kernels else []),
        notes,
        css_class="wide nowrap",
    )


def attempts_blocks(
    attempts: list[CellRecord],
    chosen: dict[tuple[str, int], CellRecord],
    unit: str = "arm",
    store: str | None = None,
) -> list[Block]:
    """Later unfinished attempts of reported cells (FAILED, KILLED, RUNNING): listed, never used."""
    if not attempts:
        return []
    rows = [
        [
            r.arm,
            str(r.seed),
            run_ref(r, store),
            r.status,
            utc(r.start_time),
            f"`{chosen[(r.arm, r.seed)].run_id}`",
        ]
        for r in attempts
    ]
    return [
        Heading(3, "Newer attempts of reported cells (not used)"),
        Table(
            [unit, "seed", "run id", "status", "started", "reported run"],
            rows,
            ["l", "r", "l", "l", "l", "l"],
            [
                f"{FLAG} These runs started after the run reported for their cell and did not finish: the reported number "
                "may be out of date (`report --strict` exits 1 while any are listed)."
            ],
        ),
    ]


@dataclass(frozen=True)
class BuildInputs:
    """What the report was built from, besides the runs: shown in its header."""

    protocol_source: str
    protocol_hash: str
    hash_option: str | None
    commit: str | None
    compare: list[tuple[str, str]]
    n_resamples: int
    bootstrap_seed: int
    confidence: float
    strict: bool
    # (a, b, c, d): (a - b) - (c - d)
    interactions: list[tuple[str, str, str, str]] = field(default_factory=list)


def header_bullets(
    inputs: BuildInputs,
    experiment: str,
    chosen_rule: str,
    logged_to: list[str],
    store: str | None = None,
    rebuilt_from: str = "",
) -> list[str]:
    """The store (default: the configured one), the experiment, the rule choosing a run per cell and
    every build option; for a report rebuilt from a published evidence export, a line saying so."""
    options = [f"--resamples {inputs.n_resamples}"]
    if inputs.hash_option:
        options.append(f"--hash {inputs.hash_option}")
    if inputs.commit:
        options.append(f"--commit {inputs.commit}")
    options += [f"--compare {a}:{b}" for a, b in inputs.compare]
    options += [f"--interaction {':'.join(quad)}" for quad in inputs.interactions]
    if inputs.strict:
        options.append("--strict")
    items = [
        f"Tracking store `{queries.tracking_uri() if store is None else store}` (credentials removed), experiment "
        f"`{experiment}`; {chosen_rule}.",
        (
            f"Built from: protocol hash `{inputs.protocol_hash}` ({inputs.protocol_source}); options "
            f"`{' '.join(options)}`; bootstrap seed {inputs.bootstrap_seed}, confidence {inputs.confidence:.0%}. "
            "Nothing else enters: rebuilding from the same runs gives the same bytes."
        ),
    ]
    if logged_to:
        items.append(
            f"This report is logged as an artifact (`report/`) of run(s) {', '.join(f'`{r}`' for r in logged_to)}."
        )
    if rebuilt_from:
        logged = "; the copy logged to that run is the store build's" if logged_to else ""
        items.append(
            f"{REBUILT_PREFIX} `{rebuilt_from}` (the runs' records and per-example predictions), without "
            f"the MLflow store: the store, runs and options above are the ones the export recorded{logged}."
        )
    return items


def provenance_blocks(
    rows: list[tuple[str, int, CellRecord]],
    attempts: list[CellRecord],
    chosen: dict[tuple[str, int], CellRecord],
    unit: str,
    store: str | None = None,
) -> list[Block]:
    return [
        Heading(2, "Runs"),
        Para(f"Every number above comes from these MLflow runs (one per {unit} and seed)."),
        runs_table(rows, unit, store),
    ] + attempts_blocks(attempts, chosen, unit, store)


def stale_items(attempts: list[CellRecord], missing: list[str]) -> list[str]:
    """What `--strict` refuses: missing cells and reported cells with a newer unfinished attempt."""
    return [f"missing cell {m}" for m in missing] + [
        f"stale: {r.arm}/seed{r.seed} has a newer {r.status} run {r.run_id}" for r in attempts
    ]
