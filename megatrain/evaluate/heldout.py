"""Held-out evaluation: the validation loss (and perplexity) on fixed sets of held-out samples.

What the sets are is ``validation_sets.py``'s: each data component's first held-out windows
(``data.val_fraction``: whole documents that the training shards never contain, at least one
window's worth per component where it has enough documents, ``megatrain/data/held_out.py``), and
``val_loss`` the mix of the components' losses under the validation weights. A run of one corpus
is one component, ``data``, whose loss is the mix.

Each set is the same samples under every parallel layout, cut like training batches: round b of
``dp * mb`` windows gives data-parallel rank r the windows ``b*dp*mb + r*mb ...`` (mb the
micro-batch), so a set of whole global batches is read exactly as a training step reads them.
The loss of a set is the mean over every token of it, whatever dp, tp or pp are:

- dp: each rank sums its micro-batches' token losses; the sums are all-reduced over the DP group
  and divided by the set's tokens. A set smaller than a round leaves a rank a short micro-batch or
  none: that rank runs a forward on a stand-in micro-batch, not counted, so the ranks' collectives
  (ZeRO-3 gathers, expert all-to-alls) stay in step;
- tp: the ranks of a TP group read the same samples and compute one (vocab-parallel) loss;
- cp: each rank runs its two chunks of every window through the ring or all-to-all, as in training
  (a long window is never whole on one rank), and the token-loss sums are all-reduced over the
  dp x cp replicas; under a pipeline the stages get the rank's chunks (``pipeline.py``);
- pp: DeepSpeed's ``eval_batch`` runs equal micro-batches through the stages and averages over
  them and DP, broadcasting the result to every stage; a set that is not whole rounds is read
  ``lcm(n, dp * mb) / n`` times over (each window as often as every other: the same mean).

``Evaluator.after_step`` is what the training loop calls; ``evaluate_checkpoint`` (and the
``megatrain eval`` command) evaluates a committed checkpoint in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatrain.config import Config
from megatrain.config.run_dirs import CHECKPOINT_HELP
from megatrain.data.index import DataError
from megatrain.data.loader import to_tensors
from megatrain.evaluate.validation_sets import (
    ValidationSet, component_windows, describe, held_out_windows, read_record, validation_sets, write_record,
)
from megatrain.observe.metrics import StepMetrics
from megatrain.parallel.context_parallel import rank_chunks
from megatrain.parallel.dims import ProcessGroups

__all__ = ["EvalResult", "Evaluator", "evaluate_checkpoint", "held_out_windows", "loss_on_windows", "mix",
           "perplexity", "rank_rounds", "text_windows"]

log = logging.getLogger("megatrain")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 80 else float("inf")


def mix(losses: dict[str, float], weights: dict[str, float]) -> float | None:
    """The validation mix: the weighted mean of the components' losses (None: no weight on any)."""
    total = sum(weights.get(name, 0.0) for name in losses)
    return sum(weights.get(name, 0.0) * loss for name, loss in losses.items()) / total if total > 0 else None


