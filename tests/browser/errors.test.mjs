// Every failure reaches JS as a typed Error subclass, and the page keeps working after it.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { SELF_COSINE_MIN } from './tolerances.mjs';
import { browser, evaluate, installApp, openApp, serve, APP } from './harness.mjs';

let server;

before(async () => {
  installApp();
  server = await serve(APP);
});

after(() => server?.close());

test('bad input, bad config, budget, NaN and use after free are typed errors', async () => {
  const chrome = await browser();
  const { page, errors } = await openApp(chrome, server.url);
  const outcomes = await evaluate(page, async (selfCosine) => {
    const m = window.xquant;
    const xq = await m.XQuant.create();
    const min = selfCosine;
    const caught = async (f) => {
      try {
        await f();
        return { threw: false };
      } catch (e) {
        return { threw: true, name: e.name, message: e.message, base: e instanceof m.XQuantError, error: e instanceof Error };
      }
    };
    const ok = async () => (await xq.quantizeCodes(new Float32Array(64), [4, 16], 2, 4)).bits === 2;
    const caches = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, maxCtx: 8, window: 0, groupQuantSize: 4 });
    const r = {};
    r.wrongShape = await caught(() => xq.quantizeCodes(new Float32Array(10), [3, 4], 2, 4));
    r.wrongType = await caught(() => xq.quantizeCodes([1, 2, 3], [1, 3], 2, 4));
    r.emptyShape = await caught(() => xq.quantizeCodes(new Float32Array(0), [0, 4], 2, 4));
    r.badBits = await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 9, 4));
    r.badGroup = await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 0));
    r.badAxis = await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 4, { valueAxis: 'rows' }));
    r.nan = await caught(() => xq.quantizeCodes(new Float32Array([0, NaN, 1, 2]), [1, 4], 2, 4));
    r.badLevels = await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 4, { levels: 'nf4' }));
    const lloyd = { valueAxis: 'channels', levels: 'lloyd-max' };
    r.lloydTokens = await caught(() => xq.quantizeCodes(new Float32Array(8), [2, 4], 2, 4, { ...lloyd, valueAxis: 'tokens' }));
    r.lloydRagged = await caught(() => xq.quantizeCodes(new Float32Array(12), [2, 6], 2, 4, lloyd));
    // Lloyd-Max codes round-trip through the primitives: one norm per group (as `scale`),
    // no zeros, a reconstruction within 2-bit Lloyd-Max error of the input.
    const lx = new Float32Array(64).map((_, i) => Math.sin(1.7 * i) + 0.3 * Math.cos(0.3 * i));
    const lq = await xq.quantizeCodes(lx, [4, 16], 2, 8, lloyd);
    const lr = await xq.dequantWithParams(lq);
    const energy = lx.reduce((a, v) => a + v * v, 0);
    const err = lr.reduce((a, v, i) => a + (v - lx[i]) ** 2, 0);
    r.lloyd = { levels: lq.levels, norms: lq.scale.length, zeros: lq.zero.every((z) => z === 0), relErr: err / energy };
    r.badConfig = await caught(() => xq.cacheSet({ layers: 0, kvHeads: 1, headDim: 8 }));
    r.badWindow = await caught(() => xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, window: 7 }));
    r.badLayer = await caught(() => caches.updateAndFetch(5, new Float32Array(8), new Float32Array(8), 1));
    r.badTokens = await caught(() => caches.updateAndFetch(0, new Float32Array(16), new Float32Array(16), 1));
    r.budget = await caught(() => caches.updateAndFetch(0, new Float32Array(9 * 8), new Float32Array(9 * 8), 9));
    r.fine = await caught(() => caches.updateAndFetch(0, new Float32Array(8 * 8), new Float32Array(8 * 8), 8));
    r.tokensAfter = caches.stats().layers[0].tokens;
    r.overBudget = await caught(() => caches.updateAndFetch(0, new Float32Array(8), new Float32Array(8), 1));
    // Calls are submitted as they are made: two at once run in order.
    r.inFlight = await caught(() => Promise.all([
      caches.updateAndFetch(1, new Float32Array(8), new Float32Array(8), 1),
      caches.updateAndFetch(1, new Float32Array(8), new Float32Array(8), 1),
    ]));
    r.inFlightTokens = caches.tokens(1);
    caches.free();
    r.useAfterFree = await caught(() => caches.updateAndFetch(0, new Float32Array(8), new Float32Array(8), 1));
    r.statsAfterFree = await caught(() => caches.stats());
    r.stillWorks = await ok();
    const other = await m.XQuant.create();
    other.free();
    r.contextAfterFree = await caught(() => other.pairLayers(4, 2));
    r.disposed = typeof caches[Symbol.dispose] === 'function';
    // Many calls in flight at once on one device (error scopes must not interleave).
    const a = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8 });
    const b = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8 });
    const x = new Float32Array(40 * 8).map((_, i) => Math.cos(i));
    const all = await Promise.all([
      xq.quantizeCodes(x, [40, 8], 2, 8),
      a.updateAndFetch(0, x, x, 40),
      xq.crossLayerSimilarity(x, x, [40, 8]),
      b.updateAndFetch(0, x, x, 40),
      xq.quantizeCodes(x, [40, 8], 3, 8),
    ]);
    r.concurrent = [all[0].bits, all[1].tokens, all[2].cosine > min, all[3].tokens, all[4].bits];
    a.free();
    b.free();
    r.pairs = xq.pairLayers(5, 2);
    r.adapter = xq.adapterInfo;
    xq.free();
    return r;
  }, SELF_COSINE_MIN);
  const typed = (o, name) => {
    assert.equal(o.threw, true, `${name} should throw`);
    assert.equal(o.name, name, o.message);
    assert.ok(o.base && o.error, `${name} is an XQuantError`);
  };
  typed(outcomes.wrongShape, 'ShapeError');
  typed(outcomes.wrongType, 'ShapeError');
  typed(outcomes.emptyShape, 'ShapeError');
  typed(outcomes.badBits, 'ConfigError');
  typed(outcomes.badGroup, 'ConfigError');
  typed(outcomes.badAxis, 'ConfigError');
  typed(outcomes.nan, 'NonFiniteError');
  typed(outcomes.badLevels, 'ConfigError');
  typed(outcomes.lloydTokens, 'ConfigError');
  typed(outcomes.lloydRagged, 'ConfigError');
  assert.equal(outcomes.lloyd.levels, 'lloyd-max');
  assert.equal(outcomes.lloyd.norms, 4 * 2, 'a norm per token and group of 8');
  assert.ok(outcomes.lloyd.zeros, 'no zeros');
  // 2-bit Lloyd-Max levels lose ~12% of a Gaussian group's energy; these groups are not
  // Gaussian, so allow twice that (a wrong level or norm loses far more).
  assert.ok(outcomes.lloyd.relErr < 0.25, `relative error ${outcomes.lloyd.relErr}`);
  typed(outcomes.badConfig, 'ConfigError');
  typed(outcomes.badWindow, 'ConfigError');
  typed(outcomes.badLayer, 'ShapeError');
  typed(outcomes.badTokens, 'ShapeError');
  typed(outcomes.budget, 'ContextBudgetError');
  assert.match(outcomes.budget.message, /maxCtx/);
  assert.doesNotMatch(outcomes.budget.message, /max_ctx/);
  assert.equal(outcomes.fine.threw, false);
  assert.equal(outcomes.tokensAfter, 8);
  typed(outcomes.overBudget, 'ContextBudgetError');
  assert.equal(outcomes.inFlight.threw, false, outcomes.inFlight.message);
  assert.equal(outcomes.inFlightTokens, 2);
  typed(outcomes.useAfterFree, 'UsageError');
  typed(outcomes.statsAfterFree, 'UsageError');
  typed(outcomes.contextAfterFree, 'UsageError');
  assert.equal(outcomes.stillWorks, true);
  assert.equal(outcomes.disposed, true);
  assert.deepEqual(outcomes.concurrent, [2, 40, true, 40, 3]);
  assert.deepEqual(outcomes.pairs.map((p) => p.role), ['anchor', 'reuse', 'anchor', 'reuse', 'anchor']);
  assert.equal(outcomes.adapter.backend, 'BrowserWebGpu');
  assert.ok(outcomes.adapter.name.length > 0);
  console.log(`  adapter: ${JSON.stringify(outcomes.adapter)}`);
  assert.deepEqual(errors, [], 'no uncaught page errors (no panics)');
  await chrome.close();
});

test('without WebGPU, create() throws WebGpuUnavailableError and the page keeps working', async () => {
  const chrome = await browser({ webgpu: false });
  const { page, errors } = await openApp(chrome, server.url);
  const r = await evaluate(page, async () => {
    const m = window.xquant;
    try {
      await m.XQuant.create();
      return { threw: false };
    } catch (e) {
      return { threw: true, name: e.name, message: e.message, typed: e instanceof m.WebGpuUnavailableError, alive: 1 + 1 };
    }
  });
  assert.equal(r.threw, true);
  assert.equal(r.name, 'WebGpuUnavailableError');
  assert.equal(r.typed, true);
  assert.match(r.message, /WebGPU|adapter/);
  assert.equal(r.alive, 2);
  assert.deepEqual(errors, []);
  await chrome.close();
});
