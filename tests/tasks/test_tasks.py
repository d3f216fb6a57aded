"""Each task's side effect, called through ``.fn()`` (no flow run), against real files and a real
Prefect server for the artifacts and events they emit."""

from __future__ import annotations

import json
import math

import pytest

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.config import ConfigError
from megatrain.reliability.rollback import read_rollbacks

ONE_STAGE = "- {name: only, steps: 6}\n"


def test_validate_campaign_returns_the_campaign_and_refuses_bad_fields(campaign_file):
    from tasks.campaign import validate_campaign

    campaign = validate_campaign.fn(str(campaign_file("ok", ONE_STAGE)))
    assert campaign.id == "ok" and campaign.stages[0].steps == 6
    bad = campaign_file("bad", "- {name: only, steps: 6, overrides: [model.n_head=7]}\n")
    with pytest.raises(ConfigError, match="(?s)stage 'only'.*model: .*divisible by n_head"):
        validate_campaign.fn(str(bad))


def _stage_config_file(campaign_file, name="rb"):
    from megatrain.launch.ranks import write_run_config

    campaign = load_campaign(campaign_file(name, ONE_STAGE))
    cfg = stage_config(campaign, 0)
    return campaign, cfg, write_run_config(cfg, campaign.stage_dir(0) / "config.yaml")


@pytest.mark.slow
def test_rollback_records_the_window_and_stops_after_the_limit(prefect_api, campaign_file):
    from tasks.rollback import RollbackLimitExceeded, rollback

    campaign, cfg, config_path = _stage_config_file(campaign_file)
    verdict = {"kind": "loss_spike", "step": 5, "value": 40.0, "baseline": 3.0, "message": "loss 40 vs 3"}
    record = rollback.fn(campaign.id, "only", str(config_path), verdict, 1)
    # no committed checkpoint yet: back to step 0, skipping the five batches that led to the spike
    assert record["restore_step"] == 0 and record["skip_samples"] == 5 * cfg.train.global_batch_size
    for count in range(2, cfg.reliability.max_rollbacks + 1):
        rollback.fn(campaign.id, "only", str(config_path), dict(verdict, step=5 + count), count)
    assert len(read_rollbacks(cfg.train.run_dir)) == cfg.reliability.max_rollbacks
    with pytest.raises(RollbackLimitExceeded, match="loss_spike at step 5 -> step 0"):
        rollback.fn(campaign.id, "only", str(config_path), dict(verdict, step=20), 99)


