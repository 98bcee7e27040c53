"""A small intervention study logged straight into an MLflow store (no training), with known effects.

Three seeds of one ViT arm (depth 2, 2 heads), 40 validation images each. The intact model
gets 30 of 40 right in every seed; zero-ablating head 1 of block 0 makes 4 more wrong in
every seed (-10.00 points in each: no spread between seeds); head 0 of block 1 makes 4, 6
and 4 more wrong (-10.00 / -15.00 / -10.00); skipping the MLP of block 1 makes 8 wrong in
seeds 0 and 1, none in seed 2 (-20.00 / -20.00 / 0.00); every other intervention changes nothing.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from tracking.record.protocol_runs import end_parent_run, start_parent_run
from workbench.protocol import load_intervention_protocol

ABLATION = """\
name: tiny
description: the acted-on protocol of the logged intervention study
dataset: {name: image_folder, val_size: 40, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 2, heads: 2, mlp_hidden: 32}
run: {epochs: 1, batch_size: 8}
arms:
  - {name: vit, reference: true}
seeds: [0, 1, 2]
"""
INTERVENTION = """\
name: tiny_logged
description: every head zero-ablated and every branch skipped, logged without training
acts_on: {{protocol: tiny, hash: {hash}}}
interventions: {{heads: all, head_modes: [zero], branches: all, position_embedding: true}}
"""
N, SEEDS = 40, (0, 1, 2)
EXTRA_WRONG = {
    "blocks.0.attn.head1.zero": (4, 4, 4),
    "blocks.1.attn.head0.zero": (4, 6, 4),
    "blocks.1.mlp.skip": (8, 8, 0),
}


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def log_intervention_store(folder: Path) -> dict:
    from workbench.protocol import load_protocol

    (folder / "tiny.yaml").write_text(ABLATION)
    path = folder / "tiny_logged.yaml"
    path.write_text(INTERVENTION.format(hash=load_protocol(folder / "tiny.yaml").hash))
    protocol = load_intervention_protocol(path)
    names = [i.name for i in protocol.grid.expand(protocol.model_config("vit"))]
    client = MlflowClient()
    parent = start_parent_run(protocol, path, allow_dirty=True, extra_tags={"intervention": "true"})
    exp_id = client.get_run(parent).info.experiment_id
    labels = np.arange(N) % 3
    cells = {}
    for seed in SEEDS:
        intact = labels.copy()
        intact[:10] = (labels[:10] + 1) % 3  # 30 of 40 right
        predicted = np.tile(intact, (len(names), 1))
        for k, name in enumerate(names):
            wrong = EXTRA_WRONG.get(name, (0, 0, 0))[seed]
            predicted[k, 10 : 10 + wrong] = (labels[10 : 10 + wrong] + 1) % 3
        tags = {
            "cell": "true",
            "intervention": "true",
            "protocol_name": protocol.name,
            "protocol_hash": protocol.hash,
            "arm": "vit",
            "seed": str(seed),
            "mlflow.parentRunId": parent,
            "source_run_id": f"{seed}" * 32,
            "git_commit": "c" * 40,
            "git_dirty": "false",
            "device": "cpu",
            "threads": "2",
        }
        run_id = client.create_run(exp_id, tags=tags).info.run_id
        accuracy = {name: float((predicted[k] == labels).mean()) for k, name in enumerate(names)}
        metrics = {
            "intact_accuracy": 0.75,
            "reload_proof_passed": 1.0,
            "reload_proof_max_abs_diff": 0.0,
            "evaluation_seconds": 1.5,
            "interventions": len(names),
            "examples": N,
            **{f"accuracy/{n}": a for n, a in accuracy.items()},
        }
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()],
            params=[Param("code_fingerprint", "e" * 16), Param("data.fingerprint", "1" * 64)],
        )
        rng = np.random.default_rng(seed)
        maps = rng.random((2, 2, 2, 2)).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in (
                (
                    "per_example.npz",
                    _npz(
                        names=np.array(names),
                        labels=labels,
                        indices=np.arange(N),
                        intact_predicted=intact,
                        intact_loss=np.ones(N, np.float32),
                        predicted=predicted,
                        loss=np.ones((len(names), N), np.float32),
                        correct=predicted == labels,
                    ),
                ),
                (
                    "attention.npz",
                    _npz(
                        maps=maps / maps.sum(axis=(2, 3), keepdims=True),
                        query=np.array("the class token"),
                    ),
                ),
            ):
                (Path(tmp) / name).write_bytes(data)
                client.log_artifact(run_id, str(Path(tmp) / name), artifact_path="interventions")
        client.set_terminated(run_id, "FINISHED")
        cells[seed] = run_id
    end_parent_run(parent, {"finished": len(cells), "failed": 0})
    return {"path": path, "protocol": protocol, "names": names, "parent": parent, "cells": cells}
