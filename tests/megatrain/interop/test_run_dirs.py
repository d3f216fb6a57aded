"""Runs own their files, and commands find them from anywhere: a run trained with a relative
``train.run_dir``, then ``megatrain eval|generate|export|status`` (the real command, in a
subprocess) run from another working directory, after the run dir moved, on a copy of it, on a
campaign dir (its final stage) and on a stage dir, also after the campaign dir moved; and a new
run dir that starts from step 0 beside a finished one.

Four tiny trainings (two at a time), shared by the module's tests."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.launch.forked import run_module, start_module
from megatrain.launch.ranks import write_run_config
from tests.megatrain.conftest import TINY, child_env, read_metrics

# tiny-cpu at one layer, 2 steps, a validation split; a serial block and full attention so that
# export has a transformers class for it (GPT-2)
SMALL = ["model.n_layer=1", "model.block=serial", "model.attention=full", "data.max_source_bytes=200000",
         "data.val_fraction=0.1", "train.steps=2", "checkpoint.interval=2", "train.eval_interval=0"]


def start(args: list[str], cwd: Path):
    """``megatrain ARGS`` in ``cwd``, forked from the warm server (a fresh interpreter less its imports)."""
    return args, start_module("megatrain.cli", args, child_env(), cwd)


def finish(*started) -> None:
    outputs = [proc.communicate(timeout=300) for _, proc in started]  # all of them end before one is judged
    for (args, proc), (out, err) in zip(started, outputs):
        assert proc.returncode == 0, f"{args[:3]} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"


def megatrain(cwd: Path, *args: str) -> str:
    """The command's stdout; a failure shows its output."""
    proc = run_module("megatrain.cli", list(args), child_env(), cwd, timeout_s=300)
    assert proc.returncode == 0, f"megatrain {' '.join(args)} (cwd {cwd}) exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def ws(tmp_path_factory, shard_root) -> Path:
    """``start/runs/first`` and ``start/runs/second`` (run_dir relative to ``start``, the second
    after the first committed), and campaign ``camp`` of stages a -> b, trained as the flow runs a
    stage (``tasks/train.py``: the stage's config.yaml, then the trainer on it) from ``start``."""
    ws = tmp_path_factory.mktemp("run-dirs")
    (ws / "start").mkdir()
    (ws / "elsewhere").mkdir()
    train = ["train", "--config", str(TINY), f"data.shard_url={shard_root}", *SMALL]
    campaign_yaml = ws / "camp.yaml"
    campaign_yaml.write_text(textwrap.dedent(f"""\
        id: camp
        recipe: {TINY}
        root_dir: {ws / 'campaigns'}
        shard_url: {shard_root}
        self_check: false
        overrides: [{', '.join(o for o in SMALL if not o.startswith('train.steps'))}]
        stages: [{{name: a, steps: 2}}, {{name: b, steps: 2}}]
        """))
    campaign = load_campaign(campaign_yaml)
    stages = [write_run_config(stage_config(campaign, i), campaign.stage_dir(i) / "config.yaml") for i in (0, 1)]

    finish(start([*train, "train.run_dir=runs/first"], ws / "start"), start(["train", "--config", str(stages[0])], ws / "start"))
    finish(start([*train, "train.run_dir=runs/second"], ws / "start"), start(["train", "--config", str(stages[1])], ws / "start"))
    return ws


def check_commands(run: str, cwd: Path, owner: Path, out: Path) -> None:
    """eval, generate, export and status of ``run`` (as typed from ``cwd``) all find step 2 under ``owner``."""
    result = json.loads(megatrain(cwd, "eval", "--checkpoint", run))
    assert result["step"] == 2 and result["checkpoint"].startswith(str(owner) + "/"), result
    assert result["split"] == "val" and result["loss"] > 0
    assert "--- step 2, prompt 'def '" in megatrain(cwd, "generate", "--checkpoint", run, "--prompt", "def ", "--max-tokens", "3")
    megatrain(cwd, "export", "--checkpoint", run, "--out", str(out))
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    status = json.loads(megatrain(cwd, "status", run, "--json"))
    assert status["finished"] and status["stages"][-1]["committed"] == [2], status
    assert status["stages"][-1]["durable_url"].startswith(str(owner) + "/"), status


@pytest.mark.slow
def test_a_relative_run_dir_is_found_from_another_working_directory(ws):
    first = ws / "start" / "runs" / "first"
    record = json.loads((first / "run.json").read_text())  # what the run stored: absolute, never the cwd's
    assert record["config"]["train"]["run_dir"] == str(first)
    assert record["config"]["checkpoint"]["durable_url"] == str(first / "checkpoints")
    assert record["config"]["checkpoint"]["staging_dir"] == str(first / "staging")
    assert Path(record["data_index"]).is_absolute()
    check_commands("../start/runs/first", ws / "elsewhere", first, ws / "hf-here")


