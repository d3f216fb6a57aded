"""Run N training steps of the real Trainer and print each step's metrics as a JSON line, without
the end-of-run checkpoint (megatrain's checkpoints do not cover ZeRO-3 yet; the steps do).

    python tests/megatrain/precision/train_steps.py STEPS --config configs/tiny-cpu.yaml KEY=VALUE ...
(or under torchrun for several ranks)."""

import json
import sys
from dataclasses import asdict

from megatrain.config import load_config
from megatrain.parallel.init import init_distributed, shutdown_distributed
from megatrain.training.trainer import Trainer


def main() -> None:
    steps, config, overrides = int(sys.argv[1]), sys.argv[3], sys.argv[4:]
    cfg = load_config(config, overrides)
    env = init_distributed(device=cfg.train.device)
    trainer = Trainer(cfg, env)
    try:
        for _ in range(steps):
            metrics = trainer.train_step()
            if env.rank == 0:
                print("STEP " + json.dumps(asdict(metrics)), flush=True)
    finally:
        trainer.checkpointer.close()
        trainer.loader.close()
        shutdown_distributed()


if __name__ == "__main__":
    main()
