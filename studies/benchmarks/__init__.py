"""Speed: the ViT against timm (``vit_benchmark``), the loader, ``--jobs`` layouts, the training recipe,
an intervention grid, and the per-arm calibration of a protocol before it runs."""
