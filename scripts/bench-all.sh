#!/usr/bin/env bash
# Every benchmark in one command (`npm run bench:all`, release build), on whatever adapter wgpu
# picks (lavapipe here; on a machine with a GPU, WGPU_BACKEND=vulkan picks it through Vulkan):
#   - kernels against a same-run copy kernel and the CPU reference, f16 and f32;
#   - a decode step of a SmolLM2-shaped cache set against the f16 cache, by context, for the
#     default plan and every preset, and GPU memory by token count;
#   - SmolLM2-135M's prefill and decode tokens/s with the default XQuant cache and the f16 one.
# Writes $BENCH_OUT/all.json (every figure, the adapter, the date) and $BENCH_OUT/all.md (the
# tables; also printed). BENCH_OUT defaults to target/bench. Sized to finish within 10
# minutes on 2 CPU cores; BENCH_QUICK=1 runs a smaller set (for checking the script).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
out=${BENCH_OUT:-target/bench}
parts="$out/parts"
rm -rf "$parts"
mkdir -p "$parts"
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

cargo build --quiet --release --bin xquant
xq=target/release/xquant
model=$(bash scripts/fetch-model)

for dtype in f16 f32; do
  say "kernels ($dtype)"
  "$xq" bench --json --iters "$kernel_iters" --dtype "$dtype" >"$parts/kernels-$dtype.json"
done
for preset in "${presets[@]}"; do
  say "cache decode steps ($preset)"
  args=()
  [ "$preset" = default ] || args=(--preset "$preset")
  memory=16
  [ "$preset" = default ] && memory=16,64,256,1024,4096,16384
  "$xq" bench-cache --json "${args[@]}" --contexts "$contexts" --steps 5 --prefill 4096 \
    --memory "$memory" >"$parts/cache-$preset.json"
done
say "model prefill and decode (SmolLM2-135M)"
"$xq" bench-model --json --model "$model" --contexts "$model_contexts" --steps 5 \
  >"$parts/model.json"
node scripts/bench-report.mjs "$out" "${presets[@]}"
say "done: $out/all.json, $out/all.md"
