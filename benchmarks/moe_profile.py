"""Kernel-level profile of an MoE recipe's compiled training step, one GPU, A/B over one kernel
choice in the same process (issue 32):

    python benchmarks/moe_profile.py --config configs/moe-gpu-2b.yaml --mb 8 \
        --ab model.kernels.moe_permute=reference,fused --out moe-profile.json

``--ab compile.mode=default,max-autotune`` varies torch.compile's mode instead of a config field;
``--ab tokens=random,text --tokens-from DIR`` feeds uniform random tokens or the text of the first
shard under DIR (real text routes very unevenly at initialisation: the same token goes to the same
experts);
``--ab train.precision=bf16,fp8 --set train.fp8.experts=true`` runs the FP8 linears and expert GEMMs
beside bf16.
Per variant: the model built from the recipe in bf16 with compiled blocks, fused AdamW, random
tokens, one optimizer step per micro-batch (a plain loop: no DeepSpeed, no data, no accumulation,
so the optimizer's share is larger than in the trainer's 512-sequence steps); step time over 10
steps after 3 warm-up steps, then two steps under torch.profiler: GPU time per kernel name and
per part (grouped GEMMs, the MoE permutation, SwiGLU, attention, optimizer, other). Prints a
table; writes every number as JSON.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mfu_profile import busy_ms, kernel_totals, phase_summary, phased_kernels  # noqa: E402

# kernel name -> part of the step (first match wins)
PARTS = [("FP8 casts", ("triton_red_fused__scaled", "triton_per_fused__scaled", "triton_poi_fused__scaled")),  # Inductor's
         ("grouped GEMMs", ("GroupProblemShape", "prepare_grouped_gemm", "_grouped_mm")),  # CUTLASS; Inductor's
         ("MoE permutation", ("_gather_rows", "_gather_sum", "_combine_bwd", "index_put", "index_copy",
                              "index_select", "_unsafe_view_add_mul_sum", "scatter_add_squeeze_sum",
                              "add_index_mul")),
         ("SwiGLU", ("_swiglu",)),
         ("attention", ("sdpa", "fmha", "flash", "cudnn")),
         ("optimizer", ("FusedOptimizer", "multi_tensor_apply")),
         ("routing (top-k, sort)", ("topk", "TopK", "RadixSort", "bitonicSort", "scatter_gather"))]


COMPILE_MODE = "compile.mode"  # --ab compile.mode=default,max-autotune: torch.compile's mode per variant
TOKENS = "tokens"  # --ab tokens=random,text: the batch's tokens per variant


def text_tokens(folder: str, mb: int, seq_len: int) -> torch.Tensor:
    """[mb, seq_len + 1] token windows from the shards under ``folder`` (shard_format.py), in name order."""
    import io
    import itertools
    import tarfile

    import numpy as np

    def all_windows():  # lazily: a real corpus has thousands of shards, and mb windows are few
        for shard in sorted(Path(folder).rglob("*.tar")):
            with tarfile.open(shard) as tar:
                for member in tar:
                    if member.name.endswith(".tokens.npy"):
                        array = np.load(io.BytesIO(tar.extractfile(member).read()))
                        yield from array.reshape(-1, array.shape[-1])

    windows = list(itertools.islice(all_windows(), mb))
    if len(windows) < mb or windows[0].shape[0] != seq_len + 1:
        raise SystemExit(f"{folder}: needs {mb} windows of {seq_len + 1} tokens")
    return torch.from_numpy(np.stack(windows[:mb]).astype(np.int64))


def part_of(kernel: str) -> str:
    return next((part for part, keys in PARTS if any(k in kernel for k in keys)), "other")


def measure(config: str, overrides: list[str], mb: int, compile_mode: str = "default", steps: int = 10,
            trace: str | None = None, tokens_from: str | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatrain.config.load import load_config
    from megatrain.model.gpt import GPT
    from megatrain.model.moe import end_step
    from megatrain.precision import apply_precision

    cfg = load_config(config, [f"train.micro_batch_size={mb}", "train.device=cuda", *overrides])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg.model).to(torch.bfloat16)
    apply_precision(model, cfg)  # train.precision=fp8: FP8 linears (and expert GEMMs: train.fp8.experts)
    for block in model.blocks:
        block.compile(mode=None if compile_mode == "default" else compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if tokens_from:
        windows = text_tokens(tokens_from, mb, cfg.model.seq_len).cuda()
        idx, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    else:
        idx, targets = (torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len), device="cuda") for _ in range(2))

    def step() -> None:  # the trainer's phase names (mfu_profile.kernels_by_phase splits by them)
        with record_function("megatrain.forward"):
            loss = model(idx, targets)
        with record_function("megatrain.backward"):
            loss.backward()
        with record_function("megatrain.optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    from torch._dynamo.utils import counters

    counters.clear()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graph_breaks = sum(counters["graph_break"].values())  # each one splits a block's graph in two
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    totals, counts = kernel_totals(prof)
    kernels = {name: {"ms": ms / 2, "calls": counts[name] // 2} for name, ms in totals.items()}  # per step
    parts: dict[str, float] = collections.defaultdict(float)
    for name, kernel in kernels.items():
        parts[part_of(name)] += kernel["ms"]
    peak = torch.cuda.max_memory_allocated() / 2**30
    balance = end_step(model)  # the routing skew over the measured steps, per layer
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"overrides": overrides, "compile_mode": compile_mode, "tokens": "text" if tokens_from else "random",
            "step_ms": step_s * 1e3,
            "tokens_per_s": mb * cfg.model.seq_len / step_s,
            "peak_gib": peak, "gpu_ms": sum(parts.values()), "gpu_busy_ms": busy_ms(prof) / 2,
            "graph_breaks": graph_breaks, "parts_ms": dict(parts), "phases": phase_summary(phased_kernels(prof), per=2),
            "moe_max_over_mean": {k: v["max_over_mean"] for k, v in balance["layers"].items()} if balance else None,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/moe-gpu-2b.yaml")
    parser.add_argument("--mb", type=int, default=8)
    parser.add_argument("--ab", default="model.kernels.moe_permute=reference,fused",
                        help="KEY=V1,V2,...: one variant per value, the first is the baseline; KEY compile.mode "
                             "varies torch.compile's mode (default, max-autotune, ...)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every variant")
    parser.add_argument("--out", default="runs/moe-profile.json")
    parser.add_argument("--trace", default=None, help="PREFIX: each variant's chrome trace to PREFIX-<i>.json")
    parser.add_argument("--tokens-from", default=None, help="a shard folder: --ab tokens=random,text reads text there")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_profile.py needs a CUDA GPU (the grouped GEMMs and the Triton kernels run there)")
    key, values = args.ab.split("=", 1)

    def trace(i: int) -> str | None:
        return f"{args.trace}-{i}.json" if args.trace else None

    device = torch.cuda.get_device_name()
    if key == COMPILE_MODE:  # torch.compile's mode, not a config field
        rows = [measure(args.config, args.set, args.mb, compile_mode=v, trace=trace(i))
                for i, v in enumerate(values.split(","))]
    elif key == TOKENS:
        if not args.tokens_from:
            raise SystemExit("--ab tokens=... needs --tokens-from SHARD_FOLDER")
        rows = [measure(args.config, args.set, args.mb, trace=trace(i),
                        tokens_from=args.tokens_from if v == "text" else None) for i, v in enumerate(values.split(","))]
    else:
        rows = [measure(args.config, [*args.set, f"{key}={v}"], args.mb, trace=trace(i))
                for i, v in enumerate(values.split(","))]
    parts = list(dict.fromkeys(p for r in rows for p in r["parts_ms"]))
    print(f"{args.config}, micro-batch {args.mb}, {device}: ms per step (GPU time by part)")
    print(f"{key:<34}" + "".join(f"{v:>14}" for v in values.split(",")))
    for label, get in [("step (wall)", lambda r: r["step_ms"]), ("tokens/s", lambda r: r["tokens_per_s"]),
                       ("GPU kernel time", lambda r: r["gpu_ms"]),
                       ("GPU busy (kernels' union)", lambda r: r["gpu_busy_ms"]),
                       ("graph breaks (compile)", lambda r: r["graph_breaks"]),
                       *((f"  {p}", (lambda p: lambda r: r["parts_ms"].get(p, 0.0))(p)) for p in parts)]:
        print(f"{label:<34}" + "".join(f"{get(r):>14,.1f}" for r in rows))
    for r in rows:
        label = r["compile_mode"] if key == COMPILE_MODE else r["tokens"] if key == TOKENS else r["overrides"][-1]
        print(f"top kernels, {label}:")
        for name, k in list(r["kernels"].items())[:12]:
            print(f"  {k['ms']:8.3f} ms {k['calls']:4d}x  {part_of(name):<22} {name[:90]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "config": args.config, "micro_batch": args.mb,
                                          "torch": torch.__version__, "variants": rows}, indent=1))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
