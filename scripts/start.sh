#!/usr/bin/env bash
# The main job: build the npm package and serve the demo at http://127.0.0.1:8080 — the
# cross-layer similarity and the XQuant trade-off of a real model's K/V (the bundled SmolLM2
# capture), computed in the browser on WebGPU. Extra argument: another port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wasm
source scripts/env.sh
bash scripts/build-wasm.sh
exec node scripts/serve.mjs "${1:-8080}"
