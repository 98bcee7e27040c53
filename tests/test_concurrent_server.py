"""Two `workbench ablate` executions of one study started together against `workbench server start` on PostgreSQL.

Before: in 2 of 6 such pairs the same cell was trained twice (both runs FINISHED, one run
key, one run_dir); in every pair both executions logged the parent's counts at one step;
a deleted duplicate parent kept a `lease.exec.<token>` tag. Now each pair must end with one
FINISHED run per cell, trained by one execution only (tracking/record/create_once.py).

The two sides of a pair meet (tests/scripts/ablate_together.py) right before they open the
parent and right before they open their first cell, so both find nothing and create at the
same moment in most pairs, instead of one finding the other's run because it came a little
later. The run prints, per pair, how close they met and what the claim withdrew.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import Launcher, free_port, postgres_server

ROOT = Path(__file__).resolve().parent.parent
PAIRS = 10
EPOCH_METRICS = ("train_loss", "val_accuracy")
PROTOCOL = """\
name: {name}
description: one arm, two seeds, for two executions started together on a server
dataset: {{name: image_folder, val_size: 6, split_seed: 3}}
model: {{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}}
optim: {{lr: 0.003}}
run: {{epochs: 2, batch_size: 8}}
arms:
  - {{name: vit, reference: true}}
seeds: [0, 1]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`workbench server start` itself (a subprocess, no auth on loopback) on PostgreSQL."""
    root = tmp_path_factory.mktemp("pairs-server")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WORKBENCH_"))}
    with postgres_server(("mlflow",)) as pg:
        launcher = Launcher(
            [
                "--backend-store-uri",
                f"{pg}/mlflow",
                "--artifacts-destination",
                str(root / "artifacts"),
                "--port",
                str(free_port()),
                "--workers",
                "2",
                "--no-auth",
            ],
            {**env, "OMP_NUM_THREADS": "1"},
            root / "launcher.log",
        )
        launcher.start()
        try:
            yield launcher
        finally:
            launcher.stop()


def start_pair(here: Path, url: str, images: Path, out: Path) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WORKBENCH_"))}
    env.update(
        {
            "MLFLOW_TRACKING_URI": url,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_OFFLINE_DIR": str(here / "offline"),
            "WORKBENCH_CACHE_DIR": str(here.parent / "cache"),
        }
    )
    # one output folder: a cell trained twice collides
    args = [
        "ablate",
        "--protocol",
        str(here / f"{here.name}.yaml"),
        "--allow-dirty",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--data-path",
        str(images),
        "--output-dir",
        str(out),
    ]
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "scripts" / "ablate_together.py"),
        str(here),
        "2",
        "--",
        *args,
    ]
    return [
        subprocess.Popen(
            cmd, env=env, cwd=here, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]


def duplicate_steps(client: MlflowClient, run) -> dict[str, dict[int, int]]:
    found = {}
    for key in run.data.metrics:
        steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
        if max(steps.values()) > 1:
            found[key] = {s: n for s, n in steps.items() if n > 1}
    return found


def check_pair(client: MlflowClient, name: str, outputs: list[str]) -> dict:
    """What is wrong with one pair's record (empty lists: nothing), and what the claim decided."""
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], "", ViewType.ALL, max_results=1000)
    cells = [r for r in runs if r.data.tags.get("cell") == "true"]
    parents = [r for r in runs if r.data.tags.get("parent") == "true"]
    active = [r for r in parents if r.info.lifecycle_stage == "active"]
    finished = Counter(r.data.tags["run_key"] for r in cells if r.info.status == "FINISHED")
    trained = Counter(
        r.data.tags["run_key"] for r in cells if any(k in r.data.metrics for k in EPOCH_METRICS)
    )
    history = (
        client.get_metric_history(active[0].info.run_id, "cells_finished")
        if len(active) == 1
        else []
    )
    return {
        "cells finished twice": [k for k, n in finished.items() if n > 1],
        "cells not finished": 2 - len(finished),
        "cells trained by two executions": [k for k, n in trained.items() if n > 1],
        "runs left RUNNING": [
            (r.info.run_id, r.info.lifecycle_stage) for r in runs if r.info.status == "RUNNING"
        ],
        "duplicate metric steps": {
            r.info.run_id: d for r in runs if (d := duplicate_steps(client, r))
        },
        "active parents": len(active),
        "parent count points": sorted(m.step for m in history),
        "parent status": active[0].info.status if len(active) == 1 else None,
        "lease tags on deleted parents": {
            r.info.run_id: [k for k in r.data.tags if k.startswith("lease.")]
            for r in parents
            if r.info.lifecycle_stage == "deleted"
            and any(k.startswith("lease.") for k in r.data.tags)
        },
        "deleted parents": sum(r.info.lifecycle_stage == "deleted" for r in parents),
        "withdrawn cell runs": sum(r.info.lifecycle_stage == "deleted" for r in cells),
        "said at the same moment": sum(out.count("at the same moment") for out in outputs),
    }


