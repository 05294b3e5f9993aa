// What a runtime author relies on: option errors in the API's own names, refused calls that
// change nothing, good manners on a shared GPUDevice, reset()/free() while calls are in
// flight, stats that add up, device loss as DeviceLostError, and a retryable ready().

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { appSession, evaluate, openApp } from './harness.mjs';
import { STATS_REL } from './tolerances.mjs';

const app = appSession();

/** In the page: `caught(f)` → { threw, name, message, typed } of `await f()`. */
const HELPERS = `
  window.caught = async (f) => {
    try {
      await f();
      return { threw: false };
    } catch (e) {
      return { threw: true, name: e?.name, message: String(e?.message), typed: e instanceof window.xquant.XQuantError };
    }
  };
`;

async function page() {
  const opened = await openApp(app.chrome, app.server.url);
  await opened.page.evaluate(HELPERS);
  return opened;
}

function typed(o, name, re, label = name) {
  assert.equal(o?.threw, true, `${label}: ${name} expected, got ${JSON.stringify(o)}`);
  assert.equal(o.name, name, `${label}: ${o.message}`);
  assert.equal(o.typed, true, `${name} is an XQuantError`);
  if (re) assert.match(o.message, re);
}

test('option typos and wrong types are ConfigErrors naming the option as documented', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const xq = await XQuant.create();
    const base = { layers: 2, kvHeads: 1, headDim: 8 };
    const set = (o) => caught(() => xq.cacheSet({ ...base, ...o }));
    const caches = xq.cacheSet({ ...base, window: 8, groupQuantSize: 8 });
    const x = new Float32Array(8);
    const r = {
      residualbits: await set({ residualbits: 2 }),
      maxCTX: await set({ maxCTX: 64 }),
      kvHeadz: await caught(() => xq.cacheSet({ layers: 2, kvHeadz: 1, headDim: 8 })),
      maxCtxString: await set({ maxCtx: '1' }),
      windowFraction: await set({ window: 1.5 }),
      negative: await set({ sinks: -4 }),
      nanEta: await set({ eta: NaN }),
      badAxis: await set({ valueAxis: 'rows' }),
      badPlan: await set({ plan: 42 }),
      notObject: await caught(() => xq.cacheSet(5)),
      headDim0: await caught(() => xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 0 })),
      huge: await set({ maxCtx: 2 ** 40 }),
      groupQuantSize0: await set({ groupQuantSize: 0 }),
      pageTokens7: await set({ pageTokens: 7, groupQuantSize: 8, window: 8 }),
      windowNotMultiple: await set({ window: 12, groupQuantSize: 8 }),
      bitsString: await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], '2', 4)),
      quantTypo: await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 4, { valueaxis: 'tokens' })),
      dequantTypo: await caught(() => xq.dequantWithParams({}, undefined, { outdtype: 'f16' })),
      analyzeTypo: await caught(() => xq.analyzeKv(new Uint8Array(8), { groupsize: 2 })),
      suggestType: await caught(() => xq.suggestPlan(new Uint8Array(8), { targetBits: '3' })),
      appendTypo: await caught(() => caches.append(0, x, x, 1, { ofset: 0 })),
      attendTypo: await caught(() => caches.attend(0, x, { queryheads: 1 })),
      attendTokens: await caught(() => caches.attend(0, x, { queryHeads: 1, tokens: '1' })),
      fetchTypo: await caught(() => caches.fetchInto(0, x, x, { dtyp: 'f32' })),
      layerString: await caught(() => caches.append('0', x, x, 1)),
      createTypo: await caught(() => XQuant.create({ powerpreference: 'low-power' })),
      createDevice: await caught(() => XQuant.create({ device: 5 })),
      createNull: await caught(() => XQuant.create(null)),
      fine: await caught(() => caches.append(0, x, x, 1, {})),
    };
    // Options an object inherits are read as a property access reads them (a literal's own
    // are read at once): the same attention, and the same checks.
    const plain = await caches.attend(0, x, { queryHeads: 1 });
    const inherited = await caches.attend(0, x, Object.create({ queryHeads: 1 }));
    r.inheritedSame = { threw: false, same: plain.length === 8 && plain.every((v, i) => Object.is(v, inherited[i])) };
    r.inheritedWrong = await caught(() => caches.attend(0, x, Object.create({ queryHeads: '1' })));
    r.getterThrows = await caught(() => caches.attend(0, x, { get queryHeads() { throw new Error('boom'); } }));
    caches.free();
    xq.free();
    return r;
  });
  typed(r.residualbits, 'ConfigError', /cacheSet: unknown option `residualbits` \(did you mean `residualBits`\?\)/);
  typed(r.maxCTX, 'ConfigError', /unknown option `maxCTX` \(did you mean `maxCtx`\?\)/);
  typed(r.kvHeadz, 'ConfigError', /unknown option `kvHeadz` \(did you mean `kvHeads`\?\)/);
  typed(r.maxCtxString, 'ConfigError');
  assert.equal(r.maxCtxString.message, 'cacheSet option `maxCtx`: expected a non-negative integer, got the string "1"');
  typed(r.windowFraction, 'ConfigError', /option `window`: expected a non-negative integer, got 1\.5/);
  typed(r.negative, 'ConfigError', /option `sinks`: .* got -4/);
  typed(r.nanEta, 'ConfigError', /option `eta`: expected a finite number, got NaN/);
  typed(r.badAxis, 'ConfigError', /option `valueAxis`: expected 'tokens' or 'channels', got the string "rows"/);
  typed(r.badPlan, 'ConfigError', /option `plan`/);
  typed(r.notObject, 'ConfigError', /options must be an object/);
  typed(r.headDim0, 'ConfigError', /headDim/);
  typed(r.huge, 'ConfigError', /maxCtx/);
  typed(r.groupQuantSize0, 'ConfigError', /groupQuantSize/);
  typed(r.pageTokens7, 'ConfigError', /pageTokens \(7\).*groupQuantSize/);
  typed(r.windowNotMultiple, 'ConfigError', /window \(12\).*groupQuantSize/);
  typed(r.bitsString, 'ConfigError', /`bits`.*the string "2"/);
  typed(r.quantTypo, 'ConfigError', /quantizeCodes: unknown option `valueaxis` \(did you mean `valueAxis`\?\)/);
  typed(r.dequantTypo, 'ConfigError', /did you mean `outDtype`/);
  typed(r.analyzeTypo, 'ConfigError', /analyzeKv: unknown option `groupsize`/);
  typed(r.suggestType, 'ConfigError', /suggestPlan option `targetBits`: expected a finite number, got the string "3"/);
  typed(r.appendTypo, 'ConfigError', /did you mean `offset`/);
  typed(r.attendTypo, 'ConfigError', /did you mean `queryHeads`/);
  typed(r.attendTokens, 'ConfigError', /attend option `tokens`/);
  typed(r.fetchTypo, 'ConfigError', /did you mean `dtype`/);
  typed(r.layerString, 'ShapeError', /layer must be a non-negative integer, got the string "0"/);
  typed(r.createTypo, 'ConfigError', /XQuant.create: unknown option `powerpreference`/);
  typed(r.createDevice, 'ConfigError', /`device`/);
  typed(r.createNull, 'ConfigError', /options must be an object/);
  assert.equal(r.fine.threw, false, r.fine.message);
  assert.equal(r.inheritedSame.same, true, 'inherited options attend as own ones do');
  typed(r.inheritedWrong, 'ConfigError', /attend option `queryHeads`: expected a non-negative integer, got the string "1"/);
  typed(r.getterThrows, 'ConfigError', /attend: cannot read its options/);
  for (const [name, o] of Object.entries(r)) {
    if (!o.threw) continue;
    assert.doesNotMatch(o.message, /JsValue|head_dim|kv_heads|max_ctx|group_quant_size|residual_bits|page_tokens|base_bits/, `${name}: ${o.message}`);
  }
  assert.deepEqual(errors, []);
  await p.close();
});

