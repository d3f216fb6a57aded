"""Causal attention forward and forward + backward through each SDPA backend and FlexAttention, at
one layer of a recipe (default moe-gpu-2b at micro-batch 32: 16 query heads over 8 KV heads of 64,
2,048 tokens): which kernel megatrain's ``attention: auto`` should take. GQA either as SDPA's
``enable_gqa`` or with the KV heads repeated. CUDA only; prints a table and writes JSON.

    python benchmarks/attention_backends.py --config configs/moe-gpu-2b.yaml --mb 32 --out attention.json
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

    out = {f"{name} {'gqa' if gqa else 'repeated kv'}": sdpa(backend, gqa)
           for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)) for gqa in (True, False)}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
    flex = torch.compile(flex_attention)
    out["flex gqa"] = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/moe-gpu-2b.yaml")
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--out", default="runs/attention-backends.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_backends.py: needs a CUDA device (its kernels are the GPU's)")
    m = load_config(args.config).model
    shape = (args.mb, m.n_head, m.seq_len, m.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(args.mb, m.kv_heads, m.seq_len, m.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows: dict[str, dict] = {}
    for name, forward in cases(q, k, v).items():
        try:
            with torch.no_grad():
                fwd = time_ms(forward, q.device)
            rows[name] = {"forward_ms": fwd, "forward_backward_ms": time_ms(lambda: forward().backward(grad), q.device)}
        except Exception as exc:  # noqa: BLE001 - a backend that has no kernel for this shape
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(f"{'kernel':<26} {'forward ms':>11} {'fwd+bwd ms':>11}")
    for name, r in rows.items():
        print(f"{name:<26} " + (f"{r['forward_ms']:>11.3f} {r['forward_backward_ms']:>11.3f}" if "error" not in r
                                 else r["error"][:80]))
    report = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"micro_batch": args.mb, "heads": m.n_head, "kv_heads": m.kv_heads, "seq_len": m.seq_len,
                        "head_dim": m.head_dim}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
