#!/usr/bin/env bash
# Calibrates a copy of the shipped DSpark drafter as scripts/train-drafter.sh does (sampled: the
# first half of each prompt set; greedy: the 96 calibration prompts per kind, ≈ 30 min) and
# measures it (the second half), then the batch-1 speedup and the throughput–interactivity
# frontier, each in one run with every arm side by side. Writes bench/results/*.json and *.svg.
# calibrate-drafter rewrites drafter.json in place, so everything runs on a copy in a temporary
# directory: drafters/ keeps the calibration it ships with.
# Usage: scripts/bench-drafter.sh [DSPARK_BINARY]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$root/target/release/dspark}"
cd "$root"
r=bench/results
work="$(mktemp -d "${TMPDIR:-/tmp}/dspark-bench-drafter.XXXXXX")"
trap 'rm -rf "$work"' EXIT
dr="$work/smollm2-135m"
cp -r drafters/smollm2-135m "$dr"
"$bin" calibrate-drafter --target smollm2-135m --drafter "$dr" --prompts all \
  --offset 0 --limit 16 --temperature 1.0 --max-tokens 512 --json $r/calibrate-dspark-smollm2.json
"$bin" calibrate-drafter --target smollm2-135m --drafter "$dr" --prompts all-calib \
  --offset 0 --limit 96 --temperature 0 --max-tokens 512 --json $r/calibrate-dspark-smollm2-greedy.json
for t in 1.0 0; do
  sfx=$([ "$t" = 0 ] && echo -greedy || true)
  "$bin" eval-drafter --target smollm2-135m --drafter "$dr" --prompts all --gamma 7 \
    --temperature "$t" --max-tokens 512 --json "$r/eval-dspark-smollm2$sfx.json"
done
# The same checkpoint without copy runs, for the ablation arm.
norun="$work/norun"
cp -r "$dr" "$norun"
python3 - "$norun/drafter.json" <<'PY'
import json, sys
p = sys.argv[1]
d = json.load(open(p))
d.get("greedy_calibration", {}).pop("copy_runs", None)
json.dump(d, open(p, "w"), indent=2)
PY
"$bin" bench spec --model smollm2-135m --drafter "dspark:$dr,dspark:$norun,ngram" --gammas 1,3,7 \
  --scheduler --prompts code --limit 16 --max-tokens 96 --rounds 3 \
  --json $r/spec-smollm2-dspark-code.json
"$bin" bench frontier --target smollm2-135m --drafter "dspark:$dr" --prompts code \
  --concurrency 1,2,4,8,16,32 --waves 4 --rounds 3 \
  --json $r/frontier-smollm2-dspark.json --plot $r/frontier-smollm2-dspark.svg
