"""Ablation studies: ablate, train, --jobs, workers, the cell queue, status and sweeps."""
