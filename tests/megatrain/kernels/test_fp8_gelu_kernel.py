"""Bias + GeLU cast to e4m3 (``fp8_gelu.py``): the reference against plain torch on CPU; the fused
Triton kernels against the reference, bit for bit (same e4m3 bytes, same scale, same gradients),
on GPU, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, where triton imports)."""

import os

import pytest
import torch
import torch.nn.functional as F

from megatrain.kernels.fp8_gelu import bias_gelu_float8, bias_gelu_float8_reference

E4M3_MAX = 448.0


def _linear(n_in: int, device: str, emulate: bool):
    """A converted Float8Linear: the cast's consumer (its config and GEMM configs)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = torch.nn.Sequential(torch.nn.Linear(n_in, 32, device=device))
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(model, config=config)[0]


def test_reference_is_torchaos_cast_of_gelu():
    h, b = 3 * torch.randn(4, 10, 64), torch.randn(64)
    g8 = bias_gelu_float8_reference(h, b, _linear(64, "cpu", emulate=True), "reference")
    g = F.gelu(h + b, approximate="tanh")
    assert g8._data.dtype == torch.float8_e4m3fn and g8._data.shape == h.shape
    assert g8._scale.item() == pytest.approx(E4M3_MAX / g.abs().max().item(), rel=1e-6)
    assert g8._data.float().abs().max().item() == E4M3_MAX  # the amax element lands on the top
    # e4m3 keeps 3 mantissa bits: every element within half a step (2^-4) of its value
    dequant = g8._data.float() / g8._scale
    assert ((dequant - g).abs() <= g.abs() * 2**-4 + 2**-9 / g8._scale).all()


def _triton_cast(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 through Triton's own conversion. The interpreter's rounds some values just
    below a power of two down a whole binade (31.5 -> 16), unlike the GPU's cvt.rn.satfinite, so
    on CPU the fused kernel is held to the reference's values cast the interpreter's way."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N)
        tl.store(Y + offs, x.to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=offs < N)

    flat = values.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
    cast[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.view(values.shape)


def _fused_vs_reference(device: str, shape, dtype, bias: bool, emulate: bool):
    gen = torch.Generator(device).manual_seed(sum(shape))
    h = (3 * torch.randn(shape, generator=gen, device=device)).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=gen, device=device).to(dtype).requires_grad_() if bias else None
    dg = torch.randn(shape, generator=gen, device=device).to(dtype)
    linear = _linear(shape[-1], device, emulate)
    outs = []
    for fn in (lambda: bias_gelu_float8(h, b, linear, "fused"), lambda: bias_gelu_float8_reference(h, b, linear, "fused")):
        g8 = fn()
        # the consumer's backward hands back a plain gradient of g; the cast passes it through
        leaves = [h] + ([b] if bias else [])
        grads = torch.autograd.grad(g8, leaves, dg)
        outs.append((g8._data.view(torch.uint8), g8._scale, g8._orig_dtype, *grads))
    (data, scale, orig, *grads), (ref_data, ref_scale, ref_orig, *ref_grads) = outs
    assert orig == ref_orig == dtype
    assert torch.equal(scale, ref_scale), (scale, ref_scale)
    if device == "cpu":  # the interpreter: the reference's scaled values through Triton's conversion
        from megatrain.kernels.gelu import bias_gelu

        g = bias_gelu(h.detach(), b.detach() if bias else None, "fused").float()
        ref_data = _triton_cast((g * ref_scale).clamp(-E4M3_MAX, E4M3_MAX)).view(torch.uint8)
    mismatched = (data != ref_data).sum().item()
    assert mismatched == 0, f"{mismatched} of {data.numel()} e4m3 bytes differ"
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=1 runs Triton on CPU")


@pytest.mark.gpu  # needs Triton, which the GPU image has and the CPU install does not
@interpreted
@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [True, False])
def test_fused_matches_reference_bit_for_bit_interpreted(bias):
    pytest.importorskip("triton")
    _fused_vs_reference("cpu", (70, 600), torch.float32, bias, emulate=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2, 128, 8192), (3, 37, 3072), (1000, 1000), (129, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_matches_reference_bit_for_bit(shape, dtype, bias):
    _fused_vs_reference("cuda", shape, dtype, bias, emulate=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_compiles_into_a_graph_with_the_fp8_gemm():
    """Inside torch.compile (fullgraph, as the compiled blocks): the GeLU MLP's fused path gives the
    eager result."""
    from megatrain.kernels.fp8_ops import fp8_matmul

    torch.manual_seed(0)
    linear = _linear(1024, "cuda", emulate=torch.cuda.get_device_capability() < (8, 9)).bfloat16()
    h = (3 * torch.randn(4, 256, 1024, device="cuda")).bfloat16().requires_grad_()
    b = torch.randn(1024, device="cuda").bfloat16().requires_grad_()

    def mlp_tail(h, b):
        return fp8_matmul(linear, bias_gelu_float8(h, b, linear, "fused"))

    eager = mlp_tail(h, b)
    (eager_dh,) = torch.autograd.grad(eager.float().square().sum(), [h])
    compiled = torch.compile(mlp_tail, fullgraph=True)(h, b)
    (compiled_dh,) = torch.autograd.grad(compiled.float().square().sum(), [h])
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(compiled_dh, eager_dh, rtol=2e-2, atol=1e-2)


def _written(kernel, kwargs) -> set[str]:
    """The arguments torch.compile believes a user Triton kernel writes: it clones each of them
    before every launch inside a compiled graph (a 537 MB copy of h per layer, if h were one)."""
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        return {dep.name for dep in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
    return set(wrap.identify_mutated_tensors(kernel, kwargs, {}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_sees_each_pass_write_only_its_output():
    from megatrain.kernels import fp8_gelu_triton as fused

    M, N = 256, 1024
    h, b = torch.randn(M, N, device="cuda").bfloat16(), torch.randn(N, device="cuda").bfloat16()
    common = dict(X=h, B=b, M=M, N=N, HAS_BIAS=True, APPROX=True, BLOCK_M=8, BLOCK_N=512)
    partials = torch.empty(64, device="cuda")
    assert _written(fused._amax_kernel, {**common, "PART": partials, "ROWS_PER_PROGRAM": 64}) == {"PART"}
    data = torch.empty(M, N, device="cuda", dtype=torch.float8_e4m3fn)
    scale = torch.ones((), device="cuda")
    assert _written(fused._cast_kernel, {**common, "SCALE": scale, "Y": data, "FP8_MAX": 448.0}) == {"Y"}
