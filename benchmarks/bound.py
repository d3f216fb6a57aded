"""How fast one training micro-batch of a GPT or Llama could possibly run on this device (issues 7, 15).

    python benchmarks/bound.py --out runs/bound.json                          # 1.3B recipe, one GPU
    python benchmarks/bound.py --config configs/tiny-cpu.yaml --device cpu    # smoke test
    python benchmarks/mfu.py --quick --only bound,baseline,default ...        # beside the baseline

Every implementation of the model, megatrain's and the baseline's alike, must run:

1. the matmuls: per layer the four projections (qkv, attention output, fc, MLP output; GQA's
   qkv is d -> d + 2 kv, SwiGLU's fc is d -> 2 ff), each
   forward and, in the backward, its input gradient and its weight gradient; the tied LM head
   the same way. Shapes are the model's own, at the micro-batch's token count;
2. attention, forward and backward: SDPA (flash/cuDNN) for full causal attention,
   FlexAttention (megatrain.kernels.flex_attention) for a sliding window;
3. the memory traffic of the work between them, at the device-to-device copy bandwidth
   measured here (``floor_bytes`` lists every term).

1 and 2 run back to back on the device, in the model's order, with nothing in between: the
micro-batch as it would be if every other op were free. Where the card meets its power limit in
them (an H200 does: ~690 of 700 W, the SM clock down to ~1.5 GHz) that is a bound for a real
step too, although the step's GEMMs run at higher clocks (the pointwise kernels between them
draw less): at the cap time is energy over the cap, and a GEMM spends at least the energy it
takes at the lowest clock the cap forces. Adding 3 gives three floors:

- ``separate``: each op between the GEMMs makes one pass over its tensors (LayerNorm, bias +
  GeLU, the residual sum, their backwards, the qkv bias gradient, the loss's softmax, the
  optimizer update amortised over the step's micro-batches). The best that kernels beside
  cuBLAS GEMMs (inductor's or hand-written) can do.
- ``epilogue``: bias, GeLU and its gradient, the residual sum and the bias gradients move
  into the GEMMs (as cuBLASLt epilogues can do); what is left is LayerNorm, the stored GeLU
  input, the loss and the optimizer. The least traffic any kernel set on cuBLAS GEMMs moves.
- ``power share``: the epilogue floor's traffic adds only its energy, i.e. its time at the copy
  rate times (copy W - idle W) / (GEMM W - idle W), as if it ran beside the GEMMs for free
  otherwise. The strictest of the three (NVML power; CUDA only).

From these follow, per attention choice, the most tokens/s and the MFU (formula of
``megatrain.observe.mfu``) such an implementation could reach here, next to what issue 7's
targets need: >= 1.12x a baseline's tokens/s and >= 66% MFU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from megatrain.config import ModelConfig  # noqa: E402
from megatrain.kernels.attention import causal_attention  # noqa: E402
from megatrain.observe.mfu import flops_per_token, peak_flops  # noqa: E402

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TARGET_SPEEDUP, TARGET_MFU = 1.12, 0.66


def projections(m: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, d_in, d_out) of one block's linears, in forward order. GQA: qkv is d -> d + 2 kv;
    SwiGLU: fc is d -> 2 ff (gate and up in one GEMM)."""
    d, ff, kv = m.d_model, m.ffn_dim, m.kv_heads * m.head_dim
    fc_out = 2 * ff if m.mlp == "swiglu" else ff
    return [("qkv", d, d + 2 * kv), ("attn_proj", d, d), ("fc", d, fc_out), ("mlp_proj", ff, d)]


def micro_batch_gemm_flops(m: ModelConfig, tokens: int) -> int:
    """FLOPs of ``MicroBatchKernels.run``'s GEMMs: three matmuls (forward, input gradient, weight
    gradient) of 2 * tokens * d_in * d_out FLOPs per linear, and the same for the LM head."""
    per_layer = sum(d_in * d_out for _, d_in, d_out in projections(m))
    return 3 * 2 * tokens * (per_layer * m.n_layer + m.vocab_size * m.d_model)


