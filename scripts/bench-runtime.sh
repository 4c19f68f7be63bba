#!/usr/bin/env bash
# Runtime benchmarks for the README (issue: model runtime). Writes JSON + SVG to bench/results/.
# Needs llama-cpp-python for the decode peer: DSPARK_LLAMA_CPP_PYTHON=/path/to/venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/dspark
cargo build --release -q -p dspark
out=bench/results
mkdir -p "$out"
for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  reps=5; [ "$m" = qwen2.5-coder-1.5b ] && reps=3
  $bin bench decode --model "$m" --json "$out/decode-$m.json"
  $bin bench verify-curve --model "$m" --reps "$reps" --json "$out/verify-curve-$m.json" --plot "$out/verify-curve-$m.svg"
  $bin bench accuracy --model "$m" --json "$out/accuracy-$m.json"
done
