"""The run logger inside a flow or task run; a plain logger when a task is called via ``.fn()``.
Either way, the handlers behind it hide secrets (``megatrain.observe.redact``)."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from megatrain.observe import redact


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    redact.install()  # Prefect makes its handlers when a run starts: filter them here, once each
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("megatrain.tasks")
