"""The runs of ``convergence.py``: megatrain's plain model, or the transformers peer loaded from
megatrain's exported initial weights, each stepped by the same optimizer code.

Both sides get megatrain's AdamW (``megatrain.optim.build_optimizer``: decay on every tensor of
dim >= 2, none on biases and norm gains; fused on GPU), its LR schedule (``Schedule.at`` set on
every group before each step), the same global grad-norm clip, bf16 autocast on GPU (fp32
weights) and fp32 on CPU. So what differs is only the model code: megatrain's blocks, kernels and
fused cross-entropy against ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` with full logits and
``F.cross_entropy`` on the targets megatrain's loader already shifted.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# The serial block and full attention: the only GPT the peers compute (MegaScale's parallel block
# and sliding window have no GPT2LMHeadModel equivalent). "125m": GPT-2 small's 12 x 768 with a
# 32k vocabulary (the BPE trained on this corpus), 111M parameters; Llama of the same width.
SHAPES = {
    ("gpt", "125m"): dict(vocab_size=32768, n_layer=12, n_head=12, d_model=768, seq_len=1024),
    ("gpt", "tiny"): dict(vocab_size=512, n_layer=2, n_head=4, d_model=64, seq_len=64),
    # GPT-3 XL's 24 x 2048 (configs/gpt-1.3b.yaml's shape, serial, seq 1024 to read the 125m shards): 1.27B
    ("gpt", "1.3b"): dict(vocab_size=32768, n_layer=24, n_head=16, d_model=2048, seq_len=1024),
    ("llama", "125m"): dict(vocab_size=32768, n_layer=12, n_head=12, n_kv_head=4, d_model=768, d_ff=2048,
                            seq_len=1024),
    ("llama", "tiny"): dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160, seq_len=64),
}
FAMILY = {
    "gpt": dict(block="serial", attention="full"),
    "llama": dict(block="serial", attention="full", position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                  tie_embeddings=False, rope_theta=10000.0),
}
PEER = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
WARM_STEPS = 5  # steps left out of a run's mean step time (compilation, autotuning, allocator growth)


def model_config(family: str, shape: str, **overrides):
    from megatrain.config import ModelConfig

    return ModelConfig(**{**SHAPES[(family, shape)], **FAMILY[family], **overrides})


def initial_model(cfg, seed: int):
    """megatrain's GPT initialised under ``seed`` (on the CPU: the same tensors on any device)."""
    from megatrain.model import GPT

    torch.manual_seed(seed)
    return GPT(cfg)


@dataclass
class Run:
    """One model being trained: its name, what it is, and its curve."""

    name: str
    impl: str  # "megatrain" or the peer's transformers class
    init_seed: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    hf: bool
    train_loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)  # {"step", "tokens", "loss"}
    step_s: list[float] = field(default_factory=list)  # wall time of each step (synchronised)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            return self.model(inputs, targets)
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def record(self) -> dict:
        """Its curves and its steady step time: the mean after its first WARM_STEPS (compile and
        autotuning happen there; their time is given apart, once per run, in ``first_steps_s``)."""
        warm = min(WARM_STEPS, len(self.step_s) // 2)
        steady = self.step_s[warm:] or [0.0]
        return {"impl": self.impl, "init_seed": self.init_seed, "train_loss": self.train_loss,
                "grad_norm": self.grad_norm, "val": self.val, "step_s_mean": sum(steady) / len(steady),
                "first_steps_s": sum(self.step_s[:warm])}


def load_peer(family: str, model, cfg, tokenizer_json: bytes):
    """The transformers model of megatrain's ``model``: exported (``interop.hf.export_model``, the
    exact GPT -> GPT2 / Llama mapping) and read back by ``from_pretrained``, in fp32."""
    import transformers

    from megatrain.interop.hf import export_model

    with tempfile.TemporaryDirectory() as folder:
        out = export_model(model, cfg, folder, tokenizer_json)
        try:
            peer = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
        except TypeError:  # transformers 4: torch_dtype
            peer = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32,
                                                                     attn_implementation="sdpa")
    if type(peer).__name__ != PEER[family]:
        raise AssertionError(f"exported {type(peer).__name__}, expected {PEER[family]}")
    return peer


