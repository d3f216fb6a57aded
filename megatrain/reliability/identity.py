"""Which heartbeat records belong to this run: a run id and, with the run's token, a signature.

The watcher believes a record that says a rank is alive and stepping. A record from outside the
run - another run sharing the store, a file copied into the run dir, anyone else who reaches
Redis - must not: it could hide a hang. The launcher makes a random token per run
(``megatrain.launch.run_token``) that only its ranks inherit, by environment; each record carries the run
id and an HMAC-SHA256 of its fields under that token. A reader ignores, and logs once per rank
and reason, a record of another run or one whose signature does not verify.

Without a token (a rank started by hand, a test of the watcher's rules) only the run id is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
from typing import Any, TypeVar

from megatrain.launch.run_token import RUN_TOKEN_ENV

log = logging.getLogger(__name__)

R = TypeVar("R")  # a heartbeat record (a dataclass with rank, host, pid, run_id, signature)
OPEN_PLACE = "open"  # where records of writers without a token go (a rank started by hand, tests)


class Identity:
    """Stamps this run's records and admits only those: the run id must match and, with a
    ``token``, the signature too. A record refused is logged once per rank and reason."""

    def __init__(self, run_id: str, token: str | None) -> None:
        self.run_id, self._key = run_id, token.encode() if token else None
        self._told: set[tuple[int, str]] = set()

    @property
    def place(self) -> str:
        """Where this run's records go: a name only the token's holders can compute (a writer
        without it, or with another, puts its records elsewhere and cannot take their place)."""
        if self._key is None:
            return OPEN_PLACE
        return hmac.new(self._key, f"heartbeats:{self.run_id}".encode(), hashlib.sha256).hexdigest()[:16]

    def _digest(self, record: Any) -> str:
        body = {k: v for k, v in record.to_dict().items() if k != "signature"}
        assert self._key is not None
        return hmac.new(self._key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    def stamp(self, record: R) -> R:
        record = dataclasses.replace(record, run_id=self.run_id, signature=None)
        if self._key is not None:
            record.signature = self._digest(record)
        return record

    def admit(self, record: Any, where: str) -> bool:
        if record.run_id != self.run_id:
            reason = f"of another run ({record.run_id!r}, this run is {self.run_id!r})"
        elif self._key is not None and not hmac.compare_digest(record.signature or "", self._digest(record)):
            reason = f"without this run's signature ({RUN_TOKEN_ENV})"
        else:
            return True
        if (record.rank, reason) not in self._told:
            self._told.add((record.rank, reason))
            log.warning("heartbeat ignored: the record for rank %d at %s is %s (host %s, pid %s)",
                        record.rank, where, reason, record.host, record.pid)
        return False


def admitted(identity: Identity | None, records: list[R], where: str) -> list[R]:
    """The records of a list ``identity`` admits (all of them without one)."""
    return records if identity is None else [record for record in records if identity.admit(record, where)]
