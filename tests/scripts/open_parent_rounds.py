"""One side of a concurrent start: open and close a study's parent at the moment the other side does.

Usage: open_parent_rounds.py FOLDER ROUNDS. Round k uses FOLDER/round<k> (its mlflow.db,
brand new or prepared by the test, and rec.yaml). Both sides meet before each round: each
writes ready-<pid> there, waits for the other's file, and starts 0.3 s after the later of
the two (both compute the same instant, however differently they drifted). Prints one
JSON line per round: the parent run id and status, or the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

SIDES = 2


def meet(here: Path) -> None:
    (here / f"ready-{os.getpid()}").touch()
    deadline = time.time() + 300
    while len(ready := list(here.glob("ready-*"))) < SIDES:
        if time.time() > deadline:
            raise TimeoutError(f"{here}: the other side never came")
        time.sleep(0.01)
    start_at = max(p.stat().st_mtime for p in ready) + 0.3
    time.sleep(max(0.0, start_at - time.time()))


def main() -> int:
    folder, rounds = Path(sys.argv[1]), int(sys.argv[2])
    from studies.ablation.ablate import open_protocol
    from tracking.record.protocol_runs import close_study_parent, open_study_parent

    failed = 0
    for k in range(rounds):
        here = folder / f"round{k}"
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{here / 'mlflow.db'}"
        try:
            meet(here)
            # the store's first use
            protocol = open_protocol(str(here / "rec.yaml"), allow_dirty=True)
            parent = open_study_parent(
                protocol, here / "rec.yaml", allow_dirty=True, log=lambda _: None
            )
            status = close_study_parent(parent, "completed")
            print(json.dumps({"round": k, "parent": parent.run_id, "status": status}), flush=True)
        except BaseException as err:  # noqa: BLE001 - reported to the test, which fails on it
            failed += 1
            print(
                json.dumps(
                    {
                        "round": k,
                        "error": f"{type(err).__name__}: {err}"[:300],
                        "trace": traceback.format_exc()[-1500:],
                    }
                ),
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
