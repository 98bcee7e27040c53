"""``studies.cli`` with every training batch delayed by ``PACE_SECONDS`` (a test helper, never shipped).

The takeover tests stop a worker in the middle of an epoch, seen by its progress bar. On a fast
machine a tiny cell's epoch (29 steps) takes about 0.1 s, shorter than the bar's refresh and the
test's poll, so "mid-epoch" is never seen. A sleep before each batch makes an epoch last
29 x PACE_SECONDS on any machine without touching a number the cell computes (sleeping changes no
bits: the cell must still equal the uninterrupted reference exactly).
Run as ``python tests/paced_cli.py <workbench arguments>``.
"""

from __future__ import annotations

import os
import time

from studies.cli import main
from workbench.data.batches import TensorLoader

PACE = float(os.environ.get("PACE_SECONDS", "0.1"))
_iter_epoch = TensorLoader.iter_epoch


def _paced(self, epoch: int, start_batch: int = 0):
    for batch in _iter_epoch(self, epoch, start_batch):
        time.sleep(PACE)
        yield batch


TensorLoader.iter_epoch = _paced

if __name__ == "__main__":
    main()
