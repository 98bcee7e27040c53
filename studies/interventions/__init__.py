"""Intervention studies (``workbench intervene``): heads, branches, positions and patches of trained cells."""
