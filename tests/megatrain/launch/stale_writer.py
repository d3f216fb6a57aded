"""A rank of a fenced attempt, run inside its host after the link is back: it tries what a stale rank
would (a heartbeat, an upload with commit of a staged step) through the real code paths, with the old
epoch in MEGATRAIN_EPOCH, and prints what the store answered, one JSON line.

    python stale_writer.py REDIS_URL RUN_ID STAGED_STEP_DIR DURABLE_URL"""

import json
import sys

from megatrain.checkpoint.upload import upload_checkpoint
from megatrain.config.reliability import ReliabilityConfig
from megatrain.launch.fencing import Fence, StaleEpoch
from megatrain.reliability.heartbeat_store import HeartbeatRecord, make_sink

url, run_id, staged, durable = sys.argv[1:5]
answers = {}
sink = make_sink(ReliabilityConfig(redis_url=url), "/nonexistent", run_id)
try:
    sink.publish(HeartbeatRecord(rank=1, step=999, phase="forward"))
    answers["heartbeat"] = "written"
except StaleEpoch as exc:
    answers["heartbeat"] = f"refused: {exc}"
try:
    upload_checkpoint(staged, durable, commit=True, retries=0, commit_timeout_s=5, fence=Fence.from_env(url, run_id))
    answers["commit"] = "committed"
except StaleEpoch as exc:
    answers["commit"] = f"refused: {exc}"
print(json.dumps(answers))
