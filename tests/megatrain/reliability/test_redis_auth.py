"""Redis with a password: every megatrain client logs in from the environment, and one without the
password (or with a wrong one) fails at once saying that authentication failed.

All against a real ``redis-server`` with ``requirepass`` (the session's, from
``megatrain.reliability.redis_server``, whose password is ``MEGATRAIN_REDIS_PASSWORD``)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from megatrain.config import ReliabilityConfig
from megatrain.launch.lease import RedisLeaseStore
from megatrain.launch.redis_client import PASSWORD_ENV, RedisAuthFailed, connect
from megatrain.reliability.heartbeat import HeartbeatRecord, RedisSink
from megatrain.reliability.selfcheck import redis_rtt_ms
from megatrain.reliability.watcher import HeartbeatWatcher


def _clients(url: str, run_id: str, tmp_path: Path) -> dict:
    """Each of megatrain's Redis clients, made for ``url`` (a callable each, so that a test can
    change the environment first)."""
    from megatrain.parallel.redis_store import RedisStore

    return {
        "heartbeat sink": lambda: RedisSink(url, run_id),
        "heartbeat watcher": lambda: HeartbeatWatcher.from_config(
            ReliabilityConfig(redis_url=url), tmp_path, run_id, world_size=1),
        "lease": lambda: RedisLeaseStore(url, run_id, ttl_s=5.0),
        "rendezvous store": lambda: RedisStore(url, run_id, timeout=timedelta(seconds=5), reconnect_s=5.0),
        "self-check ping": lambda: redis_rtt_ms(url, pings=2),
    }


def test_every_client_logs_in_with_the_password_from_the_environment(redis_url, run_id, tmp_path) -> None:
    clients = _clients(redis_url, run_id, tmp_path)
    sink = clients["heartbeat sink"]()
    sink.publish(HeartbeatRecord(rank=0, step=3, timestamp=time.time()))
    assert sink.read_all(1)[0].step == 3
    store = clients["rendezvous store"]()
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert clients["lease"]().client.ping()
    assert clients["self-check ping"]() > 0
    assert clients["heartbeat watcher"]().check().unknown is None


@pytest.mark.parametrize("given, answer", [(None, "NOAUTH"), ("not-the-password", "WRONGPASS")])
def test_a_client_without_the_password_is_refused_at_once_and_says_why(
        redis_url, run_id, tmp_path, monkeypatch, given, answer) -> None:
    assert connect(redis_url).ping()  # the server is up: a failure below is about the login only
    if given is None:
        monkeypatch.delenv(PASSWORD_ENV)
    else:
        monkeypatch.setenv(PASSWORD_ENV, given)
    for name, make in _clients(redis_url, run_id, tmp_path).items():
        start = time.monotonic()
        with pytest.raises(RedisAuthFailed) as refused:
            make()
        message = str(refused.value)
        assert "authentication failed" in message and answer in message, (name, message)
        assert "down" not in message and "unreachable" not in message, (name, message)
        assert time.monotonic() - start < 2.0, f"{name}: an auth failure must not be retried"
        if given is not None:
            assert given not in message  # the error names the variable, never its value


def test_a_password_in_the_url_is_refused(redis_url) -> None:
    with_password = redis_url.replace("redis://", "redis://:hunter2hunter2@")
    with pytest.raises(RedisAuthFailed, match=PASSWORD_ENV) as refused:
        connect(with_password)
    assert "hunter2hunter2" not in str(refused.value)
    assert connect(redis_url.replace("redis://", "redis://default@")).ping()  # a user name alone is fine


def test_the_temporary_server_is_locked_and_keeps_its_password_off_the_command_line(redis_server) -> None:
    import os

    url, proc = redis_server
    password = os.environ[PASSWORD_ENV]
    assert proc.password == password
    assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    client = connect(url)
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("requirepass")["requirepass"] == password
    client.close()


def test_a_config_with_a_password_in_a_redis_url_is_refused_without_echoing_it() -> None:
    from megatrain.config import ConfigError, load_config

    for field in ("reliability.redis_url", "parallel.init.redis_url"):
        with pytest.raises(ConfigError, match=f"{field}: the URL carries a password") as refused:
            load_config(None, [f"{field}=redis://:hunter2hunter2@redis:6379/0"])
        assert "hunter2hunter2" not in str(refused.value) and PASSWORD_ENV in str(refused.value)
    assert load_config(None, ["reliability.redis_url=redis://megatrain@redis:6379/0"]).reliability.redis_url
