"""Helpers for the parallel parity tests: launch ``parity_worker.py`` under torchrun (gloo on
127.0.0.1) and compute the single-process reference of the same global batch in this process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import parity_worker
import torch

from megatrain.launch.forked import ForkLaunch, run_to_end

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_parity(nproc: int, variants: list[dict], out_dir: Path, timeout: int = 300) -> dict[str, dict]:
    """Run every variant in one world of ``nproc`` gloo processes; return
    {variant name: results}, the per-stage files of a pipeline merged into one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    launch = ForkLaunch(["--out", str(out_dir), "--variants", json.dumps(variants)], nproc,
                        script=str(HERE / "parity_worker.py"))  # forked with torchrun's environment
    code, output = run_to_end(launch, env, ROOT, timeout)
    if code != 0:
        raise AssertionError(f"the ranks failed ({code}):\n{output[-9000:]}")
    results: dict[str, dict] = {}
    for variant in variants:
        files = sorted(out_dir.glob(f"{variant['name']}.stage*.pt"))
        assert files, f"no results for {variant['name']}"
        merged: dict = {"grads": {}, "weights": {}}
        for path in files:
            part = torch.load(path, weights_only=True)
            merged["grads"].update(part["grads"])
            merged["weights"].update(part["weights"])
            if part["stage"] == len(files) - 1:  # the last stage computes the loss
                merged["loss"], merged["grad_norm"] = part["loss"], part["grad_norm"]
            merged.setdefault("norm_check", {}).update(part.get("norm_check", {}))
        results[variant["name"]] = merged
    return results


def reference_run(variant: dict) -> dict:
    """The same steps in one process with plain torch and no DeepSpeed: micro-batch losses
    scaled by 1/accumulation, gradients clipped to ``grad_clip`` by global norm, LAMB, schedule.
    This is the math every parallel layout must reproduce."""
    cfg = parity_worker.build_config(variant, world=1)
    model = parity_worker.build_model(cfg)
    optimizer = parity_worker.build_optimizer(model, cfg.optim)
    scheduler = parity_worker.build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    named = dict(model.named_parameters())
    losses, norms, grads = [], [], {}
    for step in range(cfg.train.steps):
        micro = parity_worker.my_micro_batches(cfg, step, dp_rank=0, dp=1)
        micro_losses = []
        for inputs, targets in micro:
            loss = model(inputs, targets)
            (loss / len(micro)).backward()
            micro_losses.append(loss.detach())
        if step == 0:
            grads = {name: named[name].grad.clone() for name in parity_worker.SAMPLED if name in named}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(torch.stack(micro_losses).mean()))
    weights = {name: param.detach().clone() for name, param in named.items()}
    return {"loss": losses, "grad_norm": norms, "grads": grads, "weights": weights}
