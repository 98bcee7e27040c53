"""What each kind of run logs to MLflow, and how it is found again.

``training_runs`` (every trained cell: keyed runs, per-epoch metrics, checkpoints, the logged
model; ``dataset_inputs`` names where its data came from), ``transfer_runs``,
``intervention_runs``, ``sweep_runs`` (a sweep's parent), ``equivalence_runs``,
``benchmark_runs`` and ``figure_runs`` (the analysis figures of finished cells).
"""
