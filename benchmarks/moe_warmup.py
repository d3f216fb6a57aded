"""Warm up an MoE recipe and export it, for ``benchmarks/mfu.py --init-from``: the trainer runs
``train.steps`` steps on the recipe's data, each step's metrics go to ``<run_dir>/warmup-metrics.jsonl``
(``benchmarks/moe_balance.py`` reads it), and the model is written as a transformers folder. No
checkpoint is written: moe-gpu-2b's is 30 GB with its optimizer state, and only the weights are
needed.

Why: right after initialisation a router sends its tokens to a few experts (max/mean load 4-6 per
layer on text), which no long run sees past its first few hundred steps, and the grouped GEMMs of
the busiest experts dominate. Both rows of the benchmark start from the exported weights, so both
meet the same, warmed-up routing:

    python benchmarks/moe_warmup.py configs/moe-gpu-2b.yaml /tmp/warm/hf train.device=cuda train.steps=480 \\
        train.micro_batch_size=16 train.global_batch_size=32 optim.warmup_steps=100 \\
        data.max_source_bytes=64000000 train.run_dir=/tmp/warm/run
    python benchmarks/mfu.py --quick --config configs/moe-gpu-2b.yaml --large-batch 512 --default-mbs 32 \\
        --baseline-mbs 32 --late-baseline-mbs "" --only baseline,default --init-from /tmp/warm/hf \\
        --source-bytes 64000000

The second reads the text the warm-up trained on (``--source-bytes`` as its ``data.max_source_bytes``);
quick mode's default 6-MB slice of it routes less evenly. ``benchmarks/results/mfu-moe-2b-gb512-480-step-weights-permute-by-token-h200.json``
was made so, on one H200, in one 474-s run (the warm-up 236 s with its export).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from megatrain import storage  # noqa: E402
from megatrain.config import load_config  # noqa: E402
from megatrain.interop.hf import export_model  # noqa: E402
from megatrain.parallel.init import init_distributed, shutdown_distributed  # noqa: E402
from megatrain.training.trainer import Trainer  # noqa: E402


def line(m) -> str:
    """One step's loss, speed and expert load (worst layer, and the mean over layers)."""
    layers = [v["max_over_mean"] for v in (m.moe or {}).get("layers", {}).values()]
    load = f" load worst {m.moe['max_over_mean']:.2f} mean {sum(layers) / len(layers):.2f}" if layers else ""
    return f"step {m.step} loss {m.loss:.3f} tok/s {m.tokens_per_s:,.0f}{load}"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cfg = load_config(sys.argv[1], sys.argv[3:])
    out = Path(sys.argv[2])
    env = init_distributed(device=cfg.train.device)
    trainer = Trainer(cfg, env)
    start = time.time()
    try:
        with open(Path(cfg.train.run_dir) / "warmup-metrics.jsonl", "w") as metrics:
            for _ in range(cfg.train.steps):
                m = trainer.train_step()
                metrics.write(json.dumps({k: v for k, v in asdict(m).items() if k != "startup"}) + "\n")
                if m.step % 25 == 0 or m.step == 1:
                    print(f"{line(m)} at {time.time() - start:.0f}s", flush=True)
        # the tokenizer of the very shards this run read (a shard folder may hold other versions too)
        tokenizer_json = storage.read_bytes(trainer.index.tokenizer_url)
        export_model(trainer.engine.module, cfg.model, out, tokenizer_json, cfg.data.eos_token)
        print(f"exported to {out} at {time.time() - start:.0f}s", flush=True)
    finally:
        trainer.loader.close()
        shutdown_distributed()


if __name__ == "__main__":
    main()
