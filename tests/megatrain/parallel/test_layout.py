"""Process-free checks of the layout pieces: rank order shared with DeepSpeed's topology, layout
validation, the DeepSpeed config sections, chunking, weight slicing and the pipeline layer list."""

from __future__ import annotations

import pytest
import torch

from megatrain.config import load_config
from megatrain.model import GPT
from megatrain.parallel.deepspeed import deepspeed_config, pipeline_topology
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.overlap import chunk_bounds, dp_bucket_numel, make_buckets
from megatrain.parallel.pipeline import LossHead, _ExistingTiedLayer, pipeline_layers
from megatrain.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel

TINY = ["model.vocab_size=128", "model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.seq_len=16",
        "model.attention=full", "train.micro_batch_size=2", "train.global_batch_size=8"]


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (3, 4, 2), (1, 8, 4), (4, 1, 1)])
def test_deepspeed_topology_orders_ranks_like_ours(dp, tp, pp):
    dims, topo = ParallelDims(dp=dp, tp=tp, pp=pp), pipeline_topology(ParallelDims(dp=dp, tp=tp, pp=pp))
    for rank in range(dims.world_size):
        p, d, t = dims.coords(rank)
        assert topo.get_rank(pipe=p, data=d, model=t) == rank
    assert sorted(map(sorted, topo.get_axis_comm_lists("pipe"))) == sorted(map(sorted, dims.pp_groups()))
    assert sorted(map(sorted, topo.get_axis_comm_lists("data"))) == sorted(map(sorted, dims.dp_groups()))


def test_stage_groups_hold_every_tp_and_dp_rank_of_a_stage():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.stage_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ProcessGroups(dims, rank=6).coords == (1, 1, 0)


@pytest.mark.parametrize("dims, gpus_per_node, message", [
    (ParallelDims(dp=1, tp=3, pp=2), 8, "must divide gpus_per_node"),
    (ParallelDims(dp=1, tp=16, pp=1), 8, "must divide gpus_per_node"),
    (ParallelDims(dp=3, tp=4, pp=1), 8, "not a multiple of gpus_per_node"),
    (ParallelDims(dp=1, tp=2, pp=8), 8, "must not exceed n_layer"),
])
def test_layouts_that_cannot_work_fail_before_any_group_exists(dims, gpus_per_node, message):
    with pytest.raises(ValueError, match=message):
        dims.validate(dims.world_size, gpus_per_node, n_head=12, n_layer=4)


