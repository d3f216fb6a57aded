"""``megatrain plan`` for the 175B recipe against a calculation written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.parallel.plan import GIB, activation_bytes_per_layer, cli, memory_plan

RECIPE = str(Path(__file__).resolve().parents[3] / "configs" / "gpt-175b.yaml")

# configs/gpt-175b.yaml: d=12288, ff=4d=49152, V=64000, s=2048, L=96, a=128 heads, parallel block,
# biases, tied embeddings, micro-batch 1, global batch 6144, TP8 PP8, ZeRO-1, full recompute.
d, ff, V, s, L, a, b, t, p = 12288, 49152, 64000, 2048, 96, 128, 1, 8, 8
WORLD = 12288  # MegaScale's 175B run
dp = WORLD // (t * p)  # 192

# Parameters on one first-stage GPU: 96/8 = 12 layers, each with
qkv = 3 * d * d // t + 3 * d // t  # column-parallel weight and bias: 56,627,712
attn_proj = d * d // t + d  # row-parallel weight, whole bias: 18,886,656
fc = d * ff // t + ff // t  # 75,503,616
mlp_proj = ff * d // t + d  # 75,509,760
norm = 2 * d  # one LayerNorm (parallel block), replicated: 24,576
per_layer = qkv + attn_proj + fc + mlp_proj + norm  # 226,552,320
P = 12 * per_layer + V * d // t + s * d  # + token-table shard 98,304,000 + position table 25,165,824
assert P == 2_842_097_664

# bf16 parameters and gradients, fp32 master + m + v partitioned over dp (ZeRO-1)
params_bytes = 2 * P  # 5,684,195,328
grads_bytes = 2 * P
optimizer_bytes = 12 * P / dp  # 177,631,104

# Full recompute with SP keeps each layer's sequence-sharded input, 2 bytes * s*b*h/t = 6,291,456,
# for 12 layers x 8 micro-batches in flight (1F1B first stage; 6144 / 192 = 32 micro-batches >= 8)
stored_full = 12 * 8 * (2 * s * b * d / t)  # 603,979,776
# recomputing one layer rebuilds its activations once: sbh(34/t + 5as/(ht)) minus what is stored
layer_none = s * b * d * 34 / t + 5 * a * s * s * b / t  # 106,954,752 + 335,544,320 = 442,499,072
working = layer_none - 2 * s * b * d / t  # 436,207,616
TOTAL = params_bytes + grads_bytes + optimizer_bytes + stored_full + working  # 12,586,209,152 B = 11.72 GiB


def test_175b_plan_matches_the_hand_calculation():
    plan = memory_plan(load_config(RECIPE), world_size=WORLD)
    assert (plan.tp, plan.pp, plan.dp, plan.layers_per_stage, plan.micro_batches_in_flight) == (8, 8, 192, 12, 8)
    assert plan.params == P
    assert plan.params_bytes == params_bytes
    assert plan.grads_bytes == grads_bytes
    assert plan.optimizer_bytes == pytest.approx(optimizer_bytes)
    assert plan.recompute == "full"
    assert plan.activation_bytes["full"] == pytest.approx(stored_full)
    assert plan.recompute_working_bytes == pytest.approx(working)
    assert plan.total_bytes == pytest.approx(TOTAL)
    assert TOTAL == pytest.approx(12_586_209_152)


def test_korthikanti_activation_modes_at_tp8():
    cfg = load_config(RECIPE)
    sbh = s * b * d
    assert activation_bytes_per_layer(cfg, "none") == pytest.approx(sbh * (34 / t + 5 * a * s / (d * t)))
    assert activation_bytes_per_layer(cfg, "selective") == pytest.approx(sbh * 34 / t)
    no_sp = load_config(RECIPE, ["parallel.sequence_parallel=false"])
    assert activation_bytes_per_layer(no_sp, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert activation_bytes_per_layer(no_sp, "full") == pytest.approx(2 * sbh)


def test_zero_stages_partition_more_state():
    cfg = load_config(RECIPE, ["parallel.zero_stage=3", "parallel.pp=1"])  # ZeRO-3 needs no pipeline
    plan = memory_plan(cfg, world_size=8 * 192)
    assert plan.params_bytes == pytest.approx(2 * plan.params / 192)
    assert plan.grads_bytes == pytest.approx(2 * plan.params / 192)


def test_cli_prints_the_table(capsys):
    assert cli([RECIPE, "--world-size", str(WORLD)]) == 0
    out = capsys.readouterr().out
    assert "tp=8 pp=8 dp=192 (world 12288), ZeRO-1, bf16, 8 micro-batches in flight" in out
    assert f"{TOTAL / GIB:10.2f}" in next(line for line in out.splitlines() if line.startswith("total"))
    assert "full" in out and "<- this recipe" in out


def test_cli_rejects_a_world_size_that_does_not_fit(capsys):
    assert cli([RECIPE, "--world-size", "100"]) == 2
    assert "not divisible by tp*pp*cp = 64" in capsys.readouterr().out


LLAMA_8B = str(Path(__file__).resolve().parents[3] / "configs" / "llama-8b.yaml")


def test_llama_8b_plan_matches_the_hand_calculation():
    """configs/llama-8b.yaml at 64 GPUs: d=4096, 32 query / 8 KV heads of 128 (kv width 1024),
    SwiGLU ff=14336, V=128256 untied, s=8192, 32 serial blocks without biases, RoPE (no position
    table), micro-batch 1, TP4 (SP) x DP16, ZeRO-1, full recompute."""
    d, kv, ff, V, s, L, a, t, dp = 4096, 1024, 14336, 128256, 8192, 32, 32, 4, 16
    qkv = (d + 2 * kv) * d // t  # GQA: q [d, d] + k, v [kv, d] each, column-parallel: 6,291,456
    o = d * d // t  # 4,194,304
    gate_up = 2 * ff * d // t  # 29,360,128
    down = ff * d // t  # 14,680,064
    norms = 2 * d  # two RMSNorm gains, no bias
    per_layer = qkv + o + gate_up + down + norms  # 54,534,144
    embedding = V * d // t  # 131,334,144
    head = d + V * d // t  # pp = 1: this GPU is the last stage too (final norm + untied projection)
    P = L * per_layer + embedding + head
    assert P == 2_007_764_992  # = 8,030,261,248 / 4 + the replicated norms' 3/4 share
    # stored: each layer's sequence-sharded input; working set: one layer's activations, term by term
    stored = L * 1 * (2 * s * d / t)
    replicated = 10 * d  # norm inputs 4h, qkv and MLP inputs 2h + 2h, dropout masks 2h
    sharded = 2 * d + 2 * kv + 2 * kv + 2 * d + 4 * ff + 2 * ff  # q, k, v, o's input, gate + up, down's input
    layer_none = s * (replicated + sharded) / t + 5 * a * s * s / t
    working = layer_none - 2 * s * d / t
    plan = memory_plan(load_config(LLAMA_8B), world_size=64)
    assert (plan.tp, plan.dp, plan.params) == (t, dp, P)
    assert plan.params_bytes == 2 * P and plan.grads_bytes == 2 * P
    assert plan.optimizer_bytes == pytest.approx(12 * P / dp)
    assert plan.activation_bytes["full"] == pytest.approx(stored)
    assert plan.recompute_working_bytes == pytest.approx(working)
    assert plan.total_bytes == pytest.approx(4 * P + 12 * P / dp + stored + working)
    assert plan.total_bytes / GIB < 141 / 1.074  # fits an H200 (141 GB) with room to spare


# One checkpoint of the whole run (megatrain/parallel/plan.py checkpoint_size): every parameter once
# in bf16 (2 bytes) plus fp32 master, m and v (12 bytes; ZeRO-1 partitions them over dp, so the
# checkpoint holds them once), plus the last pipeline stage's copy of the tied token embedding, plus
# each rank's RNG state and metadata (64 KiB counted per rank).
WHOLE = V * d + s * d + L * ((4 * d * d + 4 * d) + (2 * d * ff + ff + d) + 2 * d) + 2 * d  # 174,770,774,016
CHECKPOINT = (WHOLE + V * d) * (2 + 12) + WORLD * 64 * 1024  # 2,458,606,190,592 B = 2289.76 GiB


def test_175b_checkpoint_size_matches_the_hand_calculation(capsys):
    from megatrain.model.gpt import expected_parameter_count
    from megatrain.parallel.plan import checkpoint_size

    cfg = load_config(RECIPE)
    assert WHOLE == expected_parameter_count(cfg.model) == 174_770_774_016
    size = checkpoint_size(cfg, WORLD)
    assert size.total == CHECKPOINT == 2_458_606_190_592
    # a node of 8 GPUs is one TP group of one (dp, pp) slot: DP rank 0's 8 ranks hold the weights
    # of their stage shard and 1/192 of its optimizer state each
    shard = P + V * d // t  # the first stage's shard plus the last stage's head bound
    rank0 = shard * 2 + -(-shard * 12 // dp) + 64 * 1024
    assert size.largest_rank == rank0 and size.per_node == 8 * rank0
    assert memory_plan(cfg, world_size=WORLD).checkpoint == size

    assert cli([RECIPE, "--world-size", str(WORLD)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: {CHECKPOINT / GIB:.2f} GiB (two: {2 * CHECKPOINT / GIB:.2f} GiB)" in out
    assert "checkpoint: 2289.76 GiB (two: 4579.51 GiB)" in out


def test_llama_8b_at_128k_cp8_prints_each_policy_term_by_term(capsys):
    """128k tokens over cp=8: 16,384 a GPU; each policy's peak and the terms that make it."""
    args = [LLAMA_8B, "model.seq_len=131072", "train.seq_len=131072", "parallel.cp=8", "--world-size", "32"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "16,384 tokens per sample on this GPU: seq_len 131,072 / cp 8" in out
    for term in ("loss: vocab-parallel softmax", "ring: fp32 scores of a chunk pair", "block outputs"):
        assert term in out
    plan = memory_plan(load_config(LLAMA_8B, args[1:4]), world_size=32)
    peaks = {policy: plan.peak_bytes(policy) for policy in plan.activations}
    assert peaks["full"] < peaks["every_n"] < peaks["selective"] < peaks["none"]
    assert f"total {peaks['full'] / GIB:8.2f} GiB  <- this recipe" in out
    # the vocab-parallel loss keeps its fp32 softmax: 4 bytes x 16,384 tokens x 128,256 / 4
    assert plan.activations["full"].stored["loss: vocab-parallel softmax [N, V/t], fp32"] == 4 * 16384 * 128256 / 4
