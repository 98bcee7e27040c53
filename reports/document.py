"""The report's content: sections of tables, notes and figures built from a ``StudyData``.

Every number names where it came from: per-seed values are metrics of the runs in the Runs
table (one per arm and seed), the methods are stated under each table, and cells the
protocol expects without a finished run are flagged wherever they would have counted.
"""

from __future__ import annotations

import math

from reports import figures, provenance, tables
from reports.collect import StudyData, labels_and_predictions
from reports.provenance import BuildInputs
from reports.common.convergence import convergence_blocks
from reports.render import Block, Bullets, Figure, Heading, Para, Table
from reports.tables import ArmSummary
from workbench.code_history import current_name
from workbench.estimates import mean_interval
from workbench.text.portable import portable_text
from reports.content.predictions import DegenerateReport, degenerate_predictions
from reports.content.rounding import fmt

SPLIT_TITLES = {"val": "Validation", "test": "Test"}
SPLIT_SOURCES = {
    "val": "metric `best_val_accuracy`: validation accuracy of the best-validation checkpoint",
    "test": "metric `test_accuracy`: the best-validation checkpoint evaluated once on the test split",
}
FLAG = "⚠"


def pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.2f}"


def class_names(study: StudyData) -> list[str]:
    """Dataset class names when the dataset has a fixed list of K classes, else the indices."""
    k, dataset = study.num_classes, None
    for cell in study.cells.values():
        dataset = cell.record.params.get("data.name")
        break
    names: tuple[str, ...] = ()
    if dataset == "fashion_mnist":
        from workbench.data.fashion_mnist import CLASS_NAMES as names
    elif dataset == "cifar10":
        from workbench.data.cifar10 import CLASS_NAMES as names
    return (
        [f"{i} {names[i]}" for i in range(k)]
        if len(names) == k
        else [f"class {i}" for i in range(k)]
    )


def arm_label(study: StudyData, arm: str) -> str:
    return f"{arm} (reference)" if arm == study.spec.reference else arm


def n_label(n: int, expected: int) -> str:
    return f"{n} of {expected}" + ("" if n == expected else f" {FLAG}")


# ----------------------------------------------------------------------------- sections


def header(
    study: StudyData, inputs: BuildInputs, logged_to: list[str], conflicts: list[str]
) -> list[Block]:
    spec = study.spec
    expected = len(spec.arms) * len(spec.seeds)
    chosen = "one run per cell: its newest finished run (latest end time)"
    if study.commit_filter:
        chosen = f"one run per cell: its newest finished run at code commit `{study.commit_filter}`"
    blocks: list[Block] = [
        Heading(1, f"Report: {spec.name}@{spec.short_hash}"),
        Para(
            spec.description
            + (
                f" {FLAG} (the description contradicts the hashed protocol: see Warnings)"
                if conflicts
                else ""
            )
        ),
        Bullets(
            [
                f"Protocol `{spec.name}`, hash `{spec.hash}` (from {spec.source}).",
                (
                    f"Arms: {', '.join(arm_label(study, a) for a in spec.arms)}; seeds: {', '.join(map(str, spec.seeds))} "
                    f"(paired by seed); splits reported: {', '.join(SPLIT_TITLES[s].lower() for s in spec.splits)}."
                ),
                *provenance.header_bullets(
                    inputs, spec.name, chosen, logged_to, study.tracking_uri, study.rebuilt_from
                ),
                f"Cells with a finished run: **{len(study.cells)} of {expected}**"
                + (
                    "."
                    if len(study.cells) == expected
                    else f" {FLAG} missing cells are listed under Runs; every mean states its n."
                ),
                (
                    "Accuracies in %, differences in percentage points (a − b); every interval is 95%; the configuration "
                    "below is rendered from the hashed protocol."
                ),
            ]
        ),
    ]
    warnings = warning_items(study, conflicts)
    if warnings:
        blocks += [Heading(2, "Warnings"), Bullets([f"{FLAG} {w}" for w in warnings])]
    return blocks


