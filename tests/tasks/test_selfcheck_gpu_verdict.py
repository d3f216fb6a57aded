"""The self-check task the campaign runs before training (``flows/pretrain.py``), with the card
judged: this CPU node's real measurements judged as an H100 (``expected_gpu``) are far below
its figures. Without ``strict`` that is a warning and the task returns (training goes on); with
``strict`` the task fails in one line naming the card, the metric, measured vs expected."""

from __future__ import annotations

import json

import pytest

from megatrain.config.campaign import load_campaign

ONE_STAGE = "- {name: only, steps: 6}\n"
CHEAP = ["reliability.selfcheck.nproc_per_node=1", "reliability.selfcheck.gemm_size=128",
         "reliability.selfcheck.copy_mb=4", "reliability.selfcheck.storage_mb=1",
         "reliability.selfcheck.expected_gpu=NVIDIA H100 80GB HBM3"]


def test_a_slow_card_warns_and_with_strict_stops_the_campaign(prefect_api, campaign_file):
    from tasks.selfcheck import SelfCheckFailed, run_self_check

    campaign = load_campaign(campaign_file("gpuverdict", ONE_STAGE))
    judged = campaign.model_copy(update={"overrides": [*campaign.overrides, *CHEAP]})
    result = run_self_check.fn(judged)
    assert result["card"] == "H100 SXM"
    assert [w.split(" slow: ")[1].split(" ")[0] for w in result["warnings"]] == ["gemm", "memory_copy"]
    rows = {row["check"]: row for row in json.loads((campaign.campaign_dir / "selfcheck.json").read_text())}
    assert rows["gemm"]["expected"] == 742 and rows["gemm"]["verdict"] == "slow" and rows["gemm"]["passed"]
    assert rows["gemm"]["fraction"] == pytest.approx(rows["gemm"]["value"] / 742, abs=1e-3)
    assert rows["storage"]["expected"] is None and rows["storage"]["verdict"] == ""

    strict = judged.model_copy(update={"overrides": [*judged.overrides, "reliability.selfcheck.strict=true"]})
    with pytest.raises(SelfCheckFailed) as failed:
        run_self_check.fn(strict)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("self-check failed: ")
    assert "gemm (GPU 'NVIDIA H100 80GB HBM3' (H100 SXM) slow: gemm " in message
    assert " TFLOP/s < 0.8 x expected 742 TFLOP/s (0.00 of expected)" in message
    assert "memory_copy (GPU 'NVIDIA H100 80GB HBM3' (H100 SXM) slow: memory_copy " in message
