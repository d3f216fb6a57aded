"""The campaign report from a campaign dir: stages in order, attempts with their log files, the
loss curve with its restart and rollback marks, and every picture inline for the UI."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatrain.config import load_config
from megatrain.launch.ranks import write_run_config
from megatrain.report.campaign import build_report
from megatrain.checkpoint.cli import stage_durable_urls
from megatrain.report.status import campaign_status
from megatrain.report.hang_view import Layout, hang_grid, plot_hang_grid
from megatrain.report.runs import fault_marks
from megatrain.observe.straggler import plot_heatmap

ROOT_DIR = Path(__file__).resolve().parents[3]


def metrics_row(step: int, loss: float, **extra) -> str:
    return json.dumps({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * step, "step_time_s": 0.1,
                       "tokens_per_s": 640.0, "mfu": None, "phases_ms": {}, **extra})


def hold_lease(directory: Path, owner: str, pid: int | None = None) -> None:
    """A lease file as ``megatrain.launch.lease`` writes it, held by this test process (alive) or
    by ``pid``."""
    from dataclasses import asdict

    from megatrain.launch.lease import LeaseRecord

    record = LeaseRecord(owner=owner)
    if pid is not None:
        record.pid, record.pid_start = pid, None
    (directory / "lease.json").write_text(json.dumps(asdict(record)))


def make_campaign(tmp_path):
    """Two stages written the way the flow writes them (config.yaml from a real resolved config),
    the second listed first on disk so that only the init_from chain can order them."""
    campaign = tmp_path / "camp-1"
    for name, previous in (("b-second", "a-first"), ("a-first", None)):
        overrides = [f"train.run_dir={campaign / name}", f"checkpoint.durable_url={campaign / 'durable' / name}", "train.steps=6"]
        if previous:
            overrides.append(f"checkpoint.init_from={campaign / 'durable' / previous}")
        write_run_config(load_config(ROOT_DIR / "configs/tiny-cpu.yaml", overrides), campaign / name / "config.yaml")
    first, second = campaign / "a-first", campaign / "b-second"
    # first: killed in step 5 (its row never written), restarted from the checkpoint at step 4:
    # the steps never go back, only attempts.jsonl says where the attempt ended
    steps = [(1, 7.0), (2, 6.8), (3, 6.6), (4, 6.5), (5, 6.4), (6, 6.3)]
    (first / "metrics.jsonl").write_text("\n".join(metrics_row(s, l) for s, l in steps) + "\n")
    (first / "attempts.jsonl").write_text("\n".join(json.dumps(a) for a in (
        {"attempt": 1, "status": "crashed", "message": "rank 1 exited on SIGKILL at step 5", "metrics_rows": 4,
         "log": str(first / "logs/attempt-1.log")},
        {"attempt": 2, "status": "completed", "message": "", "metrics_rows": 6, "log": str(first / "logs/attempt-2.log")},
    )) + "\n")
    # second: NaN at step 4, rolled back to step 2; validation loss every 2 steps
    steps = [(1, 6.2), (2, 6.1), (3, 6.0), (3, 6.05), (4, 5.9), (5, 5.8), (6, 5.7)]
    (second / "metrics.jsonl").write_text("\n".join(
        metrics_row(s, l, **({"val_loss": l + 0.2} if s % 2 == 0 else {})) for s, l in steps) + "\n")
    (second / "rollbacks.json").write_text(json.dumps([{"restore_step": 2, "anomaly_step": 4, "skip_samples": 16,
                                                        "lr_scale": 1.0, "kind": "nan_loss", "message": "step 4: loss is nan"}]))
    plot_heatmap([[1.0, 1.0, 2.0]] * 8, second / "stragglers.png", flagged=[2])
    layout = Layout(pp=1, dp=2, tp=1)
    plot_hang_grid(hang_grid({}, layout, dead=[1]), layout, second / "hang-attempt1.png")
    return campaign


def test_status_orders_stages_by_their_chain_and_reads_faults(tmp_path):
    campaign = make_campaign(tmp_path)
    status = campaign_status(campaign)
    assert [s.name for s in status.stages] == ["a-first", "b-second"]
    first, second = status.stages
    assert (first.attempts, first.restarts, first.last_step) == (2, 1, 6)
    assert first.last_fault == "the ranks finished but final step 6 is not committed"
    assert second.rollbacks == 1 and second.val_loss == 5.9 and "nan_loss at step 4" in second.last_fault
    # nothing committed and no lease: the ranks finished without a durable final step (what the
    # flow fails a stage for), whatever the age of metrics.jsonl; the second stage was never ended
    assert not status.finished and (first.state, second.state) == ("failed", "stopped")
    assert first.notes == second.notes == []
    hold_lease(campaign, "flow run of camp-1")  # a live flow: it works on the first stage not done
    first, second = campaign_status(campaign).stages
    assert (first.state, second.state) == ("running", "stopped")
    assert first.last_fault == "attempt 1 crashed: rank 1 exited on SIGKILL at step 5"
    assert campaign_status("camp-1", root=tmp_path).dir == str(campaign)
    assert stage_durable_urls(campaign) == [str(campaign / "durable/a-first"), str(campaign / "durable/b-second")]


def test_fault_marks_tell_restarts_from_rollbacks(tmp_path):
    campaign = make_campaign(tmp_path)
    assert fault_marks(campaign / "a-first") == [("restart", 4, 4)]
    assert fault_marks(campaign / "b-second") == [("rollback", 4, 2)]
    (campaign / "a-first" / "attempts.jsonl").unlink()  # an older run: where the steps went back
    (campaign / "a-first" / "metrics.jsonl").write_text("\n".join(metrics_row(s, 7.0 - s / 10) for s in (1, 2, 3, 4, 5, 5, 6)))
    assert fault_marks(campaign / "a-first") == [("restart", 5, 4)]


def test_report_has_every_picture_inline_for_the_ui_and_as_files_for_the_disk(tmp_path):
    campaign = make_campaign(tmp_path)
    report = build_report(campaign)
    assert list(report.pictures) == ["loss curve", "b-second: straggler heat map", "b-second: who hung (hang-attempt1)"]
    assert len(re.findall(r"!\[[^\]]*\]\(data:image/png;base64,[A-Za-z0-9+/=]{1000,}\)", report.ui_markdown)) == 3
    assert "data:image" not in report.markdown and "![loss curve](loss.png)" in report.markdown
    assert f"(full log: `{campaign / 'a-first/logs/attempt-1.log'}`)" in report.markdown
    assert [f["status"] for f in report.summary["faults"]] == ["crashed"]
    assert report.summary["stages"][1]["val loss"] == 5.9
    assert (campaign / "report/loss.png").stat().st_size > 10_000
    assert report.summary["tensorboard"] is None
    (campaign / "a-first" / "tb").mkdir()  # where the TensorBoard sink writes a stage's event files
    assert build_report(campaign).summary["tensorboard"] == str(campaign)


def test_report_shows_each_stages_samples_and_says_when_there_are_none(tmp_path):
    campaign = make_campaign(tmp_path)
    written = [{"prompt": "def ", "text": "def f(x):\n    return x", "step": 6}]
    (campaign / "a-first" / "samples.json").write_text(json.dumps(written))
    (campaign / "b-second" / "samples.json").write_text("{not json")  # a sampling that died mid-write
    report = build_report(campaign)
    assert report.summary["samples"] == {"a-first": written, "b-second": []}
    assert "    def f(x):\n        return x" in report.markdown  # an indented code block, lines kept
    assert "`b-second`: no samples" in report.markdown and "`b-second`: no samples" in report.ui_markdown