@pytest.mark.slow
def test_a_moved_run_dir_still_finds_its_checkpoints(ws):
    first, moved = ws / "start" / "runs" / "first", ws / "moved" / "renamed"
    moved.parent.mkdir(exist_ok=True)
    shutil.move(first, moved)  # where run.json says it is no longer exists
    try:
        check_commands("../moved/renamed", ws / "elsewhere", moved, ws / "hf-moved")
        # a copy is a run dir of its own: its checkpoints are the copy's, not the original's
        shutil.copytree(moved, ws / "copy")
        status = json.loads(megatrain(ws / "elsewhere", "status", str(ws / "copy"), "--json"))
        assert status["stages"][0]["durable_url"] == str(ws / "copy" / "checkpoints"), status
    finally:
        shutil.move(moved, first)


def test_a_new_run_dir_starts_from_step_zero(ws):
    first, second = ws / "start" / "runs" / "first", ws / "start" / "runs" / "second"
    assert [row["step"] for row in read_metrics(second)] == [1, 2]  # trained both steps: nothing to resume
    assert sorted(p.name for p in (second / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert (first / "checkpoints" / "step-00000002" / "manifest.json").exists()


@pytest.mark.slow
def test_a_campaign_dir_stands_for_its_final_stage_also_after_it_moved(ws):
    moved = ws / "moved-campaigns" / "camp"
    moved.parent.mkdir()
    shutil.move(ws / "campaigns" / "camp", moved)  # where the stages' config.yaml and run.json say is gone
    elsewhere = ws / "elsewhere"

    result = json.loads(megatrain(elsewhere, "eval", "--checkpoint", "../moved-campaigns/camp"))
    assert result["step"] == 2 and result["checkpoint"] == str(moved / "durable" / "b" / "step-00000002"), result
    text = megatrain(elsewhere, "generate", "--checkpoint", str(moved / "a"), "--prompt", "x", "--max-tokens", "2", "--json")
    assert json.loads(text.splitlines()[0])["step"] == 2
    for target in (moved, moved / "a"):  # a stage dir shows its campaign
        status = json.loads(megatrain(elsewhere, "status", str(target), "--json"))
        assert status["kind"] == "campaign" and status["finished"], status
        assert [(s["name"], s["committed"]) for s in status["stages"]] == [("a", [2]), ("b", [2])], status
        assert status["stages"][1]["durable_url"] == str(moved / "durable" / "b")


@pytest.mark.slow
def test_a_folder_that_is_no_run_is_one_line_naming_it(ws):
    proc = run_module("megatrain.cli", ["eval", "--checkpoint", "."], child_env(), ws / "elsewhere", timeout_s=120)
    expected = ("megatrain eval: .: not a run dir (no run.json or config.yaml), nor a campaign dir (stage folders with "
                "config.yaml), nor a checkpoint dir (step-* folders)")
    assert proc.returncode == 1 and proc.stdout == "" and proc.stderr.splitlines() == [expected], proc.stderr


def test_the_recorded_paths_are_read_against_the_run_dirs_place(tmp_path):
    """``relocate``'s three cases, on real folders: inside (the run dir's own), beside it (a
    campaign's durable/<stage>), elsewhere (as recorded); older records relative to the cwd."""
    from megatrain.config.run_dirs import relocate

    now = tmp_path / "now" / "stage"
    (now / "checkpoints").mkdir(parents=True)
    (tmp_path / "now" / "durable" / "stage").mkdir(parents=True)
    was = "/gone/camp/stage"
    assert relocate(f"{was}/checkpoints", was, now) == str(now / "checkpoints")  # inside
    assert relocate("/gone/camp/durable/stage", was, now) == str(tmp_path / "now" / "durable" / "stage")  # beside
    assert relocate("/gone/elsewhere/x", was, now) == "/gone/elsewhere/x"  # two levels up: not the run's
    assert relocate("s3://bucket/ckpt", was, now) == "s3://bucket/ckpt"
    assert relocate("runs/x/checkpoints", "runs/x", now) == str(now / "checkpoints")  # an older, cwd-relative record
    assert relocate(f"{was}/missing", was, now) == str(now / "missing")  # neither exists: where it belongs now

    then = tmp_path / "then" / "stage"  # the recorded run dir still there (``now`` is a copy of it)
    (then / "checkpoints").mkdir(parents=True)
    (tmp_path / "then" / "durable" / "stage").mkdir(parents=True)
    assert relocate(str(then / "checkpoints"), str(then), now) == str(now / "checkpoints")  # the copy's own
    durable = str(tmp_path / "then" / "durable" / "stage")
    assert relocate(durable, str(then), now) == durable  # beside it and still there: as recorded
