"""Causal attention forward and forward + backward through each SDPA backend and FlexAttention, at
one layer of a recipe (default moe-gpu-2b at micro-batch 32: 16 query heads over 8 KV heads of 64,
2,048 tokens): which kernel megatrain's ``attention: auto`` should take. GQA either as SDPA's
``enable_gqa`` or with the KV heads repeated. CUDA only; prints a table and writes JSON.

    python benchmarks/attention_backends.py --config configs/moe-gpu-2b.yaml --mb 32 --out attention.json
    python benchmarks/attention_backends.py --config configs/llama-1b.yaml --mb 1 --seq-len 65536 --layouts heads,tokens

``--layouts``: ``heads`` times q, k, v as contiguous [B, H, T, hd]; ``tokens`` as the model hands them
to attention, [B, T, H, hd] in memory (the qkv projection's output) seen transposed, which is what a
long-context step runs. ``sdpa auto`` is SDPA with no backend forced: what ``attention: auto`` takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from bound import time_ms  # noqa: E402

from megatrain.config import load_config  # noqa: E402


def cases(q, k, v):
    """name -> forward(): SDPA per backend (GQA native or repeated), FlexAttention compiled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]

    def sdpa(backend, gqa: bool):
        def forward():
            with sdpa_kernel([backend]):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
        return forward

    out = {"sdpa auto gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    out |= {f"{name} {'gqa' if gqa else 'repeated kv'}": sdpa(backend, gqa)
           for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)) for gqa in (True, False)}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
    flex = torch.compile(flex_attention)
    out["flex gqa"] = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)
    return out


def qkv_tensor(batch: int, heads: int, seq_len: int, head_dim: int, layout: str) -> torch.Tensor:
    """[B, heads, T, hd] bf16 leaf: contiguous (``heads``) or a transposed view of [B, T, heads, hd] (``tokens``)."""
    if layout == "heads":
        return torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if layout == "tokens":
        base = torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        return base.transpose(1, 2).requires_grad_()
    raise SystemExit(f"--layouts: {layout!r} is not one of heads, tokens")


def timed(forward, grad: torch.Tensor, device: torch.device) -> dict:
    try:
        with torch.no_grad():
            fwd = time_ms(forward, device)
        return {"forward_ms": fwd, "forward_backward_ms": time_ms(lambda: forward().backward(grad), device)}
    except Exception as exc:  # noqa: BLE001 - a backend that has no kernel for this shape
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/moe-gpu-2b.yaml")
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=None, help="instead of the recipe's model.seq_len")
    parser.add_argument("--layouts", default="heads", help="comma list of heads, tokens (the module docstring)")
    parser.add_argument("--out", default="runs/attention-backends.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_backends.py: needs a CUDA device (its kernels are the GPU's)")
    m = load_config(args.config).model
    seq_len = args.seq_len or m.seq_len
    rows: dict[str, dict] = {}
    for layout in args.layouts.split(","):
        q, k, v = (qkv_tensor(args.mb, heads, seq_len, m.head_dim, layout) for heads in (m.n_head, m.kv_heads, m.kv_heads))
        grad = torch.randn_like(q)
        for name, forward in cases(q, k, v).items():
            rows[f"{layout}: {name}"] = timed(forward, grad, q.device)
        del q, k, v, grad
    flops = 2 * args.mb * m.n_head * seq_len * seq_len * m.head_dim  # causal: half of 4 B H T^2 hd
    print(f"{'layout: kernel':<34} {'forward ms':>11} {'fwd+bwd ms':>11} {'fwd+bwd TFLOP/s':>16}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<34} {r['error'][:80]}")
            continue
        r["forward_backward_tflops"] = 3.5 * flops / r["forward_backward_ms"] / 1e9  # backward 2.5x the forward
        print(f"{name:<34} {r['forward_ms']:>11.3f} {r['forward_backward_ms']:>11.3f} {r['forward_backward_tflops']:>16.1f}")
    report = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"micro_batch": args.mb, "heads": m.n_head, "kv_heads": m.kv_heads, "seq_len": seq_len,
                        "head_dim": m.head_dim}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
