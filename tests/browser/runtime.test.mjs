// A runtime author's integration, in headless Chromium on WebGPU: the package runs on the
// runtime's own GPUDevice, takes K/V from the runtime's GPUBuffers, attends over its packed
// cache into the runtime's buffers (no host round trip), and leaves the device as it found it.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ATTEND_VS_FETCH_REL } from './tolerances.mjs';
import { appSession, evaluate, openApp } from './harness.mjs';

const app = appSession();

test('decode on the runtime device: GPU in, GPU out, attention equals attention over fetchInto', async () => {
  const { page, errors } = await openApp(app.chrome, app.server.url);
  const r = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const adapter = await navigator.gpu.requestAdapter();
    const device = await adapter.requestDevice();
    const runtimeErrors = [];
    const onError = (e) => runtimeErrors.push(e.error.message);
    device.onuncapturederror = onError;
    const U = GPUBufferUsage;
    const [L, H, D, HQ, PREFILL, STEPS] = [4, 2, 64, 6, 200, 20];
    let seed = 7;
    const rand = (n) =>
      Float32Array.from({ length: n }, () => {
        seed = (seed * 1103515245 + 12345) % 2147483648;
        return (seed / 2147483648) * 4 - 2;
      });
    const buffer = (data, usage = U.STORAGE | U.COPY_DST | U.COPY_SRC) => {
      const b = device.createBuffer({ size: Math.max(256, data.byteLength), usage });
      device.queue.writeBuffer(b, 0, data);
      return b;
    };
    const read = async (b, n) => {
      const staging = device.createBuffer({ size: n * 4, usage: U.MAP_READ | U.COPY_DST });
      const enc = device.createCommandEncoder();
      enc.copyBufferToBuffer(b, 0, staging, 0, n * 4);
      device.queue.submit([enc.finish()]);
      await staging.mapAsync(GPUMapMode.READ);
      const out = new Float32Array(staging.getMappedRange().slice(0));
      staging.destroy();
      return out;
    };

    const xq = await XQuant.create({ device });
    const out = { sameDevice: xq.device === device };
    const caches = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, window: 32, maxCtx: 1024 });

    // Prefill from the runtime's buffers.
    for (let l = 0; l < L; l++) {
      await caches.append(l, buffer(rand(H * PREFILL * D)), buffer(rand(H * PREFILL * D)), PREFILL);
    }
    // Decode: every layer appends one token and attends, without awaiting in between; the
    // runtime then submits its own readback of the outputs, which must run after them.
    const q = Array.from({ length: L }, () => buffer(rand(HQ * D)));
    const o = Array.from({ length: L }, () => buffer(new Float32Array(HQ * D)));
    const k1 = Array.from({ length: L }, () => buffer(rand(H * D)));
    const v1 = Array.from({ length: L }, () => buffer(rand(H * D)));
    const times = [];
    let results;
    for (let s = 0; s < STEPS; s++) {
      for (let l = 0; l < L; l++) {
        device.queue.writeBuffer(k1[l], 0, rand(H * D));
        device.queue.writeBuffer(v1[l], 0, rand(H * D));
        device.queue.writeBuffer(q[l], 0, rand(HQ * D));
      }
      const t0 = performance.now();
      const calls = [];
      for (let l = 0; l < L; l++) {
        calls.push(caches.append(l, k1[l], v1[l], 1));
        calls.push(caches.attendGpu(l, q[l], o[l], { queryHeads: HQ }));
      }
      results = await Promise.all(o.map((b) => read(b, HQ * D)));
      await Promise.all(calls);
      times.push(performance.now() - t0);
    }
    out.times = times;
    out.tokens = caches.tokens(0);
    out.stats = caches.stats().totals;
    out.allocated = xq.allocatedBytes();

    // The same attention, computed here over the cache's reconstruction (fetchInto, f32).
    const n = out.tokens;
    out.worst = 0;
    for (let l = 0; l < L; l++) {
      const kb = buffer(new Float32Array(H * n * D)), vb = buffer(new Float32Array(H * n * D));
      await caches.fetchInto(l, kb, vb);
      const [k, v, qs] = await Promise.all([read(kb, H * n * D), read(vb, H * n * D), read(q[l], HQ * D)]);
      let vmax = 1;
      for (const x of v) vmax = Math.max(vmax, Math.abs(x));
      for (let h = 0; h < HQ; h++) {
        const kv = Math.floor(h / (HQ / H)) * n * D;
        const scores = [];
        for (let j = 0; j < n; j++) {
          let s = 0;
          for (let d = 0; d < D; d++) s += qs[h * D + d] * k[kv + j * D + d];
          scores.push(s / Math.sqrt(D));
        }
        const m = Math.max(...scores);
        const p = scores.map((s) => Math.exp(s - m));
        const sum = p.reduce((a, b) => a + b, 0);
        for (let d = 0; d < D; d++) {
          let acc = 0;
          for (let j = 0; j < n; j++) acc += p[j] * v[kv + j * D + d];
          out.worst = Math.max(out.worst, Math.abs(acc / sum - results[l][h * D + d]) / vmax);
        }
      }
      kb.destroy();
      vb.destroy();
    }

    // Bad buffers are typed errors and change nothing.
    const caught = async (f) => {
      try {
        await f();
        return { threw: false };
      } catch (e) {
        return { threw: true, name: e.name, message: e.message };
      }
    };
    const before = caches.tokens(0);
    const small = buffer(new Float32Array(16));
    out.tooSmall = await caught(() => caches.append(0, small, small, 1));
    const noStorage = device.createBuffer({ size: H * D * 4, usage: U.COPY_DST });
    out.noStorage = await caught(() => caches.append(0, noStorage, noStorage, 1));
    out.misaligned = await caught(() => caches.append(0, k1[0], v1[0], 1, { offset: 4 }));
    out.notBuffer = await caught(() => caches.attendGpu(0, {}, o[0], { queryHeads: HQ }));
    out.noHeads = await caught(() => caches.attendGpu(0, q[0], o[0], {}));
    const dead = buffer(rand(H * D));
    dead.destroy();
    out.destroyed = await caught(() => caches.append(0, dead, dead, 1));
    const other = await (await navigator.gpu.requestAdapter()).requestDevice();
    const foreign = other.createBuffer({ size: 256 * 4, usage: U.STORAGE | U.COPY_DST });
    out.foreign = await caught(() => caches.append(0, foreign, foreign, 1));
    out.unchanged = caches.tokens(0) === before;
    out.stillWorks = await caught(() => caches.append(0, k1[0], v1[0], 1));
    out.afterTokens = caches.tokens(0);

    // The runtime's own errors still reach its own handler, and ours are not blamed on it.
    device.createBuffer({ size: 4, usage: U.MAP_READ | U.STORAGE });
    await device.queue.onSubmittedWorkDone();
    for (let i = 0; i < 50 && runtimeErrors.length === 0; i++) await new Promise((ok) => setTimeout(ok, 100));
    out.handlerKept = device.onuncapturederror === onError;
    out.runtimeErrors = runtimeErrors.length;
    out.afterRuntimeError = await caught(() => caches.attendGpu(0, q[0], o[0], { queryHeads: HQ }));

    caches.free();
    xq.free();
    // The runtime's device outlives the package.
    const check = buffer(new Float32Array([1, 2, 3]));
    out.deviceAlive = Array.from(await read(check, 3));
    other.destroy();
    return out;
  }, undefined, 240000);
  console.log(`  decode steps (4 layers, append + attendGpu each): ${r.times.map((t) => t.toFixed(1)).join(' ')} ms`);
  console.log(`  attention vs attention over fetchInto: worst ${r.worst.toExponential(2)} of max |V|`);
  assert.equal(r.sameDevice, true);
  assert.equal(r.tokens, 220);
  assert.ok(r.worst < ATTEND_VS_FETCH_REL, `fused attention differs from attention over fetchInto: ${r.worst}`);
  assert.ok(r.stats.effectiveBits < 16);
  const typed = (o, name, re) => {
    assert.equal(o.threw, true, `${name} expected`);
    assert.equal(o.name, name, o.message);
    if (re) assert.match(o.message, re);
  };
  typed(r.tooSmall, 'ShapeError', /too small/);
  typed(r.noStorage, 'ConfigError', /STORAGE/);
  typed(r.misaligned, 'ShapeError', /multiple of 256/);
  typed(r.notBuffer, 'ShapeError', /GPUBuffer/);
  typed(r.noHeads, 'ConfigError', /queryHeads/);
  typed(r.destroyed, 'GpuError');
  typed(r.foreign, 'GpuError');
  assert.equal(r.unchanged, true, 'refused calls change nothing');
  assert.equal(r.stillWorks.threw, false, r.stillWorks.message);
  assert.equal(r.afterTokens, 221);
  assert.equal(r.handlerKept, true, "the runtime's onuncapturederror is left alone");
  assert.equal(r.runtimeErrors, 1, "the runtime's own error reaches its handler");
  assert.equal(r.afterRuntimeError.threw, false, r.afterRuntimeError.message);
  assert.deepEqual(r.deviceAlive, [1, 2, 3]);
  assert.deepEqual(errors, []);
});

