#!/bin/bash
# The MoE headline of #32 on one GPU, as benchmarks/RESULTS.md measures it, in one call of about
# 400 s on an H200: warm up configs/moe-gpu-2b.yaml for 480 steps and export it, judge the expert
# load of the warm-up, then time megatrain beside transformers' Qwen2MoE, both from the exported
# weights, at the recipe's global batch of 512 (micro-batch 32) on the warm-up's text.
#
#     bash benchmarks/moe_headline.sh OUT_DIR [NAME] [mfu.py arguments]
#
# e.g. `--variants rms-bwd-rows1` adds that A/B row of megatrain, from the same weights.
#
# Writes OUT_DIR/moe-warmup-NAME.json and OUT_DIR/mfu-moe-gb512-NAME.json (NAME: warm480).
set -euo pipefail
out=${1:?usage: bash benchmarks/moe_headline.sh OUT_DIR [NAME] [mfu.py arguments]}
name=${2:-warm480}
shift $(( $# >= 2 ? 2 : 1 ))
work=${MOE_HEADLINE_WORK:-/tmp/moe-headline}
cd "$(dirname "$0")/.."
mkdir -p "$out" "$work"
python3 benchmarks/moe_warmup.py configs/moe-gpu-2b.yaml "$work/hf" train.device=cuda train.steps=480 \
    train.micro_batch_size=16 train.global_batch_size=32 optim.warmup_steps=100 \
    data.max_source_bytes=64000000 train.run_dir="$work/run" 2>&1 | grep -E "^step (1|475) |exported"
python3 benchmarks/moe_balance.py "$work/run/warmup-metrics.jsonl" --name warmup-480 --pool 16 \
    --out "$out/moe-warmup-$name.json" | tail -3
python3 benchmarks/mfu.py --quick --budget-s 400 --large-batch 512 --config configs/moe-gpu-2b.yaml \
    --default-mbs 32 --baseline-mbs 32 --late-baseline-mbs "" --only baseline,default --steps 3 \
    --init-from "$work/hf" --work "$work/mfu" --source-bytes 64000000 --out "$out/mfu-moe-gb512-$name.json" "$@"
