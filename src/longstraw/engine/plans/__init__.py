"""Execution plans for one group's gradient: standard (reference), detach (the paper), exact (ours)."""
