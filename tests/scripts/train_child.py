"""Child process for the kill-and-resume tests: train the tiny config into a run folder.

Usage: train_child.py RUN_DIR [mlflow EXPERIMENT]
With "mlflow", trains through studies.train.train_one (MLFLOW_TRACKING_URI from the env).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
torch.set_num_threads(1)

from synthetic import synthetic_data, tiny_config  # noqa: E402

run_dir = Path(sys.argv[1])
cfg = tiny_config(epochs=4, checkpoint_every_steps=3)
data = synthetic_data()
if len(sys.argv) > 2 and sys.argv[2] == "mlflow":
    from studies.train import train_one

    outcome = train_one(cfg, data, sys.argv[3], run_dir, run_name="child")
    print(outcome.status, outcome.run_id)
else:
    from workbench.train.loop import Trainer

    Trainer(cfg, data, run_dir).fit()
print("DONE")