def warning_items(study: StudyData, conflicts: list[str] = ()) -> list[str]:
    out = [f"the description contradicts the hashed protocol: {c}" for c in conflicts]
    for h, n in study.other_hashes.items():
        out.append(
            f"runs with another hash of `{study.spec.name}` exist and are not used: `{h[:12]}` ({n} cell runs); "
            f"report them with `--hash {h[:12]}`"
        )
    if study.missing:
        out.append(
            f"{len(study.missing)} expected cell(s) have no finished run: "
            + ", ".join(f"{a}/seed{s}" for a, s, _ in study.missing)
            + " (see Missing cells)"
        )
    chosen = [c.record for c in study.cells.values()]
    for key, what in (
        ("data.fingerprint", "data fingerprints"),
        ("data.split_fingerprint", "split fingerprints"),
    ):
        values = sorted({r.params.get(key, "?") for r in chosen})
        if len(values) > 1:
            out.append(
                f"the runs used {len(values)} different {what} ({', '.join(v[:12] for v in values)}): "
                "seeds may not be paired on identical data"
            )
    commits = sorted({r.commit for r in chosen})
    code = {
        current_name(r.params.get("code_fingerprint") or r.tags.get("code_fingerprint"))
        for r in chosen
    }
    if len(commits) > 1 and (len(code) > 1 or None in code):
        out.append(
            f"the chosen runs come from {len(commits)} code commits ({', '.join(c[:10] for c in commits)}); "
            "pass `--commit` to report one"
        )
    dirty = sorted(f"{r.arm}/seed{r.seed}" for r in chosen if r.dirty != "false")
    if dirty:
        out.append(
            f"{len(dirty)} run(s) came from a checkout with uncommitted changes (git_dirty): {', '.join(dirty)}"
        )
    failed_proof = sorted(
        f"{r.arm}/seed{r.seed}" for r in chosen if r.metrics.get("reload_proof_passed", 1.0) != 1.0
    )
    if failed_proof:
        out.append(f"reload proof not passed: {', '.join(failed_proof)}")
    out += tables.consistency_problems(study)
    for r in study.unexpected:
        out.append(
            f"run {r.run_id} has arm {r.arm!r} / seed {r.seed}, which the protocol does not list; not used"
        )
    for r in study.attempts:
        out.append(
            f"{r.arm}/seed{r.seed} has a newer {r.status} run {r.run_id} (started {provenance.utc(r.start_time)}); "
            "the report uses the older finished run (see Runs)"
        )
    out += degenerate_warnings(study)
    return out


