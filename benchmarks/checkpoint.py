"""How long a checkpoint blocks the training loop: two-stage snapshot vs a synchronous torch.save.

The state is a recipe's GPT plus Adam-like optimizer state, built with plain torch (no DeepSpeed):

- ``--device cuda``: bf16 weights + fp32 master weights + fp32 exp_avg + exp_avg_sq (mixed
  precision, what a ZeRO rank holds at dp=1); ``--device cpu``: fp32 weights + the two moments.

Measured, in order (the JSON is rewritten after each phase, so a run cut short keeps its numbers):

1. ``torch.save`` of that state to the local disk (GPU tensors are copied to host inside it);
2. stage 1, first save: allocate (and on CUDA pin) the host buffers + device -> host copy;
3. stage 1, steady state: the same into the reused buffers (what every later save costs);
4. the background staging write (safetensors + sha256) of a save;
5. stage 2: upload to a local "durable" directory with read-back verification and commit.

    python benchmarks/checkpoint.py --config configs/gpt-125m.yaml --device cpu --out bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.checkpoint.snapshot import RankSnapshot, Snapshotter  # noqa: E402
from megatrain.checkpoint.upload import upload_checkpoint  # noqa: E402
from megatrain.config import load_config  # noqa: E402
from megatrain.model import GPT  # noqa: E402


def build_state(config: str, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """file name -> tensors: the model file and the optimizer file of a one-rank checkpoint."""
    cfg = load_config(config)
    with torch.device(device):
        model = GPT(cfg.model)
    mixed = device.type == "cuda"
    weights = {name: p.detach().to(torch.bfloat16 if mixed else torch.float32) for name, p in model.named_parameters()}
    optim: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if mixed:
            optim[f"{name}.master"] = p.detach().float().clone()
        # random values, not zeros: untouched zero pages would make host copies unrealistically cheap
        optim[f"{name}.exp_avg"] = torch.randn_like(p, dtype=torch.float32) * 1e-3
        optim[f"{name}.exp_avg_sq"] = torch.rand_like(p, dtype=torch.float32) * 1e-6
    del model
    return {"model-pp00-tp00.safetensors": weights, "rank-00000.safetensors": optim}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_torch_save(state: dict, path: Path, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - start


def snapshot_of(state: dict, step: int) -> RankSnapshot:
    marker = {"fingerprint": "benchmark", "layout": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1},
              "coords": {"pp": 0, "dp": 0, "tp": 0}, "data_position": None, "versions": {"torch": torch.__version__}}
    meta = {"step": step, "rank": 0}
    return RankSnapshot(step=step, rank=0, tensor_files=state, json_files={"rank-00000.json": meta}, marker=marker)


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/gpt-125m.yaml")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=None, help="scratch dir on the local disk (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--skip-upload", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (host copies on CPU use them; torchrun ranks get 1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": args.config, "device": args.device, "host": platform.node(), "torch": torch.__version__,
                    "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    def record(**values: float) -> None:
        result.update(values)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))

    state = build_state(args.config, device)
    total = sum(t.numel() * t.element_size() for tensors in state.values() for t in tensors.values())
    record(state_gb=total / 1e9, tensors=sum(len(t) for t in state.values()))
    print(f"state: {total / 1e9:.2f} GB in {result['tensors']} tensors on {args.device}", flush=True)

    # 1. synchronous baseline
    path = scratch / "torch_save.pt"
    record(torch_save_s=timed_torch_save(state, path, device))
    path.unlink()
    print(f"torch.save: {result['torch_save_s']:.2f} s", flush=True)

    # 2-4. stage 1: first save allocates, the second reuses; both stage to disk in the background
    snapshotter = Snapshotter(scratch / "staging", device)
    for step, key in ((1, "first"), (2, "steady")):
        sync(device)
        staged = snapshotter.snapshot(snapshot_of(state, step))
        timing = snapshotter.last_timing
        record(**{f"snapshot_{key}_blocked_s": timing.blocked_s, f"snapshot_{key}_copy_s": timing.copy_s})
        print(f"snapshot ({key}): blocked {timing.blocked_s:.3f} s", flush=True)
        written = staged.result()
        record(**{f"staging_{key}_write_s": written.write_s},
               staging_write_s=written.write_s, staging_gbs=written.bytes / 1e9 / written.write_s)
        print(f"staging write: {written.write_s:.2f} s ({result['staging_gbs']:.2f} GB/s)", flush=True)
        if step == 1:
            shutil.rmtree(written.path)
    snapshotter.close()
    record(blocked_vs_torch_save=result["snapshot_steady_blocked_s"] / result["torch_save_s"])

    # 5. stage 2
    if not args.skip_upload:
        upload = upload_checkpoint(written.path, str(scratch / "durable"), retries=0, clean_staged=True)
        record(upload_s=upload.seconds, upload_gbs=upload.bytes / 1e9 / upload.seconds)
        print(f"upload + verify + commit: {upload.seconds:.2f} s ({result['upload_gbs']:.2f} GB/s)", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)

    rows = [
        ("state", f"{result['state_gb']:.2f} GB ({args.config}, {args.device})"),
        ("torch.save (blocks the loop)", f"{result['torch_save_s']:.3f} s"),
        ("snapshot, first save (alloc + copy)", f"{result['snapshot_first_blocked_s']:.3f} s"),
        ("snapshot, steady state (copy)", f"{result['snapshot_steady_blocked_s']:.3f} s"),
        ("  = fraction of torch.save", f"{100 * result['blocked_vs_torch_save']:.1f} %"),
        ("staging write, background", f"{result['staging_write_s']:.2f} s ({result['staging_gbs']:.2f} GB/s)"),
    ]
    if "upload_s" in result:
        rows.append(("upload + verify + commit", f"{result['upload_s']:.2f} s ({result['upload_gbs']:.2f} GB/s)"))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
