#!/usr/bin/env bash
# The main job on a built-in default: the adapter in use, then the XQuant analysis and the
# cross-layer similarity of a bundled K/V example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh

cargo build --quiet --bin xquant
xq=target/debug/xquant
example=target/example/synthetic-kv.safetensors
mkdir -p target/example
[ -f "$example" ] || "$xq" synth --out "$example" --layers 8 --heads 2 --tokens 256 --dim 64 --correlation 0.8

"$xq" info
echo
"$xq" analyze "$example" "$@"
echo
"$xq" similarity "$example"