test('a refused call adds no token and changes no byte', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const xq = await XQuant.create();
    const caches = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, maxCtx: 12, window: 8, groupQuantSize: 8, sinks: 0 });
    const x = (t) => new Float32Array(t * 8).map((_, i) => Math.sin(i));
    await caches.append(0, x(10), x(10), 10);
    const snap = () => JSON.stringify([caches.tokens(0), caches.tokens(1), caches.stats().totals]);
    const start = snap();
    const dev = xq.device;
    const dead = dev.createBuffer({ size: 1024, usage: GPUBufferUsage.STORAGE });
    dead.destroy();
    const nan = x(1);
    nan[3] = NaN;
    const big = x(1);
    big[0] = 1e6; // beyond f16
    const attempts = {
      shape: () => caches.append(0, x(2), x(1), 1),
      tokensMismatch: () => caches.append(0, x(2), x(2), 1),
      wrongArray: () => caches.append(0, new Int32Array(8), new Int32Array(8), 1),
      nan: () => caches.append(0, nan, x(1), 1),
      tooBig: () => caches.append(0, big, x(1), 1),
      budget: () => caches.append(0, x(3), x(3), 3),
      badLayer: () => caches.append(7, x(1), x(1), 1),
      zeroTokens: () => caches.append(0, x(0), x(0), 0),
      updateBudget: () => caches.updateAndFetch(0, x(3), x(3), 3),
      gpuRefused: () => caches.append(0, dead, dead, 1),
    };
    const out = {};
    for (const [name, f] of Object.entries(attempts)) {
      const c = await caught(f);
      out[name] = { ...c, unchanged: snap() === start };
    }
    out.after = await caught(() => caches.append(0, x(2), x(2), 2));
    out.tokens = caches.tokens(0);
    caches.free();
    xq.free();
    return out;
  });
  const names = {
    shape: 'ShapeError', tokensMismatch: 'ShapeError', wrongArray: 'ShapeError', nan: 'NonFiniteError',
    tooBig: 'NonFiniteError', budget: 'ContextBudgetError', badLayer: 'ShapeError', zeroTokens: 'ShapeError',
    updateBudget: 'ContextBudgetError', gpuRefused: 'GpuError',
  };
  for (const [k, name] of Object.entries(names)) {
    typed(r[k], name);
    assert.equal(r[k].unchanged, true, `${k} changed the set`);
  }
  assert.equal(r.after.threw, false, r.after.message);
  assert.equal(r.tokens, 12);
  assert.deepEqual(errors, []);
  await p.close();
});

