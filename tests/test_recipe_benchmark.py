"""The plain PyTorch loop of the recipe: the same work as the workbench's training, timed beside it."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from studies.benchmarks.recipe_benchmark import compare_cells, summary
from synthetic import synthetic_data, tiny_config
from workbench.bench.recipe import plain_fit
from workbench.train.loop import Trainer


def test_plain_loop_trains_exactly_what_the_workbench_trains(tmp_path):
    data = synthetic_data(128, 48, 30)
    cfg = tiny_config(epochs=2, evaluate_test=True, patience=1)
    plain = plain_fit(cfg, data)
    ours = Trainer(cfg, data, tmp_path).fit()
    # same seeds, same loader, same kernels: the same numbers, not merely close ones
    assert (plain.best_val_accuracy, plain.best_epoch) == (ours.best_metric, ours.best_epoch), (
        plain,
        ours.best_metric,
    )
    assert plain.test_accuracy == ours.final_metrics["test_accuracy"]
    assert plain.epochs_run == len(ours.history) and plain.seconds > 0


@pytest.mark.slow  # 12-21 s on 2 busy cores: keeps the default tier under 5 minutes (docs/testing.md)
def test_compare_cells_times_both_and_reports_the_ratio(mlflow_store, tmp_path):
    data = synthetic_data(96, 48, 20)
    cfg = tiny_config(epochs=1, evaluate_test=True)
    cells = [("vit", 0, cfg), ("vit", 1, replace(cfg, run=replace(cfg.run, seed=1)))]
    table = compare_cells(cells, data, "recipe", tmp_path / "out", say=lambda line: None)
    assert list(table["seed"]) == [0, 1]
    assert (table["plain_s"] > 0).all() and (table["workbench_s"] > 0).all()
    assert table["same_best_val_accuracy"].all(), table[
        ["plain_best_val_accuracy", "workbench_best_val_accuracy"]
    ]
    expected = table["workbench_s"] / table["plain_s"]
    assert ((table["ratio"] - expected).abs() < 1e-12).all()
    text = summary(table, "t")
    total = table["workbench_s"].sum() / table["plain_s"].sum()
    assert f"ratio {total:.3f}" in text and "goal <= 1.1" in text
    # Two cells are two rounds: the verdict is shown and says it is not resolved.
    assert "cells: workbench vs plain loop: not resolved at this noise" in text, text
    assert "cells: use: either (not resolved)" in text, text
    assert isinstance(table, pd.DataFrame) and table["run_id"].notna().all()
