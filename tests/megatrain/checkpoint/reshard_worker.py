"""torchrun entry point of test_reshard.py: ``megatrain.train`` with every sample a rank consumes
recorded as (stream position, dp_rank, sha1 of its tokens) in ``$RESHARD_SAMPLES.<rank>``, so the
test can check that no sample is repeated or skipped across a change of layout."""

from __future__ import annotations

import hashlib
import json
import os
import sys

from megatrain.data import loader
from megatrain.training.rank import main

_next = loader.ShardLoader._next  # where next() and next_raw() both take their batches


def _recording_next(self: loader.ShardLoader):
    pos = self.samples_consumed
    batch, tensors = _next(self)  # [ranks, mb, seq_len + 1], and the thread's tensors of it (or None)
    with open(f"{os.environ['RESHARD_SAMPLES']}.{os.environ['RANK']}", "a") as out:
        for k, dp_rank in enumerate(self.stream.dp_ranks):
            for j in range(self.stream.mb):
                digest = hashlib.sha1(batch[k, j].tobytes()).hexdigest()
                out.write(json.dumps([pos + dp_rank * self.stream.mb + j, dp_rank, digest]) + "\n")
    return batch, tensors


loader.ShardLoader._next = _recording_next

if __name__ == "__main__":
    sys.exit(main())