test("on a shared device the runtime's error handler and errors stay the runtime's", async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const device = await (await navigator.gpu.requestAdapter()).requestDevice();
    const seen = { handler: 0, listener: 0 };
    const handler = () => seen.handler++;
    device.onuncapturederror = handler;
    device.addEventListener('uncapturederror', () => seen.listener++);
    const added = [];
    const addEventListener = device.addEventListener.bind(device);
    device.addEventListener = (type, ...rest) => {
      added.push(type);
      return addEventListener(type, ...rest);
    };
    const settle = async (n) => {
      await device.queue.onSubmittedWorkDone();
      for (let i = 0; i < 50 && seen.handler < n; i++) await new Promise((ok) => setTimeout(ok, 50));
    };
    const U = GPUBufferUsage;
    const xq = await XQuant.create({ device });
    const caches = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
    const x = new Float32Array(8).fill(0.5);
    const out = {};
    await caches.append(0, x, x, 1);
    // 1. The runtime's own error, before a cache call.
    device.createBuffer({ size: 4, usage: U.MAP_READ | U.STORAGE });
    out.afterRuntimeError = await caught(() => caches.append(0, x, x, 1));
    await settle(1);
    // 2. The runtime's error while a cache call is in flight.
    const inFlight = caches.attend(0, new Float32Array(8), { queryHeads: 1 });
    device.createBuffer({ size: 4, usage: U.MAP_READ | U.STORAGE });
    out.inFlight = await caught(() => inFlight);
    await settle(2);
    // 3. Our own GPU error is ours: it does not reach the runtime's handler.
    const dead = device.createBuffer({ size: 1024, usage: U.STORAGE });
    dead.destroy();
    out.ours = await caught(() => caches.append(0, dead, dead, 1));
    await settle(3);
    out.next = await caught(() => caches.append(0, x, x, 1));
    out.tokens = caches.tokens(0);
    out.handlerKept = device.onuncapturederror === handler;
    out.seen = { ...seen };
    out.added = added;
    caches.free();
    xq.free();
    device.destroy();
    return out;
  });
  assert.equal(r.afterRuntimeError.threw, false, r.afterRuntimeError.message);
  assert.equal(r.inFlight.threw, false, r.inFlight.message);
  typed(r.ours, 'GpuError');
  assert.equal(r.next.threw, false, r.next.message);
  assert.equal(r.tokens, 3);
  assert.equal(r.handlerKept, true, 'onuncapturederror is left alone');
  assert.deepEqual(r.seen, { handler: 2, listener: 2 }, "exactly the runtime's two errors reach its handler and listener");
  assert.deepEqual(r.added.filter((t) => t === 'uncapturederror'), [], 'no uncapturederror listener added');
  assert.deepEqual(errors, []);
  await p.close();
});

