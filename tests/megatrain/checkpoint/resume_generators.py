"""``python -m resume_generators TMP``: a resumed fake trainer that draws from every process-wide
random generator (torch's through dropout, python's, numpy's) draws what the straight run drew.

A process of its own (test_checkpointer.py forks it from the warm fork server): in the test
worker any thread may draw from these generators between two steps, a library's retry jitter in
a thread another test left included, and the resumed run would then differ for no fault of the
checkpoint. Exits 0 when the states are equal, else with the assertion's traceback."""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoint_fakes import assert_same_state, full_state, make_config, make_trainer, run

from megatrain.checkpoint.manager import Checkpointer


def resume_with_every_generator(tmp: Path) -> None:
    straight = make_trainer(make_config(tmp / "straight", interval=4), draws_globals=True)
    checkpointer = Checkpointer(straight.cfg, straight.env, straight.groups)
    run(straight, checkpointer, 8)
    checkpointer.close()
    expected = full_state(straight)

    cfg = make_config(tmp / "resumed", interval=4)
    first = make_trainer(cfg, draws_globals=True)
    checkpointer = Checkpointer(cfg, first.env, first.groups)
    run(first, checkpointer, 4)
    checkpointer.close()
    second = make_trainer(cfg, seed=99, draws_globals=True)  # other weights, data seed and generators
    resumed = Checkpointer(cfg, second.env, second.groups)
    second.step = resumed.restore(second)
    assert second.step == 4
    run(second, resumed, 8)
    resumed.close()
    assert_same_state(full_state(second), expected)


if __name__ == "__main__":
    resume_with_every_generator(Path(sys.argv[1]))
