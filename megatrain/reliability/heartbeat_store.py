"""Heartbeats, what is stored and where: the record of one rank, and the sinks that hold them.

A ``HeartbeatRecord`` (step, phase, loss, throughput, time) goes through a sink: Redis on a
cluster, a directory of JSON files on one machine. The writer (``heartbeat.py``) publishes; the
watcher (``watcher.py``) reads. The heartbeat store can fail (Redis restarted): writers keep
training and retry every beat.

A record must come from this run, or a stray writer (another run sharing the store, a copied file,
anyone who reaches Redis) could make a hung rank look alive. ``make_sink`` gives each sink the
run's ``Identity``: writers stamp the run id and, when the environment holds the run's token
(``MEGATRAIN_RUN_TOKEN``, made by the launcher and inherited by its ranks), an HMAC of the record;
readers ignore, and log once, a record of another run or without a valid signature (``identity.py``).

A record refused must also cost nothing: it may not take the place of a true one, or the watcher
would lose the true record's clocks (a frozen rank's last step, a peer's beats) and call the hang
late or blame the wrong rank. So every writer has a slot of its own, inside a place named by the
token (``Identity.place``): a file ``rank<r>.<place>.<writer>.json`` or a field ``<writer>`` of the
hash ``megatrain:<run_id>:heartbeat:<place>:<r>``, where ``<writer>`` is the writer's start (ms)
and pid. A writer without the token, or with another, writes elsewhere; a writer of an earlier
attempt (the right token, a process that outlived its attempt) writes beside this attempt's, and a
reader asked for records ``started_after`` the attempt began skips it. A reader takes, per rank,
the newest admitted record of its place; what lies elsewhere is logged once and never read. (A
process that finds this run's own slot of a rank and rewrites it faster than the watcher reads
can still hide that rank's records, as it could delete them: file permissions and Redis ACLs keep
it out, not this module.)

A rank of an attempt with a fencing epoch (``MEGATRAIN_EPOCH``, hosts launcher) writes its records
to Redis through a script that first compares the epoch (``fencing.py``): once a newer attempt
exists, a stale rank's beat is refused and never lands where the watch reads.

Timestamps are wall-clock (``time.time()``) from each rank's host; across hosts this assumes
NTP-synchronised clocks, with skew far below the timeout (seconds vs tens of seconds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatrain.config import ReliabilityConfig
from megatrain.reliability._files import atomic_write_text
from megatrain.reliability.identity import OPEN_PLACE, RUN_TOKEN_ENV, Identity, admitted

log = logging.getLogger(__name__)

RECENT_STEPS = 8  # steps of forward time each record carries
PHASES = ("init", "data", "forward", "backward", "optimizer", "pipeline", "checkpoint", "collective", "eval", "log",
          "done")
# The phases of a step whose length is the step's own: compute and the collectives between ranks.
# A frozen step is called hung sooner (the watcher's stall rule) only while every rank is in one
# of these; data reads, checkpoint saves, evaluation and logging may legitimately take longer.
STEP_PHASES = frozenset({"forward", "backward", "optimizer", "pipeline", "collective"})


@dataclass
class HeartbeatRecord:
    """One rank's latest state. ``timestamp``: when this beat was sent; ``step_since``: when the
    rank first reported ``step`` (so ``timestamp - step_since`` is how long the step has taken).
    ``first_step_done``: this process has finished a step; until then (compile, warm-up) the
    watcher allows the longer init timeout."""

    rank: int
    step: int = 0
    phase: str = "init"
    loss: float | None = None
    tokens_per_s: float | None = None
    timestamp: float = 0.0
    step_since: float = 0.0
    phase_since: float = 0.0  # when the rank entered ``phase`` (any phase change is progress)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    dp_rank: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    straggler: bool = False
    first_step_done: bool = False
    step_phase_s: dict[str, float] | None = None  # seconds per phase of the last finished step
    recent_forward_s: list[list[float]] | None = None  # [step, forward seconds] of the last steps
    recent_step_s: list[float] | None = None  # seconds from step to step of the last steps (the stall rule's scale)
    init_phase: str | None = None  # during phase "init": the start-up phase (megatrain/observe/startup.py)
    waits: list[dict[str, Any]] | None = None  # waits on other processes now (megatrain/waits.py)
    started_at: float = field(default_factory=time.time)  # when this record's writer began: its attempt
    epoch: int | None = None  # the attempt's fencing epoch (launch/fencing.py); None: not fenced
    run_id: str | None = None  # whose record this is (stamped by the sink's Identity)
    signature: str | None = None  # HMAC-SHA256 of the rest under the run's token

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeartbeatRecord:
        # Ignore fields this version does not know: a newer writer must not break an older watcher.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


# ---------------------------------------------------------------------------------------------
# Sinks: where records go. Each holds every writer's latest record, in its own slot.


class HeartbeatSink(Protocol):
    def publish(self, record: HeartbeatRecord) -> None: ...

    def read_all(self, world_size: int, started_after: float | None = None) -> dict[int, HeartbeatRecord]: ...

    def close(self) -> None: ...


def writer_id(record: HeartbeatRecord) -> str:
    """A writer's slot: its start in ms and its pid (a restarted rank is another writer)."""
    return f"{int(record.started_at * 1000)}-{record.pid}"


