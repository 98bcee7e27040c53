"""One `workbench ablate` execution that meets the other side of its pair at the moments that matter.

Usage: ablate_together.py FOLDER SIDES -- ARGS... (ARGS: the `workbench` command line, e.g.
`ablate --protocol p.yaml ...`). It imports the CLI first (seconds, and not the same
seconds for both sides). Then the sides meet three times: before the command starts,
right before it opens the study's parent, and right before it opens its first cell's run.
At each meeting a side writes FOLDER/ready-<stage>-<pid>, waits until SIDES such files
exist and goes on 0.3 s after the later of them, so the executions reach the same step
within a few milliseconds, not one after the other because one of them prepared its data
or found the parent a little faster. Everything else is the real command. It prints
`met <stage> <unix time>` at each meeting and exits with the command's exit status.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def meet(here: Path, sides: int, stage: str) -> None:
    (here / f"ready-{stage}-{os.getpid()}").touch()
    deadline = time.time() + 180
    while len(ready := list(here.glob(f"ready-{stage}-*"))) < sides:
        if time.time() > deadline:
            raise TimeoutError(f"{here}: the other side never reached {stage}")
        time.sleep(0.01)
    start_at = max(p.stat().st_mtime for p in ready) + 0.3
    time.sleep(max(0.0, start_at - time.time()))
    print(f"met {stage} {time.time():.3f}", flush=True)


def meeting_first(fn, here: Path, sides: int, stage: str):
    """``fn`` that meets the other side before its first call."""
    met = []

    def wrapper(*args, **kwargs):
        if not met:
            met.append(True)
            meet(here, sides, stage)
        return fn(*args, **kwargs)

    return wrapper


def main() -> int:
    folder, sides, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :]
    from studies.ablation import train
    from studies.cli import main as workbench
    from studies.runtime import study_execution  # held_parent opens the study's parent from here

    study_execution.open_study_parent = meeting_first(
        study_execution.open_study_parent, folder, sides, "parent"
    )
    train.open_leased_run = meeting_first(train.open_leased_run, folder, sides, "cell")
    meet(folder, sides, "start")
    try:
        workbench.main(args=args, prog_name="workbench", standalone_mode=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
