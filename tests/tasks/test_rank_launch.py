"""How a stage's ranks start (tasks/train.py ``rank_launch``): forked from the launcher's warm
server for CPU ranks on a machine without a GPU, the warm standby when asked for, torchrun when
forking is turned off."""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.config import load_config
from megatrain.launch.forked import ForkLaunch
from megatrain.launch.standby import StandbyLaunch
from tasks.train import rank_launch

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


def test_cpu_ranks_are_forked_unless_turned_off_or_a_standby_is_asked_for():
    forked = rank_launch(load_config(TINY, ["train.device=cpu"]), "run.yaml", 2)
    if torch.cuda.is_available():  # a GPU machine: fresh processes even for CPU ranks
        assert isinstance(forked, list)
    else:
        assert isinstance(forked, ForkLaunch) and forked.argv == ["--config", "run.yaml"] and forked.nproc_per_node == 2
    torchrun = rank_launch(load_config(TINY, ["train.device=cpu", "reliability.fork_cpu_ranks=false"]), "run.yaml", 2)
    assert isinstance(torchrun, list) and torchrun[1:3] == ["-m", "megatrain.launch.torchrun"]  # its stores on loopback
    standby = rank_launch(load_config(TINY, ["reliability.warm_standby=true"]), "run.yaml", 2)
    assert isinstance(standby, StandbyLaunch)
    gpu = rank_launch(load_config(TINY, ["train.device=cuda"]), "run.yaml", 1)
    assert isinstance(gpu, list)