class MicroBatchKernels:
    """The GEMMs and attention calls of one micro-batch's forward and backward, on random
    tensors of the model's shapes. Each layer has its own weights (as in the model); the
    activations are shared between layers (each is far larger than the L2 cache anyway)."""

    def __init__(self, m: ModelConfig, micro_batch: int, device: torch.device, dtype: torch.dtype):
        self.m, self.tokens = m, micro_batch * m.seq_len
        M, d = self.tokens, m.d_model

        def rand(*shape: int, grad: bool = False) -> torch.Tensor:
            return (torch.randn(*shape, device=device, dtype=dtype) * 0.02).requires_grad_(grad)

        self.weights = [[rand(d_out, d_in) for _, d_in, d_out in projections(m)] for _ in range(m.n_layer)]
        self.inputs = {d_in: rand(M, d_in) for _, d_in, _ in projections(m)}     # [M, d_in]
        self.out_grads = {d_out: rand(M, d_out) for _, _, d_out in projections(m)}  # [M, d_out]
        self.head, self.head_grad = rand(m.vocab_size, d), rand(M, m.vocab_size)  # [V, d], [M, V]
        shape = (micro_batch, m.n_head, m.seq_len, m.head_dim)
        kv_shape = (micro_batch, m.kv_heads, m.seq_len, m.head_dim)
        self.q = rand(*shape, grad=True)  # [B, H, T, hd]
        self.k, self.v = rand(*kv_shape, grad=True), rand(*kv_shape, grad=True)  # [B, G, T, hd]
        self.attn_grad = rand(*shape)

    def run(self, gemms: bool, attention: Attention | None) -> None:
        """Forward then backward of every layer; outputs are discarded."""
        qkv = (self.q, self.k, self.v)
        attn_out = []
        for layer in self.weights:  # forward
            for (_, d_in, _), w in zip(projections(self.m), layer):
                if gemms:
                    F.linear(self.inputs[d_in], w)  # [M, d_out]
            if attention is not None:
                attn_out.append(attention(*qkv))
        if gemms:  # LM head: logits, then dlogits @ W and dlogits^T @ h
            F.linear(self.inputs[self.m.d_model], self.head)
            self.head_grad @ self.head
            self.head_grad.t() @ self.inputs[self.m.d_model]
        for i in reversed(range(len(self.weights))):  # backward
            if attention is not None:
                torch.autograd.grad(attn_out[i], qkv, self.attn_grad)
            for (_, d_in, d_out), w in reversed(list(zip(projections(self.m), self.weights[i]))):
                if gemms:
                    self.out_grads[d_out] @ w                      # input gradient [M, d_in]
                    self.out_grads[d_out].t() @ self.inputs[d_in]  # weight gradient [d_out, d_in]


def floor_bytes(m: ModelConfig, tokens: int, n_params: int, micro_batches_per_step: int) -> dict[str, dict[str, float]]:
    """Bytes that must cross HBM between the GEMMs, per micro-batch, for each floor (bf16
    activations, fp32 master weights and moments). Each term: (reads + writes) x tensor size."""
    M, d, ff, V = tokens, m.d_model, m.ffn_dim, m.vocab_size
    kv = m.kv_heads * m.head_dim
    act = 2  # bytes per bf16 element
    norms = 2 if m.block == "serial" else 1  # norms (LayerNorm or RMSNorm) per layer
    glu = m.mlp == "swiglu"  # SwiGLU reads [gate | up] (2 ff) where GeLU reads ff
    per_layer_separate = {
        "norm fwd: read x, write norm(x)": norms * 2 * M * d * act,
        "activation fwd: read fc out, write it activated": (3 if glu else 2) * M * ff * act,
        "residual sum fwd: read x + 2 projections, write": (4 if norms == 1 else 6) * M * d * act,
        "activation bwd (+ GeLU's bias grad): read grad + fc out, write": (5 if glu else 3) * M * ff * act,
        "norm bwd (+ residual grad): read grad, x, dy; write dx": norms * 4 * M * d * act,
        "qkv bias grad: read dqkv": M * (d + 2 * kv) * act if m.bias else 0,
        "RoPE on q and k, fwd + bwd: read, write each way": 4 * M * (d + kv) * act if m.position == "rope" else 0,
    }
    per_layer_epilogue = {
        "norm fwd: read x, write norm(x)": norms * 2 * M * d * act,
        "activation input kept for the bwd: written by the fc GEMM, read by the bwd GEMM": 2 * M * (2 if glu else 1) * ff * act,
        "norm bwd (+ residual grad): read grad, x, dy; write dx": norms * 4 * M * d * act,
        "RoPE on q and k, fwd + bwd: read, write each way": 4 * M * (d + kv) * act if m.position == "rope" else 0,
    }
    once = {
        "embedding and final LayerNorm, fwd + bwd": 8 * M * d * act,
        "loss: read logits, write dlogits": 2 * M * V * act,
        # fp32 master, m, v, grad read; master, m, v written, bf16 weights written: per step
        "optimizer (per step, amortised)": 30 * n_params / micro_batches_per_step,
    }
    out = {}
    for name, per_layer in (("separate", per_layer_separate), ("epilogue", per_layer_epilogue)):
        terms = {k: v * m.n_layer for k, v in per_layer.items()} | once
        out[name] = {**terms, "total": sum(terms.values())}
    return out


