#!/usr/bin/env bash
# What a CPU without AVX-512 gets: one forward of k new tokens (ctx 256, batch 1) on each ISA's
# kernels, the ISAs alternated run by run on this machine, then one JSON with every run and the
# median per ISA and k. `--isa avx2` runs the AVX2 kernels an AMD Zen 2/3 or an older Intel
# would (the same bits as AVX-512 VNNI, tested).
#
#   scripts/bench-isa.sh [MODEL] [OUT.json] [RUNS] [ISAS]
#   (defaults: smollm2-135m, bench/results/isa-MODEL.json, 3, "avx2 avx512bf16")
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m}
out=${2:-bench/results/isa-$model.json}
runs=${3:-3}
isas=${4:-avx2 avx512bf16}
bin=./target/release/dspark
cargo build -q --release -p dspark
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$runs"); do
  for isa in $isas; do
    "$bin" --isa "$isa" bench verify-curve --model "$model" --ctx 256 --k 1,2,4,8 --batch 1 \
      --reps 10 --json "$tmp/$isa-$r.json" > /dev/null
  done
done
python3 - "$tmp" "$out" "$model" "$runs" "$isas" "$0 $*" <<'EOF'
import json, statistics, sys, glob, os
tmp, out, model, runs, isas, cmd = sys.argv[1:]
res = {"command": cmd, "model": model, "runs": int(runs), "ctx": 256, "batch": 1, "isas": {}}
for isa in isas.split():
    per_k = {}
    for f in sorted(glob.glob(os.path.join(tmp, f"{isa}-*.json"))):
        for p in json.load(open(f))["points"]:
            per_k.setdefault(p["k"], []).append(p["ms_median"])
    med = {k: statistics.median(v) for k, v in sorted(per_k.items())}
    res["isas"][isa] = {
        "ms_median_per_run": {str(k): v for k, v in sorted(per_k.items())},
        "ms_median": {str(k): m for k, m in med.items()},
        "t_k_over_t_1": {str(k): m / med[1] for k, m in med.items()},
    }
    print(isa, " ".join(f"k={k}: {m:.2f} ms" for k, m in med.items()))
json.dump(res, open(out, "w"), indent=1)
print("wrote", out)
EOF
