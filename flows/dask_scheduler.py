"""The Dask engine's client side: a scheduler that is not there, or goes away, is named in one line.

With ``data.dask_address`` the shard-corpus flow runs its tasks on a scheduler of its own (a
separate process, maybe another host). When that scheduler was killed in the middle of sharding,
the flow's task calls came back with no result at all: the flow returned ``None`` for the corpus
(0.9 s after the kill, measured), and the campaign failed later, far from the cause, with
``TypeError: 'NoneType' object is not a mapping``. ``scheduler_named`` wraps a flow run on the
cluster:

- before it, the scheduler must answer within ``PROBE_DEADLINE_S`` (a bounded wait, shown as
  such: ``megatrain/waits.py``), else one line names its address;
- after it, every corpus must have its summary; where one has none, or the run raised, the
  scheduler is asked again, and one that does not answer is the error: ``DaskSchedulerLost``,
  a ConnectionError, so the tasks' retry policy (``tasks/_retry.py``) treats it as transient.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

from megatrain.waits import bounded, waiting

PROBE_DEADLINE_S = 10.0  # a scheduler answers its identity in milliseconds


class DaskSchedulerLost(ConnectionError):
    """The Dask scheduler at ``data.dask_address`` does not answer (killed, stopped, unreachable)."""


def _answers(address: str, deadline_s: float) -> str | None:
    """None when the scheduler at ``address`` answers within the deadline, else why not."""
    from urllib.parse import urlsplit

    from distributed import Client

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    with waiting("Dask scheduler", address, deadline_s) as wait:
        try:  # a port nobody listens on says so at once (the client would retry until its timeout)
            socket.create_connection((parts.hostname, parts.port), timeout=wait.remaining()).close()
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            def ask() -> None:
                with Client(address, timeout=deadline_s, set_as_default=False) as client:
                    client.scheduler_info()
            bounded(ask, wait)
        except Exception as exc:  # noqa: BLE001  (every way of not answering is the answer)
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"
    return None


@contextlib.contextmanager
def scheduler_named(address: str | None, what: str) -> Iterator[Callable[[Any], Any]]:
    """Run ``what`` (e.g. "sharding 2 corpora") on the cluster at ``address`` (None: a LocalCluster
    of this process, which cannot go away alone); yields ``check(results)``, which returns the
    results when every one is a summary and raises the named error otherwise."""
    if address:
        problem = _answers(address, PROBE_DEADLINE_S)
        if problem is not None:
            raise DaskSchedulerLost(f"data.dask_address: the Dask scheduler at {address} does not answer ({problem}); "
                                    f"start it, or set data.engine=local")

    def check(results: Any) -> Any:
        summaries = results if isinstance(results, list) else [results]
        if all(isinstance(s, dict) for s in summaries):
            return results
        missing = sum(not isinstance(s, dict) for s in summaries)
        lost = _answers(address, PROBE_DEADLINE_S) if address else None
        if lost is not None:
            raise DaskSchedulerLost(f"the Dask scheduler at {address} stopped answering while {what} ({lost}): "
                                    f"{missing} of {len(summaries)} corpora have no index; finished units are kept, "
                                    f"a rerun shards only the rest")
        raise RuntimeError(f"{what} on Dask{' at ' + address if address else ''}: {missing} of {len(summaries)} "
                           "corpora came back without an index (see the shard-unit task runs)")

    try:
        yield check
    except DaskSchedulerLost:
        raise
    except Exception as exc:
        lost = _answers(address, PROBE_DEADLINE_S) if address else None
        if lost is not None:
            raise DaskSchedulerLost(f"the Dask scheduler at {address} stopped answering while {what} ({lost}); "
                                    f"{type(exc).__name__} in the flow") from exc
        raise
