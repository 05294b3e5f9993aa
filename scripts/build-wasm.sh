#!/usr/bin/env bash
# Builds the npm package into dist/xquant-wgpu: wasm-pack (no downloads), wasm-opt -Os from the
# npm `binaryen` package (a devDependency: wasm-pack's own wasm-opt would be a download), plus
# the hand-written facade (js/). `npm pack dist/xquant-wgpu` then makes the installable tarball.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wasm
wasm-pack build --target web --mode no-install --release --out-dir pkg --out-name xquant_wgpu >/dev/null 2>&1 \
  || wasm-pack build --target web --mode no-install --release --out-dir pkg --out-name xquant_wgpu
# The features Rust's wasm32 target emits by default: binaryen must accept them, and adds none.
WASM_FEATURES=(--enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext
  --enable-mutable-globals --enable-reference-types --enable-multivalue)
if [ ! -x node_modules/.bin/wasm-opt ]; then
  echo "[build] node_modules/.bin/wasm-opt missing: run npm ci" >&2
  exit 1
fi
before=$(stat -c %s pkg/xquant_wgpu_bg.wasm)
node_modules/.bin/wasm-opt -Os "${WASM_FEATURES[@]}" pkg/xquant_wgpu_bg.wasm -o pkg/xquant_wgpu_bg.opt.wasm
mv pkg/xquant_wgpu_bg.opt.wasm pkg/xquant_wgpu_bg.wasm
after=$(stat -c %s pkg/xquant_wgpu_bg.wasm)
echo "[build] wasm-opt -Os: $before -> $after bytes ($(gzip -9c pkg/xquant_wgpu_bg.wasm | wc -c) gzipped)" >&2
out=dist/xquant-wgpu
rm -rf "$out"
mkdir -p "$out"
cp pkg/xquant_wgpu.js pkg/xquant_wgpu.d.ts pkg/xquant_wgpu_bg.wasm pkg/xquant_wgpu_bg.wasm.d.ts "$out/"
cp js/index.js js/index.d.ts js/README.md "$out/"
cp js/package.template.json "$out/package.json"
echo "built $out ($(du -sh "$out" | cut -f1))" >&2
