"""The one way megatrain opens a Redis client: with the campaign's password, from the environment.

Every Redis client of the project (heartbeats, the rendezvous store, leases, the self-check's
PING) is made by ``connect``. The campaign's Redis runs with ``requirepass`` (Terraform generates
the password into a Kubernetes secret; a command-line run's temporary server makes a random one),
and the password reaches a process only through ``MEGATRAIN_REDIS_PASSWORD``:

- never a config file: a ``redis_url`` carrying a password (``redis://:pw@host``) is refused, since
  configs are copied into run dirs, ConfigMaps and reports; a user name alone (an ACL user) is fine;
- never a command line: anyone on the host can read a process's arguments.

A refused password is a ``RedisAuthFailed``, a ``DeterministicError``: no retry can fix it, and the
message says that authentication failed, not that Redis is down. redis-py files its auth errors
under ``ConnectionError``, which every Redis caller here retries or reads as "store down", so
``connect`` sends one PING at once and turns an auth error into ours. A server that cannot be
reached yet is no error here: the callers already ride out outages (Redis may start after a rank).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from megatrain.errors import DeterministicError

PASSWORD_ENV = "MEGATRAIN_REDIS_PASSWORD"


class RedisAuthFailed(DeterministicError):
    """The Redis server refused this client's credentials (NOAUTH, WRONGPASS)."""


def password() -> str | None:
    """The campaign's Redis password from the environment (None: a server without one)."""
    return os.environ.get(PASSWORD_ENV) or None


def check_url(url: str) -> None:
    """Refuse a Redis URL that carries a password (it would end up in config files and logs)."""
    if urlsplit(url).password is not None:
        host = urlsplit(url).hostname or "?"
        raise RedisAuthFailed(f"the Redis URL for {host} carries a password; configs must not: remove it from "
                              f"the URL and pass it in the environment variable {PASSWORD_ENV}")


def connect(url: str, secret: str | None = None, **options: Any):
    """A ``redis.Redis`` for ``url`` with the password ``secret``, default that of ``MEGATRAIN_REDIS_PASSWORD``
    (given: a process that reaches a Redis other than its environment's, e.g. a cluster's).

    ``options`` go to ``redis.Redis.from_url`` (timeouts, retry). Raises ``RedisAuthFailed`` when
    the server refuses the credentials; an unreachable server is left to the caller's own retries.
    """
    import redis  # imported here: runs without Redis (a directory of heartbeats) need no client

    check_url(url)
    client = redis.Redis.from_url(url, password=secret or password(), **options)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        raise auth_failed(url, exc) from None
    except redis.ResponseError as exc:  # "AUTH <password> called without any password configured"
        client.close()
        if "AUTH" not in str(exc):
            raise
        raise auth_failed(url, exc) from None
    except (redis.ConnectionError, redis.TimeoutError):
        pass  # not up (yet): the caller's outage handling applies
    return client


def auth_failed(url: str, exc: Exception) -> RedisAuthFailed:
    """The error for a refused login, saying which side is wrong (never the password itself)."""
    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or 6379}"
    # Redis's own codes, named whatever the protocol's wording (RESP3's HELLO says it differently)
    given = (f"WRONGPASS: the password in {PASSWORD_ENV} is not the server's" if password()
             else f"NOAUTH: no password given ({PASSWORD_ENV} is not set)")
    return RedisAuthFailed(f"Redis at {where}: authentication failed ({given}): {exc}")
