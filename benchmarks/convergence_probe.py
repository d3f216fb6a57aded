"""The first steps of convergence runs, tensor group by tensor group, in this process.

    python benchmarks/convergence_probe.py --family gpt --shape 1.3b --batch 8 --runs peer+compile:0 --steps 2

Runs are built as ``convergence.py`` builds them (``convergence_models.make_run``) and fed the
loader's first batches (or ``--random`` tokens). For each step and run it prints the loss, the
total gradient norm (before the clip) and the norms of the embedding, the output head, the
first and last block, plus digests of the inputs and of the targets, and writes them to
``--out`` as JSON. Running it in several processes with different ``--runs`` tells a difference
that comes from the process (what else ran there) from one that comes from the models.
``--eval-first`` runs convergence.py's held-out evaluation before step 0, as convergence.py does.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import convergence as conv  # noqa: E402
import convergence_data as data  # noqa: E402
import convergence_models as models  # noqa: E402


def group_of(name: str, n_layer: int) -> str:
    """Which part of the model a parameter belongs to, in either implementation's names."""
    if any(key in name for key in ("wte", "embed_tokens", "tok_emb", "embedding")):
        return "embedding"
    if name == "head.weight" or any(key in name for key in ("lm_head", "output")):
        return "head"
    if any(key in name for key in ("ln_f", "norm_f", "final_norm", "model.norm.")):
        return "final norm"
    if any(key in name for key in ("wpe", "pos_emb")):
        return "positions"
    for layer, label in ((0, "block 0"), (n_layer - 1, "last block")):
        if f".{layer}." in f".{name}":
            return label
    return "other"


def group_norms(model: torch.nn.Module, n_layer: int) -> dict[str, float]:
    """Gradient norm per group; a tied tensor is counted once, under its first name."""
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():  # named_parameters() yields a shared tensor once
        if param.grad is not None:
            group = group_of(name, n_layer)
            squares[group] = squares.get(group, 0.0) + float(param.grad.float().pow(2).sum())
    return {group: value ** 0.5 for group, value in sorted(squares.items())}


def digest(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.cpu().numpy().tobytes())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random", action="store_true", help="random tokens instead of the loader's batches")
    parser.add_argument("--probe-out", default=None, help="JSON of the printed rows")
    parser.add_argument("--eval-first", action="store_true",
                        help="the held-out evaluation before step 0, as convergence.py runs it (its last chunk "
                             "is shorter than the batch: compiled runs see a second shape before training)")
    args, rest = parser.parse_known_args(argv)
    conv_args = conv.parse_args(rest)
    with models.shape_policy(dynamic=conv_args.dynamic_shapes):  # convergence.py's --dynamic-shapes
        return probe(args, conv_args)


def probe(args, conv_args) -> int:
    device = torch.device(conv_args.device)
    cfg = models.model_config(conv_args.family, conv_args.shape)
    data_cfg = data.data_config(f"{conv_args.work}/shards", cfg.vocab_size, max_source_bytes=conv_args.max_source_bytes,
                                doc_roots=tuple(r for r in conv_args.doc_roots.split(",") if r),
                                num_workers=conv_args.num_workers)
    index = data.build_shards(data_cfg, cfg.seq_len, cfg.vocab_size)
    optim_cfg = conv.optim_config(conv_args)
    runs = [models.make_run(name, conv_args.family, cfg, optim_cfg, data.tokenizer_bytes(index), device)
            for name in conv_args.runs.split(",")]
    if args.eval_first:
        val_x, val_y = data.held_out(index, conv_args.val_windows)
        for run in runs:
            print(json.dumps({"held_out_before_step_0": run.name,
                              "loss": models.held_out_loss(run, val_x, val_y, conv_args.batch, device)}), flush=True)
    batches = data.train_batches(index, data_cfg, conv_args.batch, cfg.vocab_size)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for step in range(conv_args.steps):
        if args.random:
            tokens = torch.randint(cfg.vocab_size, (conv_args.batch, cfg.seq_len + 1), generator=generator)
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:
            inputs, targets, _ = next(batches)
        row = {"step": step, "inputs_crc32": digest(inputs), "targets_crc32": digest(targets),
               "targets_equal_shifted_inputs": bool((inputs[:, 1:] == targets[:, :-1]).all()), "runs": {}}
        inputs, targets = inputs.to(device), targets.to(device)
        for run in runs:
            loss, norm = models.train_step(run, inputs, targets, conv_args.lr / conv_args.warmup, 0.0, device)
            total = sum(v ** 2 for v in group_norms(run.model, cfg.n_layer).values()) ** 0.5
            row["runs"][run.name] = {"loss": float(loss), "grad_norm": total,
                                     "groups": group_norms(run.model, cfg.n_layer)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.probe_out:
        Path(args.probe_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
