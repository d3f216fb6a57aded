"""`make serve` as an operator uses it, against the real thing: scripts/serve.sh starts a Prefect
server and a process worker and registers the deployments; `prefect deployment run pretrain/local`
trains a small campaign with a crash and a NaN; the anomaly's event triggers the self-check for
that campaign; the UI shows the loss curve as a picture (headless Chromium, checked by pixel
colour); the CLI reads the campaign dir; `scripts/serve.sh stop` (make stop) ends every process
serve.sh started, with a campaign still training, and none is left in the process table.

One module, one server: the tests run in file order and share it (the last one stops it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # one server, two flow runs and a triggered self-check: ~8 min on 2 loaded cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def campaign_yaml(directory: Path, shard_url: Path, name: str, stages: list[dict]) -> Path:
    doc = {
        "id": name, "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 1,
        "root_dir": str(directory / "campaigns"), "shard_url": str(shard_url), "self_check": False,
        "overrides": ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2",
                      "train.log_interval=1", "reliability.heartbeat_interval_s=0.5",
                      "reliability.heartbeat_timeout_s=60"],
        "stages": stages,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def processes_with(marker: str) -> list[int]:
    """PIDs whose environment or command line holds ``marker`` (this test's PREFECT_HOME: every
    process serve.sh started inherits it, the flow runs and their ranks included)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            text = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in text:
            found.append(int(proc.name))
    return found


class Served:
    def __init__(self, tmp: Path, shard_root: Path):
        self.tmp = tmp
        self.home = tmp / "prefect-home"
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = dict(os.environ, PREFECT_HOME=str(self.home), MEGATRAIN_PREFECT_PORT=str(self.port),
                        MEGATRAIN_SERVE_DIR=str(tmp / "serve"), MEGATRAIN_IMAGE="registry.example/megatrain:test",
                        VENV_BIN=str(Path(sys.executable).parent), PREFECT_API_URL=self.api,
                        PYTHONPATH=str(ROOT), COLUMNS="400",  # rich: one event per line
                        # the worker asks for scheduled runs every 2 s, not Prefect's 10: three runs
                        # (two deployment runs, the triggered self-check) each start up to 8 s sooner
                        PREFECT_WORKER_QUERY_SECONDS="2")
        self.shard_root = shard_root
        self.flow_run_id: str | None = None

    def sh(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.sh(str(Path(sys.executable).parent / "prefect"), *args, timeout=timeout)

    def api_post(self, path: str, body: dict) -> list | dict:
        import urllib.request

        request = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory, shard_root, seeded_prefect_db):
    served = Served(tmp_path_factory.mktemp("serve"), shard_root)
    # $PREFECT_HOME/prefect.db, migrated already (a copy of the session's template): `prefect server
    # start` finds nothing to migrate and is healthy ~10 s sooner; the database is still its own
    seeded_prefect_db(served.home / "prefect.db")
    started = served.sh(str(ROOT / "scripts/serve.sh"), timeout=600)
    assert started.returncode == 0, started.stdout + started.stderr
    yield served
    served.sh(str(ROOT / "scripts/serve.sh"), "stop", timeout=120)  # a no-op when the last test stopped it


def test_serve_registers_local_self_check_and_the_cluster_with_its_image(served):
    deployments = {d["name"]: d for d in served.api_post("/deployments/filter", {})}
    assert set(deployments) == {"local", "self-check-on-anomaly", "cluster"}
    assert deployments["local"]["parameters"]["campaign_id"] == "new"
    cluster = deployments["cluster"]
    assert cluster["job_variables"]["image"] == "registry.example/megatrain:test"
    assert cluster["job_variables"]["env"]["MEGATRAIN_IMAGE"] == "registry.example/megatrain:test"
    assert cluster["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/megatrain"}}]


def test_a_deployment_run_trains_a_fresh_campaign_and_recovers(served):
    stages = [
        {"name": "first", "steps": 6, "overrides": ["train.seq_len=64", "reliability.faults=[{kind: kill_rank, step: 5, rank: 0}]"]},
        {"name": "second", "steps": 6, "overrides": ["reliability.faults=[{kind: nan_loss, step: 4, rank: 0}]"]},
    ]
    path = campaign_yaml(served.tmp, served.shard_root, "ui", stages)
    run = served.prefect("deployment", "run", "pretrain/local", "-p", f"campaign_path={path}", "-p", "campaign_id=new",
                         "--watch", "--watch-timeout", "900", timeout=960)
    output = run.stdout + run.stderr
    (served.tmp / "watch.log").write_text(output)
    assert run.returncode == 0, output
    served.flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)
    (flow_run,) = served.api_post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [served.flow_run_id]}}})
    assert flow_run["state"]["type"] == "COMPLETED"
    campaigns = [p for p in (served.tmp / "campaigns").iterdir() if p.name.startswith("ui-")]
    assert len(campaigns) == 1  # "new": the file's id plus the flow run's
    served.campaign_dir = campaigns[0]
    assert served.campaign_dir.name == f"ui-{served.flow_run_id[:8]}"
    report = json.loads((served.campaign_dir / "report/report.json").read_text())
    assert [f["status"] for f in report["faults"]] == ["crashed", "anomaly"]
    # --watch streams events: the report's path is one, the progress bar's updates are few
    assert f"megatrain.report.written * {served.campaign_dir / 'report/report.md'}" in output.replace("\n", "")
    assert output.count("prefect.artifact.updated") <= 2 * 11, output
    # ...and the progress in words: each stage's tens of percent, named by stage and step
    flat = output.replace("\n", "")
    assert "megatrain.stage.progress * stage first: 100% (step 6 of 6)" in flat, output
    assert "megatrain.stage.progress * stage second: 100% (step 6 of 6)" in flat, output