def shape_policy(dynamic: bool):
    """Whether a compiled model seeing a second input shape recompiles as a graph dynamic in it
    (torch's default) or as another static graph. Static by default here: the held-out evaluation
    before step 0 ends on a short chunk (43 windows in chunks of 8), so under torch's default every
    compiled run trains on a dynamic-shape graph it would not use in a real run, where the batch is
    fixed, and on an H200 the compiled 1.3B GPT2LMHeadModel's dynamic graph gave a step-0 gradient
    norm of 37.3 where eager, static and megatrain give 52.1 (convergence_probe.py --eval-first with
    and without --dynamic-shapes, benchmarks/RESULTS.md). mfu.py compiles with the same policy.
    A context manager: the setting is restored after it (it is process-wide)."""
    import torch._dynamo

    return torch._dynamo.config.patch(automatic_dynamic_shapes=dynamic)


def make_run(name: str, family: str, cfg, optim_cfg, tokenizer_json: bytes, device: torch.device) -> Run:
    """``name``: ``megatrain[@reference][+fp8][+compile][:seed]`` (default init seed 0;
    ``@reference``: megatrain's plain-torch norm, activation and cross-entropy instead of its fused
    kernels; ``+fp8``: its FP8 recipe, ``train.precision: fp8``, on the blocks' linears; ``+compile``:
    its compiled blocks, ``model.compile``) or ``peer[+compile]:<seed>`` (megatrain's init under that
    seed, exported, loaded by transformers; ``+compile``: ``torch.compile`` of the whole peer)."""
    from megatrain.optim import build_optimizer

    spec, _, seed = name.partition(":")
    spec, *flags = spec.split("+")
    impl, _, kernels = spec.partition("@")
    if set(flags) - {"fp8", "compile"} or (impl == "peer" and "fp8" in flags):
        raise SystemExit(f"run {name!r}: megatrain[@reference][+fp8][+compile][:seed] or peer[+compile]:<seed>")
    seed_value = int(seed or 0)
    if kernels == "reference":
        fields = {k: "reference" for k in ("layernorm", "gelu", "cross_entropy", "rmsnorm", "swiglu", "rope")}
        cfg = cfg.model_copy(update={"kernels": cfg.kernels.model_copy(update=fields)})
    elif kernels:
        raise SystemExit(f"run {name!r}: the only kernel choice is @reference")
    model = initial_model(cfg, seed_value)  # the same init with or without fp8 / compile
    hf = impl == "peer"
    if hf:
        model = load_peer(family, model, cfg, tokenizer_json)
    elif impl != "megatrain":
        raise SystemExit(f"run {name!r}: megatrain[@reference][+fp8][+compile][:seed] or peer[+compile]:<seed>")
    model = model.to(device).train()
    if "fp8" in flags:
        from megatrain.config import Config
        from megatrain.precision.fp8 import apply_precision, check_precision_supported

        run_cfg = Config(model=cfg.model_copy(update={"compile": "compile" in flags}), train={"precision": "fp8"})
        check_precision_supported(run_cfg, device)
        apply_precision(model, run_cfg)
    if "compile" in flags:
        if hf:
            model.compile()
        else:
            for block in model.blocks:  # as parallel/parallelize.py compiles megatrain's model
                block.compile()
    label = PEER[family] if hf else "megatrain" + (" (reference kernels)" if kernels else "")
    label += "".join(f" +{flag}" for flag in flags)
    return Run(name=name, impl=label, init_seed=seed_value, model=model,
               optimizer=build_optimizer(model, optim_cfg), hf=hf)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, lr: float, grad_clip: float,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step at ``lr``: (loss, grad norm before the clip), left on the device."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    with autocast(device):
        loss = run.loss(inputs, targets)
    loss.backward()
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else torch.zeros((), device=device)
    run.optimizer.step()
    return loss.detach(), norm.detach()


@torch.no_grad()
def held_out_loss(run: Run, inputs: torch.Tensor, targets: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean token loss over the held-out windows (every window has seq_len targets)."""
    run.model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    for i in range(0, len(inputs), batch):
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        with autocast(device):
            total += run.loss(x, y).double() * len(x)
    run.model.train()
    return float(total / len(inputs))
