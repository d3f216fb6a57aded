"""Prefect flows: the pretraining lifecycle, each a short table of contents of task calls."""
