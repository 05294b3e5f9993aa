#!/usr/bin/env bash
# Every test: formatting, lints, then the native test suite (GPU tests on lavapipe or any
# adapter; with REQUIRE_GPU=1 a missing adapter fails them instead of skipping).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
echo "== cargo test"
cargo test --quiet
