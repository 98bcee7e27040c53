"""The calibration section of a report: ECE, NLL, Brier before and after temperature scaling, from saved predictions."""
