"""Model FLOPs utilisation: the useful FLOPs a model needs per token, over the chip's peak.

    flops/token = 6 N + 12 * n_layer * d_model * attended_context

6N: each parameter does one multiply-add (2 FLOPs) per token in the forward and two in the
backward (activation and weight gradients). N counts every parameter that takes part in a matmul
per token: all parameters except a learned position table (a lookup). The token embedding
counts once: with tied embeddings it is the LM head's matrix (a real [d, V] matmul per token);
untied, the input table is counted too, by the same convention as PaLM and nanoGPT (small next
to the head). LayerNorm gains and biases are included; they are negligible.

The Llama family needs no other term: N already holds SwiGLU's three matrices (gate, up, down)
and GQA's smaller K/V projections ([n_kv_head * head_dim, d] each), so 6N counts exactly the
projections that run; RoPE, RMSNorm and SwiGLU's pointwise product are not matmuls.

12 L d s: the attention scores QK^T and the weighted sum AV, 2 * 2 * d * s FLOPs per token per
layer forward, times 3 for forward + backward. d = n_head * head_dim: every query head attends,
so grouped-query attention (fewer K/V heads, shared) does not reduce this term. s is the attended context: the sequence length,
or the window for sliding-window attention. By convention (PaLM, MegaScale) causal masking is
not halved: the formula describes the model, not a kernel. Activation recomputation is not
counted either: MFU counts the model's FLOPs, not the hardware's.

The peak is the dense bf16 tensor-core rate from the vendor's datasheet (no sparsity).
"""

from __future__ import annotations

from megatrain.config import ModelConfig

# Dense bf16 peak FLOP/s by device-name substring, checked in order (more specific first).
_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIE", 756e12),
    ("H100", 989.4e12),  # SXM
    ("H200", 989.4e12),  # SXM: the H100's compute with more memory
    ("A100", 312e12),
    ("L40S", 362.05e12),  # listed so that the "L4" entry below does not claim them
    ("L40", 181.05e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),
)


def non_embedding_params(model_cfg: ModelConfig, n_params: int) -> int:
    """N of the formula: the model's parameter count minus the position table (learned
    positions only: RoPE has none)."""
    if model_cfg.position != "learned":
        return n_params
    return n_params - model_cfg.seq_len * model_cfg.d_model


def flops_per_token(model_cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token (forward + backward), see the module docstring.

    ``n_params``: the whole model's parameter count, each tensor once (``count_parameters(model)``
    on an unsplit model; with tensor or pipeline parallelism pass the global count, not a
    rank's). A learned position table is subtracted here."""
    n = non_embedding_params(model_cfg, n_params)
    return 6.0 * n + 12.0 * model_cfg.n_layer * model_cfg.d_model * model_cfg.attended_context


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name (``torch.cuda.get_device_name()``);
    None for CPUs and unknown devices, where MFU is not reported."""
    name = device_name.upper()
    for key, peak in _PEAKS:
        if key in name:
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Fraction of peak (0..1) achieved at this throughput; None when the peak is unknown.
    For several GPUs pass the per-GPU token rate, or the summed rate with the summed peak."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s * flops_per_token / peak
