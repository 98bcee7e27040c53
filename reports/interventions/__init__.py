"""The intervention report and its evidence."""