def accuracy_section(
    study: StudyData, summaries: dict[str, list[ArmSummary]], decimals: dict[str, int]
) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Accuracy")]
    seeds = study.spec.seeds
    for split, rows in summaries.items():
        d = decimals[split]
        epochs = {arm: tables.best_epochs(study, arm) for arm in study.spec.arms}
        body = []
        for s in rows:
            per_seed = [fmt(100 * s.values[x], d) if x in s.values else "missing" for x in seeds]
            best = " / ".join(
                "–" if x not in epochs[s.arm] else str(epochs[s.arm][x] or "n/a") for x in seeds
            )
            ci = "n/a"
            if s.values:
                mi = mean_interval(s.values, tables.CONFIDENCE)
                ci = (
                    f"[{fmt(100 * mi.low, 2)}, {fmt(100 * mi.high, 2)}]"
                    if not mi.note
                    else f"n/a ({mi.note})"
                    if mi.n < 2
                    else f"[{fmt(100 * mi.low, 2)}, {fmt(100 * mi.high, 2)}] {FLAG}"
                )
            body.append(
                [
                    arm_label(study, s.arm),
                    n_label(s.n, len(seeds)),
                    pct(s.mean),
                    ci,
                    pct(s.std),
                    *per_seed,
                    best,
                ]
            )
        exact = all(
            abs(float(fmt(100 * v, d)) - 100 * v) < 1e-9 for s in rows for v in s.values.values()
        )
        notes = [
            f"Each value: {SPLIT_SOURCES[split]}, of the run listed for that arm and seed under Runs; shown with "
            f"{d} decimals ({'every value exactly' if exact else 'rounded half away from zero'}).",
            (
                "mean, its 95% Student-t interval over seeds (df = n − 1; not clipped to 0–100) and sample std (n − 1) "
                f"over the arm's finished seeds; std and interval are n/a for one seed. Best epoch per seed in seed "
                f"order ({', '.join(map(str, seeds))})."
            ),
        ]
        notes += [
            f"{FLAG} {s.arm}: all seeds give the same value: a zero-width interval is no spread, not certainty"
            for s in rows
            if s.n > 1 and s.std == 0
        ]
        notes += [
            f"{FLAG} {s.arm}: mean over {s.n} of {len(seeds)} seeds; missing seed(s) "
            f"{', '.join(map(str, s.missing_seeds))}"
            for s in rows
            if s.missing_seeds
        ]
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(
                [
                    "arm",
                    "n seeds",
                    "mean",
                    "95% t-interval",
                    "std",
                    *[f"seed {x}" for x in seeds],
                    "best epoch",
                ],
                body,
                ["l", "r", "r", "r", "r", *["r"] * len(seeds), "r"],
                notes,
            ),
            Figure(
                f"seeds_{split}.png",
                f"{SPLIT_TITLES[split]} accuracy of every seed in every arm; a line joins one "
                "seed's runs, the black bar is the arm's mean.",
                figures.paired_seeds(study, split, {s.arm: s.values for s in rows}),
            ),
        ]
    return blocks


def degenerate(study: StudyData, split: str) -> DegenerateReport | None:
    """Predicted-class counts of every reported run on ``split`` and the classes each never predicts."""
    runs = {
        f"{arm}/seed{seed}": labels_and_predictions(study.cells[(arm, seed)], split)
        for seed in study.spec.seeds
        for arm in study.spec.arms
        if (arm, seed) in study.cells and split in study.cells[(arm, seed)].predictions
    }
    if not runs or not study.num_classes:
        return None
    return degenerate_predictions(runs, study.num_classes, class_names(study))


def degenerate_warnings(study: StudyData) -> list[str]:
    out = []
    for split in study.spec.splits:
        report = degenerate(study, split)
        out += [f"{SPLIT_TITLES[split].lower()}: {w}" for w in (report.warnings if report else [])]
    return out


def per_class_section(study: StudyData) -> list[Block]:
    names = class_names(study)
    blocks: list[Block] = [Heading(2, "Per-class accuracy")]
    for split in study.spec.splits:
        pcs = [
            pc for arm in study.spec.arms if (pc := tables.per_class(study, arm, split)) is not None
        ]
        if not pcs:
            continue
        report = degenerate(study, split)
        rows, flagged = [], []
        for k, name in enumerate(names):
            cells = []
            for pc in pcs:
                col = pc.recall[:, k]
                sd = (
                    f" ± {100 * col.std(ddof=1):.2f}"
                    if col.size > 1 and math.isfinite(col.std(ddof=1))
                    else ""
                )
                warn = (
                    report.warning_for(k, [f"{pc.arm}/seed{s}" for s in pc.seeds])
                    if report
                    else None
                )
                if warn:
                    flagged.append(f"{FLAG} {pc.arm}, {warn}.")
                cells.append(pct(float(col.mean())) + sd + (f" {FLAG}" if warn else ""))
            rows.append([name, *cells])
        notes = [
            f"Accuracy on the examples of each true class (recall), in %, from predictions/{split}.csv of each "
            "arm's runs: mean ± sample std over "
            + ", ".join(f"{pc.arm} n = {len(pc.seeds)}" for pc in pcs)
            + "."
        ]
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(
                ["class", *[arm_label(study, pc.arm) for pc in pcs]],
                rows,
                ["l", *["r"] * len(pcs)],
                notes + flagged,
            ),
        ]
        if report is not None:
            never = [
                ", ".join(names[c] for c in report.never_predicted[run]) or "–"
                for run in report.counts
            ]
            blocks.append(
                Table(
                    ["run", *names, "never predicts"],
                    [
                        [run, *map(str, counts), nv]
                        for (run, counts), nv in zip(report.counts.items(), never)
                    ],
                    ["l", *["r"] * len(names), "l"],
                    [
                        f"How often each run predicts each class on {SPLIT_TITLES[split].lower()} (counts of "
                        "`predicted` in its predictions file). A class a run never predicts has recall 0 by "
                        "construction, not by measurement."
                    ]
                    + [f"{FLAG} {w}." for w in report.warnings],
                    css_class="wide",
                )
            )
        blocks.append(
            Figure(
                f"confusion_{split}.png",
                f"{SPLIT_TITLES[split]} confusion matrices: counts summed over "
                "each arm's seeds, colour = share of the true class (row).",
                figures.confusion(pcs, names, split),
            )
        )
    return blocks


