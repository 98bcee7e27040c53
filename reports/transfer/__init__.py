"""The transfer report."""
