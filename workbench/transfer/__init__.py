"""Transfer studies: adapt a pretrained ViT to a new task by three regimes, select on validation QWK.

- the protocol schema (source, dataset, regimes × seeds) is ``workbench.protocol.transfer``, beside the
  ablation schema (``protocol`` here is an alias kept for old imports).
- ``source``: load the source (timm through the strict mapping, or a workbench checkpoint), its
  normalisation and provenance; give it a new seeded head.
- ``features``: frozen-backbone features computed once (pooled features, tokens before block k).
- ``regimes``: freezing, layer-wise lr decay, training on cached features, the QWK-selecting Trainer.
- ``runner``: one cell's selection on validation, then its single test evaluation behind a guard.
- ``evaluate``: QWK, accuracy, macro-F1, per-class recall, bootstrap CIs, file/memory agreement.
- ``report``: the report's numbers (DataFrames, confusion counts) from the cells' test predictions;
  ``reports.transfer`` renders them.

Like all of ``workbench``, nothing here imports MLflow (``tracking.kinds.transfer_runs`` does the logging).
"""
