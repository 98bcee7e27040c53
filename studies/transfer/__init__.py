"""Transfer studies: linear probe, partial and full fine-tuning from one source."""
