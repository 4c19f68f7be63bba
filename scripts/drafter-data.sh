#!/usr/bin/env bash
# Training-text recipe for `dspark train-drafter`. Prints the paths to pass to --data:
#  1. the target's own answers to ~900 synthetic chat/code/math prompts (scripts/drafter-prompts.py,
#     seeded; evaluation prompts and their tasks left out), rendered with the chat template —
#     built once with `dspark gen-data` into $DSPARK_HOME/data (≈ 5 min on 2 cores): sampled at
#     T = 1 (prompt seed 0), and greedy (prompt seed 1) for what greedy requests see; both
#     listed twice to weigh them up;
#  2. text this machine already holds in quantity: the Python standard library, Rust crate
#     sources in the cargo registry.
# Nothing is committed; the same commands rebuild the same prompts.
# Usage: scripts/drafter-data.sh [DSPARK_BINARY] [TARGET]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:-$here/../target/release/dspark}"
target="${2:-smollm2-135m}"
data="${DSPARK_HOME:-$HOME/.cache/dspark}/data"
mkdir -p "$data"
# selfgen FILE PROMPT_SEED TEMPERATURE: the target's answers to one seeded prompt set.
selfgen() {
  if [ ! -s "$1" ]; then
    python3 "$here/drafter-prompts.py" "$2" > "$data/prompts$2-$target.txt"
    "$bin" gen-data --target "$target" --prompts "$data/prompts$2-$target.txt" --out "$1.tmp" \
      --max-tokens 160 --temperature "$3" --batch 48 --seed "$2" >&2
    mv "$1.tmp" "$1"
  fi
}
gen="$data/selfgen-$target.txt"
greedy="$data/selfgen-greedy-$target.txt"
selfgen "$gen" 0 1.0
selfgen "$greedy" 1 0
paths=("$gen" "$greedy" "$gen" "$greedy")
for p in /usr/lib/python3*/ "$HOME/.cargo/registry/src"; do
  [ -e "$p" ] && paths+=("$p")
done
printf '%s\n' "${paths[@]}"
