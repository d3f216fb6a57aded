"""Prefect artifacts, created with every secret hidden (``megatrain.observe.redact``).

The tasks make artifacts through these two functions, never through ``prefect.artifacts``
directly: an artifact is readable by anyone who can read the Prefect API, and it is kept.
"""

from __future__ import annotations

from typing import Any

from prefect import artifacts

from megatrain.observe.redact import redact, redact_mapping


def create_markdown_artifact(markdown: str, *, description: str | None = None, **options: Any):
    return artifacts.create_markdown_artifact(redact(markdown), description=_hidden(description), **options)


def create_table_artifact(table: Any, *, description: str | None = None, **options: Any):
    return artifacts.create_table_artifact(redact_mapping(table), description=_hidden(description), **options)


def _hidden(text: str | None) -> str | None:
    return redact(text) if text is not None else None
