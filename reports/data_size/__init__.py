"""The Data size section of an ablation report: accuracy against the training-set size N per family of arms."""
