#!/usr/bin/env bash
# The GPU checks, in two halves, because the GPU machine has no Rust toolchain and no network:
#
#   scripts/gpu-check.sh prepare   # here: builds the kernels' test binary into .gpu/ (ignored by
#                                  # git; ~15 MB, carried to the GPU machine)
#   scripts/gpu-check.sh run       # on the GPU machine (device tool: carry [".gpu"]): runs the
#                                  # GPU tests against their CPU references, writes $OUT/gpu-check.log
#
# What `run` checks: the CUDA kernels (`kernels::cuda`, compiled there at run time by NVRTC)
# against their CPU references on random shapes, and that opening the device is no error. It
# prints the driver and NVRTC libraries it finds first, so a failure to load them is visible.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
case "${1:-}" in
  prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu
    json=$(cargo test --release -p kernels --no-run --message-format=json) ||
      { echo "building the kernels' tests failed" >&2; exit 1; }
    bin=$(printf '%s\n' "$json" |
      python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kernels":
        print(m["executable"])')
    [ -n "$bin" ] || { echo "no kernels test binary built" >&2; exit 1; }
    cp "$bin" .gpu/kernels-tests
    strip .gpu/kernels-tests 2>/dev/null || true
    ls -la .gpu
    ;;
  run)
    out="${OUT:-/tmp/gpu-check}"
    mkdir -p "$out"
    # The whole check through one pipe to its log (pipefail keeps its status).
    "$0" run-body 2>&1 | tee "$out/gpu-check.log"
    ;;
  run-body)
    nvidia-smi -L || true
    # NVRTC and the driver, wherever this image keeps them (the toolkit, or pip's nvidia wheels).
    extra=$(python3 - <<'EOF' 2>/dev/null || true
import glob, os
dirs = set()
for pat in ("/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/local/cuda*/targets/*/lib/libnvrtc.so*",
            "/usr/local/nvidia/lib64/libcuda.so*"):
    dirs.update(os.path.dirname(p) for p in glob.glob(pat))
try:
    import nvidia.cuda_nvrtc as m
    dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(list(m.__path__)[0], "lib*", "libnvrtc.so*")))
except Exception:
    pass
print(":".join(sorted(dirs)))
EOF
)
    export LD_LIBRARY_PATH="${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc' || true
    for d in ${extra//:/ }; do ls "$d" | grep -E 'libcuda\.so|libnvrtc' | sed "s|^|$d/|"; done
    .gpu/kernels-tests cuda --include-ignored --nocapture --test-threads 1
    echo "gpu-check: kernels match their CPU references"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
