"""Held-out evaluation: the validation loss (and perplexity) on a fixed set of held-out samples.

The validation set is the first ``train.eval_batches * train.global_batch_size`` windows of the
shard version's held-out shards (``data.val_fraction``: whole documents that the training shards
never contain, see ``megatrain/data/shard.py``). It is the same set of samples under every
parallel layout, cut like a training batch: global batch b, micro-batch m, data-parallel rank r
reads samples ``b*G + (m*dp + r)*mb ...`` (G = global batch, mb = micro-batch). Every
micro-batch holds the same number of tokens, so the mean of the micro-batch losses, averaged over
the DP group, is the mean over every token of the set, whatever dp, tp or pp are:

- dp: each rank takes its micro-batches, the mean is all-reduced over the DP group;
- tp: the ranks of a TP group read the same samples and compute one (vocab-parallel) loss;
- pp: DeepSpeed's ``eval_batch`` runs the micro-batches through the stages and averages over
  micro-batches and DP, broadcasting the result to every stage.

``Evaluator.after_step`` is what the training loop calls; ``evaluate_checkpoint`` (and the
``megatrain eval`` command) evaluates a committed checkpoint in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatrain.config import Config
from megatrain.config.run_dirs import CHECKPOINT_HELP
from megatrain.data.index import DataError, ShardIndex
from megatrain.data.loader import ShardCache, to_tensors
from megatrain.observe.metrics import StepMetrics
from megatrain.parallel.dims import ProcessGroups

log = logging.getLogger("megatrain")


def held_out_windows(index: ShardIndex, count: int, split: str = "val", verify_checksums: bool = True) -> np.ndarray:
    """The first ``count`` windows [count, seq_len + 1] of the held-out shards (``split="val"``)
    or of the training shards (``"train"``), in shard order; fewer when there are fewer."""
    shards = index.val_shards if split == "val" else index.shards
    view = dataclasses.replace(index, shards=shards, num_samples=sum(s.num_samples for s in shards))
    cache = ShardCache(view, verify_checksums, on_bad_shard="error")
    parts, have = [], 0
    for i in range(len(shards)):
        if have >= count:
            break
        windows = cache.get(i)[: count - have]
        parts.append(windows)
        have += len(windows)
    return np.concatenate(parts) if parts else np.empty((0, index.seq_len + 1), index.np_dtype)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 80 else float("inf")


@dataclasses.dataclass
class EvalResult:
    loss: float  # mean cross-entropy (nats/token) over the set
    perplexity: float
    samples: int
    tokens: int


class Evaluator:
    """Computes the validation loss every ``train.eval_interval`` steps and at the last step."""

    def __init__(self, cfg: Config, index: ShardIndex, groups: ProcessGroups, device: torch.device,
                 grad_accumulation: int):
        self.cfg, self.groups, self.device = cfg, groups, device
        self.micro_batch, self.accumulation = cfg.train.micro_batch_size, grad_accumulation
        self.global_batch = cfg.train.global_batch_size
        self.interval = cfg.train.eval_interval
        self.windows = np.empty((0, index.seq_len + 1))
        if self.interval == 0:
            return
        if not index.val_shards:
            log.info("no held-out evaluation: shard version %s has no validation split (data.val_fraction)", index.version)
            self.interval = 0
            return
        wanted = cfg.train.eval_batches * self.global_batch
        windows = held_out_windows(index, wanted, verify_checksums=cfg.data.verify_checksums)
        usable = len(windows) // self.global_batch * self.global_batch
        if usable == 0:
            log.warning("no held-out evaluation: %d held-out samples, fewer than one global batch (%d); raise "
                        "data.val_fraction", len(windows), self.global_batch)
            self.interval = 0
            return
        if usable < wanted:
            log.warning("held-out set: %d samples available, train.eval_batches asks for %d", usable, wanted)
        self.windows = windows[:usable]
        log.info("held-out evaluation every %d steps on %d samples", self.interval, usable)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.interval == 0 or step == self.cfg.train.steps)

    def after_step(self, engine: Any, metrics: StepMetrics) -> None:
        """The loop's hook: fills ``metrics.val_loss`` / ``val_perplexity`` on evaluation steps."""
        if self.due(metrics.step):
            result = self.evaluate(engine)
            metrics.val_loss, metrics.val_perplexity = result.loss, result.perplexity

    def micro_batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of global batch ``batch`` (see the module docstring)."""
        g, mb = self.groups, self.micro_batch
        start = batch * self.global_batch
        for m in range(self.accumulation):
            first = start + (m * g.dims.dp + g.dp_rank) * mb
            inputs, targets = to_tensors(self.windows[first:first + mb])
            yield inputs.to(self.device), targets.to(self.device)

    @torch.no_grad()
    def evaluate(self, engine: Any) -> EvalResult:
        batches = len(self.windows) // self.global_batch
        pipelined = self.groups.dims.pp > 1
        was_training = engine.module.training
        engine.eval()
        try:
            losses = []
            for b in range(batches):
                if pipelined:  # mean over micro-batches and DP, broadcast to every stage
                    losses.append(engine.eval_batch(self.micro_batches(b), num_micro_batches=self.accumulation).float())
                else:
                    losses += [engine(inputs, targets).float() for inputs, targets in self.micro_batches(b)]
            loss = torch.stack(losses).mean()
            if not pipelined and self.groups.dims.dp > 1:
                dist.all_reduce(loss, group=self.groups.dp_group)
                loss /= self.groups.dims.dp
        finally:
            engine.train(was_training)
        value = loss.item()
        return EvalResult(value, perplexity(value), len(self.windows), self.windows.size - len(self.windows))


# ------------------------------------------------------------------- a finished checkpoint


def loss_on_windows(model: torch.nn.Module, windows: np.ndarray, batch_size: int, device: torch.device) -> float:
    """Mean token loss of a plain (unsharded) model over ``windows``, batch by batch."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            inputs, targets = to_tensors(windows[start:start + batch_size])
            logits = model(inputs.to(device)).float()
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.to(device).flatten(), reduction="sum").item()
            tokens += targets.numel()
    return total / tokens


