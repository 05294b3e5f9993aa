// A runtime author's integration, in headless Chromium on WebGPU: the package runs on the
// runtime's own GPUDevice, takes K/V from the runtime's GPUBuffers, attends over its packed
// cache into the runtime's buffers (no host round trip), and leaves the device as it found it.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { ATTEND_VS_FETCH_REL } from './tolerances.mjs';
import { appSession, evaluate, openApp } from './harness.mjs';
import { installRuntimeF16 } from './runtime-f16.mjs';

const app = appSession();

/** Page-side helpers of the tests below, installed as `window.runtimeHelpers(device, seed)`:
 * seeded random data, a buffer holding it, a read back, and the worst difference of a
 * layer's attention outputs from attention computed here over the cache's `fetchInto`. */
function installHelpers() {
  window.runtimeHelpers = (device, seed) => {
    const U = GPUBufferUsage;
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
    /** max |out - attention over fetchInto| / max |V| for layer `l` with queries `qBuf`. */
    const worstVsFetch = async (caches, l, { n, H, HQ, D }, qBuf, got) => {
      const kb = buffer(new Float32Array(H * n * D)), vb = buffer(new Float32Array(H * n * D));
      await caches.fetchInto(l, kb, vb);
      const [k, v, qs] = await Promise.all([read(kb, H * n * D), read(vb, H * n * D), read(qBuf, HQ * D)]);
      kb.destroy();
      vb.destroy();
      let vmax = 1;
      for (const x of v) vmax = Math.max(vmax, Math.abs(x));
      let worst = 0;
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
          worst = Math.max(worst, Math.abs(acc / sum - got[h * D + d]) / vmax);
        }
      }
      return worst;
    };
    return { rand, buffer, read, worstVsFetch };
  };
}

/** A page of the test app with the helpers above and a runtime's own f16 cache installed. */
async function openRuntimePage() {
  const opened = await openApp(app.chrome, app.server.url);
  await opened.page.evaluate(installHelpers);
  await opened.page.evaluate(installRuntimeF16);
  return opened;
}

