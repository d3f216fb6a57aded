"""FP8 convergence evidence (issue 16): the same model trained in bf16 and in FP8, in one process,
on the same real-text shards with the same seed and data order; the loss curves plotted together.

    python benchmarks/fp8_convergence.py --config configs/gpt-125m.yaml --steps 2000 --out runs/fp8-convergence/result

Each run is megatrain's real Trainer (DeepSpeed engine, data loader, LR schedule, the FP8 guard)
stepped ``--steps`` times with ``train.precision`` bf16, then fp8 (no checkpoints). The final
loss of each is the mean of its last ``--tail`` steps; the difference is stated relative to bf16
(issue 16's target: within 1%). Writes ``<out>.json`` (every step's loss, and the FP8 guard's
statistics) and ``<out>.png``, every 250 steps too: a run cut short compares the steps both made.

The corpus should hold about as many tokens as the run reads (``epochs`` in the JSON): FP8 and
bf16 part once a small corpus is being memorised over several epochs (benchmarks/RESULTS.md),
which is not the regime of pretraining. ``data.sources`` takes globs, e.g. the standard library
plus the installed torch sources:

    python benchmarks/fp8_convergence.py --steps 1250 --override train.global_batch_size=16 \
        --override "data.sources=[stdlib,$(python -c 'import torch,os;print(os.path.dirname(torch.__file__))')/**/*.py]" \
        --override data.max_source_bytes=64000000 --override model.compile=true
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402


def train(cfg, env, steps: int, run: dict, log, save) -> None:
    """Step a Trainer, filling ``run`` (losses, FP8 guard statistics, step times) as it goes;
    ``save()`` every 250 steps, so a run cut short still leaves its curve."""
    from megatrain.training.trainer import Trainer

    with torch.device(env.device):
        trainer = Trainer(cfg, env)
    losses, fp8, times = run.setdefault("losses", []), run.setdefault("fp8", []), run.setdefault("step_s", [])
    run["tokens_per_step"] = cfg.train.global_batch_size * cfg.seq_len
    epoch_samples = trainer.loader.stream.epoch_len  # samples of one pass over the corpus
    try:
        for _ in range(steps):
            metrics = trainer.train_step()
            losses.append(metrics.loss)
            times.append(metrics.step_time_s)
            if metrics.fp8:
                fp8.append({"step": metrics.step, **metrics.fp8})
            run["epochs"] = len(losses) * cfg.train.global_batch_size / epoch_samples
            if metrics.step % 250 == 0:
                log(f"  {cfg.train.precision} step {metrics.step}: loss {metrics.loss:.4f}, {metrics.tokens_per_s:,.0f} tok/s")
                save()
    finally:
        trainer.checkpointer.close()
        trainer.loader.close()
        trainer.engine.destroy()
        del trainer
        torch._dynamo.reset()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


def _running_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def plot(results: dict, path: Path, title: str, window: int = 50) -> None:
    """Top: both loss curves (raw, faint; running mean of ``window`` steps). Bottom: fp8 minus
    bf16 of the running means, relative to bf16 (the 1% target as a band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1.3])
    styles = {"bf16": ("tab:blue", "-"), "fp8": ("tab:red", "--")}
    means = {}
    for name, run in results.items():
        losses = run["losses"]
        color, line = styles.get(name, ("tab:gray", "-"))
        steps = range(1, len(losses) + 1)
        means[name] = _running_mean(losses, window)
        top.plot(steps, losses, color=color, alpha=0.15, linewidth=0.6)
        top.plot(steps, means[name], color=color, linestyle=line, label=f"{name} (running mean of {window})")
    top.set_ylabel("training loss (nats)")
    top.set_ylim(top=min(8.0, top.get_ylim()[1]))
    top.set_title(title, fontsize=9)
    top.legend()
    top.grid(alpha=0.3)
    if "bf16" in means and "fp8" in means:
        n = min(len(means["bf16"]), len(means["fp8"]))
        rel = [100 * (f - b) / b for b, f in zip(means["bf16"][:n], means["fp8"][:n])]
        bottom.plot(range(1, n + 1), rel, color="tab:red")
        bottom.axhspan(-1, 1, color="tab:green", alpha=0.1, label="within 1%")
        bottom.axhline(0, color="black", linewidth=0.5)
        bottom.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("fp8 vs bf16 (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt-125m.yaml")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tail", type=int, default=100, help="steps averaged for the final loss")
    parser.add_argument("--work", default="runs/fp8-convergence")
    parser.add_argument("--out", default="runs/fp8-convergence/result", help="<out>.json and <out>.png")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE for both runs")
    parser.add_argument("--replot", default=None, help="only redraw <out>.png from this JSON of an earlier run")
    args = parser.parse_args(argv)
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        title = (f"{Path(report['config']).stem}, same shards/seed/data order, {report['device']}\nloss over steps "
                 f"{report['compared_steps'] - report['tail_steps'] + 1}-{report['compared_steps']}: bf16 "
                 f"{report['final_loss']['bf16']:.4f}, fp8 {report['final_loss']['fp8']:.4f} "
                 f"({100 * report['relative_difference']:+.2f}%)")
        plot(report["runs"], Path(args.out).with_suffix(".png"), title)
        return 0

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    logging.basicConfig(level=logging.WARNING)
    from megatrain.config import load_config
    from megatrain.parallel.init import init_distributed, shutdown_distributed

    env = init_distributed()
    device = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    common = [f"train.steps={args.steps}", f"data.shard_url={args.work}/shards", "train.log_interval=1000000",
              "checkpoint.interval=1000000000", "checkpoint.resume=false", *args.override]
    results: dict[str, dict] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> str:
        """JSON + PNG of what has run so far; the comparison over the steps both runs have."""
        common_steps = min((len(run["losses"]) for run in results.values()), default=0)
        n = min(args.tail, common_steps)
        tail = {name: sum(run["losses"][common_steps - n:common_steps]) / n for name, run in results.items()} if n else {}
        diff = (tail["fp8"] - tail["bf16"]) / tail["bf16"] if "fp8" in tail and "bf16" in tail else None
        report = {"device": device, "config": args.config, "overrides": args.override, "steps": args.steps,
                  "compared_steps": common_steps, "tail_steps": n, "final_loss": tail, "relative_difference": diff,
                  "within_1_percent": abs(diff) <= 0.01 if diff is not None else None, "runs": results,
                  "wall_s": time.perf_counter() - t0}
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        title = f"{Path(args.config).stem}, same shards/seed/data order, {device}"
        if diff is not None:
            title += (f"\nloss over steps {common_steps - n + 1}-{common_steps}: bf16 {tail['bf16']:.4f}, "
                      f"fp8 {tail['fp8']:.4f} ({100 * diff:+.2f}%)")
        plot(results, out.with_suffix(".png"), title)
        return title

    for precision in ("bf16", "fp8"):
        run_dir = f"{args.work}/{precision}"
        cfg = load_config(args.config, [*common, f"train.precision={precision}", f"train.run_dir={run_dir}",
                                        f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/ckpt"])
        log(f"{precision}: {args.config}, {args.steps} steps of {cfg.train.global_batch_size} x {cfg.seq_len} tokens")
        results[precision] = {}
        train(cfg, env, args.steps, results[precision], log, save)
    log(save())
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
