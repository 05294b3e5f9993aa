#!/usr/bin/env bash
# The main job: build the npm package and serve the demo at http://127.0.0.1:8080 — the
# cross-layer similarity and the XQuant trade-off of a real model's K/V (the bundled SmolLM2
# capture), computed in the browser on WebGPU, and the Generate panel (SmolLM2-135M and
# Gemma 3 270M, fetched once by scripts/fetch-model and served at /models/, picked in the
# page). Extra argument: another port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wasm
source scripts/env.sh
bash scripts/build-wasm.sh
if ! model=$(bash scripts/fetch-model); then
  echo "[start] could not fetch the model: the Generate panel will offer a file picker" >&2
  model=""
fi
if ! gemma=$(bash scripts/fetch-model gemma3-270m); then
  echo "[start] could not fetch Gemma 3 270M: the Generate panel offers SmolLM2 alone" >&2
  gemma=""
fi
XQ_MODEL="$model" XQ_GEMMA="$gemma" exec node scripts/serve.mjs "${1:-8080}"
