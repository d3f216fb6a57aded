"""Loss parity with an independent implementation, from the same start and the same data (issue 46).

    python benchmarks/convergence.py --family gpt --shape 125m --steps 2000 --runs megatrain,peer:0,peer:1 \
        --out benchmarks/results/convergence-gpt --png docs/convergence/gpt-parity.png

Runs, stepped in lock-step in one process on the same batches:

- ``megatrain``: megatrain's GPT (``megatrain.model``, its kernels and fused cross-entropy),
  initialised under seed 0;
- ``peer:<s>``: transformers' ``GPT2LMHeadModel`` (``--family llama``: ``LlamaForCausalLM``)
  loaded from megatrain's initial weights under init seed ``s``, exported by
  ``megatrain.interop.hf.export_model``. ``peer:0`` starts where ``megatrain`` starts;
  ``peer:1`` from another init, the same data order: |peer:0 - peer:1| is the seed band.

Data (``convergence_data.py``): the standard library's source plus the texts under
/usr/share/doc and /usr/share/common-licenses, sharded by megatrain (its BPE trained on the
corpus, 2% of documents held out by hash), read through megatrain's loader; every step's batch
digest goes into the JSON, so runs from other processes can be merged and shown to have read
the same batches (``--merge``). Optimizer (``convergence_models.py``): megatrain's AdamW, LR
schedule, clipping and weight decay on both sides; bf16 autocast with fp32 weights on GPU.

Train loss every step, held-out loss every ``--eval-every`` steps (and before the first), against
tokens; ``<out>.json`` is rewritten at every evaluation, ``--png`` draws the runs on one plot.
``--budget-s`` caps the training time: the steps are cut (before the warm-up ends, so the LR
schedule is that of the steps run) when the first steps' time says they would not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import convergence_data as data  # noqa: E402
import convergence_models as models  # noqa: E402
import convergence_report as report_mod  # noqa: E402

PROBE_STEPS = 8  # timed after 2 warm-up steps, to size a run under --budget-s


def optim_config(args):
    from megatrain.config import OptimConfig

    return OptimConfig(name="adamw", lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, schedule="cosine")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--shape", choices=["125m", "1.3b", "tiny"], default="125m")
    parser.add_argument("--runs", default="megatrain,peer:0,peer:1")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--min-lr", type=float, default=6e-5)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument("--max-source-bytes", type=int, default=None)
    parser.add_argument("--doc-roots", default=",".join(data.DOC_ROOTS), help="comma-separated; '' for stdlib only")
    parser.add_argument("--num-workers", type=int, default=0, help="sharding processes (0: one per core)")
    parser.add_argument("--work", default="runs/convergence")
    parser.add_argument("--out", default="benchmarks/results/convergence-gpt", help="<out>.json")
    parser.add_argument("--png", default=None)
    parser.add_argument("--budget-s", type=float, default=None, help="training wall-time cap (steps cut to fit)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--commit", default=None, help="recorded in the JSON (default: git's HEAD)")
    parser.add_argument("--target-run", default=None,
                        help="time to target: every run's wall time to the held-out loss this run reaches")
    parser.add_argument("--target-step", type=int, default=None,
                        help="the target run's evaluation step that sets the target (default: its last)")
    parser.add_argument("--merge", nargs="+", default=None, help="only merge these JSONs into --out (and --png)")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="torch.compile's default: a second batch size (the held-out set's short last chunk, "
                             "before step 0) recompiles the graph dynamic in it; by default each shape gets its own "
                             "static graph (models.set_shape_policy says why)")
    return parser.parse_args(argv)


def run_comparison(args, log=print) -> dict:
    """Shard, build the runs, train them in lock-step: the report (also written to ``<out>.json``)."""
    with models.shape_policy(dynamic=args.dynamic_shapes):
        return _run_comparison(args, log)


def _run_comparison(args, log) -> dict:
    from megatrain.optim.schedule import Schedule

    t0 = time.perf_counter()
    device = torch.device(args.device)
    cfg = models.model_config(args.family, args.shape)
    roots = tuple(r for r in args.doc_roots.split(",") if r)
    data_cfg = data.data_config(f"{args.work}/shards", cfg.vocab_size, max_source_bytes=args.max_source_bytes,
                                doc_roots=roots, num_workers=args.num_workers)
    index = data.build_shards(data_cfg, cfg.seq_len, cfg.vocab_size)
    log(f"[{time.perf_counter() - t0:6.1f}s] shards {index.url}: {index.num_tokens:,} train tokens, "
        f"{index.val_num_samples} held-out windows")
    val_x, val_y = data.held_out(index, args.val_windows)
    optim_cfg = optim_config(args)
    tokenizer_json = data.tokenizer_bytes(index)
    runs = [models.make_run(name, args.family, cfg, optim_cfg, tokenizer_json, device) for name in args.runs.split(",")]
    per_step = args.batch * cfg.seq_len
    steps = args.steps
    schedule = Schedule.of(optim_cfg, steps)
    out = report_mod.json_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "convergence", "family": args.family, "shape": args.shape, "model": cfg.model_dump(),
              "params": sum(p.numel() for p in runs[0].model.parameters()),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "precision": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32",
              "commit": args.commit or _commit(), "command": " ".join(sys.argv), "steps_requested": args.steps,
              "steps": steps, "batch": args.batch, "seq_len": cfg.seq_len, "tokens_per_step": per_step,
              "optim": optim_cfg.model_dump(), "eval_every": args.eval_every, "val_windows": len(val_x),
              "val_tokens": int(val_y.numel()), "data": data.describe(index, data_cfg, roots),
              "epochs": steps * args.batch / index.num_samples,
              "seed_band": "peer:0 and peer:1 differ only in their initial weights (megatrain's init under seed 0 "
                           "or 1, exported); the data order is the same (data.seed)",
              "compiled_shapes": "dynamic (torch's default)" if args.dynamic_shapes else "static",
              "batch_crc32": [], "runs": {}, "notes": []}

    def evaluate(step: int) -> None:
        for run in runs:
            run.val.append({"step": step, "tokens": step * per_step,
                            "loss": models.held_out_loss(run, val_x, val_y, args.batch, device)})
        report["runs"] = {run.name: run.record() for run in runs}
        report["verdict"] = report_mod.verdict(report["runs"])
        report["wall_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(report, indent=1))
        log(f"[{time.perf_counter() - t0:6.1f}s] step {step}: held-out " +
            ", ".join(f"{run.name} {run.val[-1]['loss']:.4f}" for run in runs))

    evaluate(0)
    batches = data.train_batches(index, data_cfg, args.batch, cfg.vocab_size)
    train_t0 = None
    step = 0
    while step < steps:
        inputs, targets, crc = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        report["batch_crc32"].append(crc)
        lr = schedule.at(step)
        for run in runs:
            t = time.perf_counter()
            loss, norm = models.train_step(run, inputs, targets, lr, args.grad_clip, device)
            run.train_loss.append(float(loss))  # float() waits for the step: the time is the step's
            run.grad_norm.append(float(norm))
            run.step_s.append(time.perf_counter() - t)
        step += 1
        if step == 2:
            train_t0 = time.perf_counter()
        if step == 2 + PROBE_STEPS and args.budget_s and step < args.warmup:
            per = (time.perf_counter() - train_t0) / PROBE_STEPS * 1.04  # + evaluations, measured as ~3%
            fits = int(args.budget_s / per)
            if fits < steps:
                steps = max(step + 1, fits // args.eval_every * args.eval_every)
                schedule = Schedule.of(optim_cfg, steps)
                report["steps"], report["epochs"] = steps, steps * args.batch / index.num_samples
                report["notes"].append(f"{per:.3f} s per step of all runs: {args.steps} steps would not fit "
                                       f"--budget-s {args.budget_s:.0f}; cut to {steps} (before the warm-up ended, "
                                       "so the cosine schedule is that of the steps run)")
                log(report["notes"][-1])
        if step % args.eval_every == 0 or step == steps:
            evaluate(step)
    for run in runs:
        run.train_loss, run.grad_norm = run.train_loss[:steps], run.grad_norm[:steps]
    report["runs"] = {run.name: run.record() for run in runs}
    report["verdict"] = report_mod.verdict(report["runs"])
    if args.target_run:
        report["time_to_target"] = report_mod.time_to_target(report, args.target_run, args.target_step)
    report["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=1))
    return report


def title(report: dict) -> str:
    v = report.get("verdict", {})
    head = (f"{report['family']} {report['shape']} ({report['params'] / 1e6:.0f}M), megatrain vs "
            f"{models.PEER[report['family']]}, same init + same batches, {report['device']}, {report['precision']}")
    if v.get("band_max_abs_diff_peer0_peer1") is not None:
        head += (f"\nmax held-out |megatrain - peer:0| {v['max_abs_diff_megatrain_peer0']:.4f}, "
                 f"seed band max |peer:0 - peer:1| {v['band_max_abs_diff_peer0_peer1']:.4f}")
    return head


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        report = report_mod.merge(args.merge)
        if args.target_run:  # runs trained in separate processes on the same batches, compared here
            report["time_to_target"] = report_mod.time_to_target(report, args.target_run, args.target_step)
        report_mod.json_path(args.out).write_text(json.dumps(report, indent=1))
    else:
        report = run_comparison(args, log=lambda msg: print(msg, flush=True))
    if args.png:
        report["title"] = title(report)
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        report_mod.plot(report, Path(args.png))
    print(report_mod.table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
