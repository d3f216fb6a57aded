"""Heartbeats from outside the run are ignored: a record of another run id, an unsigned one or one
signed with another token can never make a hung rank look alive (both sinks, real Redis)."""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path

import pytest

from megatrain.config import ReliabilityConfig
from megatrain.launch.run_token import RUN_TOKEN_ENV, ensure_run_token
from megatrain.reliability.heartbeat import (
    DirectorySink,
    HeartbeatRecord,
    RedisSink,
    make_sink,
)
from megatrain.reliability.identity import Identity
from megatrain.reliability.watcher import HeartbeatWatcher


def _sink(kind: str, tmp_path: Path, redis_url: str, run_id: str, identity: Identity | None):
    """A writer or reader at the place ``make_sink`` puts this run's heartbeats."""
    if kind == "redis":
        return RedisSink(redis_url, run_id, identity=identity)
    return DirectorySink(tmp_path / "heartbeats", identity=identity)


@pytest.mark.parametrize("kind", ["directory", "redis"])
@pytest.mark.parametrize("foreign", ["another run", "no token", "another token"])
def test_a_foreign_heartbeat_does_not_hide_a_planted_hang(kind, foreign, tmp_path, redis_url, run_id, monkeypatch,
                                                          caplog) -> None:
    monkeypatch.setenv(RUN_TOKEN_ENV, "this-runs-token")
    cfg = ReliabilityConfig(redis_url=redis_url if kind == "redis" else None, heartbeat_timeout_s=5.0)
    ours = make_sink(cfg, tmp_path, run_id)
    now = time.time()
    ours.publish(HeartbeatRecord(0, step=5, phase="forward", timestamp=now, step_since=now, first_step_done=True))
    # the planted hang: rank 1 beats, but its step has not moved for 9 s (timeout 5 s)
    ours.publish(HeartbeatRecord(1, step=4, phase="collective", timestamp=now, step_since=now - 9, first_step_done=True))
    watcher = HeartbeatWatcher(make_sink(cfg, tmp_path, run_id), world_size=2, timeout_s=5.0, since=0)
    assert watcher.check().hung == [1]

    identity = {"another run": Identity("someone-else", "this-runs-token"), "no token": Identity(run_id, None),
                "another token": Identity(run_id, "a-guessed-token")}[foreign]
    stray = _sink(kind, tmp_path, redis_url, run_id, identity)
    stray.publish(HeartbeatRecord(1, step=6, phase="forward", timestamp=time.time(), step_since=time.time(),
                                  first_step_done=True))
    # The stray record lands beside this run's, where that writer's identity puts it: read as its
    # own writer's place, it is there and says rank 1 is fine.
    assert stray.read_all(2)[1].step == 6
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        result = watcher.check()
        watcher.check()
    assert result.hung == [1] and result.records[1].step == 4, result.message()
    ignored = [r.getMessage() for r in caplog.records if "heartbeat ignored" in r.getMessage()]
    # logged once, not at every check (in Redis, another token's place is never even seen)
    seen = kind == "directory" or foreign == "no token"
    assert len(ignored) == seen and all("rank00001" in x or "open:1 is not" in x for x in ignored), ignored


@pytest.mark.parametrize("kind", ["directory", "redis"])
@pytest.mark.parametrize("forged", ["unsigned", "wrong signature"])
def test_a_record_forged_into_a_ranks_own_slot_resets_no_clock(kind, forged, tmp_path, redis_url, run_id, monkeypatch):
    """A forger that finds this run's slot of rank 1 and writes over it: the watcher goes on from
    rank 1's last admitted record (hung, step 4), and rank 0's next beat is read as ever."""
    monkeypatch.setenv(RUN_TOKEN_ENV, "this-runs-token")
    cfg = ReliabilityConfig(redis_url=redis_url if kind == "redis" else None, heartbeat_timeout_s=5.0)
    ours, now = make_sink(cfg, tmp_path, run_id), time.time()
    ours.publish(HeartbeatRecord(0, step=5, phase="forward", timestamp=now, step_since=now, first_step_done=True))
    hung = HeartbeatRecord(1, step=4, phase="collective", timestamp=now, step_since=now - 9, first_step_done=True)
    ours.publish(hung)
    watcher = HeartbeatWatcher(make_sink(cfg, tmp_path, run_id), world_size=2, timeout_s=5.0, since=0)
    assert watcher.check().hung == [1]
    fake = Identity(run_id, None if forged == "unsigned" else "a-guessed-token").stamp(
        HeartbeatRecord(1, step=6, phase="forward", timestamp=time.time(), step_since=time.time(), first_step_done=True,
                        started_at=hung.started_at, pid=hung.pid))
    if kind == "directory":
        (slot,) = (tmp_path / "heartbeats").glob("rank00001.*.json")
        slot.write_text(json.dumps(fake.to_dict()))
    else:
        from megatrain.launch.redis_client import connect

        client = connect(redis_url)
        key = ours.key(1)
        (field,) = client.hkeys(key)
        client.hset(key, field, json.dumps(fake.to_dict()))
        client.close()
    ours.publish(HeartbeatRecord(0, step=6, phase="forward", timestamp=time.time(), step_since=time.time(),
                                 first_step_done=True, started_at=ours.read_all(1)[0].started_at))  # its next beat
    result = watcher.check()
    assert result.hung == [1] and result.records[1].step == 4 and result.records[0].step == 6, result.message()


