"""The metrics logger decides what to print and write; the training loop only calls ``log``.

One metrics path, several sinks. Rank 0 appends one JSON line per step to
``<run_dir>/metrics.jsonl`` (the record the report and the flows read), shows a rich progress bar
on a terminal (or a plain line every ``log_interval`` steps when output is not a TTY), and hands
the same step's scalars to every enabled tracking sink: TensorBoard (on by default, event files
in ``<run_dir>/tb``), and Weights & Biases or MLflow when the recipe names a project or a
tracking URI. A sink's library is imported only when that sink is enabled, so neither wandb nor
mlflow is ever required. The sinks are written from one background thread (``sink_thread.py``):
the training thread only appends the row and queues the scalars.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatrain.observe.jsonl import open_append
from megatrain.observe.sink_thread import BackgroundSinks

log = logging.getLogger("megatrain")


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    val_loss: float | None = None  # held-out loss, on the steps the evaluator ran (megatrain/evaluate/heldout.py)
    val_perplexity: float | None = None
    # a mixture: each component's held-out loss (val_loss is their mix); a row writes val_loss/<name>
    val_components: dict[str, float] | None = None
    mfu: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    fp8: dict[str, float] | None = None  # megatrain.precision.FP8Guard.stats() when measured this step
    startup: dict | None = None  # a process's first step only: its start-up breakdown (megatrain/observe/startup.py)
    # per data component (a mixture's, or the one corpus "data"): samples and tokens consumed so far
    # in this stage, completed epochs of its own order (earlier stages included) and start (its
    # samples earlier stages consumed) (megatrain/data/mixture.py's component_stats)
    data: dict[str, dict[str, float]] | None = None
    # model.mlp=moe: expert-load health of the step (megatrain/model/moe.py's end_step): per MoE
    # layer each expert's token share, the router's mean entropy and max/mean load; aux and z-loss
    moe: dict | None = None


def scalars(metrics: StepMetrics) -> dict[str, float]:
    """The step as flat ``group/name -> value`` scalars, the names every tracking sink uses."""
    out = {
        "train/loss": metrics.loss, "train/lr": metrics.lr, "train/grad_norm": metrics.grad_norm,
        "perf/tokens_per_s": metrics.tokens_per_s, "perf/step_time_s": metrics.step_time_s,
        "train/tokens": float(metrics.tokens),
    }
    if metrics.mfu is not None:
        out["perf/mfu"] = metrics.mfu
    for phase, ms in metrics.phases_ms.items():
        out[f"phase_ms/{phase}"] = ms
    if "checkpoint" in metrics.phases_ms:  # the time the loop was blocked by a save (snapshot only)
        out["checkpoint/stall_ms"] = metrics.phases_ms["checkpoint"]
    if metrics.val_loss is not None:
        out["val/loss"] = metrics.val_loss
    if metrics.val_perplexity is not None:
        out["val/perplexity"] = metrics.val_perplexity
    for name, loss in (metrics.val_components or {}).items():
        out[f"val/loss/{name}"] = loss
    for name, stats in (metrics.data or {}).items():
        out[f"data/{name}/tokens"] = float(stats["tokens"])
        out[f"data/{name}/samples"] = float(stats["samples"])  # this stage's; epochs count on over stages
        out[f"data/{name}/epochs"] = float(stats["epochs"])
    if metrics.moe is not None:
        for key in ("aux_loss", "z_loss", "max_over_mean"):
            out[f"moe/{key}"] = metrics.moe[key]
        for layer, health in metrics.moe["layers"].items():
            out[f"moe/layer{layer}/entropy"] = health["entropy"]
            out[f"moe/layer{layer}/max_over_mean"] = health["max_over_mean"]
            for expert, share in enumerate(health["share"]):
                out[f"moe/layer{layer}/share/expert{expert}"] = share
    return out


class MetricsSink(Protocol):
    """A tracking backend: receives every step's scalars."""

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """Weights & Biases (``train.wandb_project``); wandb's own settings (WANDB_MODE, API key) apply."""

    def __init__(self, project: str, run_name: str, run_dir: Path, config: dict[str, Any]):
        import wandb  # only when enabled: never a requirement

        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    """MLflow (``train.mlflow_tracking_uri``, e.g. ``file:runs/mlruns`` or a server URL)."""

    def __init__(self, tracking_uri: str, run_name: str, config: dict[str, Any]):
        import mlflow  # only when enabled: never a requirement

        mlflow.set_tracking_uri(tracking_uri)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: v for k, v in _flatten(config).items() if v is not None})

    def write(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def build_sinks(train_cfg: Any, run_name: str, config: dict[str, Any], first_step: int = 1) -> list[MetricsSink]:
    """The tracking sinks a run's ``train`` section enables (TensorBoard by default).
    ``first_step``: the step this attempt logs first (its resume step + 1): TensorBoard drops
    what earlier attempts logged from there on."""
    sinks: list[MetricsSink] = []
    run_dir = Path(train_cfg.run_dir)
    if train_cfg.tensorboard:
        from megatrain.observe.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(tensorboard_dir(train_cfg), purge_step=first_step))
    if train_cfg.wandb_project:
        sinks.append(WandbSink(train_cfg.wandb_project, run_name, run_dir, config))
    if train_cfg.mlflow_tracking_uri:
        sinks.append(MLflowSink(train_cfg.mlflow_tracking_uri, run_name, config))
    return sinks


def tensorboard_dir(train_cfg: Any) -> Path:
    """Where a run's TensorBoard event files go: ``train.tensorboard_dir``, default ``<run_dir>/tb``."""
    return Path(train_cfg.tensorboard_dir or Path(train_cfg.run_dir) / "tb")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, log_interval: int, enabled: bool = True,
                 sinks: list[MetricsSink] | None = None):
        self.enabled = enabled
        self.log_interval = log_interval
        self.total_steps = total_steps
        # the sinks (TensorBoard, MLflow's HTTP calls, W&B) are written from their own thread
        self.sinks = BackgroundSinks(list(sinks)) if enabled and sinks else None
        self._progress = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open_append(self.path, buffering=1)  # a row torn by a killed attempt stays alone
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def log(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        row = asdict(metrics)
        for optional in ("startup", "data", "moe"):  # rows without them stay as they were
            if row[optional] is None:
                del row[optional]
        for name, loss in (row.pop("val_components") or {}).items():
            row[f"val_loss/{name}"] = loss
        self._file.write(json.dumps(row) + "\n")
        if self.sinks is not None:
            self.sinks.write(metrics.step, scalars(metrics))
        info = f"loss {metrics.loss:.4f}  {metrics.tokens_per_s:,.0f} tok/s"
        if metrics.mfu is not None:
            info += f"  MFU {100 * metrics.mfu:.1f}%"
        if metrics.val_loss is not None:
            info += f"  val {metrics.val_loss:.4f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics.step, info=info)
        elif metrics.step % self.log_interval == 0 or metrics.step == self.total_steps or metrics.val_loss is not None:
            phases = " ".join(f"{k} {v:.0f}" for k, v in metrics.phases_ms.items())
            log.info("step %d/%d  %s  lr %.2e  gnorm %.3f  [ms: %s]", metrics.step, self.total_steps, info,
                     metrics.lr, metrics.grad_norm, phases)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled:
            self._file.close()
            if self.sinks is not None:
                self.sinks.close()
