"""A preempted worker's cell: the step under way finishes, a checkpoint of it goes up, the worker exits 75.

A scheduler that takes a machine back sends SIGTERM (Kubernetes, ``scancel``, SLURM preemption)
or, ahead of a job's time limit, the signal ``sbatch --signal`` names (SIGUSR1 in
docs/remote.md, "Preemption"). A queue worker turns either into ``Preempted``
(``studies.runtime.stop_signals``); while a cell trains, it is raised at the next step boundary
(``PreemptibleTrainer``), a checkpoint of that step is written and uploaded to the cell's run
(``tracking.kinds.checkpoint_artifacts``), the run ends KILLED with its lease released, the queue
trial is handed back at once (``studies.ablation.cell_queue.hand_back``), and the worker exits
with ``PREEMPTED_EXIT``.
"""

from __future__ import annotations

from studies.runtime.stop_signals import Preempted, preemption_requested
from workbench.train.loop import Observers, Trainer, TrainingObserver

# sysexits.h EX_TEMPFAIL ("temporary failure; the user is invited to retry"): distinct from a
# failure (1), a usage error (2) and a death by signal (128 + N), so a scheduler can requeue on it
# alone: SLURM's RequeueExit=75, a Kubernetes podFailurePolicy rule onExitCodes [75] (docs/remote.md).
PREEMPTED_EXIT = 75


class _StopAtStep(TrainingObserver):
    """Raises a pending preemption at the loop's per-step check (``sync=False``: before a step starts),
    never at a write's check, so an epoch's end (validation, best weights, checkpoint) is never cut."""

    def check(self, sync: bool = False) -> None:
        stop = preemption_requested()
        if stop is not None and not sync:
            raise stop


class PreemptibleTrainer(Trainer):
    """The training loop, plus a checkpoint of the step reached when a preemption stops it mid-epoch.

    The loop itself (``workbench.train``, part of the training code's fingerprint) is not changed:
    a preemption is raised by an observer's per-step check, where the position (``pos``) is
    consistent (the last step done, the next batch not begun; batches are drawn from per-batch
    seeded generators, so fetching the next one moved no random state), and saved here as the loop
    saves its ``checkpoint_every_steps`` checkpoints, kind ``preempt``. Resuming from it is the
    loop's mid-epoch resume, bit-identical to an uninterrupted run (tests/test_train.py).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observer = Observers(self.observer, _StopAtStep())
        self.preempted_at: tuple[int, int, int] | None = None  # (epoch, batch, step) saved

    def _train_epoch(self, pos: dict) -> None:
        try:
            super()._train_epoch(pos)
        except Preempted:
            if 0 < pos["batch"] < len(self.train_loader):  # at batch 0 the epoch's checkpoint is it
                self._save(pos, kind="preempt")
                self.preempted_at = (pos["epoch"], pos["batch"], pos["step"])
            raise
