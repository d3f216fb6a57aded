"""MegaScale's recipe choices measured for quality (issue 46): arms trained one after another on
the same token stream, at equal tokens, from megatrain's init, each its own held-out curve.

    python benchmarks/convergence_ablations.py --family gpt --shape 125m --steps 1000 \
        --arms base,base+seed1,parallel,window256,window512 --out benchmarks/results/ablations-gpt-125m

An arm is ``+``-joined modifiers of the baseline (the serial block, full attention, AdamW at
``--batch`` sequences a step, ``--lr``; init seed 0):

- ``parallel``: MegaScale's parallel block, x + attn(ln(x)) + mlp(ln(x));
- ``window<N>``: sliding-window attention over N tokens;
- ``lamb``: megatrain's LAMB instead of AdamW (same betas, decay, clipping);
- ``batch<k>``: k times the batch at 1/k the steps (and 1/k the warm-up steps: equal tokens, and
  the same tokens in the same order: a step reads k consecutive baseline batches);
- ``lr<x>``: peak LR x (min LR x / 10);
- ``seed<s>``: megatrain's init under seed s (``base+seed1`` against ``base``: the seed band);
- ``moe``: the Llama family's MoE recipe at the baseline's active FLOPs per token (64 experts, top 8,
  each 1/8 of the dense ``d_ff``: configs/moe-gpu-2b.yaml's router at this width).

Every arm reads the same held-out windows at equal token counts; the JSON holds each arm's train
and held-out curves, its batch digests (the same stream for every arm, checked) and its step time.
The table gives the final held-out loss of each arm, its difference from ``base`` and the seed band
|base - base+seed1|; ``--png`` draws the held-out curves on one plot.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import convergence  # noqa: E402
import convergence_data as data  # noqa: E402
import convergence_models as models  # noqa: E402
import convergence_report as report_mod  # noqa: E402

MOE_EXPERTS, MOE_TOP_K = 64, 8


def parse_arm(name: str, family: str, cfg, args) -> dict:
    """An arm's model config, optimizer settings, batch multiple and init seed."""
    model, optim = {}, {"name": "adamw", "lr": args.lr, "min_lr": args.min_lr}
    mult, seed = 1, 0
    for part in name.split("+"):
        if part == "base":
            continue
        if part == "parallel":
            model["block"] = "parallel"
        elif part == "lamb":
            optim["name"] = "lamb"
        elif part == "moe":
            if family != "llama":
                raise SystemExit(f"arm {name!r}: moe is the Llama family's (--family llama)")
            model.update(mlp="moe", moe={"n_experts": MOE_EXPERTS, "top_k": MOE_TOP_K, "expert_d_ff": cfg.ffn_dim // MOE_TOP_K,
                                         "norm_topk_prob": False, "aux_loss_coef": 0.01, "z_loss_coef": 0.001})
            # fp32 weights under autocast: the batched-matmul experts (grouped GEMMs want bf16 weights)
            model["kernels"] = {**cfg.kernels.model_dump(), "experts": "padded"}
        elif m := re.fullmatch(r"window(\d+)", part):
            model.update(attention="sliding", window=int(m[1]))
        elif m := re.fullmatch(r"batch(\d+)", part):
            mult = int(m[1])
        elif m := re.fullmatch(r"lr([0-9.e-]+)", part):
            optim.update(lr=float(m[1]), min_lr=float(m[1]) / 10)
        elif m := re.fullmatch(r"seed(\d+)", part):
            seed = int(m[1])
        else:
            raise SystemExit(f"arm {name!r}: unknown modifier {part!r} (base, parallel, window<N>, lamb, batch<k>, "
                             "lr<x>, seed<s>, moe)")
    if args.steps % mult or args.warmup % mult or args.eval_every % mult:
        raise SystemExit(f"arm {name!r}: --steps, --warmup and --eval-every must be multiples of batch{mult}")
    return {"model": type(cfg)(**{**cfg.model_dump(), **model}), "optim": optim, "mult": mult, "seed": seed}


