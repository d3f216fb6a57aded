"""The run's token: a random secret the launcher makes and only its ranks inherit (by environment).

What a rank writes into shared stores is bound to it, so that nothing from outside the run (another
run, anyone else who reaches Redis) is taken for one of its own ranks:

- heartbeat records carry an HMAC under the token (``megatrain.reliability.identity``);
- the rendezvous store's keys live in a namespace named after the token's digest
  (``megatrain.parallel.redis_store``): an entry written without the token lands elsewhere and is
  never read.

Without a token (a rank started by hand) nothing is signed and the namespace is the run id's alone.
"""

from __future__ import annotations

import hashlib
import os
import secrets

RUN_TOKEN_ENV = "MEGATRAIN_RUN_TOKEN"


def run_token() -> str | None:
    return os.environ.get(RUN_TOKEN_ENV) or None


def ensure_run_token() -> str:
    """The run's token, made here when absent and put into this process's environment, so that every
    rank the launcher starts inherits it (and nothing else has it)."""
    if not run_token():
        os.environ[RUN_TOKEN_ENV] = secrets.token_hex(16)
    return os.environ[RUN_TOKEN_ENV]


def token_scope() -> str:
    """A key-namespace part for the token (``t<digest>:``; empty without one). A digest, so that
    reading the keys does not reveal the token."""
    token = run_token()
    return f"t{hashlib.sha256(token.encode()).hexdigest()[:16]}:" if token else ""
