"""Secrets hidden: which variable names are secret, values replaced in text, config dumps and
log records (message and traceback), and the filter reaching records logged anywhere."""

from __future__ import annotations

import logging

from megatrain.observe.redact import (
    MASK,
    RedactingFilter,
    install,
    is_secret_name,
    redact,
    redact_mapping,
)

ENV = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7",
       "MEGATRAIN_REDIS_PASSWORD": "r3dis-pass", "PREFECT_API_AUTH_STRING": "admin:prefect-pass",
       "TOKENIZERS_PARALLELISM": "false", "HOME": "/root", "SHORT_TOKEN": "ab"}


def test_secret_names() -> None:
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "MEGATRAIN_REDIS_PASSWORD",
                 "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY", "HF_TOKEN",
                 "GITHUB_TOKEN", "DB_PASSWD", "my_secret"):
        assert is_secret_name(name), name
    for name in ("TOKENIZERS_PARALLELISM", "KEY_PREFIX", "HOME", "PATH", "MEGATRAIN_IMAGE", "KEYBOARD"):
        assert not is_secret_name(name), name


def test_values_and_url_passwords_are_hidden() -> None:
    text = ("aws wJalrXUtnFEMI/K7MDENG id AKIAIOSFODNN7 redis r3dis-pass auth admin:prefect-pass "
            "url redis://user:inline-pw@host:6379/0 s3 s3://bucket/key parallel false short ab")
    hidden = redact(text, ENV)
    for value in ("wJalrXUtnFEMI/K7MDENG", "AKIAIOSFODNN7", "r3dis-pass", "prefect-pass", "inline-pw"):
        assert value not in hidden
    assert "redis://user:***@host:6379/0" in hidden and "s3://bucket/key" in hidden
    assert "parallel false short ab" in hidden  # not secrets, or too short to hide without garbling text


def test_config_dumps_show_secret_keys_as_stars(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    dump = {"storage": {"secret_key": "inline-value", "api_token": None, "endpoint": "http://x"},
            "notes": ["key is wJalrXUtnFEMI/K7MDENG"], "steps": 8}
    assert redact_mapping(dump) == {"storage": {"secret_key": MASK, "api_token": None, "endpoint": "http://x"},
                                    "notes": [f"key is {MASK}"], "steps": 8}


def test_the_filter_hides_secrets_in_messages_arguments_and_tracebacks(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRAIN_REDIS_PASSWORD", "r3dis-pass")
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        install(("",))
        install(("",))  # idempotent
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
        log = logging.getLogger("megatrain.somewhere.deep")  # propagates to the root's handler
        log.warning("password %s in use", "r3dis-pass")
        try:
            raise RuntimeError("login with r3dis-pass failed")
        except RuntimeError:
            log.exception("failed")
    finally:
        root.removeHandler(handler)
    assert records and all("r3dis-pass" not in r for r in records), records
    assert records[0] == "password *** in use" and "RuntimeError: login with *** failed" in records[1]
