"""Leaving a large Python process without its teardown.

A normal exit does two kinds of work. The first can be observed: non-daemon threads are joined,
the threading exit hooks run (Prefect drains its log and event queues there), the ``atexit``
handlers run (logging flushes, launchers kill what they started) and the streams are flushed. The
second cannot: the interpreter frees every module and object one by one. With torch, DeepSpeed and
Prefect imported, that second part is seconds of CPU and nothing else: 2.7 s after a Ctrl-C'd
campaign on an idle 2-core machine (strace: a few munmap calls, no wait), enough on a busy one
to take a command-line Ctrl-C past its 15 s bound. ``exit_after_handlers`` does the first part
and skips the second.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_after_handlers(code: int, join_threads: bool = True) -> NoReturn:
    """Exit with ``code`` as a normal exit would, less the interpreter's teardown.
    ``join_threads=False``: a forked child, whose threads belong to its parent's code."""
    try:
        if join_threads:
            threading._shutdown()  # what the interpreter calls first: thread exit hooks, then the joins
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
