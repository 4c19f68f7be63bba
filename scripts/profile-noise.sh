#!/usr/bin/env bash
# How much a busy neighbour moves the SPS(B) profile: `dspark profile` on an idle machine, then
# under a periodic hog (a busy loop on one core, 2 s of every 6 s), for each binary given.
# Writes bench/results/sps-profile-noise.json: per binary, both staircases and their ratio.
# Usage: scripts/profile-noise.sh [DSPARK_BINARY ...]   (default: target/release/dspark)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ $# -gt 0 ] || set -- "$root/target/release/dspark"
tmp=$(mktemp -d)
hog() { while true; do timeout 2 sh -c 'while :; do :; done' || true; sleep 4; done; }
i=0
for bin in "$@"; do
  "$bin" profile --json "$tmp/idle-$i.json" >/dev/null
  hog & h=$!
  "$bin" profile --json "$tmp/hog-$i.json" >/dev/null
  kill "$h"; wait "$h" 2>/dev/null || true
  i=$((i + 1))
done
python3 - "$tmp" "$@" <<'PY'
import json, sys
tmp, bins = sys.argv[1], sys.argv[2:]
runs = []
for i, b in enumerate(bins):
    idle = {p: 1e3 / s for p, s in json.load(open(f"{tmp}/idle-{i}.json"))["table"]}
    hog = {p: 1e3 / s for p, s in json.load(open(f"{tmp}/hog-{i}.json"))["table"]}
    r = [hog[p] / idle[p] for p in idle if p in hog]
    runs.append({"binary": b, "idle_ms": idle, "hog_ms": hog,
                 "ratio_max": max(r), "ratio_mean": sum(r) / len(r)})
    print(f"{b}: hog/idle step time per B: max {max(r):.2f}, mean {sum(r)/len(r):.2f}")
out = {"command": "scripts/profile-noise.sh " + " ".join(bins),
       "hog": "one core busy 2 s of every 6 s", "runs": runs}
json.dump(out, open("bench/results/sps-profile-noise.json", "w"), indent=1)
PY
rm -rf "$tmp"
