#!/usr/bin/env bash
# The cluster under load, arms side by side in one run: the drafter in its own draft-worker
# process (the disaggregated layout), the same drafter inside the target worker's process, and no
# speculation. Each arm: `dspark up`, then `dspark bench serve` closed-loop at concurrency 1 and 8
# on the same prompts. Writes one JSON (default bench/results/serve-smollm2.json).
#
#   scripts/bench-serve.sh [OUT.json]      env: DSPARK_BIN, DURATION (s per point), PROMPTS, DRAFTER
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DSPARK_BIN:-target/debug/dspark}
OUT=${1:-bench/results/serve-smollm2.json}
DUR=${DURATION:-20}
PROMPTS=${PROMPTS:-code}
DRAFTER=${DRAFTER:-ngram}
TMP=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$TMP"' EXIT

run_arm() {
  local arm=$1; shift
  local port; port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  DSPARK_LOG=warn "$BIN" up --port "$port" "$@" >"$TMP/$arm.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    sleep 0.5
  done
  sleep 2 # draft workers register right after the target
  for c in 1 8; do
    "$BIN" bench serve --url "http://127.0.0.1:$port" --prompts "$PROMPTS" --concurrency "$c" \
      --duration "$DUR" --max-tokens 64 --label "$arm" --json "$TMP/$arm-c$c.json" >/dev/null
  done
  kill -INT "$pid"; wait "$pid" || true
}

run_arm draft-worker --drafter "$DRAFTER"
run_arm draft-worker-pingpong --drafter "$DRAFTER" --pingpong
run_arm in-process --drafter "$DRAFTER" --in-process-drafter
run_arm none --drafter none --in-process-drafter

python3 - "$TMP" "$OUT" "$*" <<'PY'
import json, sys, glob, os, platform
tmp, out = sys.argv[1], sys.argv[2]
pts = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(tmp, "*.json")))]
res = {"command": "scripts/bench-serve.sh " + sys.argv[3], "machine": platform.processor() or platform.machine(),
       "cpus": os.cpu_count(), "points": pts}
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(res, open(out, "w"), indent=1)
print(f"{'arm':<22}{'conc':>5}{'tok/s':>9}{'user tok/s':>12}{'TTFT p50':>10}{'TPOT p50':>10}{'tok/fwd':>9}{'B→draft/tok':>13}{'B←draft/tok':>13}{'gRPC ms/cycle':>15}")
for p in pts:
    w = p["wire"]
    print(f"{p['label']:<22}{p['load']['concurrency']:>5}{p['tok_s']:>9.1f}{p['user_tok_s']:>12.1f}{p['ttft_ms']['p50']:>10.1f}{p['tpot_ms']['p50']:>10.1f}"
          f"{p['tokens_per_forward']:>9.2f}{w['bytes_to_draft_per_token']:>13.1f}{w['bytes_from_draft_per_token']:>13.1f}{w['grpc_overhead_ms_per_cycle']:>15.2f}")
print("wrote", out)
PY
