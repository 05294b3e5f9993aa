#!/usr/bin/env bash
# Benchmarks (release build). Default: kernel throughput against a same-run copy kernel and
# the CPU reference (`xquant bench`). With --cache first: decode steps and memory of a cache
# set against a plain f16 cache (`xquant bench-cache`). Other arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmd=bench
if [ "${1:-}" = "--cache" ]; then
  cmd=bench-cache
  shift
fi
cargo run --quiet --release --bin xquant -- "$cmd" "$@"
