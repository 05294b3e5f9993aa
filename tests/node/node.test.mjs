// The npm package in Node ≥ 20, with the `webgpu` npm package (Dawn) as the GPU: the built
// package (dist/xquant-wgpu, `bash scripts/build-wasm.sh`) loads its wasm from disk, runs a
// cache set on `XQuant.create({ gpu })` and on a shared device (`{ gpu, device }`), and its
// results match what this file computes on the CPU from the inputs.
//
// The GPU and the shared helpers: gpu.mjs.

import { test, before } from 'node:test';
import assert from 'node:assert/strict';
import { ATTEND_VS_FETCH_REL, STATS_REL } from '../browser/tolerances.mjs';
import {
  GPUBufferUsage_COPY_DST,
  GPUBufferUsage_COPY_SRC,
  GPUBufferUsage_STORAGE,
  gpuWithAdapter as gpuOf,
  loadPackage,
  probeGpu,
  random,
  readBuffer,
  skipWithout,
} from './gpu.mjs';

/** Half of one f16 ulp, relative (round to nearest). */
const F16_REL = 2 ** -11;

let pkg;
let webgpu;
/** Why the GPU tests cannot run (null: they can). */
let missing = null;

before(async () => {
  pkg = await loadPackage();
  ({ webgpu, missing } = await probeGpu());
});

/** Skips `t` visibly when there is no GPU, or fails under REQUIRE_GPU=1. Returns whether to go on. */
function gpuOrSkip(t) {
  return skipWithout(t, missing);
}

/** Attention of one query token per head over `[H, n, D]` keys/values, grouped query heads. */
function attentionCpu(q, k, v, { H, HQ, D, n }) {
  const out = new Float32Array(HQ * D);
  for (let h = 0; h < HQ; h++) {
    const kv = Math.floor(h / (HQ / H)) * n * D;
    const scores = new Float64Array(n);
    for (let j = 0; j < n; j++) {
      let s = 0;
      for (let d = 0; d < D; d++) s += q[h * D + d] * k[kv + j * D + d];
      scores[j] = s / Math.sqrt(D);
    }
    const m = Math.max(...scores);
    let sum = 0;
    for (let j = 0; j < n; j++) sum += scores[j] = Math.exp(scores[j] - m);
    for (let d = 0; d < D; d++) {
      let acc = 0;
      for (let j = 0; j < n; j++) acc += scores[j] * v[kv + j * D + d];
      out[h * D + d] = acc / sum;
    }
  }
  return out;
}


