"""Parallel layout, process groups, and the ways a model is spread over ranks."""
