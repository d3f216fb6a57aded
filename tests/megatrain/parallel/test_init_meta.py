"""Meta-device model construction: the 175B recipe is built per pipeline stage and TP shard
without ever allocating a replica, and a small model materializes exactly its rank's part."""

from __future__ import annotations

import os

import psutil
import pytest

import torch

from megatrain.config import load_config
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.meta import build_on_meta, materialize, stage_modules, use_meta
from megatrain.parallel.plan import params_per_gpu
from megatrain.parallel.tensor_parallel import apply_tensor_parallel

RSS_BOUND = 512 * 2**20  # bytes the whole 175B meta build may add; one fp32 replica is ~700 GB


def stage_params(modules: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    unique = {id(p): p for m in modules for p in m.parameters()}
    return list(unique.values())


@pytest.mark.slow
def test_175b_per_stage_on_meta_without_materializing() -> None:
    cfg = load_config("configs/gpt-175b.yaml", [])
    assert use_meta(cfg)  # auto: far above the threshold
    dims = ParallelDims(dp=1, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    rss = psutil.Process(os.getpid()).memory_info().rss
    peak = rss
    counts = []
    for pp_rank in range(dims.pp):
        groups = ProcessGroups(dims=dims, rank=dims.rank_of(pp_rank, 0, 0))
        model = build_on_meta(cfg)
        apply_tensor_parallel(model, groups, sequence_parallel=cfg.parallel.sequence_parallel,
                              overlap=cfg.parallel.overlap)
        params = stage_params(stage_modules(model, cfg, groups))
        assert all(p.is_meta for p in model.parameters())  # nothing materialized
        counts.append(sum(p.numel() for p in params))
        peak = max(peak, psutil.Process(os.getpid()).memory_info().rss)
        del model
    assert peak - rss < RSS_BOUND, f"meta build grew RSS by {(peak - rss) / 2**20:.0f} MiB"
    # the first stage is what the memory plan sizes: 12 layers, 1/8 of the token table, the position table
    assert counts[0] == params_per_gpu(cfg) == 2_842_097_664
    d = cfg.model.d_model
    assert counts[1] == counts[0] - cfg.model.vocab_size * d // 8 - cfg.model.seq_len * d  # blocks only
    assert counts[-1] > counts[1]  # the last stage also holds the tied table and the final norm


def test_small_model_materializes_only_its_stage_and_shard() -> None:
    cfg = load_config("configs/tiny-cpu.yaml", ["model.n_layer=4", "parallel.tp=2", "parallel.pp=2",
                                                "parallel.init.meta_init=always"])
    dims = ParallelDims(dp=2, tp=2, pp=2)
    built = {}
    for rank in (dims.rank_of(0, 0, 0), dims.rank_of(0, 1, 0), dims.rank_of(0, 0, 1), dims.rank_of(1, 0, 0)):
        groups = ProcessGroups(dims=dims, rank=rank)
        model = build_on_meta(cfg)
        apply_tensor_parallel(model, groups, sequence_parallel=False, overlap=cfg.parallel.overlap)
        elements = materialize(model, cfg, groups, torch.device("cpu"))
        on_stage = stage_params(stage_modules(model, cfg, groups))
        assert elements == sum(p.numel() for p in on_stage)
        real = {n: p for n, p in model.named_parameters() if not p.is_meta}
        assert {id(p) for p in real.values()} == {id(p) for p in on_stage}  # the rest stays on meta
        built[rank] = real
    first, dp_twin, tp_peer, second = (built[r] for r in (0, 2, 1, 4))
    assert "blocks.0.attn.qkv.weight" in first and "blocks.3.attn.qkv.weight" not in first
    assert "blocks.3.attn.qkv.weight" in second and "blocks.0.attn.qkv.weight" not in second
    for name, param in first.items():  # DP replicas hold identical values without communication
        assert torch.equal(param, dp_twin[name]), name
    qkv = first["blocks.0.attn.qkv.weight"]
    assert not torch.equal(qkv, tp_peer["blocks.0.attn.qkv.weight"])  # TP shards differ
    assert torch.equal(first["blocks.0.ln.weight"], tp_peer["blocks.0.ln.weight"])  # replicated across TP
    assert torch.equal(first["embed.wte.weight"], second["embed.wte.weight"])  # the tied table, first and last stage
    assert torch.all(first["blocks.0.ln.weight"] == 1) and torch.all(first["blocks.0.attn.qkv.bias"] == 0)
    assert abs(qkv.std().item() - cfg.model.init_std) < 0.1 * cfg.model.init_std
    proj_std = first["blocks.0.attn.proj.weight"].std().item()
    assert abs(proj_std - cfg.model.init_std / (2 * cfg.model.n_layer) ** 0.5) < 0.15 * proj_std
