"""The report's content: sections of tables, notes and figures built from a ``StudyData``.

Every number names where it came from: per-seed values are metrics of the runs in the Runs
table (one per arm and seed), the methods are stated under each table, and cells the
protocol expects without a finished run are flagged wherever they would have counted.
"""

from __future__ import annotations

import math

from reports import figures, tables
from reports.collect import StudyData
from reports.render import Block, Bullets, Figure, Heading, Para, Table
from reports.tables import ArmSummary, Comparison

SPLIT_TITLES = {"val": "Validation", "test": "Test"}
SPLIT_SOURCES = {
    "val": "metric `best_val_accuracy`: validation accuracy of the best-validation checkpoint",
    "test": "metric `test_accuracy`: the best-validation checkpoint evaluated once on the test split",
}
FLAG = "⚠"


def pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:.2f}"


def pp(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{100 * v:+.2f}"


def interval(low: float, high: float) -> str:
    return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"[{pp(low)}, {pp(high)}]"


def p_value(p: float) -> str:
    if not math.isfinite(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


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
    return [f"{i} {names[i]}" for i in range(k)] if len(names) == k else [str(i) for i in range(k)]


def arm_label(study: StudyData, arm: str) -> str:
    return f"{arm} (reference)" if arm == study.spec.reference else arm


def n_label(n: int, expected: int) -> str:
    return f"{n} of {expected}" + ("" if n == expected else f" {FLAG}")


# ----------------------------------------------------------------------------- sections


def header(study: StudyData, n_resamples: int, logged_to: list[str]) -> list[Block]:
    spec = study.spec
    expected = len(spec.arms) * len(spec.seeds)
    chosen = "one run per cell: its newest finished run (latest end time)"
    if study.commit_filter:
        chosen = f"one run per cell: its newest finished run at code commit `{study.commit_filter}`"
    blocks: list[Block] = [
        Heading(1, f"Report: {spec.name}@{spec.short_hash}"),
        Para(spec.description),
        Bullets([
            f"Protocol `{spec.name}`, hash `{spec.hash}` (from {spec.source}).",
            (f"Arms: {', '.join(arm_label(study, a) for a in spec.arms)}; seeds: {', '.join(map(str, spec.seeds))} "
             f"(paired by seed); splits reported: {', '.join(SPLIT_TITLES[s].lower() for s in spec.splits)}."),
            f"Tracking store `{study.tracking_uri}`, experiment `{spec.name}`; {chosen}.",
            f"Cells with a finished run: **{len(study.cells)} of {expected}**" +
            ("." if len(study.cells) == expected else f" {FLAG} missing cells are listed under Runs; every mean states its n."),
            (f"Accuracies in %, differences in percentage points (a − b); bootstrap: {n_resamples} resamples, "
             f"seed {tables.BOOTSTRAP_SEED}; confidence {tables.CONFIDENCE:.0%}."),
        ] + ([f"This report is logged as an artifact (`report/`) of run(s) {', '.join(f'`{r}`' for r in logged_to)}."]
             if logged_to else [])),
    ]
    warnings = warning_items(study)
    if warnings:
        blocks += [Heading(2, "Warnings"), Bullets([f"{FLAG} {w}" for w in warnings])]
    return blocks


def warning_items(study: StudyData) -> list[str]:
    out = []
    for h, n in study.other_hashes.items():
        out.append(f"runs with another hash of `{study.spec.name}` exist and are not used: `{h[:12]}` ({n} cell runs); "
                   f"report them with `--hash {h[:12]}`")
    if study.missing:
        out.append(f"{len(study.missing)} expected cell(s) have no finished run: "
                   + ", ".join(f"{a}/seed{s}" for a, s, _ in study.missing) + " (see Missing cells)")
    chosen = [c.record for c in study.cells.values()]
    for key, what in (("data.fingerprint", "data fingerprints"), ("data.split_fingerprint", "split fingerprints")):
        values = sorted({r.params.get(key, "?") for r in chosen})
        if len(values) > 1:
            out.append(f"the runs used {len(values)} different {what} ({', '.join(v[:12] for v in values)}): "
                       "seeds may not be paired on identical data")
    commits = sorted({r.commit for r in chosen})
    if len(commits) > 1:
        out.append(f"the chosen runs come from {len(commits)} code commits ({', '.join(c[:10] for c in commits)}); "
                   "pass `--commit` to report one")
    dirty = sorted(f"{r.arm}/seed{r.seed}" for r in chosen if r.dirty != "false")
    if dirty:
        out.append(f"{len(dirty)} run(s) came from a checkout with uncommitted changes (git_dirty): {', '.join(dirty)}")
    failed_proof = sorted(f"{r.arm}/seed{r.seed}" for r in chosen if r.metrics.get("reload_proof_passed", 1.0) != 1.0)
    if failed_proof:
        out.append(f"reload proof not passed: {', '.join(failed_proof)}")
    out += tables.consistency_problems(study)
    for r in study.unexpected:
        out.append(f"run {r.run_id} has arm {r.arm!r} / seed {r.seed}, which the protocol does not list; not used")
    return out


def accuracy_section(study: StudyData, summaries: dict[str, list[ArmSummary]]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Accuracy")]
    seeds = study.spec.seeds
    for split, rows in summaries.items():
        epochs = {arm: tables.best_epochs(study, arm) for arm in study.spec.arms}
        body = []
        for s in rows:
            per_seed = [pct(s.values[x]) if x in s.values else "missing" for x in seeds]
            best = " / ".join("–" if x not in epochs[s.arm] else str(epochs[s.arm][x] or "n/a") for x in seeds)
            body.append([arm_label(study, s.arm), n_label(s.n, len(seeds)), pct(s.mean), pct(s.std), *per_seed, best])
        notes = [f"Each value: {SPLIT_SOURCES[split]}, of the run listed for that arm and seed under Runs.",
                 ("mean and sample std (n − 1) over the arm's finished seeds; std is n/a for one seed. "
                  f"Best epoch per seed in seed order ({', '.join(map(str, seeds))}).")]
        notes += [f"{FLAG} {s.arm}: mean over {s.n} of {len(seeds)} seeds; missing seed(s) "
                  f"{', '.join(map(str, s.missing_seeds))}" for s in rows if s.missing_seeds]
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(["arm", "n seeds", "mean", "std", *[f"seed {x}" for x in seeds], "best epoch"], body,
                  ["l", "r", "r", "r", *["r"] * len(seeds), "r"], notes),
            Figure(f"seeds_{split}.png", f"{SPLIT_TITLES[split]} accuracy of every seed in every arm; a line joins one "
                   "seed's runs, the black bar is the arm's mean.",
                   figures.paired_seeds(study, split, {s.arm: s.values for s in rows})),
        ]
    return blocks


def comparison_section(study: StudyData, comparisons: dict[str, list[Comparison]], n_resamples: int) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Seed-paired comparisons")]
    seeds = study.spec.seeds
    for split, comps in comparisons.items():
        body, notes = [], []
        for c in comps:
            p = c.paired
            diffs = dict(zip(p.seeds, p.differences)) if p else {}
            per_seed = [pp(diffs[x]) if x in diffs else "missing" for x in seeds]
            boot = interval(c.bootstrap.low, c.bootstrap.high) if c.bootstrap else "n/a"
            if p is None:
                row = [f"{c.a} − {c.b}", n_label(0, c.expected_n), *per_seed, "n/a", "n/a", boot, "n/a", "n/a", "n/a"]
            else:
                won = f"{p.wins} of {p.n}" + (f" ({p.ties} tied)" if p.ties else "")
                row = [f"{c.a} − {c.b}", n_label(p.n, c.expected_n), *per_seed, pp(p.mean_difference),
                       interval(p.ci_low, p.ci_high), boot, won, p_value(p.p_value), p_value(p.wilcoxon_p_value)]
                if p.note:
                    notes.append(f"{FLAG if p.n < c.expected_n else ''} {c.a} − {c.b}: {p.note}".strip())
            if c.note:
                notes.append(f"{c.a} − {c.b}: {c.note}")
            body.append(row)
        methods = [
            (f"n: seeds with finished runs of both arms, of {len(seeds)} in the protocol. Per-seed and mean "
             f"differences: {SPLIT_SOURCES[split].split(':')[0]} of a minus b, same seed (runs under Runs)."),
            (f"t-interval: {tables.CONFIDENCE:.0%} Student-t interval of the mean difference over seeds (df = n − 1). "
             "p (paired t): two-sided paired t-test over seeds (scipy.stats.ttest_rel); p (Wilcoxon): signed-rank test "
             "(scipy.stats.wilcoxon). Won: seeds where a > b."),
            (f"Bootstrap: {tables.CONFIDENCE:.0%} hierarchical paired percentile bootstrap over seeds and examples "
             f"from the saved predictions/{split}.csv files ({n_resamples} resamples, seed {tables.BOOTSTRAP_SEED}): "
             "seeds resampled with replacement, then examples within each drawn seed, the same indices for both arms. "
             "With few seeds the seed level of a bootstrap is narrow; read it beside the t-interval."),
        ]
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(["a − b", "n", *[f"seed {x}" for x in seeds], "mean", "95% t-interval", "95% bootstrap", "won",
                   "p (paired t)", "p (Wilcoxon)"], body, ["l", "r", *["r"] * len(seeds), "r", "r", "r", "r", "r", "r"],
                  methods + notes),
        ]
    return blocks


def per_class_section(study: StudyData) -> list[Block]:
    names = class_names(study)
    blocks: list[Block] = [Heading(2, "Per-class accuracy")]
    for split in study.spec.splits:
        pcs = [pc for arm in study.spec.arms if (pc := tables.per_class(study, arm, split)) is not None]
        if not pcs:
            continue
        rows = []
        for k, name in enumerate(names):
            cells = []
            for pc in pcs:
                col = pc.recall[:, k]
                sd = f" ± {100 * col.std(ddof=1):.2f}" if col.size > 1 and math.isfinite(col.std(ddof=1)) else ""
                cells.append(pct(float(col.mean())) + sd)
            rows.append([name, *cells])
        notes = [f"Accuracy on the examples of each true class (recall), in %, from predictions/{split}.csv of each "
                 "arm's runs: mean ± sample std over " + ", ".join(f"{pc.arm} n = {len(pc.seeds)}" for pc in pcs) + "."]
        blocks += [
            Heading(3, SPLIT_TITLES[split]),
            Table(["class", *[arm_label(study, pc.arm) for pc in pcs]], rows, ["l", *["r"] * len(pcs)], notes),
            Figure(f"confusion_{split}.png", f"{SPLIT_TITLES[split]} confusion matrices: counts summed over each arm's "
                   "seeds, colour = share of the true class (row).", figures.confusion(pcs, names, split)),
        ]
    return blocks


def curves_section(study: StudyData) -> list[Block]:
    if not study.cells:
        return []
    return [Heading(2, "Training curves"),
            Figure("curves.png", "Per-epoch metrics logged by each run (MLflow metric history, step = epoch): mean "
                   "over the arm's seeds, band from the lowest to the highest seed. Runs stopped early end sooner; "
                   "later epochs average the seeds that reached them.", figures.curves(study))]


def runs_section(study: StudyData) -> list[Block]:
    spec = study.spec
    rows = []
    for seed in spec.seeds:
        for arm in spec.arms:
            cell = study.cells.get((arm, seed))
            if cell is None:
                continue
            r = cell.record
            best = r.metrics.get("best_epoch")
            rows.append([arm, str(seed), f"`{r.run_id}`", f"`{r.commit[:10]}`", r.dirty,
                         "n/a" if best is None else str(int(best)), str(max(cell.curves["val_accuracy"], default=0)),
                         f"`{r.parent_run_id}`"])
    blocks: list[Block] = [
        Heading(2, "Runs"),
        Para("Every number above comes from these MLflow runs (one per arm and seed)."),
        Table(["arm", "seed", "run id", "commit", "dirty", "best epoch", "epochs", "parent run"], rows,
              ["l", "r", "l", "l", "l", "r", "r", "l"]),
    ]
    if study.superseded:
        chosen = {k: c.record.run_id for k, c in study.cells.items()}
        blocks += [Heading(3, "Superseded runs (not used)"), Table(
            ["arm", "seed", "run id", "commit", "used instead"],
            [[r.arm, str(r.seed), f"`{r.run_id}`", f"`{r.commit[:10]}`", f"`{chosen[(r.arm, r.seed)]}`"]
             for r in study.superseded], ["l", "r", "l", "l", "l"])]
    if study.missing:
        blocks += [Heading(3, "Missing cells"), Table(
            ["arm", "seed", "status"], [[a, str(s), why] for a, s, why in study.missing], ["l", "r", "l"],
            [(f"{FLAG} These cells are expected by the protocol but have no finished run: they are left out of every "
              "mean and comparison above, whose n says so. Rerun the protocol to fill them.")])]
    if study.other_hashes:
        blocks += [Heading(3, "Other hashes of this protocol name (not used)"), Table(
            ["hash", "cell runs"], [[f"`{h}`", str(n)] for h, n in study.other_hashes.items()], ["l", "r"])]
    return blocks


def analysis_section(found: list) -> list[Block]:
    """The figures `workbench figures` logged on the protocol's parent run, when it was run."""
    if not found:
        return []
    blocks = [Heading(2, "Analysis figures"),
              Para(f"Built by `workbench figures` from these runs' checkpoints and predictions and logged on parent run "
                   f"`{found[0].run_id}` (artifacts `figures/`). Attention maps are diagnostics, not explanations.")]
    return blocks + [Figure(f"analysis_{f.filename}", f.caption, f.png) for f in found]
