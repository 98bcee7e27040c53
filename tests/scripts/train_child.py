"""Child process for the kill-and-resume tests: train the tiny config into a run folder.

Usage: train_child.py RUN_DIR [mlflow EXPERIMENT]
With "mlflow", trains through studies.ablation.train.train_one (MLFLOW_TRACKING_URI from the env).
"""

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
torch.set_num_threads(1)

from synthetic import synthetic_data, tiny_config  # noqa: E402

# WB_KILL_AT_FORWARD=N: SIGKILL this process at its N-th training forward pass, so the kill
# lands at an exact point in the middle of an epoch, after the last checkpoint (the work
# since then is lost and must be redone identically), whatever the machine's speed.
KILL_AT = int(os.environ.get("WB_KILL_AT_FORWARD", "0"))
if KILL_AT:
    from workbench.train import loop

    original_init = loop.Trainer.__init__

    def init_with_kill(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        calls = {"n": 0}

        def count(module, inputs):
            if module.training:
                calls["n"] += 1
                if calls["n"] == KILL_AT:
                    os.kill(os.getpid(), signal.SIGKILL)

        self.model.register_forward_pre_hook(count)

    loop.Trainer.__init__ = init_with_kill

run_dir = Path(sys.argv[1])
cfg = tiny_config(epochs=4, checkpoint_every_steps=3)
if os.environ.get(
    "WB_TIMM_ARM"
):  # the same run with a timm ViT arm (stochastic depth on: RNG in every step)
    from dataclasses import replace

    from synthetic import TIMM_ARM

    cfg = replace(cfg, model=TIMM_ARM)
data = synthetic_data()
if len(sys.argv) > 2 and sys.argv[2] == "mlflow":
    from studies.ablation.train import train_one

    outcome = train_one(cfg, data, experiment=sys.argv[3], output_dir=run_dir, run_name="child")
    print(outcome.status, outcome.run_id)
else:
    from workbench.train.loop import Trainer

    Trainer(cfg, data, run_dir).fit()
print("DONE")
