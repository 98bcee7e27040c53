"""What a report says, computed as pure functions: wording, rounding, tables, figures.

The report renderer (the rest of ``reports/``) calls these; nothing here reads MLflow or
writes files. Modules: ``rounding`` (displayed values a reader can recompute), ``wording``
(the results paragraph), ``intervention_wording`` (an intervention's effect in the same
careful words), ``predictions`` (degenerate classifiers), ``forest`` (the forest plot),
``config_table`` (rows from the hashed protocol), ``comparison`` (all of one comparison's
content in one call), ``interaction`` (the same for one difference of differences
(a - b) - (c - d)), ``data_size`` (the data-size reading). The numbers they state come from
``workbench.stats`` and ``workbench.estimates``; the models' costs from ``workbench.bench.cost``.
Import the module you need: this package imports nothing on its own.
"""
