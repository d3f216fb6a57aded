"""The flow's hold on a stage's checkpoint keepers (tasks/keepers.py), with real keeper processes:
one per node started before the stage, and every keeper of the stage's folders gone when it ends,
also when it ends by Ctrl-C and when a rank had to start a keeper of its own."""

from __future__ import annotations

import os
import time

import pytest

from megatrain.checkpoint.keeper_control import KeeperError, ask, start_keeper
from megatrain.config.campaign import load_campaign, stage_config
from tasks.keepers import stage_keepers


def serving(folder, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return int(ask(folder, "list")[0]["pid"])
        except KeeperError:
            assert time.monotonic() < deadline, f"no keeper serves {folder}"
            time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_RUN_TOKEN", "keepers-test-token-0123456789")  # restored after the test
    monkeypatch.setenv("MEGATRAIN_KEEPER_HOST", "127.0.0.1")


def test_stage_keepers_one_per_node_and_none_left_after_ctrl_c(campaign_file, token):
    path = campaign_file("keepers", "- name: only\n  steps: 4\n  overrides: [checkpoint.memory_interval=1, "
                                    "train.micro_batch_size=4]\n", nproc=1, extra="nnodes: 2\n")
    campaign = load_campaign(path)
    cfg = stage_config(campaign, 0)
    with pytest.raises(KeyboardInterrupt):
        with stage_keepers(campaign, 0, cfg) as folders:
            assert len(folders) == 2  # a keeper per node, each in the replication ring
            pids = [serving(folder) for folder in folders]
            assert all(ask(f, "list")[0]["peer"]["node"] == n for n, f in enumerate(folders))
            os.kill(pids[1], 9)  # node 1's keeper lost: its rank starts one of its own, not the flow's child
            while not gone(pids[1]):
                time.sleep(0.05)
            start_keeper(folders[1], campaign.stage_dir(0) / "keeper-rank.log")
            pids[1] = serving(folders[1])
            raise KeyboardInterrupt  # Ctrl-C in the stage
    for pid in pids:
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, f"keeper {pid} outlived the stage"
            time.sleep(0.05)
    assert not any((folder / "keeper.sock").exists() for folder in folders)


def test_no_keepers_without_memory_checkpoints(campaign_file):
    campaign = load_campaign(campaign_file("plain", "- name: only\n  steps: 4\n"))
    with stage_keepers(campaign, 0, stage_config(campaign, 0)) as folders:
        assert folders == []
