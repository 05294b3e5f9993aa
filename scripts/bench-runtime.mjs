// A runtime's decode step in headless Chromium on WebGPU (SwiftShader where there is no GPU),
// through the npm package's documented API (`npm run bench:runtime`): a SmolLM2-shaped model
// (30 layers, 3 KV / 9 query heads, head dim 64, K/V and queries in the runtime's own
// buffers) at BENCH_CONTEXTS tokens (default 1024), one submission per step. The default
// XQuant cache records `encodeAppend` + `encodeAttend` per layer into the runtime's encoder;
// the runtime's own f16 cache is its own WGSL: an append kernel and a split-K attention
// (chunks of 256 tokens, then a combine), bind groups made once. BENCH_STEPS steps (default
// 12) per context, XQuant and f16 alternating, after 2 warm-up steps of each; the medians of
// main-thread JS time per step (recording) and of GPU time per step (submit to
// onSubmittedWorkDone). Prints one JSON object. Needs the built package (`npm run build`).

import { browser } from '../tests/browser/harness.mjs';
import { serveDemo } from './serve.mjs';

const contexts = (process.env.BENCH_CONTEXTS || '1024').split(',').map(Number);
const steps = Number(process.env.BENCH_STEPS || 12);

const server = await serveDemo(0, { model: null });
const chrome = await browser();
try {
  const page = await chrome.newPage();
  await page.goto(server.url);
  const result = await page.evaluate(
    async ({ contexts, steps }) => {
      const { XQuant } = await import('/pkg/index.js');
      const adapter = await navigator.gpu.requestAdapter();
      const device = await adapter.requestDevice();
      const U = GPUBufferUsage;
      const [L, H, HQ, D, CHUNK] = [30, 3, 9, 64, 256];
      const MAX = Math.max(...contexts) + 2 * (steps + 2) + 8;
      const CHUNKS = Math.ceil(MAX / CHUNK);
      let seed = 5;
      const rand = (n) =>
        Float32Array.from({ length: n }, () => {
          seed = (seed * 1103515245 + 12345) % 2147483648;
          return (seed / 2147483648) * 4 - 2;
        });
      const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

      // The runtime's f16 cache: [H, MAX, D / 2] f16 pairs per layer and side.
      const module = device.createShaderModule({
        code: `
struct P { len: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> kin: array<f32>;
@group(0) @binding(2) var<storage, read> vin: array<f32>;
@group(0) @binding(3) var<storage, read_write> kc: array<u32>;
@group(0) @binding(4) var<storage, read_write> vc: array<u32>;
@group(0) @binding(5) var<storage, read> q: array<f32>;
@group(0) @binding(6) var<storage, read_write> part: array<f32>;  // [HQ, CHUNKS, 2 + D]
@group(0) @binding(7) var<storage, read_write> o: array<f32>;
const H = ${H}u; const HQ = ${HQ}u; const D = ${D}u; const MAX = ${MAX}u;
const CHUNK = ${CHUNK}u; const CHUNKS = ${CHUNKS}u;
var<workgroup> s: array<f32, CHUNK>;
var<workgroup> qs: array<f32, D>;
@compute @workgroup_size(64)
fn append(@builtin(global_invocation_id) id: vec3<u32>) {
  let i = id.x;
  if i >= H * p.n * (D / 2u) { return; }
  let pair = i % (D / 2u);
  let t = (i / (D / 2u)) % p.n;
  let h = i / (p.n * (D / 2u));
  let src = (h * p.n + t) * D + 2u * pair;
  let dst = (h * MAX + p.len + t) * (D / 2u) + pair;
  kc[dst] = pack2x16float(vec2<f32>(kin[src], kin[src + 1u]));
  vc[dst] = pack2x16float(vec2<f32>(vin[src], vin[src + 1u]));
}
// One workgroup per (query head, chunk of CHUNK tokens): scores, the chunk's max and sum,
// and its weighted value sum per channel.
@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let hq = wg.x;
  let c = wg.y;
  let h = hq / (HQ / H);
  let n = p.len + p.n;
  let j0 = c * CHUNK;
  let at = (hq * CHUNKS + c) * (2u + D);
  if j0 >= n {
    if lid == 0u { part[at] = -3.0e38; part[at + 1u] = 0.0; }
    part[at + 2u + lid] = 0.0;
    return;
  }
  let m_tokens = min(CHUNK, n - j0);
  qs[lid] = q[hq * D + lid];
  workgroupBarrier();
  for (var j = lid; j < m_tokens; j += 64u) {
    let row = (h * MAX + j0 + j) * (D / 2u);
    var acc = vec2<f32>(0.0);
    for (var d = 0u; d < D / 2u; d++) {
      acc += unpack2x16float(kc[row + d]) * vec2<f32>(qs[2u * d], qs[2u * d + 1u]);
    }
    s[j] = (acc.x + acc.y) / sqrt(f32(D));
  }
  workgroupBarrier();
  var m = -3.0e38;
  for (var j = 0u; j < m_tokens; j++) { m = max(m, s[j]); }
  var l = 0.0;
  var acc = 0.0;
  for (var j = 0u; j < m_tokens; j++) {
    let e = exp(s[j] - m);
    l += e;
    let v = unpack2x16float(vc[(h * MAX + j0 + j) * (D / 2u) + lid / 2u]);
    acc += e * select(v.x, v.y, lid % 2u == 1u);
  }
  if lid == 0u { part[at] = m; part[at + 1u] = l; }
  part[at + 2u + lid] = acc;
}
@compute @workgroup_size(64)
fn combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let hq = wg.x;
  let chunks = (p.len + p.n + CHUNK - 1u) / CHUNK;
  var m = -3.0e38;
  for (var c = 0u; c < chunks; c++) { m = max(m, part[(hq * CHUNKS + c) * (2u + D)]); }
  var l = 0.0;
  var acc = 0.0;
  for (var c = 0u; c < chunks; c++) {
    let at = (hq * CHUNKS + c) * (2u + D);
    let w = exp(part[at] - m);
    l += w * part[at + 1u];
    acc += w * part[at + 2u + lid];
  }
  o[hq * D + lid] = acc / l;
}`,
      });
      const pipe = (entryPoint) => device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint } });
      const [appendPipe, attendPipe, combinePipe] = ['append', 'attend', 'combine'].map(pipe);
      const params = device.createBuffer({ size: 16, usage: U.UNIFORM | U.COPY_DST });
      const storage = (bytes) => device.createBuffer({ size: Math.max(256, bytes), usage: U.STORAGE | U.COPY_DST });
      const SLOT = Math.ceil((H * Math.max(...contexts) * D * 4) / 256) * 256;
      const arena = storage(2 * L * SLOT);
      const at = (l) => ({ keysOffset: 2 * l * SLOT, valuesOffset: (2 * l + 1) * SLOT });
      const layers = Array.from({ length: L }, (_, l) => ({
        k: storage(H * MAX * D * 2),
        v: storage(H * MAX * D * 2),
        q: storage(HQ * D * 4),
        o: storage(HQ * D * 4),
        part: storage(HQ * CHUNKS * (2 + D) * 4),
        kin: { buffer: arena, offset: at(l).keysOffset, size: SLOT },
        vin: { buffer: arena, offset: at(l).valuesOffset, size: SLOT },
      }));
      const bind = layers.map((x) => [
        device.createBindGroup({
          layout: appendPipe.getBindGroupLayout(0),
          entries: [{ buffer: params }, x.kin, x.vin, { buffer: x.k }, { buffer: x.v }].map((resource, binding) => ({ binding, resource })),
        }),
        device.createBindGroup({
          layout: attendPipe.getBindGroupLayout(0),
          entries: [params, x.k, x.v, x.q, x.part].map((buffer, i) => ({ binding: [0, 3, 4, 5, 6][i], resource: { buffer } })),
        }),
        device.createBindGroup({
          layout: combinePipe.getBindGroupLayout(0),
          entries: [params, x.part, x.o].map((buffer, i) => ({ binding: [0, 6, 7][i], resource: { buffer } })),
        }),
      ]);

      const xq = await XQuant.create({ device });
      const rows = [];
      for (const context of contexts) {
        const caches = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, maxCtx: MAX });
        let f16Len = 0;
        const f16Step = (n) => {
          device.queue.writeBuffer(params, 0, new Uint32Array([f16Len, n]));
          const t0 = performance.now();
          const enc = device.createCommandEncoder();
          for (let l = 0; l < L; l++) {
            const pass = enc.beginComputePass();
            pass.setPipeline(appendPipe);
            pass.setBindGroup(0, bind[l][0]);
            pass.dispatchWorkgroups(Math.ceil((H * n * D) / 2 / 64));
            pass.setPipeline(attendPipe);
            pass.setBindGroup(0, bind[l][1]);
            pass.dispatchWorkgroups(HQ, CHUNKS);
            pass.setPipeline(combinePipe);
            pass.setBindGroup(0, bind[l][2]);
            pass.dispatchWorkgroups(HQ);
            pass.end();
          }
          device.queue.submit([enc.finish()]);
          f16Len += n;
          return performance.now() - t0;
        };
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
