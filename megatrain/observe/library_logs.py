"""Other libraries' log records to a file, so the console keeps megatrain's own lines.

A Dask cluster logs every scheduler, nanny, worker and connection event at INFO (206 of 251
console lines when a campaign shards on Dask), and a cluster closing logs a ``CommClosedError``
traceback that is no fault of the run. Their records reach the console through the root
logger's handlers (Prefect's console handler is one), so ``to_file`` takes the named loggers
off the root for as long as the block runs: every record is written to ``path``, nothing is
lost, and warnings still show in the file with their time and origin.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What a sharding cluster brings: Dask's distributed, the web stack of its dashboard, and
# prefect-dask's cluster lines (its start, the dashboard's address).
DASK_LOGGERS = ("distributed", "bokeh", "tornado", "prefect.task_runner.dask")


@contextmanager
def to_file(path: str | Path, names: tuple[str, ...] = DASK_LOGGERS) -> Iterator[Path]:
    """Inside the block, the loggers ``names`` (and their children) write to ``path`` only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, list(logger.handlers)))
        # distributed adds a stderr handler of its own (its config's "logging" section): off too
        for own in list(logger.handlers):
            if isinstance(own, logging.StreamHandler) and not isinstance(own, logging.FileHandler):
                logger.removeHandler(own)
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield path
    finally:
        for logger, propagate, handlers in saved:
            logger.removeHandler(handler)
            for own in handlers:
                if own not in logger.handlers:
                    logger.addHandler(own)
            logger.propagate = propagate
        handler.close()
