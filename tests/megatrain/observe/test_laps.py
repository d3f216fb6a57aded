"""observe/laps.py: each lap records the time since the last one under ``<part>_s``; None records nothing."""

import time

from megatrain.observe.laps import Laps


def test_laps_record_each_part_once():
    seconds: dict[str, float] = {}
    laps = Laps(seconds)
    time.sleep(0.02)
    laps.lap("first")
    laps.lap("second")
    assert list(seconds) == ["first_s", "second_s"]
    assert seconds["first_s"] >= 0.02 > seconds["second_s"]
    Laps(None).lap("nothing")  # no dict: no error, nothing kept
