"""Figures of an attribution study (``workbench.analysis`` holds its dozen modules already)."""