def test_a_record_of_an_earlier_attempt_signed_with_the_runs_token_is_no_news(tmp_path, run_id, monkeypatch) -> None:
    """A rank of the previous attempt that outlived it (the same run token, a fresh timestamp, a
    later step) beats beside this attempt's hung rank 1: the verdict stays hung, from this
    attempt's record."""
    monkeypatch.setenv(RUN_TOKEN_ENV, "this-runs-token")
    cfg = ReliabilityConfig(heartbeat_timeout_s=5.0)
    zombie, began = make_sink(cfg, tmp_path, run_id), time.time() - 60  # the earlier attempt's rank 1
    zombie.publish(HeartbeatRecord(1, step=3, phase="forward", timestamp=time.time(), step_since=time.time(),
                                   first_step_done=True, started_at=began))
    watcher = HeartbeatWatcher(make_sink(cfg, tmp_path, run_id), world_size=2, timeout_s=5.0)
    ours, now = make_sink(cfg, tmp_path, run_id), time.time()
    ours.publish(HeartbeatRecord(0, step=5, phase="forward", timestamp=now, step_since=now, first_step_done=True))
    first = HeartbeatRecord(1, step=4, phase="collective", timestamp=now, step_since=now, first_step_done=True)
    ours.publish(first)
    assert watcher.check().ok
    watcher.since -= 9  # this attempt's rank 1 has been stuck in step 4 for 9 s (timeout 5 s) ...
    ours.publish(HeartbeatRecord(1, step=4, phase="collective", timestamp=time.time(), step_since=now - 9,
                                 first_step_done=True, started_at=first.started_at))
    # ... while the earlier attempt's rank 1, still alive, says it is training step 7 right now
    zombie.publish(HeartbeatRecord(1, step=7, phase="forward", timestamp=time.time() + 1, step_since=time.time(),
                                   first_step_done=True, started_at=began))
    result = watcher.check()
    assert result.hung == [1] and result.records[1].step == 4, result.message()


def test_the_runs_own_ranks_are_believed(tmp_path, run_id, monkeypatch) -> None:
    """Writer and watcher of one run, both from ``make_sink``: the token the launcher made
    (``ensure_run_token``) reaches both, and the records verify."""
    monkeypatch.delenv(RUN_TOKEN_ENV, raising=False)
    token = ensure_run_token()
    assert len(token) == 32 and ensure_run_token() == token  # made once, then kept
    cfg = ReliabilityConfig()
    now = time.time()
    make_sink(cfg, tmp_path, run_id).publish(HeartbeatRecord(0, step=3, phase="forward", timestamp=now,
                                                             step_since=now, first_step_done=True))
    records = make_sink(cfg, tmp_path, run_id).read_all(1)
    assert records[0].step == 3 and records[0].run_id == run_id and records[0].signature
    assert make_sink(cfg, tmp_path, "another-run").read_all(1) == {}


def test_a_rendezvous_entry_from_outside_the_run_is_never_read(redis_url, run_id, monkeypatch) -> None:
    """The rendezvous store's keys live in a namespace named after the run token's digest: a writer
    with another token (or none) that knows the run id and the key still writes elsewhere."""
    from megatrain.parallel.redis_store import RedisStore

    def store(token: str | None) -> RedisStore:
        if token is None:
            monkeypatch.delenv(RUN_TOKEN_ENV, raising=False)
        else:
            monkeypatch.setenv(RUN_TOKEN_ENV, token)
        return RedisStore(redis_url, run_id, timeout=timedelta(seconds=1))

    ours, twin = store("this-runs-token"), store("this-runs-token")
    foreign = [store("a-guessed-token"), store(None)]
    for other in foreign:
        other.set("rank0/addr", "10.6.6.6:29500")  # an address the run must never dial
        assert other.check(["rank0/addr"])
    assert not ours.check(["rank0/addr"]) and ours.num_keys() == 0
    assert "this-runs-token" not in ours.prefix  # the namespace names a digest, not the token
    twin.set("rank0/addr", "10.0.0.1:29500")
    assert ours.get("rank0/addr") == b"10.0.0.1:29500"
    for s in [ours, twin, *foreign]:
        s.clear()
        s.close()
