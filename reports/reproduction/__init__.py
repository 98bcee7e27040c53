"""Re-trained cells of a published study judged against its evidence (``workbench reproduce``)."""
