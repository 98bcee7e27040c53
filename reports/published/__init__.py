"""Published results checked against their evidence: the claims file and its computations."""
