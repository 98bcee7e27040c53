"""Full-state training checkpoints: atomic writes, weights-only loads, RNG capture.

A checkpoint holds everything needed to continue a run as if it had never stopped:
model, optimizer, scheduler and scaler states, the position (epoch, batch within the
epoch, global step), the partial sums of the current epoch's metrics, the metric
history, early-stopping state, and the Python / NumPy / torch / CUDA RNG states. It is
a plain structure of tensors, numbers and strings, so it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.atomic import atomic_write

FORMAT = "glassbox-train-checkpoint-v1"


class CheckpointCorrupted(RuntimeError):
    """A checkpoint file exists but cannot be read back."""


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through ``workbench.atomic.atomic_write``: the old file or the new, never half."""
    atomic_write(path, lambda f: torch.save(obj, f))


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint written by ``atomic_torch_save`` (weights only, no code execution)."""
    try:
        state = torch.load(Path(path), map_location=map_location, weights_only=True)
    except Exception as err:  # pickle, zip and EOF errors all mean the same here
        raise CheckpointCorrupted(f"cannot read checkpoint {path}: {err}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointCorrupted(f"{path} is not a {FORMAT} checkpoint")
    return state


def capture_rng() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy arrays are not weights-only-loadable: store the key vector as a tensor
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
