"""A keeper that is stopped (SIGSTOP), not dead, when a restore asks it: the restore takes the
durable tier after the request's deadline, says in one line which keeper (socket, pid, its state)
did not answer, and the wait shows in the heartbeat while it lasts. Before, the restore waited
on the keeper's socket for as long as the keeper stayed stopped (602.9 s measured)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from megatrain import waits
from megatrain.checkpoint import keeper_control
from megatrain.checkpoint.keeper_control import KeeperClient, keeper_dir
from megatrain.checkpoint.manager import Checkpointer

from checkpoint_fakes import make_trainer, run


def test_a_stopped_keeper_costs_a_deadline_then_the_durable_tier(fresh, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(keeper_control, "REQUEST_DEADLINE_S", 1.0)  # 5 s in a run
    cfg, trainer, checkpointer = fresh(interval=4, memory_interval=1)
    run(trainer, checkpointer, 6)  # durable step 4; the keeper holds steps 5 and 6
    checkpointer.close()
    pid = int(KeeperClient.connect(keeper_dir(cfg.checkpoint.staging_dir), timeout_s=0).request("list")[0]["pid"])
    os.kill(pid, signal.SIGSTOP)
    seen: list[list[dict]] = []
    try:
        other = make_trainer(cfg, seed=7)
        restorer = Checkpointer(cfg, other.env, other.groups)
        outcome: dict = {}

        def restore() -> None:
            try:
                outcome["step"] = restorer.restore(other)
            except BaseException as exc:  # noqa: BLE001  (reported below)
                outcome["error"] = exc

        with caplog.at_level(logging.WARNING, logger="megatrain.checkpoint"):
            thread = threading.Thread(target=restore, name="restore")
            thread.start()
            while thread.is_alive() and not seen:  # the heartbeat's view: what this process waits for
                seen = [w for w in waits.current() if w["what"] == "checkpoint keeper: list"] and [waits.current()]
                time.sleep(0.01)
            thread.join(120)  # the old code stays in recv() until the keeper is continued
            assert not thread.is_alive(), "restore still waits on the stopped keeper"
        assert outcome == {"step": 4}, outcome
        (wait,) = seen[0]
        assert wait["pid"] == pid and wait["where"].endswith("keeper.sock") and wait["deadline_s"] == 1.0
        line = next(r.getMessage() for r in caplog.records if "keeper not asked" in r.getMessage())
        assert f"no answer from checkpoint keeper: list at {wait['where']} (pid {pid}) within 1 s" in line, line
        assert "stopped by a signal" in line, line
        assert waits.current() == []
        # the next memory save does not wait on it again: it is left alone for a while
        started = time.monotonic()
        assert restorer.save_to_memory(other) is None
        assert time.monotonic() - started < 1.0
        restorer.close()
    finally:
        os.kill(pid, signal.SIGCONT)
        keeper_control.stop_keeper(keeper_dir(cfg.checkpoint.staging_dir))  # no keeper outlives the test
