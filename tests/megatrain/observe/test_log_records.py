"""TimedLogRecords: a handler that keeps (time, message) of what it sees and finds records back."""

from __future__ import annotations

import logging

from megatrain.observe.log_records import TimedLogRecords


def test_records_are_kept_with_their_times_and_found_by_pattern_and_time() -> None:
    handler = TimedLogRecords()
    log = logging.getLogger("test_log_records")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # only this handler: pytest's own would raise on the bad record
    try:
        log.info("attempt %d ended: %s", 1, "crashed")
        log.info("attempt %d ended: %s", 2, "completed")
        log.info("bad %d", "not a number")  # cannot format: kept out, no error
    finally:
        log.removeHandler(handler)
    assert [m for _, m in handler.records] == ["attempt 1 ended: crashed", "attempt 2 ended: completed"]
    first, second = (t for t, _ in handler.records)
    assert [m.group(1) for _, m in handler.find_all(r"attempt (\d) ended")] == ["1", "2"]
    assert handler.find(r"ended") == (first, "attempt 1 ended: crashed")
    assert handler.find(r"ended", after=second) == (second, "attempt 2 ended: completed")
    assert handler.find(r"ended", after=second + 1) is None
