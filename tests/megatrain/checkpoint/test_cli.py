"""``megatrain checkpoints list|verify|inspect``."""

from __future__ import annotations

import json
from pathlib import Path

from checkpoint_fakes import run

from megatrain.checkpoint.cli import cli
from megatrain.checkpoint.files import step_dir_name


def test_list_verify_inspect(fresh, capsys):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    durable = cfg.checkpoint.durable_url
    Path(durable, step_dir_name(6)).mkdir()  # an upload that never finished
    capsys.readouterr()

    assert cli(["list", durable]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["step", "committed", "size", "files"]
    assert [line.split()[:2] for line in lines[1:]] == [["2", "yes"], ["4", "yes"], ["6", "no"]]

    assert cli(["verify", durable]) == 0
    assert "step 4: ok" in capsys.readouterr().out

    assert cli(["inspect", durable]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert cli(["inspect", f"{durable}/{step_dir_name(2)}"]) == 0  # a step dir works too
    assert json.loads(capsys.readouterr().out)["step"] == 2

    victim = f"{durable}/{step_dir_name(2)}/model-pp00-tp00.safetensors"
    with open(victim, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 1]))
    assert cli(["verify", durable]) == 1
    out = capsys.readouterr().out
    assert "step 2: CORRUPT" in out and "model-pp00-tp00.safetensors" in out and "step 4: ok" in out
    assert cli(["verify", durable, "--step", "4"]) == 0


def test_missing_url(tmp_path, capsys):
    assert cli(["list", str(tmp_path / "nothing")]) == 0
    assert "no checkpoints" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path / "nothing")]) == 1