def optimizer_config(arm: dict, args):
    from megatrain.config import OptimConfig

    return OptimConfig(name=arm["optim"]["name"], lr=arm["optim"]["lr"], min_lr=arm["optim"]["min_lr"],
                       warmup_steps=args.warmup // arm["mult"], weight_decay=args.weight_decay,
                       grad_clip=args.grad_clip, schedule="cosine")


def train_arm(name: str, arm: dict, index, data_cfg, val, args, device, log) -> dict:
    """Train one arm for the baseline's tokens; its record (curves, digests, step time)."""
    from megatrain.optim import build_optimizer
    from megatrain.optim.schedule import Schedule

    cfg, mult = arm["model"], arm["mult"]
    optim_cfg = optimizer_config(arm, args)
    model = models.initial_model(cfg, arm["seed"]).to(device).train()
    run = models.Run(name=name, impl="megatrain", init_seed=arm["seed"], model=model,
                     optimizer=build_optimizer(model, optim_cfg), hf=False)
    steps, eval_every = args.steps // mult, args.eval_every // mult
    schedule = Schedule.of(optim_cfg, steps)
    per_step = args.batch * mult * cfg.seq_len
    crcs: list[int] = []
    batches = data.train_batches(index, data_cfg, args.batch, cfg.vocab_size)

    def evaluate(step: int) -> None:
        run.val.append({"step": step, "tokens": step * per_step,
                        "loss": models.held_out_loss(run, val[0], val[1], args.batch, device)})
        log(f"  {name} step {step}: held-out {run.val[-1]['loss']:.4f}")

    evaluate(0)
    for step in range(1, steps + 1):
        parts = [next(batches) for _ in range(mult)]  # k consecutive baseline batches: the same token stream
        crcs += [crc for _, _, crc in parts]
        inputs = torch.cat([x for x, _, _ in parts]).to(device, non_blocking=True)
        targets = torch.cat([y for _, y, _ in parts]).to(device, non_blocking=True)
        t = time.perf_counter()
        loss, norm = models.train_step(run, inputs, targets, schedule.at(step - 1), args.grad_clip, device)
        run.train_loss.append(float(loss))
        run.grad_norm.append(float(norm))
        run.step_s.append(time.perf_counter() - t)
        if not math.isfinite(run.train_loss[-1]):
            log(f"  {name}: loss {run.train_loss[-1]} at step {step}: stopped (diverged)")
            break
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    batches.close()
    record = run.record()
    record.update(arm=name, model=cfg.model_dump(), optim=optim_cfg.model_dump(), batch=args.batch * mult,
                  steps=steps, tokens_per_step=per_step, batch_crc32=crcs,
                  params=sum(p.numel() for p in model.parameters()), diverged=not math.isfinite(run.train_loss[-1]))
    del run, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def summary(report: dict) -> dict:
    """Final held-out loss per arm, its difference from ``base``, the seed band, the best LR per optimizer."""
    arms = report["arms"]
    final = {name: arm["val"][-1]["loss"] for name, arm in arms.items() if arm["val"] and not arm["diverged"]}
    out: dict = {"final_val_loss": final}
    if "base" in final:
        out["minus_base"] = {name: loss - final["base"] for name, loss in final.items()}
        seeds = [final[name] for name in final if re.fullmatch(r"base(\+seed\d+)?", name)]
        if len(seeds) > 1:
            out["seed_band"] = max(seeds) - min(seeds)
    sweeps: dict[str, tuple[str, float]] = {}
    for name, loss in final.items():  # the best arm of each sweep: the arm's name without its lr<x>
        key = "+".join(p for p in name.split("+") if not p.startswith("lr")) or "base"
        if key in sweeps and sweeps[key][1] <= loss:
            continue
        sweeps[key] = (name, loss)
    out["best_of_sweep"] = {key: {"arm": name, "final_val_loss": loss} for key, (name, loss) in sweeps.items()}
    return out


