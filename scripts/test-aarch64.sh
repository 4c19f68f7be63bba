#!/usr/bin/env bash
# 64-bit Arm (aarch64 Linux) from an x86 machine, under qemu-user.
#
#   scripts/test-aarch64.sh [ARGS]       the kernels' unit tests, built for aarch64 and run
#       once as qemu's default CPU (NEON with the dot-product extension: `Isa::NeonDot`) and
#       once as a Cortex-A72 (NEON without it: `Isa::Neon`); ARGS go to the test binary.
#   scripts/test-aarch64.sh forward-bits MODEL.gguf ISA [logits]
#       runtime/examples/forward_bits.rs built for aarch64: prints the fingerprint of a
#       model's forward on ISA (neon | neondot), to compare with the x86 paths' bits.
#
# `cargo test` runs both through runtime/tests/aarch64.rs. Needs `rustup target add
# aarch64-unknown-linux-gnu`, a cross linker and qemu-user (Debian: gcc-aarch64-linux-gnu
# qemu-user); .ci/run installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Arm binaries cannot load this machine's x86 libnvrtc: their NVRTC test skips instead.
unset DSPARK_REQUIRE_NVRTC

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
cross=(
  --target "$target" --target-dir target/aarch64
  --config "target.$target.linker=\"aarch64-linux-gnu-gcc\""
  --config "target.$target.runner=[\"timeout\", \"900\", \"qemu-aarch64\", \"-L\", \"$sysroot\"]"
)

if [ "${1:-}" = "forward-bits" ]; then
  shift
  cargo build -q -p dspark-runtime --example forward_bits "${cross[@]}"
  exec timeout 900 qemu-aarch64 -L "$sysroot" "target/aarch64/$target/debug/examples/forward_bits" "$@"
fi

echo "== aarch64, NEON with dot product (qemu's default CPU)"
DSPARK_EXPECT_ISA=neondot cargo test -p kernels --lib "${cross[@]}" -- "$@"
echo "== aarch64, NEON without dot product (Cortex-A72)"
QEMU_CPU=cortex-a72 DSPARK_EXPECT_ISA=neon cargo test -p kernels --lib "${cross[@]}" -- \
  grouped:: every_available_path "$@"