test('reset() and free() while calls are in flight; a layer fed twice', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const xq = await XQuant.create();
    const caches = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
    const x = (t, k = 1) => new Float32Array(t * 8).map((_, i) => Math.sin(i * k));
    const out = {};
    // A host result in flight survives reset(): it was copied out in its own submission.
    const fetched = caches.updateAndFetch(0, x(4), x(4), 4);
    caches.reset();
    out.tokensAfterReset = caches.tokens(0);
    const f = await fetched;
    out.fetched = { tokens: f.tokens, length: f.keys.length, first: f.keys[1] };
    // The set's own buffers do not outlive reset().
    const gpu = caches.updateAndFetchGpu(0, x(4), x(4), 4);
    caches.reset();
    out.gpuAfterReset = await caught(() => gpu);
    // A GPU failure of a call made before reset() does not block the set after it.
    const dead = xq.device.createBuffer({ size: 1024, usage: GPUBufferUsage.STORAGE });
    dead.destroy();
    const failing = caches.append(0, dead, dead, 1);
    caches.reset();
    out.failing = await caught(() => failing);
    out.afterFailing = await caught(() => caches.append(0, x(1), x(1), 1));
    // A layer fed twice before the others: two appends, in order.
    const a = caches.append(1, x(1, 2), x(1, 2), 1);
    const b = caches.append(1, x(1, 3), x(1, 3), 1);
    await Promise.all([a, b]);
    out.twice = [caches.tokens(0), caches.tokens(1)];
    const both = await caches.updateAndFetch(1, x(1, 4), x(1, 4), 1);
    out.twiceOrder = [both.keys[8 + 1], Math.sin(1 * 3), both.keys[1], Math.sin(1 * 2)];
    // free() while attend is in flight: the promise still resolves.
    const att = caches.attend(1, new Float32Array(8), { queryHeads: 1 });
    caches.free();
    const o = await att;
    out.attendAfterFree = o.length;
    out.callAfterFree = await caught(() => caches.append(0, x(1), x(1), 1));
    out.resetAfterFree = await caught(() => caches.reset());
    xq.free();
    return out;
  });
  assert.equal(r.tokensAfterReset, 0);
  assert.equal(r.fetched.tokens, 4);
  assert.equal(r.fetched.length, 32);
  assert.ok(Math.abs(r.fetched.first - Math.sin(1)) < 1e-2, `fetched ${r.fetched.first}`);
  typed(r.gpuAfterReset, 'UsageError', /reset or freed/);
  typed(r.failing, 'GpuError');
  assert.equal(r.afterFailing.threw, false, r.afterFailing.message);
  assert.deepEqual(r.twice, [1, 2]);
  assert.ok(Math.abs(r.twiceOrder[0] - r.twiceOrder[1]) < 1e-2 && Math.abs(r.twiceOrder[2] - r.twiceOrder[3]) < 1e-2, JSON.stringify(r.twiceOrder));
  assert.equal(r.attendAfterFree, 8);
  typed(r.callAfterFree, 'UsageError');
  typed(r.resetAfterFree, 'UsageError');
  assert.deepEqual(errors, []);
  await p.close();
});