test('decode on the runtime device: GPU in, GPU out, attention equals attention over fetchInto', async () => {
  const { page, errors } = await openRuntimePage();
  const r = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const adapter = await navigator.gpu.requestAdapter();
    const device = await adapter.requestDevice();
    const runtimeErrors = [];
    const onError = (e) => runtimeErrors.push(e.error.message);
    device.onuncapturederror = onError;
    const U = GPUBufferUsage;
    const [L, H, D, HQ, PREFILL, STEPS] = [4, 2, 64, 6, 200, 20];
    const { rand, buffer, read, worstVsFetch } = window.runtimeHelpers(device, 7);

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
      out.worst = Math.max(out.worst, await worstVsFetch(caches, l, { n, H, HQ, D }, q[l], results[l]));
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

// A runtime's decode step as one submission: a SmolLM2-shaped model (30 layers, 3 KV / 9 query
// heads, head dim 64, every layer's K/V at offsets in one arena buffer) records the cache's
// work into its own command encoder between its own passes, next to its own f16 cache (its
// own WGSL: append, split-K attention and combine, bind groups made once;
// tests/browser/runtime-f16.mjs), and submits once per step. A step
// with a destroyed buffer fails on the GPU; the runtime rolls the set back to its checkpoint
// and runs the step again.
test('one submission per decode step: encodeAppend / encodeAttend into the runtime encoder, checkpoint and rollback', async () => {
  const { page, errors } = await openRuntimePage();
  const r = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const adapter = await navigator.gpu.requestAdapter();
    const device = await adapter.requestDevice();
    const runtimeErrors = [];
    device.onuncapturederror = (e) => runtimeErrors.push(e.error.message);
    const U = GPUBufferUsage;
    const [L, H, HQ, D, PREFILL, STEPS, MAX, FAIL_AT] = [30, 3, 9, 64, 160, 32, 256, 12];
    const { rand, buffer, read, worstVsFetch } = window.runtimeHelpers(device, 11);
    const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

    // The runtime's activations: every layer's K/V in one arena buffer (at byte offsets,
    // multiples of 256), queries and outputs per layer.
    const SLOT = Math.ceil((H * PREFILL * D * 4) / 256) * 256;
    const arena = device.createBuffer({ size: 2 * L * SLOT, usage: U.STORAGE | U.COPY_DST });
    const at = (l) => ({ keysOffset: 2 * l * SLOT, valuesOffset: (2 * l + 1) * SLOT });
    const act = Array.from({ length: L }, (_, l) => ({
      k: { buffer: arena, offset: at(l).keysOffset, size: SLOT },
      v: { buffer: arena, offset: at(l).valuesOffset, size: SLOT },
      q: buffer(new Float32Array(HQ * D)),
      o: buffer(new Float32Array(HQ * D)),
      o16: buffer(new Float32Array(HQ * D)),
    }));
    // The runtime's own f16 cache (tests/browser/runtime-f16.mjs: split-K attention).
    const f16 = window.runtimeF16(device, { H, HQ, D, MAX }, act.map((a) => ({ kin: a.k, vin: a.v, q: a.q, o: a.o16 })));
    const f16Step = (n) => f16.step(n);

    const xq = await XQuant.create({ device });
    const caches = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, maxCtx: MAX });
    const out = { appendMs: [], attendMs: [], appendStepMs: [], attendStepMs: [], xqStepMs: [], f16StepMs: [], xqGpuMs: [], f16GpuMs: [] };

    // Prefill: the same K/V into both caches.
    for (let l = 0; l < L; l++) {
      device.queue.writeBuffer(arena, at(l).keysOffset, rand(H * PREFILL * D));
      device.queue.writeBuffer(arena, at(l).valuesOffset, rand(H * PREFILL * D));
      await caches.append(l, arena, arena, PREFILL, at(l));
    }
    f16Step(PREFILL);
    await device.queue.onSubmittedWorkDone();

    const dead = buffer(rand(H * D));
    dead.destroy();
    const xqStep = (keysOf) => {
      const t0 = performance.now();
      const enc = device.createCommandEncoder();
      let [appendSum, attendSum] = [0, 0];
      for (let l = 0; l < L; l++) {
        const a = performance.now();
        const keys = keysOf(l);
        caches.encodeAppend(enc, l, keys ?? arena, arena, 1, keys ? { valuesOffset: at(l).valuesOffset } : at(l));
        const b = performance.now();
        caches.encodeAttend(enc, l, act[l].q, act[l].o, { queryHeads: HQ });
        out.appendMs.push(b - a);
        out.attendMs.push(performance.now() - b);
        appendSum += b - a;
        attendSum += performance.now() - b;
      }
      out.appendStepMs.push(appendSum / L);
      out.attendStepMs.push(attendSum / L);
      device.queue.submit([enc.finish()]);
      return performance.now() - t0;
    };
    for (let s = 0; s < STEPS; s++) {
      for (let l = 0; l < L; l++) {
        device.queue.writeBuffer(arena, at(l).keysOffset, rand(H * D));
        device.queue.writeBuffer(arena, at(l).valuesOffset, rand(H * D));
        device.queue.writeBuffer(act[l].q, 0, rand(HQ * D));
      }
      if (s === FAIL_AT) {
        // One layer's keys are a destroyed buffer: the submission fails as a whole.
        const cp = caches.checkpoint();
        out.tokensBefore = Array.from({ length: L }, (_, l) => caches.tokens(l));
        out.bytesBefore = caches.stats().totals.allocatedBytes;
        device.pushErrorScope('validation');
        xqStep((l) => (l === L / 2 ? dead : null));
        const failure = await device.popErrorScope();
        out.failed = failure !== null;
        out.tokensDuring = caches.tokens(L - 1);
        caches.rollback(cp);
        out.tokensAfter = Array.from({ length: L }, (_, l) => caches.tokens(l));
        out.bytesAfter = caches.stats().totals.allocatedBytes;
      }
      const cp = caches.checkpoint();
      let t = performance.now();
      out.xqStepMs.push(xqStep(() => null));
      await device.queue.onSubmittedWorkDone();
      out.xqGpuMs.push(performance.now() - t);
      cp.free();
      t = performance.now();
      out.f16StepMs.push(f16Step(1));
      await device.queue.onSubmittedWorkDone();
      out.f16GpuMs.push(performance.now() - t);
    }
    out.tokens = caches.tokens(0);

    // The last step's outputs against attention over fetchInto (f32), a few layers.
    const n = out.tokens;
    out.worst = 0;
    for (const l of [0, L / 2, L - 1]) {
      const got = await read(act[l].o, HQ * D);
      out.worst = Math.max(out.worst, await worstVsFetch(caches, l, { n, H, HQ, D }, act[l].q, got));
    }
    // A refused call throws at once, typed, and records nothing.
    const throws = (f) => {
      try {
        f();
        return { threw: false };
      } catch (e) {
        return { threw: true, name: e.name, message: e.message };
      }
    };
    const enc = device.createCommandEncoder();
    const before = caches.tokens(0);
    out.notEncoder = throws(() => caches.encodeAppend({}, 0, arena, arena, 1, at(0)));
    out.hostArrays = throws(() => caches.encodeAppend(enc, 0, rand(H * D), rand(H * D), 1));
    out.badOption = throws(() => caches.encodeAttend(enc, 0, act[0].q, act[0].o, { queryHeads: HQ, layuot: 'heads' }));
    out.overBudget = throws(() => caches.encodeAppend(enc, 0, arena, arena, MAX - 150, at(0)));
    out.unchanged = caches.tokens(0) === before;
    const other = xq.cacheSet({ layers: L, kvHeads: H, headDim: D, maxCtx: MAX });
    const foreign = other.checkpoint();
    out.foreignCheckpoint = throws(() => caches.rollback(foreign));
    foreign.free();
    other.free();
    const used = caches.checkpoint();
    caches.rollback(used);
    out.usedTwice = throws(() => caches.rollback(used));
    device.queue.submit([enc.finish()]);
    await device.queue.onSubmittedWorkDone();
    out.runtimeErrors = runtimeErrors;
    const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
    out.median = {
      // performance.now() is coarse in a page that is not cross-origin isolated (100 µs in
      // Chromium): per-call figures are means over every call, and a step's JS time / 60.
      append: mean(out.appendMs),
      attend: mean(out.attendMs),
      appendPerStep: median(out.appendStepMs),
      attendPerStep: median(out.attendStepMs),
      xqStep: median(out.xqStepMs),
      f16Step: median(out.f16StepMs),
      xqGpu: median(out.xqGpuMs),
      f16Gpu: median(out.f16GpuMs),
    };
    caches.free();
    xq.free();
    device.destroy();
    return out;
  }, undefined, 600000);
  const m = r.median;
  console.log(
    `  JS per call: encodeAppend ${m.appendPerStep.toFixed(3)} ms, encodeAttend ${m.attendPerStep.toFixed(3)} ms (median over steps of a step's calls / 30; ` +
      `means over all ${r.appendMs.length} calls each ${m.append.toFixed(3)} / ${m.attend.toFixed(3)} ms), ` +
      `a median step's JS / 60 calls ${(m.xqStep / 60).toFixed(3)} ms; ` +
      `JS per step (30 layers, median): XQuant ${m.xqStep.toFixed(2)} ms, the runtime's own f16 cache ${m.f16Step.toFixed(2)} ms; ` +
      `step to completion: XQuant ${m.xqGpu.toFixed(1)} ms, f16 ${m.f16Gpu.toFixed(1)} ms`,
  );
  console.log(`  attention vs attention over fetchInto after the steps: worst ${r.worst.toExponential(2)} of max |V|`);
  assert.equal(r.failed, true, 'the step with a destroyed buffer fails on the GPU');
  assert.equal(r.tokensDuring, 160 + 12 + 1, 'the set counted the recorded step');
  assert.deepEqual(r.tokensAfter, r.tokensBefore, 'rollback puts every layer back');
  assert.equal(r.bytesAfter, r.bytesBefore);
  assert.equal(r.tokens, 160 + 32);
  assert.ok(r.worst < ATTEND_VS_FETCH_REL, `attention differs from attention over fetchInto: ${r.worst}`);
  const typed = (o, name, re) => {
    assert.equal(o.threw, true, `${name} expected`);
    assert.equal(o.name, name, o.message);
    if (re) assert.match(o.message, re);
  };
  typed(r.notEncoder, 'ShapeError', /GPUCommandEncoder/);
  typed(r.hostArrays, 'ShapeError', /GPUBuffers/);
  typed(r.badOption, 'ConfigError', /layuot/);
  typed(r.overBudget, 'ContextBudgetError');
  assert.equal(r.unchanged, true, 'refused calls record nothing');
  typed(r.foreignCheckpoint, 'UsageError', /another cache set/);
  typed(r.usedTwice, 'UsageError', /freed/);
  assert.deepEqual(r.runtimeErrors, [], "the runtime's handler saw no error (the failed step was in its scope)");
  assert.deepEqual(errors, []);
});