test('XQuant.create({ gpu }): a cache set matches the CPU, stats() and free() account for it', async (t) => {
  if (!gpuOrSkip(t)) return;
  const { XQuant, UsageError } = pkg;
  const navigatorBefore = Object.getOwnPropertyDescriptor(globalThis, 'navigator');
  const gpu = await gpuOf(webgpu);
  const t0 = performance.now();
  const xq = await XQuant.create({ gpu });
  const createMs = performance.now() - t0;

  // The globals wgpu looked at during create are as they were (GPU error classes aside).
  assert.equal(globalThis.Window, undefined, 'no Window left behind');
  assert.deepEqual(Object.getOwnPropertyDescriptor(globalThis, 'navigator'), navigatorBefore);
  assert.equal(globalThis.navigator?.gpu, undefined, 'no navigator.gpu left behind');
  assert.equal(Object.hasOwn(gpu, 'requestAdapter'), false, 'the GPU is left as it was');
  const info = xq.adapterInfo;
  console.log(`  adapter: ${info.name} (${info.vendor}/${info.architecture}, fallback ${info.isFallbackAdapter}); create ${createMs.toFixed(0)} ms`);

  const [L, H, D, HQ, W, SINKS, PREFILL, STEPS] = [2, 2, 64, 4, 32, 4, 100, 12];
  // The defaults as a whole: given no quantizer option, kivi-lloyd; given some (the demo's
  // knobs), the others are KIVI-2's; a window that groups of 64 do not divide, KIVI-2's too.
  const entry = (options) => {
    const set = xq.cacheSet({ layers: 1, kvHeads: H, headDim: D, ...options });
    const [{ key, value }] = set.plan().layers;
    set.free();
    return [key.bits, key.axis, value.bits, value.axis, value.levels, value.rotation];
  };
  assert.deepEqual(entry({}), [3, 'tokens', 2, 'channels', 'lloyd-max', 'hadamard']);
  assert.deepEqual(entry({ groupSize: 2, residualBits: 4, valueAxis: 'tokens' }), [2, 'tokens', 2, 'tokens', 'uniform', 'none']);
  assert.deepEqual(entry({ window: W }), [2, 'tokens', 2, 'channels', 'uniform', 'none']);
  assert.deepEqual(entry({ keyBits: 4, valueLevels: 'lloyd-max', valueRotation: 'hadamard', groupQuantSize: 64 }), [4, 'tokens', 2, 'channels', 'lloyd-max', 'hadamard']);
  const caches = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, window: W, sinks: SINKS, maxCtx: 256 });
  const rand = random(11);
  // [H, n, D] inputs per layer, kept here to check against.
  const keys = Array.from({ length: L }, () => []);
  const values = Array.from({ length: L }, () => []);
  const append = (l, k, v, n) => {
    keys[l].push({ data: k, n });
    values[l].push({ data: v, n });
    return caches.append(l, k, v, n);
  };
  /** The layer's inputs as `[H, n, D]`. */
  const gather = (chunks) => {
    const n = chunks.reduce((a, c) => a + c.n, 0);
    const out = new Float32Array(H * n * D);
    let t0 = 0;
    for (const c of chunks) {
      for (let h = 0; h < H; h++) out.set(c.data.subarray(h * c.n * D, (h + 1) * c.n * D), (h * n + t0) * D);
      t0 += c.n;
    }
    return out;
  };

  const tDecode = performance.now();
  for (let l = 0; l < L; l++) await append(l, rand(H * PREFILL * D), rand(H * PREFILL * D), PREFILL);
  let lastQueries;
  let lastOut;
  for (let s = 0; s < STEPS; s++) {
    // A decode step: no await between the calls (each is submitted before it returns).
    const calls = [];
    lastQueries = [];
    for (let l = 0; l < L; l++) {
      calls.push(append(l, rand(H * D), rand(H * D), 1));
      lastQueries.push(rand(HQ * D));
      calls.push(caches.attend(l, lastQueries[l], { queryHeads: HQ }));
    }
    lastOut = (await Promise.all(calls)).filter((r) => r instanceof Float32Array);
  }
  const decodeMs = (performance.now() - tDecode) / STEPS;
  const n = PREFILL + STEPS;
  assert.equal(caches.tokens(0), n);

  const device = xq.device;
  let worstAttend = 0;
  for (let l = 0; l < L; l++) {
    // Every token's reconstruction, into our own GPUBuffers on the context's device.
    const usage = GPUBufferUsage_STORAGE | GPUBufferUsage_COPY_SRC;
    const kb = device.createBuffer({ size: H * n * D * 4, usage });
    const vb = device.createBuffer({ size: H * n * D * 4, usage });
    await caches.fetchInto(l, kb, vb);
    const [k, v] = await Promise.all([readBuffer(device, kb, H * n * D), readBuffer(device, vb, H * n * D)]);
    kb.destroy();
    vb.destroy();

    // Against the inputs: sinks and the window are f16 copies; the rest is 2-bit, off by at
    // most half a step of its group's range (at most the whole tensor's range), plus the
    // rounding of the group's f16 scale and zero.
    for (const [name, got, want] of [['keys', k, gather(keys[l])], ['values', v, gather(values[l])]]) {
      let lo = Infinity;
      let hi = -Infinity;
      for (const x of want) [lo, hi] = [Math.min(lo, x), Math.max(hi, x)];
      const quantBound = ((hi - lo) / 6) * (1 + 1e-3) + 4 * F16_REL * Math.max(-lo, hi);
      let worstQuant = 0;
      for (let h = 0; h < H; h++) {
        for (let j = 0; j < n; j++) {
          const exact = j < SINKS || j >= n - W;
          for (let d = 0; d < D; d++) {
            const i = (h * n + j) * D + d;
            const err = Math.abs(got[i] - want[i]);
            if (exact) {
              assert.ok(err <= F16_REL * Math.abs(want[i]) + 1e-7, `layer ${l} ${name} [${h}, ${j}, ${d}]: ${got[i]} for ${want[i]} (f16 token)`);
            } else {
              worstQuant = Math.max(worstQuant, err);
            }
          }
        }
      }
      assert.ok(worstQuant > 0, `layer ${l} ${name}: the history is quantized`);
      assert.ok(worstQuant <= quantBound, `layer ${l} ${name}: 2-bit error ${worstQuant} > ${quantBound}`);
    }

    // The last step's attention (the query sees every token) against the CPU's over the
    // reconstruction.
    const want = attentionCpu(lastQueries[l], k, v, { H, HQ, D, n });
    let vmax = 1;
    for (const x of v) vmax = Math.max(vmax, Math.abs(x));
    for (let i = 0; i < want.length; i++) worstAttend = Math.max(worstAttend, Math.abs(want[i] - lastOut[l][i]) / vmax);
  }
  console.log(`  decode step (${L} layers, append + attend): ${decodeMs.toFixed(1)} ms; attention vs CPU: worst ${worstAttend.toExponential(2)} of max |V|`);
  assert.ok(worstAttend < ATTEND_VS_FETCH_REL, `attention differs from the CPU's over the reconstruction: ${worstAttend}`);

  // stats(): the layers' tokens, and ratios that follow from the reported bytes.
  const stats = caches.stats();
  assert.equal(stats.layers.length, L);
  for (const layer of stats.layers) {
    assert.equal(layer.tokens, n);
    assert.equal(layer.sinkTokens, SINKS);
    assert.ok(Math.abs(layer.effectiveBits - (16 * layer.accountedBytes) / layer.fp16Bytes) <= STATS_REL * layer.effectiveBits);
  }
  assert.equal(stats.totals.liveTokens, L * n);
  assert.ok(stats.totals.effectiveBits < 16, `effective bits ${stats.totals.effectiveBits}`);
  assert.equal(stats.layers[0].fp16Bytes, H * n * D * 2 * 2, 'fp16 bytes: K and V, 2 bytes each');
  const held = xq.allocatedBytes();
  assert.ok(held >= stats.totals.allocatedBytes && stats.totals.allocatedBytes > 0);

  // free(): the set's buffers go at once; later calls are UsageError.
  caches.free();
  assert.ok(xq.allocatedBytes() < held, `allocated ${xq.allocatedBytes()} after free, ${held} before`);
  await assert.rejects(caches.attend(0, lastQueries[0], { queryHeads: HQ }), UsageError);
  assert.throws(() => caches.stats(), UsageError);
  xq.free();
  assert.throws(() => xq.allocatedBytes(), UsageError);
});

