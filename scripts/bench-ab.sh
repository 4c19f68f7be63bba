#!/usr/bin/env bash
# Two (or more) builds of `dspark` side by side: one forward of k new tokens (ctx 256, batch 1)
# with each build on each ISA, alternated run by run on this machine (shared machines drift by
# tens of percent over minutes, so builds must be compared within one run; odd runs take the
# builds in the order given, even runs in reverse), then one JSON with every run and the median
# per build, ISA and k. Paths are taken from the repository root.
#
#   scripts/bench-ab.sh MODEL OUT.json RUNS "ISAS" LABEL=BIN LABEL=BIN [...]
#   e.g., with the previous commit built into /tmp/dspark-before and this one into
#   /tmp/dspark-after:
#   scripts/bench-ab.sh qwen2.5-coder-1.5b bench/results/ab.json 3 "avx512bf16 avx2" \
#     before=/tmp/dspark-before after=/tmp/dspark-after
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 6 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
model=$1 out=$2 runs=$3 isas=$4
shift 4
arms=("$@")
declare -A seen=()
for arm in "${arms[@]}"; do
  case $arm in
    *=*) ;;
    *) echo "bench-ab: '$arm' is not LABEL=BIN" >&2; exit 2 ;;
  esac
  label=${arm%%=*}
  [ -z "${seen[$label]:-}" ] || { echo "bench-ab: label '$label' given twice" >&2; exit 2; }
  seen[$label]=1
  [ -x "${arm#*=}" ] || { echo "bench-ab: ${arm#*=} is not an executable" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$runs"); do
  order=("${arms[@]}")
  if [ $((r % 2)) -eq 0 ]; then
    order=()
    for ((i = ${#arms[@]} - 1; i >= 0; i--)); do order+=("${arms[$i]}"); done
  fi
  for arm in "${order[@]}"; do
    label=${arm%%=*} bin=${arm#*=}
    for isa in $isas; do
      "$bin" --isa "$isa" bench verify-curve --model "$model" --ctx 256 --k 1,2,4,8 --batch 1 \
        --reps 10 --json "$tmp/$label@$isa@$r.json" > /dev/null 2>&1
    done
  done
done
python3 - "$tmp" "$out" "$model" "$runs" "$isas" "$0 $model $out $runs '$isas' ${arms[*]}" "${arms[@]}" <<'PY'
import json, statistics, sys, os
tmp, out, model, runs, isas, cmd, *arms = sys.argv[1:]
res = {"command": cmd, "model": model, "runs": int(runs), "ctx": 256, "batch": 1,
       "k": [1, 2, 4, 8], "reps": 10, "arms": {}}
for arm in arms:
    label, binary = arm.split("=", 1)
    res["arms"][label] = {"binary": binary, "isas": {}}
    for isa in isas.split():
        per_k = {}
        for r in range(1, int(runs) + 1):
            for p in json.load(open(os.path.join(tmp, f"{label}@{isa}@{r}.json")))["points"]:
                per_k.setdefault(p["k"], []).append(p["ms_median"])
        med = {k: statistics.median(v) for k, v in sorted(per_k.items())}
        res["arms"][label]["isas"][isa] = {
            "ms_median_per_run": {str(k): v for k, v in sorted(per_k.items())},
            "ms_median": {str(k): m for k, m in med.items()},
            "t_k_over_t_1": {str(k): m / med[1] for k, m in med.items()},
        }
        print(f"{label:>8} {isa:>11}", " ".join(f"k={k}: {m:6.2f} ms" for k, m in med.items()),
              f" T(8)/T(1) {med[8] / med[1]:.2f}")
json.dump(res, open(out, "w"), indent=1)
print("wrote", out)
PY
