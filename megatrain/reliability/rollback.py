"""Rollback records: how an anomaly changed the run, applied by the trainer on restore.

After an anomaly verdict the orchestrator picks the last committed checkpoint before the anomaly
and appends a record here; the relaunched trainer restores that checkpoint, sees the record for
the step it restored, and skips the offending data window (and scales the LR if the policy says
so). Applying the record exactly when restoring ``restore_step`` makes it idempotent: a crash
before the next checkpoint replays it, and later checkpoints already contain its effect.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RollbackRecord:
    restore_step: int  # the committed checkpoint step the run goes back to
    anomaly_step: int
    skip_samples: int  # global samples skipped after restoring (the offending window)
    lr_scale: float  # multiplies the learning rate from here on
    kind: str  # the verdict's kind (nan_loss, loss_spike, ...)
    message: str


def rollbacks_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "rollbacks.json"


def read_rollbacks(run_dir: str | Path) -> list[RollbackRecord]:
    path = rollbacks_path(run_dir)
    if not path.exists():
        return []
    return [RollbackRecord(**item) for item in json.loads(path.read_text())]


def append_rollback(run_dir: str | Path, record: RollbackRecord) -> list[RollbackRecord]:
    records = [*read_rollbacks(run_dir), record]
    path = rollbacks_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in records], indent=2))
    os.replace(tmp, path)
    return records


def pending_for(run_dir: str | Path, restored_step: int) -> list[RollbackRecord]:
    """The records that apply right after restoring ``restored_step``."""
    return [r for r in read_rollbacks(run_dir) if r.restore_step == restored_step]
