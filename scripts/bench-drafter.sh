#!/usr/bin/env bash
# Calibrates the shipped DSpark drafter (held-out: first half of each prompt set) and measures it
# (second half), then the batch-1 speedup and the throughput–interactivity frontier, each in one
# run with every arm side by side. Writes bench/results/*.json and *.svg.
# Usage: scripts/bench-drafter.sh [DSPARK_BINARY]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$root/target/release/dspark}"
cd "$root"
r=bench/results
"$bin" calibrate-drafter --target smollm2-135m --drafter drafters/smollm2-135m --prompts all \
  --offset 0 --limit 16 --temperature 1.0 --max-tokens 512 --json $r/calibrate-dspark-smollm2.json
"$bin" calibrate-drafter --target smollm2-135m --drafter drafters/smollm2-135m --prompts all \
  --offset 0 --limit 16 --temperature 0 --max-tokens 512 --json $r/calibrate-dspark-smollm2-greedy.json
for t in 1.0 0; do
  sfx=$([ "$t" = 0 ] && echo -greedy || true)
  "$bin" eval-drafter --target smollm2-135m --drafter dspark --prompts all --gamma 7 \
    --temperature "$t" --max-tokens 512 --json "$r/eval-dspark-smollm2$sfx.json"
done
# The shipped checkpoint without copy runs, for the ablation arm.
norun=/tmp/dspark-norun
rm -rf "$norun" && cp -r drafters/smollm2-135m "$norun"
python3 - "$norun/drafter.json" <<'EOF'
import json, sys
p = sys.argv[1]
d = json.load(open(p))
d.get("greedy_calibration", {}).pop("copy_runs", None)
json.dump(d, open(p, "w"), indent=2)
EOF
"$bin" bench spec --model smollm2-135m --drafter dspark,dspark:$norun,ngram --gammas 1,3,7 \
  --scheduler --prompts code --limit 16 --max-tokens 96 --rounds 3 \
  --json $r/spec-smollm2-dspark-code.json
"$bin" bench frontier --target smollm2-135m --drafter dspark --prompts code \
  --concurrency 1,2,4,8,16,32 --waves 4 --rounds 3 \
  --json $r/frontier-smollm2-dspark.json --plot $r/frontier-smollm2-dspark.svg
