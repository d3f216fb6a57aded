"""Fencing: each attempt of a stage holds an epoch, and a write of an older epoch is refused.

    epoch = issue_epoch(redis_url, run_id)            # the launcher, before an attempt starts
    fence = Fence.from_env(redis_url, run_id)          # a rank: MEGATRAIN_EPOCH from its launcher
    fence.check("upload")                              # before every file sent to durable storage
    fence.commit(step, world_size)                     # the commit: compare-and-record in one script

Why the epoch comes from the cluster's Redis (``INCR megatrain:<run_id>:epoch``) and not from the
launcher's attempt counter: the counter lives in one launcher process. A launcher restarted on
another head (or a second one started by hand) counts from its own start, so two attempts could
hold the same number, and a rank cannot ask a launcher it may be cut off from. The store every rank
already reaches to meet and to beat is the one place that can order attempts for all of them; a
fencing token is only as good as the check at the place written to, so the check happens there, in
one Lua script (Redis runs a script atomically: no attempt can start between the compare and the
record). ``INCR`` is monotonic for the life of the Redis data. A Redis restarted empty (the cluster
runs it without persistence) would start at 1 again, so the epoch is also a floor the writers hand
back: the launcher issues ``max(store, the newest epoch in <run_dir>/epochs.jsonl) + 1``, and every
compare of a writer holding epoch E sets a store below E to E (E was issued, so the store held it
once). After a restart the current attempt's next beat puts the fence back, and a stale writer is
refused again. (A consensus store, etcd's revision or a persistent Redis, needs none of this.)

What each write does with the epoch:

- a heartbeat (``heartbeat_store.RedisSink``) is written by a script that first compares the epoch:
  a stale rank's beat never lands, so it cannot make a fenced attempt look alive;
- every upload to durable storage checks first, and the rank's marker carries the epoch;
- the commit records ``{step, epoch, time, host}`` in the run's commit log in Redis in the same
  script that compares, and only then writes the manifest (which carries the epoch too).

Refused writes are counted per kind (``HINCRBY megatrain:<run_id>:fenced``) and listed
(``megatrain:<run_id>:refused``), so a test or an operator can see what a fenced host tried.

What this does not close: the durable store itself (a POSIX file system, or S3 without conditional
writes keyed by a token) cannot compare an epoch, so a rank that passed the check and was cut off
before the file write lands can still write that one file later. The manifest's epoch and the commit
log in Redis tell such a step apart from a fenced commit (no log entry of its epoch after the fence).

An unreachable Redis is an ``OSError`` here (the upload's retries ride it out, as for the store
itself); a newer epoch is ``StaleEpoch``, deterministic: no retry can make an old attempt current.

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from megatrain.errors import DeterministicError

EPOCH_ENV = "MEGATRAIN_EPOCH"

# KEYS: epoch, fenced counts, refused list, commit log.  ARGV: epoch, what, refusal json, commit json ('' = none)
_COMPARE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  redis.call('RPUSH', KEYS[3], ARGV[3])
  return current
end
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end  -- a store restarted empty
if ARGV[4] ~= '' then redis.call('RPUSH', KEYS[4], ARGV[4]) end
return current
"""
# the same compare, then a heartbeat's write.  KEYS: epoch, fenced, refused, hash.  ARGV: epoch, what, refusal,
# field, value, ttl, drop (1: an earlier writer's fields go first)
_HEARTBEAT = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  redis.call('RPUSH', KEYS[3], ARGV[3])
  return current
end
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
if ARGV[7] == '1' then redis.call('DEL', KEYS[4]) end
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[6]))
return current
"""


# KEYS: epoch.  ARGV: the newest epoch the launcher knows of (its floor)
_ISSUE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return redis.call('INCR', KEYS[1])
"""


class StaleEpoch(DeterministicError):
    """A write of an attempt whose epoch a newer attempt has fenced off."""


def keys(run_id: str) -> dict[str, str]:
    base = f"megatrain:{run_id}"
    return {"epoch": f"{base}:epoch", "fenced": f"{base}:fenced", "refused": f"{base}:refused",
            "commits": f"{base}:commits", "issued": f"{base}:epochs"}


def _client(redis_url: str):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from megatrain.launch.redis_client import connect

    return connect(redis_url, socket_timeout=3.0, socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 1))