def rank_rounds(n: int, dp: int, micro_batch: int, dp_rank: int) -> list[tuple[int, int]]:
    """(first window, count) of data-parallel rank ``dp_rank``'s micro-batch in every round of a
    set of ``n`` windows; the count is short, or 0, in a last round the set does not fill."""
    rounds = -(-n // (dp * micro_batch))
    out = []
    for b in range(rounds):
        first = b * dp * micro_batch + dp_rank * micro_batch
        out.append((first, max(0, min(micro_batch, n - first))))
    return out


@dataclasses.dataclass
class EvalResult:
    loss: float | None  # the validation mix (nats/token); a run of one corpus: its loss. None: no weight on any set
    perplexity: float | None
    samples: int
    tokens: int
    components: dict[str, float] = dataclasses.field(default_factory=dict)  # each set's mean token loss


class Evaluator:
    """Computes the validation losses every ``train.eval_interval`` steps and at the last step."""

    def __init__(self, cfg: Config, components: Sequence[Any], groups: ProcessGroups, device: torch.device,
                 grad_accumulation: int):
        """``components``: the run's data components (``name``, ``index``; the trainer's list)."""
        self.cfg, self.groups, self.device = cfg, groups, device
        self.micro_batch, self.accumulation = cfg.train.micro_batch_size, grad_accumulation
        self.interval = cfg.train.eval_interval
        self.per_component = cfg.data.mixture is not None  # val_loss/<name> beside the mix
        self.sets: list[ValidationSet] = []
        if self.interval == 0:
            return
        if not cfg.data.val_fraction and not any(c.index.val_shards for c in components):
            log.info("no held-out evaluation: the data has no validation split (data.val_fraction is 0)")
            self.interval = 0
            return
        sets = validation_sets(cfg, components)
        if groups.rank == 0:
            for line in describe(cfg, sets):
                log.info("%s", line)
            write_record(cfg.train.run_dir, cfg, sets)
        self.sets = [s for s in sets if len(s.windows)]
        if not self.sets:
            log.warning("no held-out evaluation: no data component has a held-out window (see the lines above)")
            self.interval = 0
            return
        log.info("held-out evaluation every %d steps on %d samples", self.interval, sum(len(s.windows) for s in self.sets))

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int) -> bool:
        return self.enabled and (step % self.interval == 0 or step == self.cfg.train.steps)

    def after_step(self, engine: Any, metrics: StepMetrics) -> None:
        """The loop's hook: fills ``metrics.val_loss`` / ``val_perplexity`` (the mix) and, for a
        mixture, ``metrics.val_components`` on evaluation steps."""
        if self.due(metrics.step):
            result = self.evaluate(engine)
            metrics.val_loss, metrics.val_perplexity = result.loss, result.perplexity
            if self.per_component:
                metrics.val_components = result.components

    @torch.no_grad()
    def evaluate(self, engine: Any) -> EvalResult:
        was_training = engine.module.training
        engine.eval()
        try:
            losses = {s.name: self._set_loss(engine, s.windows) for s in self.sets}
        finally:
            engine.train(was_training)
        value = mix(losses, {s.name: s.weight for s in self.sets})
        samples = sum(len(s.windows) for s in self.sets)
        tokens = sum(s.windows.size - len(s.windows) for s in self.sets)
        return EvalResult(value, None if value is None else perplexity(value), samples, tokens, losses)

    def _set_loss(self, engine: Any, windows: np.ndarray) -> float:
        g, mb = self.groups, self.micro_batch
        if g.dims.pp > 1:
            return self._pipelined_loss(engine, windows)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for first, count in rank_rounds(len(windows), g.dims.dp, mb, g.dp_rank):
            # a rank past the set's end runs a stand-in micro-batch, so every rank's collectives match
            inputs, targets = to_tensors(windows[first:first + count] if count else windows[:mb])
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            if g.dims.cp > 1:  # this rank's chunks through the ring, as in training: a long window never whole here
                inputs, targets, sequence, _ = rank_chunks(inputs, targets, self.cfg, g, engine.module.eos_id)
                loss = engine(inputs, targets, sequence=sequence)
            else:
                loss = engine(inputs, targets)
            if count:
                total += loss.double() * targets.numel()  # the sum of this rank's token losses
        replicas = g.replicas()  # dp x cp: every rank holds a share of the set's tokens
        if replicas.dims.dp > 1:
            dist.all_reduce(total, group=replicas.dp_group)
        return total.item() / (windows.size - len(windows))

    def _pipelined_loss(self, engine: Any, windows: np.ndarray) -> float:
        g, mb = self.groups, self.micro_batch
        per_round = g.dims.dp * mb
        if len(windows) % per_round:  # equal micro-batches: read the set lcm(n, dp * mb) / n times over
            windows = np.tile(windows, (math.lcm(len(windows), per_round) // len(windows), 1))
        rounds = rank_rounds(len(windows), g.dims.dp, mb, g.dp_rank)

        from megatrain.parallel.pipeline import stage_micro_batch

        def micro_batches() -> Iterator[tuple]:
            for first, count in rounds:
                inputs, targets = to_tensors(windows[first:first + count])
                # this rank's chunks (the stages hold their positions), with the document ids under the mask
                staged, targets = stage_micro_batch(inputs.to(self.device), targets.to(self.device), self.cfg, g,
                                                    getattr(engine.module, "eos_id", None))
                yield staged, targets

        # the mean over micro-batches and DP, broadcast to every stage
        return engine.eval_batch(micro_batches(), num_micro_batches=len(rounds)).float().item()


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


def text_windows(run: Any, sources: list[str], count: int, text_field: str | None = None) -> np.ndarray:
    """Text files (paths, globs, JSONL, Parquet...: ``data.sources`` syntax) -> up to ``count``
    windows [n, seq_len + 1] of the run's tokens, documents separated by EOS as in its shards.
    ``text_field``: the JSONL key or table column holding the text (default the run's
    ``data.text_field``: a user's own files often name it otherwise, e.g. ``content``)."""
    from megatrain.data.sources import expand_sources, plan_units, read_documents

    tokenizer, window = run.tokenizer(), run.cfg.seq_len + 1
    index = run.index()
    eos_id, head = index.eos_id, [] if index.bos_id is None else [index.bos_id]
    ids: list[int] = []
    files, _ = expand_sources(sources)
    field = text_field or run.cfg.data.text_field
    units, _ = plan_units(files, text_field=field)
    for document in (d for unit in units for d in read_documents(unit, field)):
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
                        batch_size: int = 8, config: str | None = None, device: str = "cpu",
                        text_field: str | None = None) -> dict[str, Any]:
    """The loss of a committed checkpoint (any layout, gathered into one process) on ``split``
    of a shard version (``data``: its directory; default the run's own shards: a mixture's each
    component and their mix, ``components``), or on text files (``data``: a path or glob without
    an index.json) tokenized with the run's tokenizer, their text under ``text_field`` (default the
    run's ``data.text_field``)."""
    from megatrain.data.index import load_index
    from megatrain.interop.checkpoint import load_run

    run = load_run(checkpoint, config=config, device=device)
    count = samples or run.cfg.train.eval_batches * run.cfg.train.global_batch_size
    record = read_record(run.cfg.train.run_dir) if data is None and split == "val" else None
    if record is not None and record.get("mixture"):
        return _mixture_result(run, record, count, samples is None, batch_size)
    if data and not _is_shard_version(data):
        windows, where, split = text_windows(run, [data], count, text_field), data, "text"
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


def _mixture_result(run: Any, record: dict[str, Any], count: int, as_trained: bool, batch_size: int) -> dict[str, Any]:
    """A mixture's checkpoint on each component's held-out set (the training run's own sets when
    ``as_trained``: whole global batches, as validation_sets cuts them) and their mix under the
    run's validation weights (validation.json)."""
    from megatrain.data.index import load_index

    components, losses = {}, {}
    for name, held in record.get("components", {}).items():
        if not held.get("url"):
            continue
        index = load_index(held["url"])
        windows = (component_windows(index, count, run.cfg.train.global_batch_size) if as_trained
                   else held_out_windows(index, count))
        components[name] = {"data": index.url, "samples": len(windows), "weight": held.get("weight", 0.0),
                            "note": held.get("note") or ""}
        if len(windows):
            losses[name] = components[name]["loss"] = loss_on_windows(run.model, windows, batch_size, run.device)
    if not losses:
        raise DataError(f"{run.cfg.train.run_dir}: no mixture component has held-out samples ("
                        + "; ".join(f"{n}: {c['note']}" for n, c in components.items()) + ")")
    loss = mix(losses, record.get("weights") or {})
    return {"checkpoint": run.step_url, "step": run.step, "data": "mixture", "split": "val",
            "samples": sum(c["samples"] for c in components.values()), "loss": loss,
            "perplexity": None if loss is None else perplexity(loss), "weights from": record.get("source"),
            "components": components}


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain eval", description="Validation loss of a committed checkpoint.")
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--data", help="a shard version directory (holding index.json), or text files (a path or "
                        "glob: .txt/.jsonl/.py/.md), tokenized with the run's tokenizer; default the run's own shards (a "
                        "mixture: each component's held-out set and their mix)")
    parser.add_argument("--text-field", help="with --data text files: the JSONL key or Parquet/Arrow column that holds "
                        "the text; default the run's data.text_field")
    parser.add_argument("--split", choices=["val", "train"], default="val")
    parser.add_argument("--samples", type=int, help="windows to evaluate; default train.eval_batches global batches")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--config", help="the run's config YAML, when the checkpoint has no run.json beside it")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # A missing run, bad data or a corrupt checkpoint raises: megatrain.cli says it in one line.
    result = evaluate_checkpoint(args.checkpoint, args.data, args.split, args.samples, args.batch_size,
                                 args.config, args.device, args.text_field)
    print(json.dumps(result, indent=2))
    return 0