def test_deepspeed_config_overlap_and_pipeline_sections():
    cfg = load_config(None, TINY + ["parallel.pp=2", "parallel.tp=2", "parallel.overlap.dp_overlap_comm=false"])
    config = deepspeed_config(cfg, dp=1, bf16=False, n_params=10_000)
    assert config["zero_optimization"]["overlap_comm"] is False
    assert config["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False, "activation_checkpoint_interval": 0}
    no_sp = load_config(None, TINY + ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=false"])
    assert deepspeed_config(no_sp, 1, False, 10_000)["pipeline"]["pipe_partitioned"] is True
    zero3 = load_config(None, TINY + ["parallel.zero_stage=3"])
    assert deepspeed_config(zero3, 1, False, 10_000)["zero_optimization"]["stage3_prefetch_bucket_size"] == 5_000_000
    no_prefetch = load_config(None, TINY + ["parallel.zero_stage=3", "parallel.overlap.dp_prefetch=false"])
    assert deepspeed_config(no_prefetch, 1, False, 10_000)["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    with pytest.raises(ValueError, match="LAMB needs parallel.zero_stage 1 or 2"):
        deepspeed_config(load_config(None, TINY + ["parallel.tp=2", "parallel.zero_stage=0"]), 1, False, 10_000)
    with pytest.raises(ValueError, match="ZeRO 0 or 1"):
        deepspeed_config(load_config(None, TINY + ["parallel.pp=2", "parallel.zero_stage=2"]), 1, False, 10_000)
    pp_zero0 = load_config(None, TINY + ["parallel.pp=2", "parallel.zero_stage=0"])
    assert "pipeline" in deepspeed_config(pp_zero0, 1, False, 10_000)  # fp32: LAMB sees the model's tensors
    with pytest.raises(ValueError, match="one trust ratio"):  # bf16: BF16_Optimizer would flatten them
        deepspeed_config(pp_zero0, 1, True, 10_000)


def test_deepspeed_throughput_timer_is_off_as_deepspeed_reads_it():
    """DeepSpeed's throughput timer would synchronise the device twice per micro-batch."""
    from deepspeed.utils.config import get_timers_config

    assert get_timers_config({}).enabled is True  # DeepSpeed's default, which the config overrides
    timer = get_timers_config(deepspeed_config(load_config(None, TINY), 1, True, 10_000))
    assert timer.enabled is False


def test_dp_reducer_buckets_follow_backward_order_and_respect_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 8, 2, 9)]
    params.append(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    buckets = make_buckets(params, bucket_numel=8)
    assert [[p.numel() for p in b.params] for b in buckets] == [[3], [9], [2], [8], [4, 4]]
    assert buckets[0].params[0] is params[-1]  # the last parameter's gradient comes first in backward
    bucket = buckets[-1]
    bucket.allocate()
    assert [v.shape for v in bucket.views] == [(4,), (4,)] and bucket.buffer.numel() == 8
    assert bucket.views[1].data_ptr() == bucket.buffer.data_ptr() + 4 * 4
    assert dp_bucket_numel(1_300_000_000) == 40_625_000 and dp_bucket_numel(1000) == 5_000_000


def test_chunk_bounds_cover_the_range_in_order():
    assert chunk_bounds(8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 1)]  # never an empty chunk
    assert chunk_bounds(5, 1) == [(0, 5)]


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_sharded_linears_compute_their_heads_and_partial_sums(block):
    """Slicing is checked without processes: rank r's qkv gives heads r*H/t.. of q, k and v, and
    the row-parallel partial outputs sum to the whole projection."""
    cfg = load_config(None, TINY + [f"model.block={block}"])
    torch.manual_seed(0)
    full = GPT(cfg.model)
    x = torch.randn(2, 16, 32)
    attn = full.blocks[0].attn
    heads = attn.qkv(x).view(2, 16, 3, 4, 8)
    partial_sum = 0
    for rank in range(2):
        qkv = ColumnParallelLinear.from_linear(attn.qkv, rank, 2, interleave=3)
        torch.testing.assert_close(qkv(x).view(2, 16, 3, 2, 8), heads[:, :, :, 2 * rank : 2 * rank + 2])
        proj = RowParallelLinear.from_linear(attn.proj, rank, 2)
        partial_sum = partial_sum + proj(x[..., 16 * rank : 16 * rank + 16])
        assert proj.weight.tensor_model_parallel and not hasattr(proj.bias, "tensor_model_parallel")
    torch.testing.assert_close(partial_sum + attn.proj.bias, attn.proj(x))


def test_apply_tensor_parallel_shapes_and_marks():
    cfg = load_config(None, TINY + ["parallel.tp=2", "parallel.world_size=2"])
    model = GPT(cfg.model)
    groups = ProcessGroups(ParallelDims(dp=1, tp=2, pp=1), rank=1)  # no collectives are called here
    apply_tensor_parallel(model, groups, sequence_parallel=True, overlap=cfg.parallel.overlap)
    block = model.blocks[0]
    assert block.attn.qkv.weight.shape == (48, 32) and block.mlp.fc.weight.shape == (64, 32)
    assert block.attn.proj.weight.shape == (32, 16) and block.mlp.proj.weight.shape == (32, 64)
    assert model.embed.wte.weight.shape == (64, 32) and model.embed.wte.vocab_start == 64
    assert model.head.projection() is model.embed.wte.weight  # still tied, to the shard
    replicated = [n for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)]
    assert replicated and all(getattr(dict(model.named_parameters())[n], "sequence_parallel", False) for n in replicated)
    assert "blocks.0.ln.weight" in replicated and "embed.wpe.weight" in replicated


def test_tensor_parallel_modules_stay_outside_torch_compile():
    """torch 2.11 drops the gradients of the regions' autograd Functions when dynamo traces them
    (see tensor_parallel.py): the modules that apply them must stay eager inside compiled blocks."""
    from megatrain.parallel.tensor_parallel import EnterRegion, ExitRegion

    for module in (EnterRegion, ExitRegion, ColumnParallelLinear, RowParallelLinear):
        assert getattr(module.forward, "_torchdynamo_disable", False), module.__name__


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_layer_list(tied):
    model = GPT(load_config(None, TINY + [f"model.tie_embeddings={str(tied).lower()}"]).model)
    layers = pipeline_layers(model)
    assert isinstance(layers[-1], LossHead) and layers[-1].head is model.head
    assert layers[1:3] == list(model.blocks)
    if tied:  # the first and the last stage both hold the one Embedding module, tied by key
        first, last = layers[0], layers[-2]
        assert isinstance(first, _ExistingTiedLayer) and isinstance(last, _ExistingTiedLayer)
        assert first.key == last.key and first.build() is last.build() is model.embed
        assert last.tied_weight_attr == ["wte.weight"]
    else:
        assert layers[0] is model.embed and len(layers) == 4
