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


def test_inspect_and_verify_of_a_step_that_is_not_committed_exit_1_with_one_line(fresh, capsys):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    durable = cfg.checkpoint.durable_url
    unfinished = Path(durable, step_dir_name(6))
    unfinished.mkdir()  # an upload that never finished: files, no manifest
    (unfinished / "model-pp00-tp00.safetensors").write_bytes(b"partial")
    capsys.readouterr()

    for argv in (["inspect", durable, "--step", "6"], ["inspect", str(unfinished)],
                 ["verify", durable, "--step", "6"], ["verify", str(unfinished)]):
        assert cli(argv) == 1, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, (argv, out, err)
        assert "step 6" in err and "is not committed: it has no manifest.json" in err, err
    assert cli(["inspect", durable, "--step", "8"]) == 1
    assert "step 8 is not committed: there is no such step" in capsys.readouterr().err

    victim = Path(durable, step_dir_name(4), "model-pp00-tp00.safetensors")  # committed, then damaged
    victim.write_bytes(victim.read_bytes()[:-10])
    for argv in (["inspect", durable], ["inspect", durable, "--step", "4"], ["verify", durable, "--step", "4"]):
        assert cli(argv) == 1, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, (argv, out, err)
        assert "step 4" in err and "does not verify, so it counts as not committed" in err and victim.name in err
    assert cli(["inspect", durable, "--step", "2"]) == 0  # an older step still verifies
    assert json.loads(capsys.readouterr().out)["step"] == 2