def time_ms(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 5) -> float:
    """Median wall time of fn on the device (CUDA events around each call; host clock on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class PowerSampler:
    """Median board power (W) and SM clock (MHz) of the device while the block runs, sampled
    every 20 ms through NVML (``torch.cuda.power_draw``/``clock_rate``); None without NVML.
    NVML's power reading is an average over about a second, so samples of the first ``settle_s``
    seconds (still showing what ran before) are left out; the block must run longer than that."""

    def __init__(self, device: torch.device, settle_s: float = 1.0):
        self.device, self.settle_s, self.samples = device, settle_s, []
        self.watts = self.mhz = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(0.02):
            if time.perf_counter() - start >= self.settle_s:
                self.samples.append((torch.cuda.power_draw(self.device) / 1e3, torch.cuda.clock_rate(self.device)))

    def __enter__(self) -> PowerSampler:
        if self.device.type == "cuda":
            try:
                torch.cuda.power_draw(self.device)
                self._thread.start()
            except Exception:  # noqa: BLE001 - no NVML (pynvml) here: no power numbers, nothing else lost
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        if self.samples:
            self.watts = statistics.median(w for w, _ in self.samples)
            self.mhz = statistics.median(c for _, c in self.samples)


def copy_gbs(device: torch.device, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, GB/s of reads + writes (1 GiB on CUDA)."""
    n = 2**29 if device.type == "cuda" else 2**24
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, iters=iters, warmup=5)
    return 2 * x.numel() * x.element_size() / ms / 1e6


def attention_choices(m: ModelConfig, windows: list[int], device: torch.device) -> dict[str, tuple[Attention, int]]:
    """name -> (attention call, attended context for the MFU formula)."""
    choices: dict[str, tuple[Attention, int]] = {
        "full causal (SDPA)": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                              enable_gqa=m.kv_heads != m.n_head), m.seq_len)}
    for w in windows:
        if w < m.seq_len:  # megatrain's dispatch: FlexAttention on CUDA, SDPA with a mask on CPU
            name = f"window {w} ({'flex' if device.type == 'cuda' else 'SDPA + mask'})"
            choices[name] = (lambda q, k, v, w=w: causal_attention(q, k, v, w), w)
    return choices


