"""Transfer studies: adapt a pretrained ViT to a new task by three regimes, select on validation QWK.

- ``protocol``: the transfer protocol schema (source, dataset, regimes × seeds), validated and hashed.
- ``source``: load the source (timm through the strict mapping, or a workbench checkpoint), its
  normalisation and provenance; give it a new seeded head.
- ``features``: frozen-backbone features computed once (pooled features, tokens before block k).
- ``regimes``: freezing, layer-wise lr decay, training on cached features, the QWK-selecting Trainer.
- ``runner``: one cell's selection on validation, then its single test evaluation behind a guard.
- ``evaluate``: QWK, accuracy, macro-F1, per-class recall, bootstrap CIs, file/memory agreement.
- ``report``: the report section (DataFrames and Markdown) from the cells' test predictions.

Like all of ``workbench``, nothing here imports MLflow (``tracking.transfer`` does the logging).
"""
