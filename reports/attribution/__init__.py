"""The report of an attribution protocol: faithfulness of every method, token norms, evidence."""