test('XQuant.create({ gpu: navigator.gpu }) and ({ gpu, device }) work and leave navigator.gpu as it was', async () => {
  const { page, errors } = await openApp(app.chrome, app.server.url);
  const r = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const gpu = navigator.gpu;
    const out = {};
    const own = await XQuant.create({ gpu });
    out.ownBits = (await own.quantizeCodes(new Float32Array(64), [4, 16], 2, 16)).bits;
    own.free();
    const device = await (await gpu.requestAdapter()).requestDevice();
    const shared = await XQuant.create({ gpu, device });
    out.sameDevice = shared.device === device;
    out.sharedBits = (await shared.quantizeCodes(new Float32Array(64), [4, 16], 2, 16)).bits;
    shared.free();
    out.hookLeft = Object.prototype.hasOwnProperty.call(gpu, 'requestAdapter');
    out.gpuOwnKeys = Object.getOwnPropertyNames(navigator);
    out.sameGpu = navigator.gpu === gpu;
    device.destroy();
    return out;
  });
  assert.equal(r.ownBits, 2);
  assert.equal(r.sharedBits, 2);
  assert.equal(r.sameDevice, true);
  assert.equal(r.hookLeft, false);
  assert.deepEqual(r.gpuOwnKeys, []);
  assert.equal(r.sameGpu, true);
  assert.deepEqual(errors, []);
});
