"""The campaign flow against a real Prefect server: resume after a killed flow run, and an
anomaly rollback. Training runs for real (torchrun, gloo, the real data pipeline)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from numbers_agree import assert_numbers_agree
from process_table import processes_mentioning

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.checkpoint.files import load_safetensors, step_dir_name
from megatrain.report.runs import read_metrics
from megatrain.reliability.rollback import read_rollbacks

ROOT = Path(__file__).resolve().parents[2]

TWO_STAGES = """\
- {name: first, steps: 4, overrides: [train.seq_len=64]}
- {name: second, steps: 6}
"""


def checkpoint_tensors(durable_url: str, step: int) -> dict[str, object]:
    """Every tensor of a committed checkpoint (all ranks' files), keyed by file and name."""
    step_dir = Path(durable_url) / step_dir_name(step)
    assert (step_dir / "manifest.json").exists(), f"{step_dir} is not committed"
    tensors = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        for name, tensor in load_safetensors(path.read_bytes()).items():
            tensors[f"{path.name}:{name}"] = tensor
    assert tensors
    return tensors


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_killed_flow_run_resumes_skips_finished_stages_and_matches_bit_for_bit(prefect_api, campaign_file):
    from flows.pretrain import pretrain

    reference = load_campaign(campaign_file("reference", TWO_STAGES))
    pretrain(str(campaign_file("reference", TWO_STAGES)))

    # The same math, but the second stage is slowed (an injected slow rank, in the first attempt
    # only) so the flow can be killed in the middle of it.
    slowed = TWO_STAGES.replace("{name: second, steps: 6}", (
        '{name: second, steps: 6, overrides: ["reliability.faults=[{kind: slow_rank, step: 1, slowdown: 15}]"]}'))
    path = campaign_file("interrupted", slowed)
    campaign = load_campaign(path)
    second_durable = campaign.stage_durable_url(1)
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONUNBUFFERED="1")
    log = (path.parent / "killed-flow.log").open("w")
    flow_process = subprocess.Popen([sys.executable, "-m", "flows.pretrain", str(path)], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:  # kill the whole flow process (SIGKILL) once the second stage has committed step 2
        wait_for(lambda: (Path(second_durable) / step_dir_name(2) / "manifest.json").exists(), 400,
                 "the second stage's first checkpoint")
    finally:
        os.killpg(flow_process.pid, signal.SIGKILL)
        flow_process.wait()
    # the ranks die with their parents (PR_SET_PDEATHSIG), nobody is left training
    stage_config_path = str(campaign.stage_dir(1) / "config.yaml")
    wait_for(lambda: not processes_mentioning(stage_config_path), 30, "the ranks to die with the flow")
    first_stage_rows = len((campaign.stage_dir(0) / "metrics.jsonl").read_text().splitlines())
    assert not (Path(second_durable) / step_dir_name(6) / "manifest.json").exists()

    report = pretrain(str(path))

    # the finished stage came from the cache: its ranks did not run again
    assert len((campaign.stage_dir(0) / "metrics.jsonl").read_text().splitlines()) == first_stage_rows
    assert [row["stage"] for row in report["stages"]] == ["first", "second"]
    # the interrupted stage resumed from its last committed checkpoint, not from step 0
    resumed_steps = [row["step"] for row in read_metrics(campaign.stage_dir(1))]
    assert resumed_steps == list(range(1, 7))
    logged = [json.loads(line)["step"] for line in (campaign.stage_dir(1) / "metrics.jsonl").read_text().splitlines()]
    assert logged.count(1) == logged.count(2) == 1  # the second attempt began after a committed checkpoint
    # and the final weights and optimizer state equal the uninterrupted run's, bit for bit
    want = checkpoint_tensors(reference.stage_durable_url(1), 6)
    got = checkpoint_tensors(second_durable, 6)
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and bool((want[key] == got[key]).all()), key


@pytest.mark.slow
@pytest.mark.check  # the one end-to-end flow of make check: shard, train, an anomaly, a rollback, the report
def test_nan_loss_rolls_back_skips_the_window_and_the_campaign_completes(prefect_api, campaign_file):
    from flows.pretrain import pretrain

    path = campaign_file("nan", """\
        - name: only
          steps: 8
          overrides: ["reliability.faults=[{kind: nan_loss, step: 5, rank: 0}]"]
        """)
    campaign = load_campaign(path)
    cfg = stage_config(campaign, 0)
    report = pretrain(str(path))

    assert report["stages"][0]["rollbacks"] == 1 and report["stages"][0]["steps"] == 8
    # one set of numbers: the flow's summary, status, report.json and TensorBoard; the NaN step's
    # row, logged before the rollback, is superseded by the step trained again
    (numbers,) = assert_numbers_agree(campaign.campaign_dir, summary=report).values()
    assert (numbers["attempts"], numbers["faults"], numbers["interrupts"]) == (2, 1, 0), numbers
    assert report["stages"][0]["superseded rows"] == 1
    # three samples from the final checkpoint, in report.json and report.md
    samples = report["samples"]["only"]
    assert len(samples) == 3 and all(s["step"] == 8 and s["text"].startswith(s["prompt"]) for s in samples)
    assert "## Samples" in Path(report["report"]).read_text()
    (record,) = read_rollbacks(cfg.train.run_dir)
    batch = cfg.train.global_batch_size
    assert (record.kind, record.anomaly_step, record.restore_step, record.skip_samples) == ("nan_loss", 5, 4, batch)
    rows = read_metrics(cfg.train.run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9)) and all(math.isfinite(r["loss"]) for r in rows)
    # the skipped window shows in the data position of the final checkpoint: 8 steps + 1 skipped batch
    manifest = json.loads((Path(cfg.checkpoint.durable_url) / step_dir_name(8) / "manifest.json").read_text())
    assert manifest["data_position"]["0"]["samples_consumed"] == 9 * batch
