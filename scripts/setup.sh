#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks for xquant-wgpu, idempotently and quietly when
# everything is there. System packages are installed with apt when running as root on
# Debian; otherwise the script stops with the exact command to run.
set -euo pipefail

say() { printf '[setup] %s\n' "$*" >&2; }

apt_missing=()
# lavapipe: Vulkan on the CPU, the GPU every test machine has.
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  apt_missing+=(mesa-vulkan-drivers)
fi

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