test('XQuant.create({ gpu, device }): a runtime shares its device; GPU errors and device loss are typed', async (t) => {
  if (!gpuOrSkip(t)) return;
  const { XQuant, GpuError, DeviceLostError } = pkg;
  const gpu = await gpuOf(webgpu);
  const device = await (await gpu.requestAdapter()).requestDevice();
  const runtimeErrors = [];
  device.onuncapturederror = (e) => runtimeErrors.push(e.error.message);
  const xq = await XQuant.create({ gpu, device });
  assert.equal(xq.device, device, 'runs on the runtime device');
  assert.equal(Object.hasOwn(gpu, 'requestAdapter'), false, 'the GPU is left as it was');

  const [H, D] = [1, 64];
  const caches = xq.cacheSet({ layers: 1, kvHeads: H, headDim: D, maxCtx: 64 });
  const usage = GPUBufferUsage_STORAGE | GPUBufferUsage_COPY_DST;
  const k = device.createBuffer({ size: 256 * 4, usage });
  const v = device.createBuffer({ size: 256 * 4, usage });
  device.queue.writeBuffer(k, 0, random(3)(256));
  device.queue.writeBuffer(v, 0, random(4)(256));
  await caches.append(0, k, v, 4);
  assert.equal(caches.tokens(0), 4);

  // A destroyed buffer: the GPU refuses the submission (a validation error caught in our
  // error scope, so wgpu must recognize Dawn's GPUValidationError); nothing changes.
  const dead = device.createBuffer({ size: 256 * 4, usage });
  dead.destroy();
  await assert.rejects(caches.append(0, dead, dead, 1), GpuError);
  assert.equal(caches.tokens(0), 4, 'a refused call adds nothing');
  await caches.append(0, k, v, 1);
  assert.equal(caches.tokens(0), 5);
  await device.queue.onSubmittedWorkDone();
  assert.deepEqual(runtimeErrors, [], 'our errors are not blamed on the runtime');

  // Device loss (device.lost): every later GPU call rejects with DeviceLostError.
  device.destroy();
  await assert.rejects(caches.append(0, k, v, 1), DeviceLostError);
  await assert.rejects(xq.quantizeCodes(new Float32Array(64), [4, 16], 2, 16), DeviceLostError);
  assert.equal(caches.tokens(0), 5, 'stats still answer');
  caches.free();
  xq.free();
});

test('without a GPU, XQuant.create() is WebGpuUnavailableError naming the `webgpu` package', async () => {
  const { XQuant, WebGpuUnavailableError, ConfigError } = pkg;
  assert.equal(globalThis.navigator?.gpu, undefined);
  await assert.rejects(XQuant.create(), (e) => {
    assert.ok(e instanceof WebGpuUnavailableError, `${e?.name}: ${e?.message}`);
    assert.match(e.message, /\{ gpu/);
    assert.match(e.message, /`webgpu`/);
    return true;
  });
  await assert.rejects(XQuant.create({ gpu: {} }), ConfigError);
});