// A token-major runtime ([batch, tokens, heads, headDim], as its projections write them) hands
// its K/V and queries over as they are: a set fed token-major inputs (GPUBuffers at offsets
// through `encodeAppend`/`append`, typed arrays through `append`, queries through
// `attendGpu`/`encodeAttend` with `queryLayout: 'tokens'`) holds and attends exactly what a set
// fed the same values heads-major does, bit for bit.
test('token-major K/V and queries: the same cache and attention as heads-major inputs', async () => {
  const { page, errors } = await openRuntimePage();
  const r = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const adapter = await navigator.gpu.requestAdapter();
    const device = await adapter.requestDevice();
    const [H, HQ, D, PREFILL, CHUNK, T] = [3, 9, 63, 180, 24, 5];
    const { rand, buffer, read } = window.runtimeHelpers(device, 23);
    // [heads, tokens, D] → [tokens, heads, D]
    const toTokens = (x, heads, tokens) => {
      const y = new Float32Array(x.length);
      for (let h = 0; h < heads; h++)
        for (let t = 0; t < tokens; t++) y.set(x.subarray((h * tokens + t) * D, (h * tokens + t + 1) * D), (t * heads + h) * D);
      return y;
    };
    // At byte 512 of a larger buffer, as in a runtime's arena.
    const atOffset = (x) => {
      const b = buffer(new Float32Array(128 + x.length));
      device.queue.writeBuffer(b, 512, x);
      return b;
    };
    const xq = await XQuant.create({ device });
    const opts = { layers: 1, kvHeads: H, headDim: D, window: 32, sinks: 4, maxCtx: 512 };
    const [heads, tokens] = [xq.cacheSet(opts), xq.cacheSet(opts)];
    // Prefill: typed arrays.
    const [k0, v0] = [rand(H * PREFILL * D), rand(H * PREFILL * D)];
    await heads.append(0, k0, v0, PREFILL);
    await tokens.append(0, toTokens(k0, H, PREFILL), toTokens(v0, H, PREFILL), PREFILL, { layout: 'tokens' });
    // A chunk from GPUBuffers at an offset through the promise call, then one recorded.
    for (const recorded of [false, true]) {
      const [k, v] = [rand(H * CHUNK * D), rand(H * CHUNK * D)];
      const [kt, vt] = [atOffset(toTokens(k, H, CHUNK)), atOffset(toTokens(v, H, CHUNK))];
      const o = { layout: 'tokens', offset: 512 };
      if (recorded) {
        const enc = device.createCommandEncoder();
        heads.encodeAppend(enc, 0, buffer(k), buffer(v), CHUNK);
        tokens.encodeAppend(enc, 0, kt, vt, CHUNK, o);
        device.queue.submit([enc.finish()]);
      } else {
        await heads.append(0, buffer(k), buffer(v), CHUNK);
        await tokens.append(0, kt, vt, CHUNK, o);
      }
    }
    // A decode step: one token (both layouts are the same bytes) and one query.
    const [k1, v1, q1] = [rand(H * D), rand(H * D), rand(HQ * D)];
    const [o1h, o1t] = [buffer(new Float32Array(HQ * D)), buffer(new Float32Array(HQ * D))];
    const step = device.createCommandEncoder();
    heads.encodeAppend(step, 0, buffer(k1), buffer(v1), 1);
    heads.encodeAttend(step, 0, buffer(q1), o1h, { queryHeads: HQ });
    tokens.encodeAppend(step, 0, atOffset(k1), atOffset(v1), 1, { layout: 'tokens', offset: 512 });
    tokens.encodeAttend(step, 0, atOffset(q1), o1t, { queryHeads: HQ, queryLayout: 'tokens', offset: 512 });
    device.queue.submit([step.finish()]);
    const n = tokens.tokens(0);
    const fetch = async (c) => {
      const [kb, vb] = [buffer(new Float32Array(H * n * D)), buffer(new Float32Array(H * n * D))];
      await c.fetchInto(0, kb, vb);
      return [...(await read(kb, H * n * D)), ...(await read(vb, H * n * D))];
    };
    const same = (a, b) => a.length === b.length && a.every((x, i) => Object.is(x, b[i]));
    const out = { n, sameCache: same(await fetch(heads), await fetch(tokens)) };
    out.sameDecode = same(await read(o1h, HQ * D), await read(o1t, HQ * D));
    // T queries: heads-major vs token-major, both written token-major.
    const q = rand(HQ * T * D);
    const qt = atOffset(toTokens(q, HQ, T));
    const [oh, ot, or] = [0, 1, 2].map(() => buffer(new Float32Array(HQ * T * D)));
    const a = { queryHeads: HQ, tokens: T, layout: 'tokens' };
    await heads.attendGpu(0, buffer(q), oh, a);
    await tokens.attendGpu(0, qt, ot, { ...a, queryLayout: 'tokens', offset: 512 });
    const enc = device.createCommandEncoder();
    tokens.encodeAttend(enc, 0, qt, or, { ...a, queryLayout: 'tokens', offset: 512 });
    device.queue.submit([enc.finish()]);
    const [gh, gt, gr] = [await read(oh, HQ * T * D), await read(ot, HQ * T * D), await read(or, HQ * T * D)];
    out.sameAttend = same(gh, gt) && same(gh, gr);
    out.nonZero = gh.some((x) => x !== 0);
    const host = await tokens.attend(0, toTokens(q, HQ, T), { ...a, queryLayout: 'tokens' });
    out.sameHost = same(gh, host);
    try {
      await tokens.append(0, rand(H * 2 * D), rand(H * 2 * D), 2, { layout: 'token' });
      out.badLayout = null;
    } catch (e) {
      out.badLayout = { name: e.name, message: e.message };
    }
    out.unchanged = tokens.tokens(0) === n;
    heads.free();
    tokens.free();
    xq.free();
    device.destroy();
    return out;
  });
  assert.equal(r.n, 180 + 2 * 24 + 1);
  assert.equal(r.sameDecode, true, 'a one-token step reads token-major inputs as they are');
  assert.equal(r.sameCache, true, 'the token-major set holds the same K/V');
  assert.equal(r.nonZero, true);
  assert.equal(r.sameAttend, true, 'token-major queries attend as heads-major ones (attendGpu and encodeAttend)');
  assert.equal(r.sameHost, true, 'host token-major queries too');
  assert.equal(r.badLayout?.name, 'ConfigError', JSON.stringify(r.badLayout));
  assert.match(r.badLayout.message, /layout/);
  assert.equal(r.unchanged, true);
  assert.deepEqual(errors, []);
});