def test_the_loss_curve_is_a_picture_in_the_ui(served):
    sys.path.insert(0, str(ROOT / "scripts"))
    from ui_pictures import TRAIN_COLOR, capture, is_blank, pixels_near

    shots = capture(served.api, served.flow_run_id, served.tmp / "screenshots")
    curve = pixels_near(shots["loss-curve"], TRAIN_COLOR)
    assert curve >= 400, f"the loss curve's colour covers {curve} pixels of {shots['loss-curve']}"
    assert pixels_near(shots["report"], TRAIN_COLOR) >= 400  # the report artifact shows it too
    assert not [name for name, png in shots.items() if is_blank(png)]  # every page drew itself
    if os.environ.get("MEGATRAIN_SCREENSHOTS"):  # keep them (docs/screenshots)
        for name, png in shots.items():
            shutil.copy(png, Path(os.environ["MEGATRAIN_SCREENSHOTS"]) / png.name)


def test_the_anomaly_triggers_the_self_check_of_that_campaign(served):
    config = str(served.campaign_dir / "second" / "config.yaml")
    deadline = time.monotonic() + 240
    while True:
        runs = [r for r in served.api_post("/flow_runs/filter", {}) if r["parameters"].get("config_path")]
        done = [r for r in runs if r["state"] and r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED")]
        if done or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert done, f"no triggered self-check finished; runs with a config_path: {runs}"
    (check,) = done
    assert check["parameters"]["config_path"] == config
    assert check["parameters"]["campaign_id"] == served.campaign_dir.name
    assert check["parameters"]["nodes"] == socket.gethostname()
    assert check["state"]["type"] == "COMPLETED"
    assert (served.campaign_dir / "second" / "selfcheck.json").exists()
    # not beside the training it diagnoses: it measured after the relaunched ranks were done
    beats = [json.loads(p.read_text()) for p in (served.campaign_dir / "second" / "heartbeats").glob("rank*.json")]
    done_at = max(beat["timestamp"] for beat in beats)
    measured_at = (served.campaign_dir / "second" / "selfcheck.json").stat().st_mtime
    assert all(beat["phase"] == "done" for beat in beats) and measured_at > done_at


def test_the_cli_reads_the_campaign_dir_and_a_rerun_says_it_is_finished(served):
    megatrain = [sys.executable, "-m", "megatrain.cli"]
    status = served.sh(*megatrain, "status", str(served.campaign_dir), "--json")
    stages = json.loads(status.stdout)["stages"]
    assert [(s["name"], s["state"], s["last_step"], s["committed"][-1]) for s in stages] == [
        ("first", "done", 6, 6), ("second", "done", 6, 6)]
    assert stages[0]["restarts"] == 1 and stages[1]["rollbacks"] == 1
    assert "crashed" in stages[0]["last_fault"] and "nan" in stages[1]["last_fault"]
    table = served.sh(*megatrain, "status", served.campaign_dir.name, "--root", str(served.campaign_dir.parent)).stdout
    assert "first" in table and "6/6" in table and "finished" in table
    listed = served.sh(*megatrain, "checkpoints", "list", str(served.campaign_dir / "durable")).stdout
    assert listed.count("yes") >= 4 and "/first/" in listed and "/second/" in listed
    verified = served.sh(*megatrain, "checkpoints", "verify", str(served.campaign_dir))
    assert verified.returncode == 0 and "ok" in verified.stdout
    report = served.sh(*megatrain, "report", str(served.campaign_dir))
    assert report.returncode == 0 and "faults detected and recovered: 2" in report.stdout
    rerun = served.sh(sys.executable, "-m", "flows.pretrain", str(served.tmp / "ui.yaml"), f"id={served.campaign_dir.name}")
    assert rerun.returncode == 0 and "is already finished" in rerun.stdout, rerun.stdout + rerun.stderr
    # a deployment run of the finished campaign ends as the command line does: nothing runs again
    again = served.prefect("deployment", "run", "pretrain/local", "-p", f"campaign_path={served.tmp / 'ui.yaml'}",
                           "-p", f"campaign_id={served.campaign_dir.name}", "--watch", "--watch-timeout", "300",
                           timeout=360)
    output = again.stdout + again.stderr
    assert again.returncode == 0 and "megatrain.campaign.already-finished * campaign" in output, output
    assert "is already finished" in output.replace("\n", ""), output
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)
    task_runs = served.api_post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    assert [t["name"].rsplit("-", 1)[0] for t in task_runs] == ["validate-campaign"], task_runs


def test_make_stop_ends_everything_serve_started_even_mid_training(served):
    slow = [{"name": "slow", "steps": 400, "overrides": ["train.seq_len=64"]}]
    path = campaign_yaml(served.tmp, served.shard_root, "slow", slow)
    run = served.prefect("deployment", "run", "pretrain/local", "-p", f"campaign_path={path}", "-p", "campaign_id=new")
    assert run.returncode == 0, run.stdout + run.stderr
    deadline = time.monotonic() + 240
    ranks = lambda: set(processes_with("megatrain.train")) & set(processes_with(str(path.parent / "campaigns" / "slow-")))
    while not ranks():
        assert time.monotonic() < deadline, "the slow campaign's ranks never started"
        time.sleep(1)
    assert processes_with(str(served.home))  # the server, the worker, the flow run and its ranks

    stop = served.sh(str(ROOT / "scripts/serve.sh"), "stop", timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "none left" in stop.stdout
    left = processes_with(str(served.home))
    assert left == [], {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left}