def test_write_report_makes_tables_a_curve_and_a_summary(prefect_api, campaign_file):
    from tasks.report import write_report

    campaign = load_campaign(campaign_file("report", ONE_STAGE))
    run_dir = campaign.stage_dir(0)
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "loss": 7.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 1024 * s,
             "step_time_s": 0.1, "tokens_per_s": 10240.0, "mfu": None, "phases_ms": {"forward": 30.0}}
            for s in range(1, 7)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = {"stage": "only", "steps": 6, "attempts": 2, "restarts": 1, "rollbacks": 0, "run_dir": str(run_dir),
              "durable_url": str(campaign.stage_durable_url(0)),
              "history": [{"status": "crashed", "message": "ranks exited with code 1"}, {"status": "completed", "message": ""}]}
    summary = write_report.fn(campaign, [result])
    (stage,) = summary["stages"]
    assert stage["final loss"] == pytest.approx(6.4) and stage["restarts"] == 1 and stage["tokens/s"] == 10240
    report = (campaign.campaign_dir / "report" / "report.md").read_text()
    assert "attempt 1: **crashed**" in report and "attempt 2: **completed**" in report
    assert (campaign.campaign_dir / "report" / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_self_check_passes_on_this_machine_and_names_a_failing_check(prefect_api, campaign_file):
    from tasks.selfcheck import SelfCheckFailed, run_self_check

    campaign = load_campaign(campaign_file("sc", ONE_STAGE))
    result = run_self_check.fn(campaign)
    assert result["checks"] >= 3
    rows = json.loads((campaign.campaign_dir / "selfcheck.json").read_text())
    assert all(row["passed"] for row in rows) and all(math.isfinite(row["value"]) for row in rows)
    strict = campaign.model_copy(update={"overrides": [*campaign.overrides, "reliability.selfcheck.min_gemm_tflops=1e9"]})
    with pytest.raises(SelfCheckFailed, match="gemm"):
        run_self_check.fn(strict)


def test_validate_campaign_names_a_missing_data_source_or_tokenizer(campaign_file, tmp_path):
    from megatrain.errors import InputError
    from tasks.campaign import validate_campaign

    glob = campaign_file("noglob", f'- {{name: only, steps: 6, overrides: ["data.sources=[{tmp_path}/none-*.txt]"]}}\n')
    with pytest.raises(InputError, match=r"stage only: data.sources source '.*none-\*.txt' matches no file"):
        validate_campaign.fn(str(glob))
    missing = campaign_file("nofile", f'- {{name: only, steps: 6, overrides: ["data.sources=[{tmp_path}/gone.txt]"]}}\n')
    with pytest.raises(InputError, match="data.sources source .*gone.txt' does not exist"):
        validate_campaign.fn(str(missing))
    component = campaign_file("nomix", "- {name: only, steps: 6, overrides: ['data.mixture=[{name: code, sources: [stdlib], "
                              f"weight: 1}}, {{name: web, sources: [{tmp_path}/web.jsonl.gz], weight: 1}}]']}}\n")
    with pytest.raises(InputError, match="stage only: data.mixture component 'web' source .*web.jsonl.gz' does not exist"):
        validate_campaign.fn(str(component))
    tokenizer = campaign_file("notok", f"- {{name: only, steps: 6, overrides: [data.tokenizer={tmp_path}/tok.json]}}\n")
    with pytest.raises(InputError, match="data.tokenizer .*tok.json' does not exist"):
        validate_campaign.fn(str(tokenizer))


def test_shard_data_retries_io_errors_only():
    from prefect.states import Failed

    from megatrain.data.index import DataError
    from megatrain.errors import InputError
    from megatrain.storage import StorageError
    from tasks.data import _transient

    def failed(exc):
        return Failed(data=exc)

    assert _transient(None, None, failed(StorageError("s3://b/x", "connection reset")))
    assert _transient(None, None, failed(TimeoutError("read timed out")))
    assert not _transient(None, None, failed(DataError("source 'x': the glob matches no file")))
    assert not _transient(None, None, failed(InputError("tokenizer missing")))
    assert not _transient(None, None, failed(KeyError("a bug")))


def test_a_stage_is_durable_only_when_its_final_step_is_committed_and_verifies(tmp_path):
    from megatrain.checkpoint.files import FileRecord, step_dir_name
    from tasks.train import final_checkpoint_problem

    durable = tmp_path / "durable"
    assert "final step 4 is not committed" in final_checkpoint_problem(str(durable), 4)
    step_dir = durable / step_dir_name(4)
    step_dir.mkdir(parents=True)
    import hashlib

    import torch
    from safetensors.torch import save

    weights = save({"w": torch.ones(4)})  # a real safetensors file: a fake one fails its parse check
    (step_dir / "model.safetensors").write_bytes(weights)
    record = FileRecord(size=len(weights), sha256=hashlib.sha256(weights).hexdigest())
    manifest = {"step": 4, "files": {"rank-00000": {"model.safetensors": record.to_json()}}, "bytes": len(weights)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    assert final_checkpoint_problem(str(durable), 4) is None
    (step_dir / "model.safetensors").write_bytes(weights[:-1] + b"\x00")  # corrupted at rest: one byte of w
    assert "final step 4 does not verify" in final_checkpoint_problem(str(durable), 4)
    (step_dir / "manifest.json").write_text("{not json")
    assert "unreadable manifest" in final_checkpoint_problem(str(durable), 4)


def test_upload_retries_a_storage_failure_but_not_a_deterministic_one():
    from prefect.states import Failed

    from megatrain.errors import UnsafePathError
    from megatrain.storage import NoSpaceError, StorageError
    from tasks._retry import unless_deterministic

    assert unless_deterministic(None, None, Failed(data=StorageError("s3://b/x", "connection reset")))
    assert unless_deterministic(None, None, Failed(data=RuntimeError("a crash")))
    assert not unless_deterministic(None, None, Failed(data=NoSpaceError("/staging/step-2", "staging", 10, 0)))
    assert not unless_deterministic(None, None, Failed(data=UnsafePathError("'../x' leaves /staging/step-2")))


def test_an_unsafe_staged_name_fails_the_upload_task_once_without_retries(prefect_api, tmp_path):
    """Through a real task run: one run, no backoff (the retries would have waited 2+4+8+16+32 s)."""
    from prefect import flow

    from megatrain.checkpoint.files import rank_marker, rank_meta_file, step_dir_name, write_json
    from megatrain.errors import UnsafePathError
    from tasks.checkpoint import upload_checkpoint

    step_dir = tmp_path / "staging" / step_dir_name(2)
    step_dir.mkdir(parents=True)
    meta = write_json(step_dir / rank_meta_file(0), {"step": 2, "rank": 0})
    write_json(step_dir / rank_marker(0), {
        "step": 2, "rank": 0, "fingerprint": "f", "coords": {"dp": 0, "tp": 0, "pp": 0},
        "layout": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1},
        "files": {rank_meta_file(0): meta.to_json(), "../../outside.bin": meta.to_json()}})

    @flow
    def one_upload() -> tuple:
        state = upload_checkpoint(str(tmp_path / "staging"), str(tmp_path / "durable"), 2, 2, return_state=True)
        with pytest.raises(UnsafePathError, match="outside.bin"):
            state.result()
        return state.is_failed(), state.state_details.task_run_id

    failed, task_run_id = one_upload()
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_task_run(task_run_id)
    assert failed and run.run_count == 1  # no retry
    assert not (tmp_path / "durable").exists() or not any((tmp_path / "durable").rglob("manifest.json"))


class _Ended:
    """A task run's final state as ``retry_condition_fn`` sees it: ``result()`` raises its error."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self):
        raise self.exc


def test_validate_campaign_probes_every_location_and_retries_only_an_outage(campaign_file, tmp_path):
    """The preflight in validate-campaign: a read-only durable store (a real ro tmpfs) fails at
    once in one line naming the field, the path and the bytes, and the task does not retry it; a
    store where nothing listens is an outage, which it does retry."""
    import socket
    import subprocess

    from megatrain.storage import LocationNotWritable, StorageError
    from tasks.campaign import validate_campaign

    disk = tmp_path / "ro"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)], check=False,
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        path = campaign_file("ro", ONE_STAGE, extra=f"durable_url: {disk}\n")
        with pytest.raises(LocationNotWritable) as failed:
            validate_campaign.fn(str(path))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    message = str(failed.value)
    assert message.startswith(f"checkpoint.durable_url {disk}/only is not writable: OSError: [Errno 30] Read-only "
                              "file system; it must hold two checkpoints (2 x ") and message.endswith("(1.0 MiB) free")
    assert "\n" not in message
    assert validate_campaign.retry_condition_fn(None, None, _Ended(failed.value)) is False
    assert not (tmp_path / "campaigns" / "ro").exists()  # the probes of the run and staging dirs left nothing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = campaign_file("down", ONE_STAGE, extra=f"durable_url: webhdfs://127.0.0.1:{port}/ckpt\n")
    with pytest.raises(StorageError, match=rf"^webhdfs://127.0.0.1:{port}/ckpt/only/\S+: ConnectionError") as down:
        validate_campaign.fn(str(path))
    assert validate_campaign.retry_condition_fn(None, None, _Ended(down.value)) is True
