#!/usr/bin/env bash
# Training-text recipe for `dspark train-drafter`: text this machine already holds in quantity
# (the Python standard library, Rust crate sources in the cargo registry, the project's own prompt
# sets). Prints the paths to pass to --data; nothing is copied or committed.
set -euo pipefail
paths=()
for p in /usr/lib/python3*/ "$HOME/.cargo/registry/src" "$(cd "$(dirname "$0")/.." && pwd)/prompts"; do
  [ -e "$p" ] && paths+=("$p")
done
printf '%s\n' "${paths[@]}"
