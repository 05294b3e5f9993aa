#!/usr/bin/env bash
# Kernel benchmark (release build): throughput against a same-run copy kernel and the CPU
# reference. Extra arguments go to `xquant bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cargo run --quiet --release --bin xquant -- bench "$@"
