"""Transfer studies (``workbench transfer``): linear probe, partial and full fine-tuning from one source."""
