#!/usr/bin/env bash
# Builds the kernels' unit tests for 64-bit Arm (aarch64 Linux) and runs them under qemu-user:
# once as qemu's default CPU (NEON with the dot-product extension: `Isa::NeonDot`), once as a
# Cortex-A72 (NEON without it: `Isa::Neon`). The grouped tests hold both NEON paths to the bits
# of the portable mirror, which the x86 paths are held to on x86.
#
# Needs: `rustup target add aarch64-unknown-linux-gnu`, a cross linker and qemu-user
# (Debian: gcc-aarch64-linux-gnu qemu-user); .ci/run installs them. Extra arguments go to the
# test binary (a name filter, --nocapture).
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
args=(
  -p kernels --lib --target "$target" --target-dir target/aarch64
  --config "target.$target.linker=\"aarch64-linux-gnu-gcc\""
  --config "target.$target.runner=[\"qemu-aarch64\", \"-L\", \"$sysroot\"]"
)

echo "== aarch64, NEON with dot product (qemu's default CPU)"
DSPARK_EXPECT_ISA=neondot cargo test "${args[@]}" -- "$@"
echo "== aarch64, NEON without dot product (Cortex-A72)"
QEMU_CPU=cortex-a72 DSPARK_EXPECT_ISA=neon cargo test "${args[@]}" -- grouped:: every_available_path "$@"
