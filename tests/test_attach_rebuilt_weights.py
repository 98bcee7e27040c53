"""scripts/attach_rebuilt_weights.py takes a rebuilt cell only where its re-training was bitwise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "attach_rebuilt_weights", ROOT / "scripts" / "attach_rebuilt_weights.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(published, retrained, metrics=12, history=300, files=2):
    return {
        "arm": "vit",
        "seed": 0,
        "published_run": published,
        "retrained_run": retrained,
        "metrics": 12,
        "metrics_equal": metrics,
        "history_points": 300,
        "history_equal": history,
        "prediction_files": 2,
        "prediction_files_identical": files,
    }


@pytest.mark.parametrize(
    "short",
    [
        {"metrics": 8},  # the losses differ in the last bits: numerical, not bitwise
        {"history": 200},
        {"files": 0},
    ],
)
def test_a_re_training_short_of_bitwise_is_not_taken(tmp_path, short):
    doc = {
        "protocol": {"name": "fmnist_seed_recipe"},
        "cells": [_cell("a" * 32, "b" * 32, **short)],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert _script().bitwise_cells([path]) == {}


def test_a_bitwise_re_training_maps_the_published_run_to_the_rebuilt_one(tmp_path):
    doc = {"protocol": {"name": "fmnist_seed_recipe"}, "cells": [_cell("a" * 32, "b" * 32)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    found = _script().bitwise_cells([path])
    assert list(found) == ["a" * 32] and found["a" * 32][0] == "b" * 32
    assert (
        "12 of 12 metrics, 300 of 300 history points and 2 of 2 prediction files"
        in found["a" * 32][1]
    )
