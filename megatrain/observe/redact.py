"""Secrets never reach a log line, a file a run writes, or a Prefect artifact: they become ``***``.

What is secret is read from the environment, where secrets live (storage keys, the Redis password,
the Prefect auth string): the value of every variable named as one (``is_secret_name``). Each
path out goes through ``redact``:

- logging: ``install()`` puts ``RedactingFilter`` on the handlers of the root, ``megatrain`` and
  Prefect loggers (a filter on a handler sees every record it writes, propagated ones included);
- an attempt's output (every rank's lines, to files and to the Prefect log): ``AttemptLog``;
- Prefect artifacts: ``tasks/_artifacts.py``;
- config dumps: ``redact_mapping`` shows a secret-named key's value as ``***``.

A URL's password (``scheme://user:password@host``) is hidden wherever it shows up, whether or not
it came from the environment.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
# A shorter value ("1", "yes", a test's "test") is no secret worth hiding, and hiding it garbles
# text: with AWS keys "test" every path under /tmp/pytest-... lost its "test". Real keys, tokens
# and generated passwords are 16+ characters.
MIN_LENGTH = 8
# Named exactly: secrets whose names the patterns below would miss.
SECRET_NAMES = {"AWS_ACCESS_KEY_ID", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
                "MEGATRAIN_REDIS_PASSWORD", "MEGATRAIN_RUN_TOKEN"}
# A name's words (split at "_"): any of these makes it secret; "KEY" only as the last word, so that
# KEY_PREFIX or KEYBOARD_LAYOUT stay visible while AWS_SECRET_KEY or PREFECT_API_KEY do not.
SECRET_WORDS = {"SECRET", "PASSWORD", "PASSWD", "TOKEN", "CREDENTIAL", "CREDENTIALS", "APIKEY", "AUTH"}
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)(?P<password>[^@/\s]+)(?=@)")


def is_secret_name(name: str) -> bool:
    """``AWS_SECRET_ACCESS_KEY``, ``MEGATRAIN_REDIS_PASSWORD``, ``HF_TOKEN``: yes;
    ``TOKENIZERS_PARALLELISM``, ``KEY_PREFIX``: no."""
    upper = name.upper()
    words = upper.split("_")
    return upper in SECRET_NAMES or bool(SECRET_WORDS & set(words)) or words[-1] == "KEY"


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values to hide, longest first (so that a secret containing another is hidden whole)."""
    environ = os.environ if environ is None else environ
    values = {value for name, value in environ.items() if is_secret_name(name) and len(value) >= MIN_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with every secret value, and a URL's password, replaced by ``***``.

    The environment is read at each call: a secret set after start-up (the temporary Redis's
    password) is hidden too, at the cost of a scan of a few hundred short strings per line."""
    for value in secret_values(environ):
        if value in text:
            text = text.replace(value, MASK)
    return _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, text) if "://" in text else text


def redact_mapping(data: Any) -> Any:
    """A copy of a config dump (dicts, lists, scalars) with secret-named keys' values as ``***``
    and every string redacted."""
    if isinstance(data, Mapping):
        return {key: MASK if isinstance(key, str) and is_secret_name(key) and data[key] not in (None, "")
                else redact_mapping(data[key]) for key in data}
    if isinstance(data, (list, tuple)):
        return [redact_mapping(item) for item in data]
    return redact(data) if isinstance(data, str) else data


class RedactingFilter(logging.Filter):
    """Rewrites a record's message (and its traceback) with the secrets hidden; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = redact(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


LOGGERS = ("", "megatrain", "prefect", "prefect.flow_runs", "prefect.task_runs")  # whose handlers get the filter


def install(names: tuple[str, ...] = LOGGERS) -> None:
    """Put one ``RedactingFilter`` on every handler of these loggers (idempotent)."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
