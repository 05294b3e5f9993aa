#!/usr/bin/env bash
# Builds the npm package into dist/xquant-wgpu: wasm-pack (no downloads, no wasm-opt) plus the
# hand-written facade (js/). `npm pack dist/xquant-wgpu` then makes the installable tarball.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wasm
wasm-pack build --target web --mode no-install --release --out-dir pkg --out-name xquant_wgpu >/dev/null 2>&1 \
  || wasm-pack build --target web --mode no-install --release --out-dir pkg --out-name xquant_wgpu
out=dist/xquant-wgpu
rm -rf "$out"
mkdir -p "$out"
cp pkg/xquant_wgpu.js pkg/xquant_wgpu.d.ts pkg/xquant_wgpu_bg.wasm pkg/xquant_wgpu_bg.wasm.d.ts "$out/"
cp js/index.js js/index.d.ts js/README.md "$out/"
cp js/package.template.json "$out/package.json"
echo "built $out ($(du -sh "$out" | cut -f1))" >&2