def curves_section(study: StudyData) -> list[Block]:
    if not study.cells:
        return []
    return [
        Heading(2, "Training curves"),
        Figure(
            "curves.png",
            "Per-epoch metrics logged by each run (MLflow metric history, step = epoch): mean "
            "over the arm's seeds, band from the lowest to the highest seed. Runs stopped early end sooner; "
            "later epochs average the seeds that reached them.",
            figures.curves(study),
        ),
    ] + convergence_blocks(
        {key: cell.curves.get("val_accuracy", {}) for key, cell in study.cells.items()},
        list(study.spec.arms),
    )


def runs_section(study: StudyData) -> list[Block]:
    spec = study.spec
    rows = [
        (arm, seed, study.cells[(arm, seed)].record)
        for seed in spec.seeds
        for arm in spec.arms
        if (arm, seed) in study.cells
    ]
    chosen = {k: c.record for k, c in study.cells.items()}
    blocks = provenance.provenance_blocks(rows, study.attempts, chosen, "arm", study.tracking_uri)
    if study.superseded:
        chosen = {k: c.record.run_id for k, c in study.cells.items()}
        blocks += [
            Heading(3, "Superseded runs (not used)"),
            Table(
                ["arm", "seed", "run id", "commit", "used instead"],
                [
                    [
                        r.arm,
                        str(r.seed),
                        provenance.run_ref(r, study.tracking_uri),
                        f"`{r.commit[:10]}`",
                        f"`{chosen[(r.arm, r.seed)]}`",
                    ]
                    for r in study.superseded
                ],
                ["l", "r", "l", "l", "l"],
            ),
        ]
    if study.missing:
        blocks += [
            Heading(3, "Missing cells"),
            Table(
                ["arm", "seed", "status"],
                [[a, str(s), why] for a, s, why in study.missing],
                ["l", "r", "l"],
                [
                    (
                        f"{FLAG} These cells are expected by the protocol but have no finished run: they are left out of every "
                        "mean and comparison above, whose n says so. Rerun the protocol to fill them."
                    )
                ],
            ),
        ]
    if study.other_hashes:
        blocks += [
            Heading(3, "Other hashes of this protocol name (not used)"),
            Table(
                ["hash", "cell runs"],
                [[f"`{h}`", str(n)] for h, n in study.other_hashes.items()],
                ["l", "r"],
            ),
        ]
    return blocks


def analysis_section(found: list) -> list[Block]:
    """The figures `workbench figures` logged on the protocol's parent run, when it was run."""
    if not found:
        return []
    blocks = [
        Heading(2, "Analysis figures"),
        Para(
            f"Built by `workbench figures` from these runs' checkpoints and predictions and logged on parent run "
            f"`{found[0].run_id}` (artifacts `figures/`). Attention maps are diagnostics, not explanations."
        ),
    ]
    return blocks + [
        Figure(f"analysis_{f.filename}", portable_text(f.caption), f.png) for f in found
    ]
