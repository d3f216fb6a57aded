"""The data of ``benchmarks/mfu.py``: megatrain's real pipeline, webdataset shards on local disk
(``shard_corpus`` on the standard library's source), sharded in a background process while the
baseline compiles; every row then reads them through ``megatrain.data.loader``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mfu_report import log

ROOT = Path(__file__).resolve().parents[1]


class Data:
    """Shards the corpus once (a background process), then hands out real loaders."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]):
        self.args, self.overrides = args, overrides
        self.proc: subprocess.Popen | None = None
        self.index = None
        self.started = time.perf_counter()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "megatrain.cli", "shard", "--config", self.args.config, *self.overrides]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.log_path = Path(self.args.work) / "shard.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        log(f"sharding in the background: {' '.join(cmd[1:])}")

    def ready(self, cfg):
        if self.index is None:
            if self.proc is not None:
                rc = self.proc.wait()
                if rc != 0:
                    raise RuntimeError(f"sharding failed (rc {rc}):\n{self.log_path.read_text()[-3000:]}")
                log(f"shards ready after {time.perf_counter() - self.started:.1f}s")
            from megatrain.data.shard import shard_corpus

            self.index = shard_corpus(cfg.data, cfg.seq_len, cfg.model.vocab_size)  # finds the finished index
        return self.index

    def loader(self, cfg, micro_batch_size: int, device=None):
        """The baseline's loader: megatrain's, with its batches pinned for a GPU (a torch.device) as the
        trainer's are."""
        from megatrain.data.loader import build_loader

        d = cfg.data
        return build_loader(self.ready(cfg), micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1, seed=d.seed,
                            prefetch_batches=d.prefetch_batches, on_bad_shard=d.on_bad_shard,
                            verify_checksums=d.verify_checksums, shuffle_shards=d.shuffle_shards, pin_device=device)