def open_the_study_before(path: Path, url: str, monkeypatch) -> None:
    """An earlier execution that opened the study's parent and was interrupted before any cell.

    Both executions of the pair then find that parent and reopen it at the same moment, each
    writing its own lease token on it; they must share the one left there.
    """
    from studies.ablation.ablate import open_protocol
    from tracking.record.protocol_runs import close_study_parent, open_study_parent

    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    protocol = open_protocol(str(path), allow_dirty=True)
    close_study_parent(
        open_study_parent(protocol, path, allow_dirty=True, log=lambda _: None), "interrupted"
    )


@pytest.mark.slow
@pytest.mark.integration
def test_ten_pairs_of_ablate_started_together_on_a_server_train_each_cell_once(
    server, tmp_path, monkeypatch
):
    """Even pairs on a new study, odd pairs on a study whose parent exists already."""
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    images = tmp_path / "images"
    make_image_folder(images, per_class={"train": 8, "test": 3})
    client, began, report = MlflowClient(server.url), time.monotonic(), []
    for k in range(PAIRS):
        here = tmp_path / f"pair{k}"
        here.mkdir()
        (here / f"pair{k}.yaml").write_text(PROTOCOL.format(name=f"pair{k}"))
        executions = 2
        if k % 2:
            open_the_study_before(here / f"pair{k}.yaml", server.url, monkeypatch)
            executions = 3
        sides = start_pair(here, server.url, images, tmp_path / "out")
        outputs = [side.communicate(timeout=600)[0] for side in sides]
        met = {}  # stage -> the times both sides passed it
        for out in outputs:  # a progress bar may share the line
            for stage, when in re.findall(r"met (\w+) (\d+\.\d+)", out):
                met.setdefault(stage, []).append(float(when))
        codes = [side.returncode for side in sides]
        assert codes == [0, 0], f"pair {k}: exit {codes}\n" + "\n----\n".join(
            out[-3000:] for out in outputs
        )
        found = check_pair(client, f"pair{k}", outputs)
        found["gaps ms"] = {
            stage: round(1000 * (max(t) - min(t)), 1) for stage, t in met.items() if len(t) == 2
        }
        report.append(found)
        wrong = {
            what: v
            for what, v in found.items()
            if what
            in (
                "cells finished twice",
                "cells trained by two executions",
                "runs left RUNNING",
                "duplicate metric steps",
                "lease tags on deleted parents",
            )
            and v
        }
        if (
            found["cells not finished"]
            or found["active parents"] != 1
            or found["parent status"] != "FINISHED"
        ):
            wrong["parents / cells"] = (
                found["active parents"],
                found["parent status"],
                found["cells not finished"],
            )
        if found["parent count points"] != list(
            range(1, executions + 1)
        ):  # one point per execution, a step each
            wrong["parent count points"] = found["parent count points"]
        assert not wrong, f"pair {k}: {wrong}\n{json.dumps(found, indent=1)}\n" + "\n----\n".join(
            out[-4000:] for out in outputs
        )
    print(f"\n{PAIRS} pairs in {time.monotonic() - began:.0f} s:")
    for k, found in enumerate(report):
        print(
            f"  pair {k} ({'used' if k % 2 else 'new'} study): met within {found['gaps ms']} ms, "
            f"{found['deleted parents']} parent(s) and "
            f"{found['withdrawn cell runs']} cell run(s) withdrawn, 'at the same moment' said "
            f"{found['said at the same moment']} time(s)"
        )
