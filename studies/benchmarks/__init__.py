"""Speed: the ViT against timm, the loader, --jobs layouts, the recipe, calibration."""
