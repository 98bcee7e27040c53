"""Intervention studies: heads, branches and patches of trained cells."""