test('stats() fields add up', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const xq = await XQuant.create();
    const x = (t) => new Float32Array(2 * t * 16).map((_, i) => Math.cos(i * 0.37));
    const caches = xq.cacheSet({ layers: 2, kvHeads: 2, headDim: 16, window: 32, groupQuantSize: 32 });
    const empty = caches.stats();
    await caches.append(0, x(110), x(110), 110);
    await caches.append(1, x(110), x(110), 110);
    const stats = caches.stats();
    const reference = xq.cacheSet({ layers: 2, kvHeads: 2, headDim: 16, groupSize: 2, decodePolicy: 'reference', window: 0, sinks: 0, groupQuantSize: 32 });
    await reference.append(0, x(64), x(64), 64);
    const pending = reference.stats().totals.pendingTokens;
    await reference.append(1, x(64), x(64), 64);
    const consumed = reference.stats().totals.pendingTokens;
    const allocated = xq.allocatedBytes();
    caches.free();
    reference.free();
    xq.free();
    return { empty, stats, pending, consumed, allocated };
  });
  const { layers, totals } = r.stats;
  const close = (a, b, what) => assert.ok(Math.abs(a - b) <= STATS_REL * Math.max(1, Math.abs(b)), `${what}: ${a} vs ${b}`);
  assert.equal(totals.liveTokens, 220, 'liveTokens sums the layers');
  assert.equal(totals.pendingTokens, 0, 'nothing pending under the window policy');
  for (const l of layers) {
    assert.equal(l.tokens, 110);
    assert.equal(l.windowTokens + l.sinkTokens <= l.tokens, true);
    for (const f of ['accountedBytes', 'allocatedBytes', 'fp16Bytes']) assert.equal(l[f], l.key[f] + l.value[f], `layer ${l.layer} ${f}`);
    close(l.effectiveBits, (16 * l.accountedBytes) / l.fp16Bytes, 'layer effectiveBits');
    for (const kv of [l.key, l.value]) close(kv.effectiveBits, (16 * kv.accountedBytes) / kv.fp16Bytes, 'kv effectiveBits');
    assert.equal(l.fp16Bytes, 2 * 2 * 110 * 16 * 2, 'fp16 bytes of K and V');
  }
  for (const f of ['accountedBytes', 'allocatedBytes', 'fp16Bytes']) assert.equal(totals[f], layers[0][f] + layers[1][f], `totals.${f}`);
  close(totals.effectiveBits, (16 * totals.accountedBytes) / totals.fp16Bytes, 'totals.effectiveBits (accounted)');
  close(totals.ratioVsFp16, totals.allocatedBytes / totals.fp16Bytes, 'totals.ratioVsFp16 (allocated)');
  assert.ok(r.allocated >= totals.allocatedBytes + totals.scratchBytes, 'the context holds at least the set');
  assert.equal(r.empty.totals.liveTokens, 0);
  assert.equal(r.empty.totals.effectiveBits, 0);
  assert.equal(r.empty.totals.ratioVsFp16, 0);
  assert.ok(r.pending > 0, `the anchor's tokens wait for their reader (${r.pending})`);
  assert.equal(r.consumed, 0);
  assert.deepEqual(errors, []);
  await p.close();
});