def _as_os_error(exc: Exception) -> OSError:
    return OSError(f"fencing store unreachable: {type(exc).__name__}: {exc}")


def issue_epoch(redis_url: str, run_id: str, floor: int = 0, **about: Any) -> tuple[int, float]:
    """A new attempt's epoch (INCR: greater than every epoch issued before, and than ``floor``, the
    newest the caller knows of) and when it was issued, also kept in ``megatrain:<run_id>:epochs``
    (epoch -> time and ``about``): the fence's time."""
    client = _client(redis_url)
    try:
        k = keys(run_id)
        epoch = int(client.eval(_ISSUE, 1, k["epoch"], int(floor)))
        issued = time.time()
        client.hset(k["issued"], str(epoch), json.dumps({"time": issued, **about}))
        return epoch, issued
    finally:
        client.close()


def read_log(redis_url: str, run_id: str) -> dict[str, Any]:
    """What the store holds: current epoch, issue times, commit log, refusal counts and list."""
    client = _client(redis_url)
    try:
        k = keys(run_id)
        return {"epoch": int(client.get(k["epoch"]) or 0),
                "issued": {int(e): json.loads(v) for e, v in client.hgetall(k["issued"]).items()},
                "commits": [json.loads(v) for v in client.lrange(k["commits"], 0, -1)],
                "fenced": {w.decode(): int(n) for w, n in client.hgetall(k["fenced"]).items()},
                "refused": [json.loads(v) for v in client.lrange(k["refused"], 0, -1)]}
    finally:
        client.close()


class Fence:
    """One rank's (or one writer's) epoch, checked against the store before each write."""

    def __init__(self, redis_url: str, run_id: str, epoch: int) -> None:
        self.redis_url, self.run_id, self.epoch = redis_url, run_id, int(epoch)
        self.keys = keys(run_id)
        self._redis = None

    @classmethod
    def from_env(cls, redis_url: str | None, run_id: str) -> Fence | None:
        """The fence of a rank whose launcher issued it an epoch (None: no fencing, one machine)."""
        raw = os.environ.get(EPOCH_ENV)
        return cls(redis_url, run_id, int(raw)) if raw and redis_url else None

    @property
    def client(self):
        if self._redis is None:
            self._redis = _client(self.redis_url)
        return self._redis

    def _refusal(self, what: str, **about: Any) -> str:
        return json.dumps({"what": what, "epoch": self.epoch, "time": time.time(), "host": socket.gethostname(),
                           "pid": os.getpid(), **about})

    def _script(self, script: str, keys_: list[str], argv: list[Any], what: str) -> int:
        import redis

        try:
            current = int(self.client.eval(script, len(keys_), *keys_, *argv))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise _as_os_error(exc) from None
        if current > self.epoch:
            raise StaleEpoch(f"{what} refused: this attempt's epoch {self.epoch} is fenced by epoch {current} "
                             f"(a newer attempt of run {self.run_id} started)")
        return current

    def check(self, what: str, **about: Any) -> None:
        """Raise StaleEpoch when a newer epoch exists (counted as a refused ``what``)."""
        k = self.keys
        self._script(_COMPARE, [k["epoch"], k["fenced"], k["refused"], k["commits"]],
                     [self.epoch, what, self._refusal(what, **about), ""], what)

    def commit(self, step: int, **about: Any) -> dict[str, Any]:
        """The commit's compare-and-record: the step enters the commit log with this epoch, or
        StaleEpoch. Returns the record (the manifest is written after it)."""
        k = self.keys
        record = {"step": int(step), "epoch": self.epoch, "time": time.time(), "host": socket.gethostname(),
                  "pid": os.getpid(), **about}
        self._script(_COMPARE, [k["epoch"], k["fenced"], k["refused"], k["commits"]],
                     [self.epoch, "commit", self._refusal("commit", step=int(step)), json.dumps(record)],
                     f"commit of step {step}")
        return record

    def heartbeat(self, key: str, field: str, value: str, ttl_s: int, drop_first: bool) -> None:
        """A heartbeat's HSET (and EXPIRE), done only while no newer epoch exists."""
        k = self.keys
        self._script(_HEARTBEAT, [k["epoch"], k["fenced"], k["refused"], key],
                     [self.epoch, "heartbeat", self._refusal("heartbeat"), field, value, ttl_s,
                      "1" if drop_first else "0"], "heartbeat")

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None
