#!/usr/bin/env bash
# Every benchmark in one command (`npm run bench:all`, release build), on whatever adapter wgpu
# picks (lavapipe here; on a machine with a GPU, WGPU_BACKEND=vulkan picks it through Vulkan):
#   - kernels against a same-run copy kernel and the CPU reference, f16 and f32;
#   - a decode step of a SmolLM2-shaped cache set against the f16 cache, by context, for the
#     default plan and every preset, and GPU memory by token count;
#   - SmolLM2-135M's prefill and decode tokens/s with the default XQuant cache and the f16 one.
# Writes $BENCH_OUT/all.json (every figure, the adapter, the host, the date) and
# $BENCH_OUT/all.md (the tables; also printed). BENCH_OUT defaults to target/bench. Sized to
# finish within 10 minutes on 2 CPU cores; BENCH_QUICK=1 runs a smaller set (for checking the
# script).
#
# On a machine without the toolchain (a GPU box with no cargo, node or network):
#   XQUANT_BIN=path/to/xquant  a release binary built elsewhere: no set-up, no build;
#   XQ_MODEL=path/to/model     SmolLM2-135M-Instruct.Q4_1.gguf: no download;
#   arguments kernels|cache|model run only those parts (default: all three), keeping the
#   other parts already in $BENCH_OUT/parts, so a run can be finished in pieces;
# without node the report is left for `node scripts/bench-report.mjs OUT PRESET...` elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${BENCH_OUT:-target/bench}
parts="$out/parts"
say() { printf '[bench:all] %s (%ss)\n' "$*" "$SECONDS" >&2; }

contexts=64,256,1024,4096,8192,16384
presets=(default kivi-2 reference xquant-paper)
model_contexts=512
kernel_iters=10
if [ "${BENCH_QUICK:-}" = 1 ]; then
  contexts=64,1024
  presets=(default reference)
  model_contexts=64
  kernel_iters=2
fi

want=("$@")
[ ${#want[@]} -gt 0 ] || want=(kernels cache model)
for p in "${want[@]}"; do
  case "$p" in
    kernels | cache | model) ;;
    *) echo "[bench:all] unknown part '$p' (kernels, cache, model)" >&2; exit 2 ;;
  esac
done
wants() { [[ " ${want[*]} " == *" $1 "* ]]; }

source scripts/env.sh
if [ -n "${XQUANT_BIN:-}" ]; then
  xq=$XQUANT_BIN
else
  bash scripts/setup.sh
  cargo build --quiet --release --bin xquant
  xq=target/release/xquant
fi
[ $# -gt 0 ] || rm -rf "$parts"
mkdir -p "$parts"
rm -f "$out/all.json" "$out/all.md"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
printf '{"cpu": "%s", "cores": %s}\n' "${cpu:-unknown}" "$(nproc)" >"$parts/host.json"

if wants kernels; then
  for dtype in f16 f32; do
    say "kernels ($dtype)"
    "$xq" bench --json --iters "$kernel_iters" --dtype "$dtype" >"$parts/kernels-$dtype.json"
  done
fi
if wants cache; then
  for preset in "${presets[@]}"; do
    say "cache decode steps ($preset)"
    args=()
    [ "$preset" = default ] || args=(--preset "$preset")
    memory=16
    [ "$preset" = default ] && memory=16,64,256,1024,4096,16384
    "$xq" bench-cache --json "${args[@]}" --contexts "$contexts" --steps 5 --prefill 4096 \
      --memory "$memory" >"$parts/cache-$preset.json"
  done
fi
if wants model; then
  model=${XQ_MODEL:-$(bash scripts/fetch-model)}
  say "model prefill and decode (SmolLM2-135M)"
  "$xq" bench-model --json --model "$model" --contexts "$model_contexts" --steps 5 \
    >"$parts/model.json"
fi
missing=()
for name in kernels-f16 kernels-f32 "${presets[@]/#/cache-}" model; do
  [ -s "$parts/$name.json" ] || missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "done: $parts (still missing: ${missing[*]})"
elif command -v node >/dev/null; then
  node scripts/bench-report.mjs "$out" "${presets[@]}"
  say "done: $out/all.json, $out/all.md"
else
  say "done: $parts (no node here: node scripts/bench-report.mjs $out ${presets[*]} makes the report)"
fi
