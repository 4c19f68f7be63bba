#!/usr/bin/env bash
# Rebuilds the shipped DSpark drafter for smollm2-135m (drafters/smollm2-135m) from scratch on
# CPU, then calibrates and evaluates it. Steps and timings of the shipped run are in
# drafters/smollm2-135m/train_state.json and README "DSpark drafter".
# Two phases, as the shipped checkpoint was trained: over the whole vocabulary first, then, with
# the draft vocabulary fixed, a fine-tuning phase over it (cheaper steps, larger batches, both
# halves of the self-generated text).
# Usage: scripts/train-drafter.sh [OUT_DIR] [STEPS]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/drafters/smollm2-135m}"
steps="${2:-8000}"
cd "$root"
cargo build --release -p dspark
bin="$root/target/release/dspark"
mapfile -t data < <(scripts/drafter-data.sh "$bin" smollm2-135m)
"$bin" train-drafter --target smollm2-135m --data "${data[@]}" --out "$out" --steps "$steps" \
  --gamma 7 --rank 64 --layers 1 --max-bytes 1600000 --save-every 250 --draft-vocab 0
# The draft vocabulary: the 8192 most frequent target tokens of the training text (FR-Spec).
"$bin" drafter-vocab --target smollm2-135m --drafter "$out" --size 8192 --data "${data[@]}"
"$bin" train-drafter --target smollm2-135m --data "${data[@]}" --out "$out" --fine-tune \
  --steps 11000 --batch 32 --lr 6e-4 --max-bytes 3200000 --save-every 250
# Calibration on held-out prompts (first half of each prompt set): the copy prior (one run
# without it), then the confidences (input mix, STS temperatures and shifts) on drafts made with
# it (greedy: with the copy runs fitted from that first run, as served); once for sampled
# requests (T = 1) and once for greedy ones;
# evaluation on the second half, at both temperatures. The first run sets the serving forward's
# 4-bit weights, which both calibrations then fit.
"$bin" calibrate-drafter --target smollm2-135m --drafter "$out" --prompts all --offset 0 --limit 16 \
  --max-tokens 512 --serve-bits 4 --json bench/results/calibrate-dspark-smollm2.json
# Greedy: on the 288 calibration prompts (prompts/calib), which the greedy confidence head's
# fit needs; the copy-run head is fitted on the copy runs of its last run (≈ 30 min on 2 cores).
"$bin" calibrate-drafter --target smollm2-135m --drafter "$out" --prompts all-calib --offset 0 --limit 96 \
  --max-tokens 512 --temperature 0 --json bench/results/calibrate-dspark-smollm2-greedy.json
"$bin" eval-drafter --target smollm2-135m --drafter "$out" --prompts all --gamma 7 --temperature 1.0 \
  --max-tokens 512 --json bench/results/eval-dspark-smollm2.json
"$bin" eval-drafter --target smollm2-135m --drafter "$out" --prompts all --gamma 7 --temperature 0 \
  --max-tokens 512 --json bench/results/eval-dspark-smollm2-greedy.json