def text_windows(run: Any, sources: list[str], count: int) -> np.ndarray:
    """Text files (paths, globs, JSONL, Parquet...: ``data.sources`` syntax) -> up to ``count``
    windows [n, seq_len + 1] of the run's tokens, documents separated by EOS as in its shards."""
    from megatrain.data.sources import expand_sources, plan_units, read_documents

    tokenizer, window = run.tokenizer(), run.cfg.seq_len + 1
    index = run.index()
    eos_id, head = index.eos_id, [] if index.bos_id is None else [index.bos_id]
    ids: list[int] = []
    files, _ = expand_sources(sources)
    units, _ = plan_units(files, text_field=run.cfg.data.text_field)
    for document in (d for unit in units for d in read_documents(unit, run.cfg.data.text_field)):
        ids += head + tokenizer.encode(document).ids + [eos_id]
        if len(ids) >= count * window:
            break
    n = min(count, len(ids) // window)
    return np.asarray(ids[: n * window], dtype=np.int64).reshape(n, window)


def _is_shard_version(url: str) -> bool:
    from megatrain import storage
    from megatrain.data.index import INDEX_NAME

    try:
        return storage.exists(storage.join_url(url, INDEX_NAME))
    except storage.StorageError:  # e.g. a file: nothing lies below it
        return False


def evaluate_checkpoint(checkpoint: str, data: str | None = None, split: str = "val", samples: int | None = None,
                        batch_size: int = 8, config: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """The loss of a committed checkpoint (any layout, gathered into one process) on ``split``
    of a shard version (``data``: its directory; default the run's own shards), or on text files
    (``data``: a path or glob without an index.json) tokenized with the run's tokenizer."""
    from megatrain.data.index import load_index
    from megatrain.interop.checkpoint import load_run

    run = load_run(checkpoint, config=config, device=device)
    count = samples or run.cfg.train.eval_batches * run.cfg.train.global_batch_size
    if data and not _is_shard_version(data):
        windows, where, split = text_windows(run, [data], count), data, "text"
    else:
        index = load_index(data) if data else run.index()
        if index.seq_len > run.cfg.model.seq_len:
            raise DataError(f"{index.url}: windows of {index.seq_len} tokens, the model takes {run.cfg.model.seq_len}")
        windows, where = held_out_windows(index, count, split), index.url
    if len(windows) == 0:
        raise DataError(f"{where}: no {split} samples (a validation split needs data.val_fraction > 0; text needs "
                        f"more than {run.cfg.seq_len} tokens)")
    loss = loss_on_windows(run.model, windows, batch_size, run.device)
    return {"checkpoint": run.step_url, "step": run.step, "data": where, "split": split,
            "samples": len(windows), "loss": loss, "perplexity": perplexity(loss)}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain eval", description="Validation loss of a committed checkpoint.")
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--data", help="a shard version directory (holding index.json), or text files (a path or "
                        "glob: .txt/.jsonl/.py/.md), tokenized with the run's tokenizer; default the run's own shards")
    parser.add_argument("--split", choices=["val", "train"], default="val")
    parser.add_argument("--samples", type=int, help="windows to evaluate; default train.eval_batches global batches")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--config", help="the run's config YAML, when the checkpoint has no run.json beside it")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # A missing run, bad data or a corrupt checkpoint raises: megatrain.cli says it in one line.
    result = evaluate_checkpoint(args.checkpoint, args.data, args.split, args.samples, args.batch_size,
                                 args.config, args.device)
    print(json.dumps(result, indent=2))
    return 0