def _newest(identity: Identity | None, found: dict[int, list[HeartbeatRecord]], started_after: float | None,
            where: str) -> dict[int, HeartbeatRecord]:
    """Per rank, the newest record ``identity`` admits among those whose writer began after
    ``started_after`` (a writer of an earlier attempt is no news of this one)."""
    out = {}
    for rank, candidates in found.items():
        kept = [r for r in admitted(identity, candidates, where)
                if started_after is None or r.started_at >= started_after]
        if kept:
            out[rank] = max(kept, key=lambda r: r.timestamp)
    return out


class _Told:
    """Log a thing ignored once (per key), not at every read."""

    def __init__(self) -> None:
        self._told: set = set()

    def once(self, key: object, message: str, *args: object) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning(message, *args)


_FILE = re.compile(r"rank(\d+)\.([0-9a-z]+)\.(\d+)-(\d+)\.json")


class DirectorySink:
    """One JSON file per writer, replaced atomically: for one machine or a shared filesystem.
    ``identity``: stamp and check records, and name the place (None: write unsigned records and
    read every record unchecked, as tests of the watcher's rules do)."""

    def __init__(self, path: str | Path, identity: Identity | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.place = identity.place if identity is not None else OPEN_PLACE
        self._mine: set[Path] = set()  # files this process writes (an earlier writer's are removed once)
        self._told = _Told()

    def _file(self, record: HeartbeatRecord) -> Path:
        return self.path / f"rank{record.rank:05d}.{self.place}.{writer_id(record)}.json"

    def publish(self, record: HeartbeatRecord) -> None:
        if self.identity is not None:
            record = self.identity.stamp(record)
        path = self._file(record)
        if path not in self._mine:  # a new writer of the rank: the records of earlier ones are history
            self._mine.add(path)
            for old in self.path.glob(f"rank{record.rank:05d}.{self.place}.*.json"):
                if old != path:
                    old.unlink(missing_ok=True)
        atomic_write_text(path, json.dumps(record.to_dict()))

    def read_all(self, world_size: int, started_after: float | None = None) -> dict[int, HeartbeatRecord]:
        found: dict[int, list[HeartbeatRecord]] = {}
        for entry in os.scandir(self.path):
            match = _FILE.fullmatch(entry.name)
            if match is None:
                if entry.name.startswith("rank") and entry.name.endswith(".json"):
                    self._told.once(entry.name, "heartbeat ignored: %s in %s is not where this run's records go "
                                    "(another run, no token or another)", entry.name, self.path)
                continue
            rank, place, started_ms = int(match[1]), match[2], int(match[3])
            if place != self.place and self.identity is not None:  # (without one: any writer's, unchecked)
                self._told.once((rank, place), "heartbeat ignored: %s in %s is not where this run's records go "
                                "(another run, no token or another)", entry.name, self.path)
                continue
            if rank >= world_size or (started_after is not None and started_ms < 1000 * started_after - 1):
                continue  # a writer of an earlier attempt: not read at all
            try:
                data = json.loads(Path(entry.path).read_text())
                found.setdefault(rank, []).append(HeartbeatRecord.from_dict(data))
            except FileNotFoundError:
                continue  # its writer replaced it between the listing and the read
            except (ValueError, TypeError, AttributeError) as exc:  # not a record: ignored, like a forged one
                self._told.once(entry.name, "heartbeat ignored: %s is not a record (%s)", entry.path, exc)
        return _newest(self.identity, found, started_after, str(self.path))

    def close(self) -> None:
        pass


class RedisSink:
    """A Redis hash per rank (``megatrain:<run_id>:heartbeat:<place>:<rank>``), one field per
    writer holding its record as JSON, with a TTL, so the records of a finished or abandoned run
    clean themselves up."""

    def __init__(self, url: str, run_id: str, ttl_s: float = 300.0, identity: Identity | None = None,
                 fence=None, secret: str | None = None) -> None:
        # imported here: the directory sink must work without a Redis client
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from megatrain.launch.redis_client import connect

        self.run_id = run_id
        self.identity = identity
        self.fence = fence  # with an epoch: a beat of a fenced attempt is refused by the store (fencing.py)
        self.place = identity.place if identity is not None else OPEN_PLACE
        self._mine: set[str] = set()  # writers this process publishes for (earlier ones are dropped once)
        self._told = _Told()
        self.ttl_s = max(1, math.ceil(ttl_s))
        # One immediate retry (a connection the server dropped is reopened), no backoff: a beat
        # that fails is simply sent again one interval later, and a watcher must not block for
        # seconds in client retries while the store is down.
        self._redis = connect(url, secret, socket_timeout=5.0, socket_connect_timeout=2.0,
                              retry=Retry(NoBackoff(), 1))

    def key(self, rank: int) -> str:
        return f"megatrain:{self.run_id}:heartbeat:{self.place}:{rank}"

    def _open_key(self, rank: int) -> str:
        return f"megatrain:{self.run_id}:heartbeat:{OPEN_PLACE}:{rank}"

    def publish(self, record: HeartbeatRecord) -> None:
        if self.fence is not None:
            record = dataclasses.replace(record, epoch=self.fence.epoch)  # signed with the rest
        if self.identity is not None:
            record = self.identity.stamp(record)
        key, writer = self.key(record.rank), writer_id(record)
        if self.fence is not None:  # compare and write in one script: a fenced rank's beat never lands
            new = (key, writer) not in self._mine
            self.fence.heartbeat(key, writer, json.dumps(record.to_dict()), self.ttl_s, drop_first=new)
            self._mine.add((key, writer))
            return
        pipe = self._redis.pipeline(transaction=False)
        if (key, writer) not in self._mine:  # a new writer of the rank: earlier writers' records are history
            self._mine.add((key, writer))
            pipe.delete(key)
        pipe.hset(key, writer, json.dumps(record.to_dict()))
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def read_all(self, world_size: int, started_after: float | None = None) -> dict[int, HeartbeatRecord]:
        pipe = self._redis.pipeline(transaction=False)
        for rank in range(world_size):
            pipe.hgetall(self.key(rank))
            pipe.exists(self._open_key(rank))  # where writers without a token put theirs
        replies = pipe.execute()
        found: dict[int, list[HeartbeatRecord]] = {}
        for rank in range(world_size):
            raw, unplaced = replies[2 * rank], replies[2 * rank + 1]
            if unplaced and self.place != OPEN_PLACE:  # (another token's place is never read: not even seen)
                self._told.once(rank, "heartbeat ignored: %s is not where this run's records go (a writer without "
                                "the run's token)", self._open_key(rank))
            for writer, value in (raw or {}).items():
                try:
                    found.setdefault(rank, []).append(HeartbeatRecord.from_dict(json.loads(value)))
                except (ValueError, TypeError, AttributeError) as exc:  # not a record: ignored, like a forged one
                    self._told.once((rank, writer), "heartbeat ignored: field %s of %s is not a record (%s)",
                                    writer, self.key(rank), exc)
        return _newest(self.identity, found, started_after, f"megatrain:{self.run_id}:heartbeat:{self.place}:*")

    # Stacks on request, the cluster's way: a watcher cannot signal another host's processes, so it
    # asks through the store and each rank's heartbeat thread answers with its own stacks.
    def _stacks_key(self, what: str) -> str:
        return f"megatrain:{self.run_id}:stacks:{self.place}:{what}"

    def request_stacks(self) -> str:
        """Ask every rank of the run for its stacks; the request's id (replies name it)."""
        request = str(time.time_ns())
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._stacks_key("replies"))
        pipe.set(self._stacks_key("request"), request, ex=self.ttl_s)
        pipe.execute()
        return request

    def stack_request(self) -> str | None:
        """The run's current request for stacks, or None."""
        value = self._redis.get(self._stacks_key("request"))
        return value.decode() if isinstance(value, bytes) else value

    def publish_stacks(self, rank: int, request: str, text: str, host: str, pid: int) -> None:
        key = self._stacks_key("replies")
        reply = json.dumps({"request": request, "host": host, "pid": pid, "text": text})
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, f"{rank}:{host}:{pid}", reply)  # a stale process of the rank answers beside it
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def read_stacks(self, request: str) -> dict[tuple[int, str, int], str]:
        """The replies to ``request``: (rank, host, pid) -> stack text."""
        out = {}
        for field_, value in (self._redis.hgetall(self._stacks_key("replies")) or {}).items():
            try:
                reply = json.loads(value)
                rank = int((field_.decode() if isinstance(field_, bytes) else field_).split(":", 1)[0])
            except (ValueError, TypeError):
                continue
            if reply.get("request") == request:
                out[(rank, reply["host"], int(reply["pid"]))] = reply["text"]
        return out

    def close(self) -> None:
        self._redis.close()
        if self.fence is not None:
            self.fence.close()


def make_sink(cfg: ReliabilityConfig, run_dir: str | Path, run_id: str, secret: str | None = None) -> HeartbeatSink:
    """Redis when ``cfg.redis_url`` is set (``secret``: its password, default the environment's), else
    ``<run_dir>/heartbeats``; either way taking only this run's records (signed when the environment
    holds the run's token)."""
    identity = Identity(run_id, os.environ.get(RUN_TOKEN_ENV))
    if cfg.redis_url:
        # Keep records well past the timeout so a watcher can still show a dead rank's last state.
        from megatrain.launch.fencing import Fence

        return RedisSink(cfg.redis_url, run_id, ttl_s=max(10 * cfg.heartbeat_timeout_s, 300.0), identity=identity,
                         fence=Fence.from_env(cfg.redis_url, run_id), secret=secret)
    return DirectorySink(Path(run_dir) / "heartbeats", identity=identity)
