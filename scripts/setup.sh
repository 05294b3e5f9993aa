#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for xquant-wgpu, idempotently and quietly when
# everything is there. Arguments choose extra parts: `wasm` (rustup target, wasm-bindgen-cli,
# wasm-pack, npm packages: binaryen's wasm-opt) and `browser` (Chromium, ChromeDriver, npm packages: Playwright, TypeScript, and
# `webgpu` (Dawn) for the package's Node tests, which run on Chromium's SwiftShader). System packages are
# installed with apt when running as root on Debian; otherwise the script stops with the
# exact command to run.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }

WASM_BINDGEN_VERSION=0.2.130   # must equal the wasm-bindgen crate in Cargo.lock
WASM_PACK_VERSION=0.15.1

apt_missing=()
# lavapipe: Vulkan on the CPU, the GPU every test machine has.
ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || apt_missing+=(mesa-vulkan-drivers)
for part in "$@"; do
  if [ "$part" = browser ]; then
    command -v chromium >/dev/null 2>&1 || apt_missing+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || apt_missing+=(chromium-driver)
  fi
done

if [ ${#apt_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${apt_missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${apt_missing[@]}" >/dev/null
  else
    say "missing system packages: ${apt_missing[*]}"
    say "run: sudo apt-get install -y ${apt_missing[*]}"
    exit 1
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  say "cargo not found: install Rust with rustup (https://rustup.rs), then re-run"
  exit 1
fi

# The npm devDependencies (package-lock.json): binaryen's wasm-opt for the build; Playwright,
# TypeScript, WebGPU types and Dawn (webgpu) for the tests.
npm_packages() {
  local dir
  for dir in node_modules/binaryen node_modules/playwright-core node_modules/typescript \
    node_modules/@webgpu/types node_modules/webgpu; do
    if [ ! -d "$dir" ]; then
      say "installing npm packages"
      npm ci --no-audit --no-fund --loglevel=error >/dev/null
      return
    fi
  done
}

for part in "$@"; do
  case "$part" in
    wasm)
      if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
        say "adding the wasm32-unknown-unknown target"
        rustup target add wasm32-unknown-unknown >/dev/null
      fi
      if ! wasm-bindgen --version 2>/dev/null | grep -q " $WASM_BINDGEN_VERSION"; then
        say "installing wasm-bindgen-cli $WASM_BINDGEN_VERSION (a few minutes)"
        cargo install --quiet --force wasm-bindgen-cli --version "$WASM_BINDGEN_VERSION"
      fi
      if ! wasm-pack --version 2>/dev/null | grep -q " $WASM_PACK_VERSION"; then
        say "installing wasm-pack $WASM_PACK_VERSION (a few minutes)"
        cargo install --quiet --force wasm-pack --version "$WASM_PACK_VERSION" --locked
      fi
      npm_packages
      ;;
    browser)
      npm_packages
      ;;
  esac
done