test('after device loss every call rejects with DeviceLostError, and create() works again', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const { XQuant } = window.xquant;
    const xq = await XQuant.create();
    const caches = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
    const x = new Float32Array(8 * 8).map((_, i) => Math.sin(i));
    await caches.append(0, x, x, 8);
    const saved = await caches.save();
    const q = await xq.quantizeCodes(x, [8, 8], 2, 8);
    const buf = xq.device.createBuffer({ size: 1024, usage: GPUBufferUsage.STORAGE });
    // Each call settles within 10 s, or counts as a hang.
    const settled = (f) => caught(() => Promise.race([f(), new Promise((_, no) => setTimeout(() => no(new Error('hang')), 10000))]));
    const calls = {
      append: () => caches.append(0, x, x, 8),
      appendGpu: () => caches.append(0, buf, buf, 1),
      updateAndFetch: () => caches.updateAndFetch(1, x, x, 8),
      updateAndFetchGpu: () => caches.updateAndFetchGpu(1, x, x, 8),
      attend: () => caches.attend(0, new Float32Array(8), { queryHeads: 1 }),
      attendGpu: () => caches.attendGpu(0, buf, buf, { queryHeads: 1 }),
      fetchInto: () => caches.fetchInto(0, buf, buf),
      save: () => caches.save(),
      quantizeCodes: () => xq.quantizeCodes(x, [8, 8], 2, 8),
      computeReuseParams: () => xq.computeReuseParams(x, q),
      dequantWithParams: () => xq.dequantWithParams(q),
      quantizeResidual: () => xq.quantizeResidual(x, x, [8, 8], 2, 8),
      crossLayerSimilarity: () => xq.crossLayerSimilarity(x, x, [8, 8]),
      similarityMatrix: () => xq.similarityMatrix([x, x], [8, 8]),
      analyzeKv: () => xq.analyzeKv(new Uint8Array(16)),
      suggestPlan: () => xq.suggestPlan(new Uint8Array(16)),
      kvSimilarity: () => xq.kvSimilarity(new Uint8Array(16)),
      // Made in the same task as destroy(), cacheSet() cannot know yet: its set's calls do.
      cacheSet: async () => {
        const c = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8 });
        try {
          await c.append(0, x.subarray(0, 8), x.subarray(0, 8), 1);
        } finally {
          c.free();
        }
      },
      // The same for a restored set: its bytes are uploaded; its first call knows.
      restoreCacheSet: async () => {
        const c = await xq.restoreCacheSet(saved);
        try {
          await c.append(0, x.subarray(0, 8), x.subarray(0, 8), 1);
        } finally {
          c.free();
        }
      },
    };
    xq.device.destroy();
    // Made at once (before the loss is reported) and after it.
    const immediate = await Promise.all(Object.values(calls).map(settled));
    await xq.device.lost;
    const later = {};
    for (const [name, f] of Object.entries(calls)) later[name] = await settled(f);
    const names = Object.keys(calls);
    const host = { tokens: caches.tokens(1), stats: caches.stats().layers.length };
    caches.free();
    xq.free();
    const fresh = await XQuant.create();
    const again = fresh.cacheSet({ layers: 1, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
    const works = await caught(() => again.updateAndFetch(0, x, x, 8));
    const bits = (await fresh.quantizeCodes(x, [8, 8], 2, 8)).bits;
    again.free();
    fresh.free();
    return { immediate: Object.fromEntries(names.map((n, i) => [n, immediate[i]])), later, host, works, bits };
  });
  // A call made in the same task as destroy() may still fail on its own bad input first
  // (these three parse 16 bytes that are no file before touching the GPU).
  const hostFirst = new Set(['analyzeKv', 'suggestPlan', 'kvSimilarity']);
  for (const when of ['immediate', 'later']) {
    for (const [name, o] of Object.entries(r[when])) {
      const expected = when === 'immediate' && hostFirst.has(name) && o.name === 'FormatError' ? 'FormatError' : 'DeviceLostError';
      typed(o, expected, undefined, `${when} ${name}`);
    }
  }
  // Host-side reads still answer (the counts of calls caught by the loss: see below).
  assert.equal(r.host.stats, 2);
  assert.equal(typeof r.host.tokens, 'number');
  assert.equal(r.works.threw, false, r.works.message);
  assert.equal(r.bits, 2);
  assert.deepEqual(errors, []);
  await p.close();
});

test('a failed ready() is retried by the next call', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const m = window.xquant;
    const first = await caught(() => m.ready('./missing.wasm'));
    const viaCreate = await caught(() => m.XQuant.create({ wasm: './missing.wasm' }));
    const second = await caught(() => m.ready());
    const xq = await m.XQuant.create();
    const bits = (await xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 4)).bits;
    xq.free();
    return { first, viaCreate, second, bits };
  });
  typed(r.first, 'IoError', /could not load/);
  typed(r.viaCreate, 'IoError', /could not load/);
  assert.equal(r.second.threw, false, r.second.message);
  assert.equal(r.bits, 2);
  // The 404s of the missing module are the only console errors.
  assert.ok(errors.every((e) => /404|Not Found|missing\.wasm/i.test(e)), errors.join('\n'));
  await p.close();
});

// WebGPU reports a loss asynchronously and popErrorScope resolves with no error on a lost
// device, so a call made in the same task as destroy() is accepted by the set before the
// loss is known. The facade settles it lost (the set keeps each accepted call's checkpoint
// until then) and the set goes back to before it.
test('a call rejected by a device loss adds no token', async () => {
  const { page: p, errors } = await page();
  const r = await evaluate(p, async () => {
    const xq = await window.xquant.XQuant.create();
    const x = new Float32Array(8 * 8).map((_, i) => Math.sin(i));
    const solo = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
    await solo.append(0, x, x, 8);
    xq.device.destroy();
    const call = await caught(() => solo.append(0, x, x, 8));
    const tokens = solo.tokens(0);
    solo.free();
    xq.free();
    return { call, tokens };
  });
  typed(r.call, 'DeviceLostError');
  assert.equal(r.tokens, 8, 'the rejected call added no token');
  assert.deepEqual(errors, []);
  await p.close();
});
