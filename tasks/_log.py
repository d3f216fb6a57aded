"""The run logger inside a flow or task run; a plain logger when a task is called via ``.fn()``."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("megatrain.tasks")