def table(report: dict) -> str:
    s = report["summary"]
    band = s.get("seed_band")
    lines = ["| arm | params | batch x steps | optimizer, peak LR | held-out loss (final) | minus base | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, arm in report["arms"].items():
        loss = s["final_val_loss"].get(name)
        diff = s.get("minus_base", {}).get(name)
        lines.append(f"| {name} | {arm['params'] / 1e6:.0f}M | {arm['batch']} x {arm['steps']} | {arm['optim']['name']} "
                     f"{arm['optim']['lr']:g} | {'diverged' if loss is None else f'{loss:.4f}'} | "
                     f"{'-' if diff is None else f'{diff:+.4f}'} | {arm['step_s_mean']:.3f} |")
    if band is not None:
        lines.append(f"\nseed band |base - base+seed<s>|: {band:.4f}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, arm in report["arms"].items():
        ax.plot([p["tokens"] / 1e6 for p in arm["val"]], [p["loss"] for p in arm["val"]], marker=".", label=name)
    seconds = [arm["val"][1]["loss"] for arm in report["arms"].values() if len(arm["val"]) > 1]
    if seconds:
        ax.set_ylim(top=max(seconds) + 0.3)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(report.get("title", ""), fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--shape", choices=sorted({s for _, s in models.SHAPES}), default="125m")
    p.add_argument("--arms", default="base,base+seed1,parallel,window256")
    for flag, kind, default in (("--steps", int, 1000), ("--batch", int, 16), ("--lr", float, 6e-4),
                                ("--min-lr", float, 6e-5), ("--warmup", int, 100), ("--weight-decay", float, 0.1),
                                ("--grad-clip", float, 1.0), ("--eval-every", int, 100), ("--val-windows", int, 128),
                                ("--max-source-bytes", int, None), ("--num-workers", int, 0)):
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--doc-roots", default=",".join(data.DOC_ROOTS))
    p.add_argument("--work", default="runs/convergence")
    p.add_argument("--out", default="benchmarks/results/ablations")
    p.add_argument("--png", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--commit", default=None)
    return p.parse_args(argv)


def run_ablations(args, log=print) -> dict:
    t0 = time.perf_counter()
    device = torch.device(args.device)
    cfg = models.model_config(args.family, args.shape)
    roots = tuple(r for r in args.doc_roots.split(",") if r)
    data_cfg = data.data_config(f"{args.work}/shards", cfg.vocab_size, max_source_bytes=args.max_source_bytes,
                                doc_roots=roots, num_workers=args.num_workers)
    index = data.build_shards(data_cfg, cfg.seq_len, cfg.vocab_size)
    val = data.held_out(index, args.val_windows)
    arms = {name: parse_arm(name, args.family, cfg, args) for name in args.arms.split(",")}  # all refused before any runs
    out = report_mod.json_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "convergence_ablations", "family": args.family, "shape": args.shape,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "precision": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32",
              "commit": args.commit or convergence._commit(), "command": " ".join(sys.argv),
              "tokens": args.steps * args.batch * cfg.seq_len, "seq_len": cfg.seq_len, "base_batch": args.batch,
              "data": data.describe(index, data_cfg, roots), "val_windows": len(val[0]),
              "epochs": args.steps * args.batch / index.num_samples, "arms": {}}
    for name, arm in arms.items():
        log(f"[{time.perf_counter() - t0:6.1f}s] arm {name}")
        report["arms"][name] = train_arm(name, arm, index, data_cfg, val, args, device, log)
        first = next(iter(report["arms"].values()))["batch_crc32"]
        mine = report["arms"][name]["batch_crc32"]
        if mine != first[:len(mine)]:
            raise SystemExit(f"arm {name}: read another token stream than {next(iter(report['arms']))}")
        report["summary"] = summary(report)
        report["wall_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run_ablations(args, log=lambda msg: print(msg, flush=True))
    print(table(report))
    if args.png:
        report["title"] = (f"{args.family} {args.shape}, equal tokens ({report['tokens'] / 1e6:.1f}M), same stream, "
                           f"{report['device']}, {report['precision']}")
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(report, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
