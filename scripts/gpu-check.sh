#!/usr/bin/env bash
# The GPU checks, in two halves, because the GPU machine has no Rust toolchain and no network:
#
#   scripts/gpu-check.sh prepare   # here: builds the kernels' and runtime's test binaries and a
#                                  # one-layer cut of smollm2-135m into .gpu/ (ignored by git;
#                                  # ~34 MB xz-compressed, carried to the GPU machine)
#   scripts/gpu-check.sh run       # on the GPU machine (device tool: carry [".gpu"]): runs the
#                                  # GPU tests against their CPU references, writes $OUT/gpu-check.log
#
# What `run` checks: the CUDA kernels (`kernels::cuda`, compiled there at run time by NVRTC)
# against their CPU references on random shapes; the model forward written over those kernels
# (`dspark_runtime::device`) against the CPU forward's logits on tiny seeded models and on real
# SmolLM2 weights, in one prefill and in decode steps and verification windows over the device's
# KV cache; and that opening the device is no error. It prints the driver and NVRTC libraries it
# finds first, so a failure to load them is visible. Then it measures what a window of k tokens
# costs there (runtime/examples/gpu-verify-curve.rs) for SmolLM2-135M's and
# Qwen2.5-Coder-1.5B's shapes, into $OUT/gpu-verify-curve-*.json.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
case "${1:-}" in
  prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu
    json=$(cargo test --release -p kernels -p dspark-runtime --lib --no-run --message-format=json) ||
      { echo "building the kernels' and runtime's tests failed" >&2; exit 1; }
    printf '%s\n' "$json" |
      python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])' |
      while read -r name exe; do
        case "$name" in
          kernels) cp "$exe" .gpu/kernels-tests ;;
          dspark_runtime) cp "$exe" .gpu/runtime-tests ;;
        esac
      done
    cargo build -q --release -p dspark-runtime --example gpu-verify-curve
    cp target/release/examples/gpu-verify-curve .gpu/gpu-verify-curve
    for b in kernels-tests runtime-tests gpu-verify-curve; do
      [ -f ".gpu/$b" ] || { echo "no $b binary built" >&2; exit 1; }
      strip ".gpu/$b" 2>/dev/null || true
    done
    # Real weights for the forward check: the default model cut to its first layers (the GPU
    # machine has no network, and what travels there is at most 64 MiB with the working tree).
    layers="${GPU_CHECK_LAYERS:-1}"
    src=$(cargo run -q --release -p dspark -- fetch-model smollm2-135m | tail -1) || true
    [ -f "$src" ] || src="${DSPARK_HOME:-$HOME/.cache/dspark}/models/smollm2-135m.gguf"
    cargo run -q --release -p dspark-runtime --example slice-gguf -- "$src" .gpu/smollm2-135m-cut.gguf "$layers"
    # The benchmark's shapes: each model's config, read from its GGUF header (Qwen2.5-Coder-1.5B's
    # is kept in scripts/gpu-configs/, dumped the same way, so prepare needs no 1 GB download).
    .gpu/gpu-verify-curve --dump-config "$src" > .gpu/smollm2-135m.json
    cp scripts/gpu-configs/qwen2.5-coder-1.5b.json .gpu/
    # What travels is compressed (Q8_0 weights and binaries shrink by a tenth to two thirds);
    # `run` unpacks it with Python's lzma, which every image with python3 has.
    for f in .gpu/*; do xz -T0 -6 "$f"; done
    ls -la .gpu
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    gpu=$(du -cb .gpu/* | tail -1 | cut -f1)
    echo "working tree $tree B + .gpu $gpu B = $((tree + gpu)) B (limit $((64 << 20)) B)"
    [ $((tree + gpu)) -lt $((64 << 20)) ] || { echo "too large to carry: lower GPU_CHECK_LAYERS" >&2; exit 1; }
    ;;
  run)
    out="${OUT:-/tmp/gpu-check}"
    mkdir -p "$out"
    # The whole check through one pipe to its log (pipefail keeps its status).
    "$root/scripts/gpu-check.sh" run-body 2>&1 | tee "$out/gpu-check.log"
    ;;
  run-body)
    out="${OUT:-/tmp/gpu-check}"
    nvidia-smi -L || true
    # NVRTC and the driver, wherever this image keeps them (the toolkit, or pip's nvidia wheels).
    extra=$(python3 - <<'EOF' 2>/dev/null || true
import glob, os
dirs = set()
for pat in ("/usr/local/cuda*/lib64/libnvrtc.so*", "/usr/local/cuda*/targets/*/lib/libnvrtc.so*",
            "/usr/local/nvidia/lib64/libcuda.so*"):
    dirs.update(os.path.dirname(p) for p in glob.glob(pat))
try:
    # PyPI's NVIDIA wheels: nvidia/cuda_nvrtc/lib (CUDA 12) or nvidia/cu13/lib (CUDA 13).
    import nvidia
    for root in nvidia.__path__:
        dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "lib*", "libnvrtc.so*")))
except Exception:
    pass
print(":".join(sorted(dirs)))
EOF
)
    export LD_LIBRARY_PATH="${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc' || true
    for d in ${extra//:/ }; do ls "$d" | grep -E 'libcuda\.so|libnvrtc' | sed "s|^|$d/|" || true; done
    ls .gpu/*.xz >/dev/null 2>&1 || { echo "gpu-check: FAILED: no .gpu/*.xz (run prepare here first)"; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    for f in .gpu/*.xz; do
      python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as a, open(sys.argv[2], "wb") as b: shutil.copyfileobj(a, b)' \
        "$f" "$work/$(basename "$f" .xz)"
    done
    chmod +x "$work/kernels-tests" "$work/runtime-tests" "$work/gpu-verify-curve"
    # Both halves run whatever the first one gives, so one device call reports both.
    status=0
    if "$work/kernels-tests" cuda --include-ignored --nocapture --test-threads 1; then
      echo "gpu-check: kernels match their CPU references"
    else
      echo "gpu-check: FAILED: the kernels against their CPU references"; status=1
    fi
    if DSPARK_GPU_MODEL="$work/smollm2-135m-cut.gguf" \
      "$work/runtime-tests" device --include-ignored --nocapture --test-threads 1; then
      echo "gpu-check: the CUDA forward matches the CPU forward (tiny models and real weights)"
    else
      echo "gpu-check: FAILED: the CUDA forward against the CPU forward"; status=1
    fi
    # What a window of k tokens costs on this GPU, both matmul kernels side by side.
    for m in smollm2-135m qwen2.5-coder-1.5b; do
      if "$work/gpu-verify-curve" --config "$work/$m.json" --name "$m" \
        --json "$out/gpu-verify-curve-$m.json" --via "scripts/gpu-check.sh run"; then
        echo "gpu-check: measured $m"
      else
        echo "gpu-check: FAILED: the verification-cost measurement of $m"; status=1
      fi
    done
    exit $status
    ;;
  *)
    echo "usage: scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
