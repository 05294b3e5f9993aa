#!/usr/bin/env bash
# Benchmarks (release build). Default: kernel throughput against a same-run copy kernel and
# the CPU reference (`xquant bench`). With --cache first: decode steps and memory of a cache
# set against a plain f16 cache (`xquant bench-cache`). With --model first: SmolLM2 decode
# speed, f16 cache against XQuant (`xquant bench-model`). Other arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmd=(bench)
case "${1:-}" in
  --cache) cmd=(bench-cache); shift ;;
  --model) cmd=(bench-model --model "$(bash scripts/fetch-model)"); shift ;;
esac
cargo run --quiet --release --bin xquant -- "${cmd[@]}" "$@"
