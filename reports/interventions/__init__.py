"""The intervention report: ``intervention_study`` (what it reads), ``intervention_report`` (tables,
figures, the files) and ``intervention_evidence`` (the published evidence, and the study read back)."""
