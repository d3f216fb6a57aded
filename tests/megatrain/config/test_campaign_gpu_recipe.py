"""configs/campaign-gpu.yaml (``make demo-gpu``): one rank per visible GPU, refused at once without one."""

from pathlib import Path

import pytest

from megatrain.config import ConfigError
from megatrain.config.campaign import load_campaign, stage_config, visible_gpus

ROOT = Path(__file__).resolve().parents[3]
GPU_CAMPAIGN = ROOT / "configs/campaign-gpu.yaml"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU: auto resolves instead of failing")
def test_auto_without_a_gpu_fails_at_once_in_one_line():
    with pytest.raises(ConfigError) as raised:
        load_campaign(GPU_CAMPAIGN)
    fields = str(raised.value).splitlines()[1:]
    assert len(fields) == 1 and fields[0].startswith("  nproc_per_node:") and "needs a GPU" in fields[0]


def test_hidden_gpus_count_as_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES hides them"):
        visible_gpus()


def test_a_number_is_kept_and_every_stage_is_the_gpu_recipe():
    campaign = load_campaign(GPU_CAMPAIGN, ["nproc_per_node=2"])
    assert campaign.nproc_per_node == 2 and campaign.world_size == 2
    first, second = (stage_config(campaign, i) for i in range(2))
    for cfg in (first, second):  # the 1.3B recipe, compiled, on the device auto picks, bf16 there
        assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.compile) == (24, 2048, True)
        assert (cfg.train.device, cfg.train.dtype, cfg.parallel.world_size) == ("auto", "auto", 2)
        assert cfg.reliability.warm_standby
    assert (first.train.seq_len, second.train.seq_len or second.model.seq_len) == (1024, 2048)
    assert [(f.kind, f.rank) for f in first.reliability.faults] == [("kill_rank", 0)]
    assert [(f.kind, f.rank) for f in second.reliability.faults] == [("nan_loss", 0)]
    # each fault lies after a committed step of its own stage, so the recovery resumes mid-stage
    for cfg in (first, second):
        assert cfg.checkpoint.interval < cfg.reliability.faults[0].step <= cfg.train.steps
