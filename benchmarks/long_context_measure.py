"""The measured side of ``benchmarks/long_context_memory.py``: what a training step of megatrain's
model really keeps for its backward, on any device.

``StoredBytes`` is a dispatch mode that notes every storage an op writes during the forward
(weakly: it keeps nothing alive) and the part of the model that wrote it (the embedding, block i,
the head and loss). After the forward, the storages still alive are exactly what autograd and the
checkpoints keep for the backward: the stored activations. Parameters, buffers and the inputs are
left out. (``torch.autograd.graph.saved_tensors_hooks`` would see the saved tensors too, but not the
block inputs a non-reentrant checkpoint keeps: its own hooks replace the outer ones inside it.)

``train_steps`` runs the steps: megatrain's GPT with the recipe's activation checkpointing applied
by ``parallelize.apply_activation_checkpointing`` (the function ``parallelize`` calls at pp = 1), the
model's own loss (``Head.loss``: the chunked/fused LM-head cross-entropy), backward and a fused
AdamW step, on random tokens. On CUDA it also reads ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoredBytes(TorchDispatchMode):
    """Storages written inside the mode, by the part of the model that wrote them."""

    def __init__(self, exclude: list[torch.Tensor]):
        super().__init__()
        self.exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        self.part = "other"
        self.seen: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                old = self.seen.get(ref.cdata)
                if ref.cdata not in self.exclude and (old is None or old[0].expired()):
                    self.seen[ref.cdata] = (ref, storage.nbytes(), self.part)
        return out

    def alive(self) -> dict[str, int]:
        """Bytes of the storages still alive, by part."""
        parts: dict[str, int] = {}
        for ref, nbytes, part in self.seen.values():
            if not ref.expired():
                parts[part] = parts.get(part, 0) + nbytes
        return parts


def label_parts(model, meter: StoredBytes) -> list:
    """Forward hooks naming the part that runs: "embedding", "blocks", "head"."""
    def enter(name):
        def hook(*_):
            meter.part = name
        return hook

    handles = [model.embed.register_forward_pre_hook(enter("embedding"))]
    handles += [b.register_forward_pre_hook(enter("blocks")) for b in model.blocks]
    # the loss is Head.loss, not Head.forward: it runs after the last block, so that block's hook
    # would still be set; the final norm's hook marks the start of the head
    handles.append(model.head.ln_f.register_forward_pre_hook(enter("head")))
    return handles


@dataclass
class Measured:
    stored: dict[str, int]  # alive after the forward, by part (embedding, blocks, head)
    peak_bytes: int | None = None  # CUDA: max_memory_allocated over the measured steps
    states_bytes: int | None = None  # CUDA: allocated before a step (parameters, gradients, optimizer)
    losses: list[float] = field(default_factory=list)

    @property
    def stored_bytes(self) -> int:
        return sum(self.stored.values())


def build_model(cfg, device: torch.device, dtype: torch.dtype):
    from megatrain.model import GPT
    from megatrain.parallel.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg.model)
    model.to(dtype)
    if cfg.model.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    return model


def measure_forward(model, idx, targets, sequence=None) -> tuple[torch.Tensor, dict[str, int]]:
    """One forward under the meter: (loss, stored bytes by part)."""
    exclude = [*model.parameters(), *model.buffers(), idx, targets]
    meter = StoredBytes(exclude)
    handles = label_parts(model, meter)
    try:
        with meter:
            loss = model(idx, targets) if sequence is None else model(idx, targets, sequence=sequence)
    finally:
        for h in handles:
            h.remove()
    stored = meter.alive()
    stored.pop("other", None)  # the loss scalar and the like
    return loss, stored


def train_steps(cfg, device: torch.device, dtype: torch.dtype, steps: int = 3, sequence_fn=None) -> Measured:
    """``steps`` training steps of ``cfg``'s model at micro-batch x seq_len; the stored bytes of the
    last forward, and on CUDA the peak. ``sequence_fn(T)``: a ``Sequence`` for the model (ring
    attention on a cp group), else none."""
    model = build_model(cfg, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    b, s, v = cfg.train.micro_batch_size, cfg.seq_len, cfg.model.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    cuda = device.type == "cuda"
    result = Measured(stored={})
    for step in range(steps):
        idx = torch.randint(0, v, (b, s), generator=gen).to(device)
        targets = torch.randint(0, v, (b, s), generator=gen).to(device)
        sequence = sequence_fn(s) if sequence_fn else None
        if cuda and step == steps - 1:  # the states exist after the first step: measure the last one
            torch.cuda.synchronize(device)
            result.states_bytes = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss, stored = measure_forward(model, idx, targets, sequence)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as DeepSpeed's buffers do
        result.losses.append(float(loss.detach()))
        result.stored = stored
    if cuda:
        torch.cuda.synchronize(device)
        result.peak_bytes = torch.cuda.max_memory_allocated(device)
    return result
