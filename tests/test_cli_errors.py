"""One error path for people (``megatrain/cli.py``): every command ends a failure a person can act
on with one line naming the file or field, and the documented exit code; a bug with one line
naming the file that holds its traceback.

The table runs the real commands in child processes (cwd = the repository, inputs under a tmp dir)
on bad inputs, including a real tiny committed checkpoint trained once for the module."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import megatrain
from megatrain import cli
from megatrain.errors import (
    EXIT_BUG,
    EXIT_CONFIG,
    EXIT_DETERMINISTIC,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NO_MEMORY,
    EXIT_TEMPORARY,
)
from megatrain.launch.forked import run_module

ROOT = Path(__file__).resolve().parents[1]

# Lines of third parties that are not the failure and that we cannot silence: substring -> why.
NOISE = {
    "[real_accelerator.py:": "DeepSpeed's 'Setting accelerator to CPU' warning, printed when deepspeed is imported "
                             "on a machine without a GPU (train imports it before the data are read)",
}
MAX_LINES = 3

# The tiny recipe, trained for 2 steps: serial block and full attention, so that it is a GPT-2 that
# export accepts (tiny-cpu's parallel block has no Hugging Face architecture: export would refuse
# it before reading the weights, and the corrupt file would never be read).
TINY = ["--config", "configs/tiny-cpu.yaml", "model.n_layer=1", "data.max_source_bytes=200000"]
BUILD = [*TINY, "train.steps=2", "checkpoint.interval=2", "model.block=serial", "model.attention=full",
         "train.run_dir={ws}/run", "checkpoint.staging_dir={ws}/run/staging", "checkpoint.durable_url={ws}/run/checkpoints",
         "data.shard_url={ws}/shards"]
SCRATCH = ["train.run_dir={ws}/scratch", "checkpoint.staging_dir={ws}/scratch/staging",
           "checkpoint.durable_url={ws}/scratch/checkpoints", "data.shard_url={ws}/shards", "train.steps=2"]
MODEL_FILE = "step-00000002/model-pp00-tp00.safetensors"


def run(args: list[str], tmp: Path, module: str = "megatrain.cli") -> subprocess.CompletedProcess:
    """``python -m module ARGS``, forked from this worker's warm fork server (megatrain/launch/forked.py:
    the process a fresh interpreter would be, less its 2-4 s of imports; test_version and the bug
    row below start fresh interpreters)."""
    env = {**os.environ, "TMPDIR": str(tmp)}  # a bug's traceback file lands under tmp
    return run_module(module, args, env, ROOT, timeout_s=180)


def output_lines(result: subprocess.CompletedProcess) -> list[str]:
    lines = (result.stdout + result.stderr).splitlines()
    return [line for line in lines if line.strip() and not any(noise in line for noise in NOISE)]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace: a committed tiny checkpoint (``run``), a copy of its checkpoints with one model
    file corrupted, one with a truncated tokenizer.json, and bad input files."""
    ws = tmp_path_factory.mktemp("cli-errors")
    built = run(["train", *(arg.format(ws=ws) for arg in BUILD)], ws)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    checkpoints = ws / "run" / "checkpoints"
    assert (checkpoints / MODEL_FILE).exists()

    corrupt = ws / "corrupt-checkpoints"  # a durable root: its committed steps are read from here
    shutil.copytree(checkpoints, corrupt)
    data = bytearray((corrupt / MODEL_FILE).read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + 64  # inside the tensors, past the header
    data[start:start + 16] = bytes(b ^ 0xFF for b in data[start:start + 16])
    (corrupt / MODEL_FILE).write_bytes(bytes(data))

    bad_tokenizer = ws / "bad-tokenizer-checkpoints"
    shutil.copytree(checkpoints, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_bytes((checkpoints / "tokenizer.json").read_bytes()[:700])

    (ws / "bad-field.yaml").write_text("model:\n  n_layer: -3\n")
    (ws / "binary.txt").write_bytes(bytes(range(256)) * 20)
    shard_tokenizer = next((ws / "shards").glob("*/tokenizer.json"))
    (ws / "truncated-tokenizer.json").write_bytes(shard_tokenizer.read_bytes()[:500])
    (ws / "a-directory").mkdir()
    (ws / "a-file").write_text("not a folder\n")
    (ws / "hf-without-config").mkdir()
    (ws / "hf-without-config" / "model.safetensors").write_bytes(b"")
    stages = "stages:\n  - name: a\n    steps: {steps}\n"
    campaign = f"id: bad\nrecipe: {ROOT / 'configs/tiny-cpu.yaml'}\nroot_dir: {ws / 'campaigns'}\nself_check: false\n"
    (ws / "campaign-bad-field.yaml").write_text(campaign + stages.format(steps=-1))
    (ws / "campaign-bad-yaml.yaml").write_text("id: [unclosed\n")
    (ws / "campaign-missing-corpus.yaml").write_text(
        campaign + f"overrides:\n  - data.sources=[{ws / 'missing.txt'}]\n" + stages.format(steps=2))
    unfinished_campaign(ws, checkpoints)
    (ws / "bad-record").mkdir()
    (ws / "bad-record" / "run.json").write_text('{"config": {"model": ')
    return ws


def unfinished_campaign(ws: Path, checkpoints: Path) -> None:
    """Campaign ``unfinished`` as the flow leaves it after its first stage: stage folders a and b
    with their config.yaml, stage a's checkpoints committed (a copy of the run's), b's none."""
    from megatrain.config.campaign import load_campaign, stage_config
    from megatrain.launch.ranks import write_run_config

    (ws / "unfinished.yaml").write_text(
        f"id: unfinished\nrecipe: {ROOT / 'configs/tiny-cpu.yaml'}\nroot_dir: {ws / 'campaigns'}\n"
        f"durable_url: {ws / 'unfinished-durable'}\nself_check: false\n"
        "stages:\n  - {name: a, steps: 2}\n  - {name: b, steps: 2}\n")
    campaign = load_campaign(ws / "unfinished.yaml")
    for index in (0, 1):
        write_run_config(stage_config(campaign, index), campaign.stage_dir(index) / "config.yaml")
    shutil.copytree(checkpoints, ws / "unfinished-durable" / "a")


def xfail(reason: str):
    return pytest.mark.xfail(strict=False, reason=reason)


# id: (command line, exit codes accepted, what the one line must name). "{ws}" is the workspace.
# Train meets a bad input inside the rank, which ends an InputError with 4, the launcher's code
# (megatrain/training/rank.py), and a DataError through megatrain.cli with 1: both are documented.
TRAIN_INPUT = {EXIT_INPUT, EXIT_DETERMINISTIC}
ROWS = {
    # train
    "train: a bad config field": (["train", "--config", "{ws}/bad-field.yaml"], {EXIT_CONFIG}, ["bad-field.yaml", "model.n_layer"]),
    "train: a missing config file": (["train", "--config", "{ws}/missing.yaml"], {EXIT_CONFIG}, ["missing.yaml"]),
    "train: an override of an unknown key": (["train", *TINY, "model.nonsense=1"], {EXIT_CONFIG}, ["model.nonsense"]),
    "train: a missing corpus file": (["train", *TINY, *SCRATCH, "data.sources=[{ws}/missing.txt]"], TRAIN_INPUT,
                                     ["missing.txt"]),
    "train: a binary corpus file": (["train", *TINY, *SCRATCH, "data.sources=[{ws}/binary.txt]"], TRAIN_INPUT,
                                    ["binary.txt", "binary"]),
    "train: a truncated tokenizer.json": (["train", *TINY, *SCRATCH, "data.tokenizer={ws}/truncated-tokenizer.json"],
                                          TRAIN_INPUT, ["truncated-tokenizer.json"]),
    "train: bf16 on ZeRO-0 (an optimizer no checkpoint can hold), refused before the first step": (
        ["train", *TINY, *SCRATCH, "parallel.zero_stage=0", "train.dtype=bf16"], {EXIT_DETERMINISTIC},
        ["parallel.zero_stage=0", "zero_stage=1"]),
    "train: a directory as the config": (["train", "--config", "{ws}/a-directory"], {EXIT_INPUT}, ["a-directory"]),
    # shard
    "shard: a bad config field": (["shard", "--config", "{ws}/bad-field.yaml"], {EXIT_CONFIG}, ["model.n_layer"]),
    "shard: a missing config file": (["shard", "--config", "{ws}/missing.yaml"], {EXIT_CONFIG}, ["missing.yaml"]),
    "shard: an override of an unknown key": (["shard", *TINY, "data.nonsense=1"], {EXIT_CONFIG}, ["data.nonsense"]),
    "shard: a missing corpus file": (["shard", *TINY, "data.shard_url={ws}/shards", "data.sources=[{ws}/missing.txt]"],
                                     {EXIT_INPUT}, ["missing.txt"]),
    "shard: a binary corpus file": (["shard", *TINY, "data.shard_url={ws}/shards", "data.sources=[{ws}/binary.txt]"],
                                    {EXIT_INPUT}, ["binary.txt", "binary"]),
    "shard: a truncated tokenizer.json": (["shard", *TINY, "data.shard_url={ws}/shards",
                                           "data.tokenizer={ws}/truncated-tokenizer.json"],
                                          {EXIT_INPUT}, ["truncated-tokenizer.json"]),
    # export
    "export: a corrupt checkpoint": (["export", "--checkpoint", "{ws}/corrupt-checkpoints", "--out", "{ws}/hf-corrupt"],
                                     {EXIT_INPUT}, [MODEL_FILE, "corrupt"]),
    "export: a checkpoint dir that does not exist": (["export", "--checkpoint", "{ws}/no-such-run", "--out", "{ws}/hf"],
                                                     {EXIT_INPUT}, ["no-such-run"]),
    "export: a file where the output folder goes": (["export", "--checkpoint", "{ws}/run", "--out", "{ws}/a-file"],
                                                    {EXIT_INPUT}, ["a-file"]),
    # import
    "import: an HF dir without config.json": (["import", "--hf", "{ws}/hf-without-config", "--out", "{ws}/r.yaml"],
                                              {EXIT_INPUT}, ["hf-without-config", "config.json"]),
    "import: an HF dir that does not exist": (["import", "--hf", "{ws}/no-such-hf", "--out", "{ws}/r.yaml"],
                                              {EXIT_INPUT}, ["no-such-hf"]),
    # eval
    "eval: a corrupt checkpoint": (["eval", "--checkpoint", "{ws}/corrupt-checkpoints"], {EXIT_INPUT}, [MODEL_FILE, "corrupt"]),
    "eval: a checkpoint dir that does not exist": (["eval", "--checkpoint", "{ws}/no-such-run"], {EXIT_INPUT}, ["no-such-run"]),
    "eval: a directory as the config": (["eval", "--checkpoint", "{ws}/run", "--config", "{ws}/a-directory"],
                                        {EXIT_INPUT}, ["a-directory"]),
    "eval: a folder that is not a run": (["eval", "--checkpoint", "{ws}/a-directory"], {EXIT_INPUT},
                                         ["{ws}/a-directory: not a run dir"]),
    "eval: a damaged run.json": (["eval", "--checkpoint", "{ws}/bad-record"], {EXIT_INPUT}, ["{ws}/bad-record/run.json"]),
    "eval: a campaign dir whose final stage has no checkpoint": (
        ["eval", "--checkpoint", "{ws}/campaigns/unfinished"], {EXIT_INPUT},
        ["{ws}/campaigns/unfinished", "final stage 'b'", "stage 'a' has step 2"]),
    # generate
    "generate: a corrupt checkpoint": (["generate", "--checkpoint", "{ws}/corrupt-checkpoints", "--prompt", "def "],
                                       {EXIT_INPUT}, [MODEL_FILE, "corrupt"]),
    "generate: a checkpoint dir that does not exist": (["generate", "--checkpoint", "{ws}/no-such-run", "--prompt", "x"],
                                                       {EXIT_INPUT}, ["no-such-run"]),
    "generate: a prompt longer than the model's window": (["generate", "--checkpoint", "{ws}/run", "--prompt", "word " * 400],
                                                          {EXIT_INPUT}, ["--prompt", "model.seq_len"]),
    "generate: a truncated tokenizer.json beside the checkpoints": (
        ["generate", "--checkpoint", "{ws}/bad-tokenizer-checkpoints", "--prompt", "x"], {EXIT_INPUT},
        ["{ws}/bad-tokenizer-checkpoints/tokenizer.json: not valid JSON", "line 1 column"]),
    "generate: a folder that is not a run": (["generate", "--checkpoint", "{ws}/a-directory", "--prompt", "x"],
                                             {EXIT_INPUT}, ["{ws}/a-directory: not a run dir"]),
    # status
    "status: a folder that is no run or campaign": (["status", "{ws}/a-directory"], {EXIT_INPUT},
                                                    ["{ws}/a-directory: not a run dir"]),
    # checkpoints
    "checkpoints: inspect a missing step": (["checkpoints", "inspect", "{ws}/run/checkpoints", "--step", "7"],
                                            {EXIT_INPUT}, ["step 7"]),
    "checkpoints: inspect a dir that does not exist": (["checkpoints", "inspect", "{ws}/no-such-checkpoints"],
                                                       {EXIT_INPUT}, ["no-such-checkpoints"]),
    "checkpoints: verify a corrupt checkpoint": (["checkpoints", "verify", "{ws}/corrupt-checkpoints"],
                                                 {EXIT_INPUT}, [MODEL_FILE, "CORRUPT"]),
}
FLOW_ROWS = {
    "flow: a bad campaign field": (["{ws}/campaign-bad-field.yaml"], {EXIT_CONFIG}, ["campaign-bad-field.yaml", "stages.0.steps"]),
    "flow: a missing campaign file": (["{ws}/missing-campaign.yaml"], {EXIT_CONFIG}, ["missing-campaign.yaml"]),
    "flow: a campaign that is not YAML": (["{ws}/campaign-bad-yaml.yaml"], {EXIT_CONFIG}, ["campaign-bad-yaml.yaml"]),
    "flow: a directory as the campaign": (["{ws}/a-directory"], {EXIT_INPUT}, ["a-directory"]),
    # flows/lifecycle.py's code for a campaign whose inputs are missing: 2, nothing started
    "flow: a campaign whose corpus is missing": (["{ws}/campaign-missing-corpus.yaml"], {EXIT_CONFIG}, ["missing.txt"]),
}


def _params(rows: dict) -> list:
    return [row if hasattr(row, "marks") else pytest.param(*row) for row in rows.values()]


def _check(result: subprocess.CompletedProcess, codes: set[int], names: list[str], ws: Path) -> None:
    lines = output_lines(result)
    text = "\n".join(lines)
    assert result.returncode in codes, f"exit {result.returncode}, expected {sorted(codes)}:\n{text[-3000:]}"
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{text[-3000:]}"
    assert "Traceback" not in text and "internal error" not in text, text
    for name in names:
        assert name.format(ws=ws) in text, f"{name!r} not named in:\n{text}"


@pytest.mark.parametrize("args, codes, names", _params(ROWS), ids=list(ROWS))
@pytest.mark.slow
def test_a_bad_input_ends_in_one_line_naming_it(ws, args, codes, names):
    _check(run([arg.format(ws=ws) for arg in args], ws), codes, names, ws)


@pytest.mark.parametrize("args, codes, names", _params(FLOW_ROWS), ids=list(FLOW_ROWS))
@pytest.mark.slow
def test_a_bad_campaign_ends_in_one_line_naming_it(ws, args, codes, names):
    result = run([arg.format(ws=ws) for arg in args], ws, module="flows.pretrain")
    _check(result, codes, names, ws)
    assert "temporary server" not in result.stdout + result.stderr  # found before any server starts


def test_version():
    result = subprocess.run([sys.executable, "-m", "megatrain.cli", "--version"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == f"megatrain {megatrain.__version__}"


def test_a_bug_in_a_real_process_leaves_its_traceback_in_a_file(tmp_path):
    code = ("import sys; from megatrain import cli; cli.COMMANDS['boom'] = ('json:loads', 'a bug'); "
            "sys.exit(cli.main(['boom', 'x']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode == EXIT_BUG and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("megatrain boom: internal error TypeError: ") and "(traceback in " in line
    logs = list((tmp_path / "megatrain-errors").glob("megatrain-boom-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    assert "Traceback (most recent call last)" in logs[0].read_text() and "TypeError" in logs[0].read_text()


# The handler itself: a fake subcommand raising each class.

def _raising(factory):
    def command(argv: list[str]) -> int:
        raise factory()
    return command


def _storage_not_found():
    from megatrain.storage import StorageError

    try:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/shards")
    except FileNotFoundError as cause:
        error = StorageError("/x/shards", "not found")
        error.__cause__ = cause
        return error


def _torch_out_of_memory():
    import torch

    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # a PiB: torch's CPU allocator refuses it
    except RuntimeError as exc:
        return exc
    pytest.skip("this machine allocated a PiB")


def _storage_full():
    """What storage.errors_name makes of a full disk: a StorageError (an outage's class) caused by ENOSPC."""
    from megatrain.storage import StorageError

    error = StorageError("/x/shards/shard-000000.tar", "[Errno 28] No space left on device")
    error.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    return error


def _numpy_out_of_memory():
    import numpy as np

    try:
        np.empty(1 << 50, dtype=np.uint8)
    except MemoryError as exc:
        return exc
    pytest.skip("this machine allocated a PiB")


def _errors():
    from megatrain.checkpoint.files import ChecksumError, UnreadableFile
    from megatrain.checkpoint.restore import CheckpointError
    from megatrain.checkpoint.restore import CheckpointMismatch as RestoreMismatch
    from megatrain.checkpoint.upload import UploadError
    from megatrain.config import ConfigError
    from megatrain.config.schema import BatchSplitError
    from megatrain.data.index import BadShardError, DataError
    from megatrain.errors import (
        CheckpointMismatch,
        DeterministicError,
        InputError,
        MegatrainError,
        UnsafePathError,
    )
    from megatrain.storage import NoSpaceError, StorageError

    return {
        "ConfigError": (lambda: ConfigError("x.yaml: invalid config\n  model.n_layer: bad"), EXIT_CONFIG,
                        "x.yaml: invalid config | model.n_layer: bad"),
        "BatchSplitError": (lambda: BatchSplitError("train.global_batch_size 7: not a multiple"), EXIT_CONFIG,
                            "train.global_batch_size"),
        "InputError": (lambda: InputError("data.tokenizer 'x.json' does not exist"), EXIT_INPUT, "x.json"),
        "DataError": (lambda: DataError("a.txt: binary"), EXIT_INPUT, "a.txt: binary"),
        "BadShardError": (lambda: BadShardError("shard-000.tar", "truncated"), EXIT_INPUT, "bad shard shard-000.tar"),
        "ChecksumError": (lambda: ChecksumError("m.safetensors: sha256 differs (corrupted)"), EXIT_INPUT, "m.safetensors"),
        "UnreadableFile": (lambda: UnreadableFile("manifest.json: not valid JSON"), EXIT_INPUT, "manifest.json"),
        "CheckpointError": (lambda: CheckpointError("/c: no checkpoint restores"), EXIT_INPUT, "/c"),
        "CheckpointMismatch": (lambda: CheckpointMismatch("model.n_layer 2 != 1"), EXIT_DETERMINISTIC, "model.n_layer"),
        "restore.CheckpointMismatch": (lambda: RestoreMismatch("model.d_model 64 != 128"), EXIT_DETERMINISTIC, "d_model"),
        "DeterministicError": (lambda: DeterministicError("data exhausted"), EXIT_DETERMINISTIC, "data exhausted"),
        "UnsafePathError": (lambda: UnsafePathError("../x: leaves its folder"), EXIT_DETERMINISTIC, "../x"),
        "NoSpaceError": (lambda: NoSpaceError("/ckpt", "a checkpoint", 100, 10), EXIT_DETERMINISTIC, "/ckpt"),
        "MegatrainError": (lambda: MegatrainError("/run is in use"), EXIT_DETERMINISTIC, "/run is in use"),
        "StorageError": (lambda: StorageError("s3://b/k", "ReadTimeout: timed out"), EXIT_TEMPORARY, "s3://b/k"),
        "StorageError, not found": (_storage_not_found, EXIT_INPUT, "/x/shards: not found"),
        "UploadError": (lambda: UploadError("s3://b/step-2: gave up after 3 attempts"), EXIT_TEMPORARY, "s3://b/step-2"),
        "FileNotFoundError": (lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y.yaml"),
                              EXIT_INPUT, "/x/y.yaml: no such file or directory"),
        "IsADirectoryError": (lambda: IsADirectoryError(errno.EISDIR, "Is a directory", "/x/dir"), EXIT_INPUT,
                              "/x/dir: is a directory"),
        "FileExistsError": (lambda: FileExistsError(errno.EEXIST, "File exists", "/x/out"), EXIT_INPUT, "/x/out: file exists"),
        "ENOSPC": (lambda: OSError(errno.ENOSPC, "No space left on device", "/x/ckpt"), EXIT_DETERMINISTIC,
                   "/x/ckpt: no space left"),
        "ENOSPC at a buffered write's close": (lambda: OSError(errno.ENOSPC, "No space left on device"),
                                                EXIT_DETERMINISTIC, "no space left on device (or quota) while in "),
        "StorageError of a full disk": (_storage_full, EXIT_DETERMINISTIC, "/x/shards/shard-000000.tar: "),
        "MemoryError": (MemoryError, EXIT_NO_MEMORY, "out of host memory while in "),
        "numpy MemoryError": (_numpy_out_of_memory, EXIT_NO_MEMORY, "out of host memory while in "),
        "torch's allocator": (_torch_out_of_memory, EXIT_NO_MEMORY, "out of host memory while in "),
        "loader out of memory": (lambda: ImportError("libtorch_cpu.so: failed to map segment from shared object"),
                                 EXIT_NO_MEMORY, "out of host memory while importing modules"),
        "KeyboardInterrupt": (KeyboardInterrupt, EXIT_INTERRUPTED, "interrupted"),
    }


ERRORS = list(_errors())


@pytest.mark.parametrize("name", ERRORS)
def test_the_handler_ends_each_known_failure_in_one_line(name, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    factory, code, text = _errors()[name]
    assert cli.run_command("megatrain fake", _raising(factory), []) == code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("megatrain fake: ") and text in err, err
    assert not (tmp_path / "megatrain-errors").exists()  # no traceback file for a known failure


def test_a_subcommand_reached_through_main_goes_through_the_handler(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "fake", (f"{__name__}:_fake_bad_config", "raises a ConfigError"))
    assert cli.main(["fake"]) == EXIT_CONFIG
    assert capsys.readouterr().err == "megatrain fake: fake.yaml: invalid config | model.n_layer: must be > 0\n"


def _fake_bad_config(argv: list[str]) -> int:
    from megatrain.config import ConfigError

    raise ConfigError("fake.yaml: invalid config\n  model.n_layer: must be > 0")


def test_an_unexpected_exception_leaves_its_traceback_in_a_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def broken_subcommand(argv: list[str]) -> int:
        raise ValueError("unpacking went wrong\nsecond line")

    assert cli.run_command("megatrain fake", broken_subcommand, ["--flag"]) == EXIT_BUG
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith("megatrain fake: internal error ValueError: unpacking went wrong | second line")
    [log] = (tmp_path / "megatrain-errors").glob("megatrain-fake-*.log")
    assert line.endswith(f"(traceback in {log})")
    text = log.read_text()
    assert text.startswith("megatrain fake --flag\n")
    assert "Traceback (most recent call last)" in text and "broken_subcommand" in text and "ValueError" in text


def test_without_a_writable_tempdir_the_traceback_goes_to_stderr(capsys, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "not-a-dir"))
    assert cli.run_command("megatrain fake", _raising(lambda: KeyError("k")), []) == EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1] == "megatrain fake: internal error KeyError: 'k' (traceback above)"


def test_argparse_exits_and_return_codes_pass_through(capsys):
    with pytest.raises(SystemExit):
        cli.run_command("megatrain fake", lambda argv: sys.exit(2), [])
    assert cli.run_command("megatrain fake", lambda argv: 3, []) == 3
    assert cli.run_command("megatrain fake", lambda argv: None, []) == 0
    assert capsys.readouterr().err == ""