def measure_bound(m: ModelConfig, micro_batch: int, global_batch: int, device: torch.device, *,
                  windows: list[int] = (), iters: int = 5, baseline_tokens_per_s: float | None = None,
                  log: Callable[[str], None] = print) -> dict:
    """Time the micro-batch's GEMMs and attention and return the bounds (see the module docstring)."""
    from megatrain.model.gpt import GPT, count_parameters

    with torch.device("meta"):
        n_params = count_parameters(GPT(m))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = MicroBatchKernels(m, micro_batch, device, dtype)
    tokens = kernels.tokens
    with PowerSampler(device) as copy_power:  # ~3 s of copies: long enough to sample the power
        bandwidth = copy_gbs(device, iters=6000 if device.type == "cuda" else 20)
    floors = floor_bytes(m, tokens, n_params, max(1, global_batch // micro_batch))
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    warmup = 2
    with PowerSampler(device) as gemm_power:
        gemm_ms = time_ms(lambda: kernels.run(True, None), device, iters, warmup)
    with PowerSampler(device, settle_s=2.0) as idle_power:  # nothing running: drawn whatever runs
        time.sleep(3.0 if device.type == "cuda" else 0.0)
    gemm_flops = micro_batch_gemm_flops(m, tokens)
    log(f"bound: GEMMs alone {gemm_ms:.1f} ms per micro-batch of {tokens} tokens "
        f"({gemm_flops / gemm_ms / 1e9:.3g} TFLOP/s, {fmt(gemm_power.watts, '.0f')} W, {fmt(gemm_power.mhz, '.0f')} MHz); "
        f"copy {bandwidth:.0f} GB/s ({fmt(copy_power.watts, '.0f')} W); idle {fmt(idle_power.watts, '.0f')} W")
    rows = []
    for name, (attention, context) in attention_choices(m, list(windows), device).items():
        attn_ms = time_ms(lambda: kernels.run(False, attention), device, iters, warmup)
        with PowerSampler(device) as power:
            both_ms = time_ms(lambda: kernels.run(True, attention), device, iters, warmup)
        fpt = flops_per_token(m.model_copy(update={"attention": "sliding", "window": context}) if context < m.seq_len else m, n_params)
        row = {"attention": name, "attended_context": context, "flops_per_token": fpt, "attention_ms": attn_ms,
               "gemm_plus_attention_ms": both_ms, "power_w": power.watts, "sm_mhz": power.mhz}
        for floor, terms in floors.items():
            ms = both_ms + terms["total"] / bandwidth / 1e6
            row[f"{floor}_ms"] = ms
            row[f"{floor}_tokens_per_s"] = tokens / ms * 1e3
            row[f"{floor}_mfu"] = tokens / ms * 1e3 * fpt / peak if peak else None
        # At the power cap a step's time is its energy over the cap: the GEMMs and attention
        # alone already draw the cap, so other work adds at least its own energy, i.e. its time
        # at the copy bandwidth scaled by the copy's power over the cap (the strictest floor).
        # The idle draw is paid all along whatever runs, so it is taken off both powers.
        if power.watts and copy_power.watts and idle_power.watts is not None:
            share = min(1.0, max(0.0, copy_power.watts - idle_power.watts) / (power.watts - idle_power.watts))
            row["power_share_ms"] = both_ms + share * floors["epilogue"]["total"] / bandwidth / 1e6
        else:
            row["power_share_ms"] = None
        # what the targets need, as ms per micro-batch: the tighter of the two
        row["mfu_target_ms"] = tokens * fpt / (TARGET_MFU * peak) * 1e3 if peak else None
        row["speedup_target_ms"] = tokens / (TARGET_SPEEDUP * baseline_tokens_per_s) * 1e3 if baseline_tokens_per_s else None
        needs = [x for x in (row["mfu_target_ms"], row["speedup_target_ms"]) if x]
        row["targets_ms"] = min(needs) if needs else None
        row["targets_reachable"] = ({f: row[f"{f}_ms"] <= row["targets_ms"] for f in (*floors, "power_share")
                                     if row[f"{f}_ms"] is not None} if needs else None)
        rows.append(row)
        log(f"bound: {name}: attention alone {attn_ms:.1f} ms, GEMMs + attention {both_ms:.1f} ms, "
            f"floors {row['separate_ms']:.1f} / {row['epilogue_ms']:.1f} ms; targets need <= {fmt(row['targets_ms'], '.1f')} ms")
    del kernels
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "micro_batch": micro_batch, "tokens": tokens, "global_batch": global_batch, "n_params": n_params,
            "peak_flops": peak, "copy_gbs": bandwidth, "gemm_ms": gemm_ms, "gemm_tflops": gemm_flops / gemm_ms / 1e9,
            "power": {"gemm_w": gemm_power.watts, "gemm_mhz": gemm_power.mhz, "idle_w": idle_power.watts,
                      "idle_mhz": idle_power.mhz, "copy_w": copy_power.watts,
                      "copy_mhz": copy_power.mhz},
            "floor_bytes": floors, "baseline_tokens_per_s": baseline_tokens_per_s, "rows": rows}


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(bound: dict) -> str:
    """Markdown table of the bound's rows."""
    lines = [f"Bound on {bound['device']}: {bound['tokens']} tokens per micro-batch; GEMMs alone "
             f"{bound['gemm_ms']:.1f} ms ({bound['gemm_tflops']:.3g} TFLOP/s); copy {bound['copy_gbs']:.0f} GB/s",
             "", "| attention | attention ms | GEMM + attention ms | W / MHz | + separate floor ms | tokens/s | MFU "
             "| + epilogue floor ms | tokens/s | MFU | epilogue floor at its power share ms | targets need ms "
             "| reachable (separate / epilogue / power share) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bound["rows"]:
        reach = r["targets_reachable"]
        lines.append(
            f"| {r['attention']} | {r['attention_ms']:.1f} | {r['gemm_plus_attention_ms']:.1f} "
            f"| {fmt(r['power_w'], '.0f')} / {fmt(r['sm_mhz'], '.0f')} | {r['separate_ms']:.1f} "
            f"| {r['separate_tokens_per_s']:,.0f} | {pct(r['separate_mfu'])} "
            f"| {r['epilogue_ms']:.1f} | {r['epilogue_tokens_per_s']:,.0f} | {pct(r['epilogue_mfu'])} "
            f"| {fmt(r['power_share_ms'], '.1f')} | {fmt(r['targets_ms'], '.1f')} | {'-' if reach is None else ' / '.join('yes' if v else 'no' for v in reach.values())} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- FP8 (issue 16)
FP8_PEAK_FLOPS = 1978.9e12  # H100/H200 SXM dense FP8 tensor-core peak (datasheet, no sparsity)


def fp8_gemm_bound(m: ModelConfig, micro_batch: int, device: torch.device, iters: int = 5) -> dict:
    """The blocks' GEMMs of one micro-batch as FP8 ``torch._scaled_mm`` calls (tensorwise scales,
    e4m3 activations and weights, e5m2 output gradients: torchao's tensorwise recipe) with the
    LM head in bf16, beside the same GEMMs all in bf16 (``MicroBatchKernels``), each with its
    board power and SM clock. Operands are cast and laid out beforehand: this is the speed of
    light of the FP8 GEMMs under the power cap, with every cast and amax free. CUDA only."""
    M, e4m3, e5m2 = micro_batch * m.seq_len, torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=device)

    def fp8(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * 0.5).to(dtype)

    def col_major(t: torch.Tensor) -> torch.Tensor:  # _scaled_mm wants its second operand column-major
        return t.t().contiguous().t()

    # activations shared by the layers (each far larger than the L2, as in MicroBatchKernels), weights per layer:
    # x [M, k] and dy [M, n] row-major for the forward and dgrad, dy^T [n, M] and x column-major for the wgrad
    acts = [(fp8((M, d_in), e4m3), fp8((M, d_out), e5m2), fp8((d_out, M), e5m2), col_major(fp8((M, d_in), e4m3)))
            for _, d_in, d_out in projections(m)]
    weights = [[(fp8((d_out, d_in), e4m3).t(), col_major(fp8((d_out, d_in), e4m3))) for _, d_in, d_out in projections(m)]
               for _ in range(m.n_layer)]  # w^T [k, n] column-major (fwd), w [n, k] column-major (dgrad)
    bf16 = MicroBatchKernels(m.model_copy(update={"n_layer": 1}), micro_batch, device, torch.bfloat16)

    def run() -> None:
        for layer in weights:
            for (x, dy, dy_t, x_cm), (w_t, w) in zip(acts, layer):
                torch._scaled_mm(x, w_t, one, one, out_dtype=torch.bfloat16)      # y = x w^T   [M, n]
                torch._scaled_mm(dy, w, one, one, out_dtype=torch.bfloat16)       # dx = dy w   [M, k]
                torch._scaled_mm(dy_t, x_cm, one, one, out_dtype=torch.bfloat16)  # dw = dy^T x [n, k]
        F.linear(bf16.inputs[m.d_model], bf16.head)  # the LM head stays bf16: fwd, dgrad, wgrad
        bf16.head_grad @ bf16.head
        bf16.head_grad.t() @ bf16.inputs[m.d_model]

    per_layer = sum(d_in * d_out for _, d_in, d_out in projections(m))
    block_flops, head_flops = 6 * M * per_layer * m.n_layer, 6 * M * m.vocab_size * m.d_model
    with PowerSampler(device) as power:
        ms = time_ms(run, device, iters, warmup=2)
    del acts, weights, bf16
    all_bf16 = MicroBatchKernels(m, micro_batch, device, torch.bfloat16)
    with PowerSampler(device) as bf16_power:
        bf16_ms = time_ms(lambda: all_bf16.run(True, None), device, iters, warmup=2)
    del all_bf16
    torch.cuda.empty_cache()
    return {"micro_batch": micro_batch, "tokens": M, "gemm_flops": block_flops + head_flops,
            "fp8_ms": ms, "fp8_tflops": (block_flops + head_flops) / ms / 1e9, "fp8_power_w": power.watts,
            "fp8_sm_mhz": power.mhz, "bf16_ms": bf16_ms, "bf16_tflops": (block_flops + head_flops) / bf16_ms / 1e9,
            "bf16_power_w": bf16_power.watts, "bf16_sm_mhz": bf16_power.mhz, "speedup": bf16_ms / ms,
            "fp8_peak_flops": FP8_PEAK_FLOPS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt-1.3b.yaml")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--windows", default="1024,512,256", help="sliding windows to bound too (comma list)")
    parser.add_argument("--baseline-tokens-per-s", type=float, default=None, help="for the 1.12x target")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default="runs/bound/bound.json")
    args = parser.parse_args(argv)

    from megatrain.config import load_config

    cfg = load_config(args.config)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    windows = [int(w) for w in args.windows.split(",") if w]
    mb = args.micro_batch or cfg.train.micro_batch_size
    bound = measure_bound(cfg.model, mb, cfg.train.global_batch_size, device, windows=windows, iters=args.iters,
                          baseline_tokens_per_s=args.baseline_tokens_per_s)
    bound["table"] = table(bound)
    print(bound["table"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(bound, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
