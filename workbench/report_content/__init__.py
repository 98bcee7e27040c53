"""What a report says, computed as pure functions: numbers, wording, rounding, figures.

The report renderer (``reports/``) calls these; nothing here reads MLflow or writes files.
Modules: ``numbers`` (intervals, effect size, test resolution, Monte-Carlo error),
``rounding`` (displayed values a reader can recompute), ``wording`` (the results
paragraph), ``predictions`` (degenerate classifiers), ``forest`` (the forest plot),
``cost`` (parameters, FLOPs, throughput), ``config_table`` (rows from the hashed protocol),
``comparison`` (all of one comparison's content in one call), ``interaction`` (the same for
one difference of differences (a - b) - (c - d)).
Import the module you need: this package imports nothing on its own, so ``workbench.stats``
can use ``numbers`` without pulling in matplotlib or torch.
"""
