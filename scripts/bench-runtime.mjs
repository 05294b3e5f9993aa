// A runtime's decode step in headless Chromium on WebGPU (SwiftShader where there is no GPU),
// through the npm package's documented API (`npm run bench:runtime`): a SmolLM2-shaped model
// (30 layers, 3 KV / 9 query heads, head dim 64, K/V and queries in the runtime's own
// buffers) at BENCH_CONTEXTS tokens (default 1024), one submission per step. The default
// XQuant cache records `encodeAppend` + `encodeAttend` per layer into the runtime's encoder;
// the runtime's own f16 cache is its own WGSL (tests/browser/runtime-f16.mjs: an append
// kernel and a split-K attention in chunks of 256 tokens, then a combine; bind groups made
// once). BENCH_STEPS steps (default
// 12) per context, XQuant and f16 alternating, after 2 warm-up steps of each; the medians of
// main-thread JS time per step (recording) and of GPU time per step (submit to
// onSubmittedWorkDone). Prints one JSON object. Needs the built package (`npm run build`).

import { browser } from '../tests/browser/harness.mjs';
import { installRuntimeF16 } from '../tests/browser/runtime-f16.mjs';
import { serveDemo } from './serve.mjs';

const contexts = (process.env.BENCH_CONTEXTS || '1024').split(',').map(Number);
const steps = Number(process.env.BENCH_STEPS || 12);

const server = await serveDemo(0, { model: null, gemma: null });
const chrome = await browser();
try {
  const page = await chrome.newPage();
  await page.goto(server.url);
  await page.evaluate(installRuntimeF16);
  const result = await page.evaluate(
    async ({ contexts, steps }) => {
      const { XQuant } = await import('/pkg/index.js');
      const adapter = await navigator.gpu.requestAdapter();
      const device = await adapter.requestDevice();
      const U = GPUBufferUsage;
      const [L, H, HQ, D] = [30, 3, 9, 64];
      const MAX = Math.max(...contexts) + 2 * (steps + 2) + 8;
      let seed = 5;
      const rand = (n) =>
        Float32Array.from({ length: n }, () => {
          seed = (seed * 1103515245 + 12345) % 2147483648;
          return (seed / 2147483648) * 4 - 2;
        });
      const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

      const storage = (bytes) => device.createBuffer({ size: Math.max(256, bytes), usage: U.STORAGE | U.COPY_DST });
      const SLOT = Math.ceil((H * Math.max(...contexts) * D * 4) / 256) * 256;
      const arena = storage(2 * L * SLOT);
      const at = (l) => ({ keysOffset: 2 * l * SLOT, valuesOffset: (2 * l + 1) * SLOT });
      const layers = Array.from({ length: L }, (_, l) => ({
        q: storage(HQ * D * 4),
        o: storage(HQ * D * 4),
        f16Out: storage(HQ * D * 4),
        kin: { buffer: arena, offset: at(l).keysOffset, size: SLOT },
        vin: { buffer: arena, offset: at(l).valuesOffset, size: SLOT },
      }));

      const xq = await XQuant.create({ device });
      const rows = [];
      for (const context of contexts) {
        const caches = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, maxCtx: MAX });
        const f16 = window.runtimeF16(device, { H, HQ, D, MAX }, layers.map((x) => ({ ...x, o: x.f16Out })));
        const f16Step = (n) => f16.step(n);
        const xqStep = () => {
          const t0 = performance.now();
          const enc = device.createCommandEncoder();
          for (let l = 0; l < L; l++) {
            caches.encodeAppend(enc, l, arena, arena, 1, at(l));
            caches.encodeAttend(enc, l, layers[l].q, layers[l].o, { queryHeads: HQ });
          }
          device.queue.submit([enc.finish()]);
          return performance.now() - t0;
        };
        // The context: the same K/V into both caches (the f16 cache's append reads the arena
        // as [H, n, D] for n tokens, as the package does).
        for (let l = 0; l < L; l++) {
          device.queue.writeBuffer(arena, at(l).keysOffset, rand(H * context * D));
          device.queue.writeBuffer(arena, at(l).valuesOffset, rand(H * context * D));
          device.queue.writeBuffer(layers[l].q, 0, rand(HQ * D));
          await caches.append(l, arena, arena, context, at(l));
        }
        f16Step(context);
        await device.queue.onSubmittedWorkDone();
        const js = { xquant: [], f16: [] };
        const gpu = { xquant: [], f16: [] };
        for (let s = 0; s < steps + 2; s++) {
          for (const [name, step] of [['xquant', xqStep], ['f16', () => f16Step(1)]]) {
            const t = performance.now();
            const ms = step();
            await device.queue.onSubmittedWorkDone();
            if (s >= 2) {
              js[name].push(ms);
              gpu[name].push(performance.now() - t);
            }
          }
        }
        const stats = caches.stats().totals;
        rows.push({
          context,
          xquantJsMs: median(js.xquant),
          f16JsMs: median(js.f16),
          xquantStepMs: median(gpu.xquant),
          f16StepMs: median(gpu.f16),
          stepRatio: median(gpu.xquant.map((x, i) => x / gpu.f16[i])),
          xquantKvBytes: stats.allocatedBytes,
          f16KvBytes: 2 * L * H * (context + steps + 2) * D * 2,
        });
        caches.free();
      }
      const info = xq.adapterInfo;
      xq.free();
      device.destroy();
      return { adapter: info, rows };
    },
    { contexts, steps },
  );
  console.log(JSON.stringify({ date: new Date().toISOString().slice(0, 10), steps, ...result }, null, 2));
} finally {
  await chrome.close();
  server.close();
}
