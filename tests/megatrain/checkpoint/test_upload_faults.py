"""Faults around durable storage: an outage, a crash mid-upload. Training goes on, nothing
committed is lost, and a half-uploaded checkpoint is never restored."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from checkpoint_fakes import FlakyFileSystem, make_trainer, run

from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import step_dir_name
from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import verify_checkpoint
from megatrain.checkpoint.retention import apply_retention
from megatrain.checkpoint.upload import upload_checkpoint


def test_storage_outage_delays_uploads_and_loses_nothing(fresh, tmp_path):
    durable = f"flaky://{tmp_path / 'durable'}"
    cfg, trainer, checkpointer = fresh(interval=2, durable_url=durable, upload_backoff_s=0.2, upload_retries=8, keep_last=5)
    run(trainer, checkpointer, 2)
    checkpointer.close()  # step 2 committed before the outage
    checkpointer = Checkpointer(cfg, trainer.env, trainer.groups)
    FlakyFileSystem.failures = 0
    FlakyFileSystem.down_until = time.monotonic() + 2.0
    start = time.monotonic()
    run(trainer, checkpointer, 8)  # saves at 4, 6, 8 while storage is down
    assert time.monotonic() - start < 1.5, "the training loop waited for durable storage"
    assert time.monotonic() < FlakyFileSystem.down_until
    checkpointer.close()  # uploads retried through the outage
    assert FlakyFileSystem.failures > 0
    committed = catalog.committed(durable)
    assert [info.step for info in committed] == [2, 4, 6, 8]
    assert all(not verify_checkpoint(info.url, info.manifest) for info in committed)


_KILLED_UPLOADER = """
import sys, time
from megatrain import storage
from megatrain.checkpoint.upload import upload_checkpoint
real_put = storage.put_file
def put_then_stall(local, url):
    real_put(local, url)
    print("uploaded", url, flush=True)
    time.sleep(60)  # killed here, half-way through the step
storage.put_file = put_then_stall
upload_checkpoint(sys.argv[1], sys.argv[2], backoff_s=0.01)
"""


def test_crash_mid_upload_is_never_restored(fresh, tmp_path):
    cfg, trainer, checkpointer = fresh(interval=2, upload_mode="external")
    run(trainer, checkpointer, 4)
    checkpointer.close()
    staging, durable = cfg.checkpoint.staging_dir, cfg.checkpoint.durable_url
    upload_checkpoint(f"{staging}/{step_dir_name(2)}", durable)  # step 2: committed
    uploader = subprocess.Popen([sys.executable, "-c", _KILLED_UPLOADER, f"{staging}/{step_dir_name(4)}", durable],
                                stdout=subprocess.PIPE, text=True)
    assert uploader.stdout.readline().startswith("uploaded")
    uploader.send_signal(signal.SIGKILL)
    uploader.wait()

    infos = catalog.list_checkpoints(durable)
    assert [(i.step, i.committed) for i in infos] == [(2, True), (4, False)]
    assert infos[1].files >= 1  # a file of step 4 made it, the manifest did not
    assert apply_retention(durable, keep_last=1) == []  # nothing committed is lost
    # (A relaunched trainer discards its staging dir, so restore through another one here: the
    # staged step 4 is still needed below.)
    probe = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"staging_dir": str(tmp_path / "probe")})})
    other = make_trainer(probe, seed=3)
    assert Checkpointer(probe, other.env, other.groups).restore(other) == 2

    # Rerunning the upload (a Prefect retry) finishes the step, and then it is the one restored.
    result = upload_checkpoint(f"{staging}/{step_dir_name(4)}", durable)
    assert result.committed and 0 < result.bytes
    again = make_trainer(probe, seed=3)
    assert Checkpointer(probe, again.env, again.groups).restore(again) == 4
