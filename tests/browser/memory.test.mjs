// Creating and freeing 200 cache sets with data returns the package's GPU memory to where
// it started.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { browser, evaluate, installApp, openApp, serve, APP } from './harness.mjs';

let server;

before(async () => {
  installApp();
  server = await serve(APP);
});

after(() => server?.close());

test('200 cache sets created and freed leave no GPU memory behind', async () => {
  const chrome = await browser();
  const { page, errors } = await openApp(chrome, server.url);
  const r = await evaluate(page, async () => {
    const xq = await window.xquant.XQuant.create();
    const start = xq.allocatedBytes();
    let peak = 0;
    const x = new Float32Array(2 * 40 * 16).map((_, i) => Math.sin(i));
    for (let i = 0; i < 200; i++) {
      const caches = xq.cacheSet({ layers: 2, kvHeads: 2, headDim: 16, window: 8, groupQuantSize: 8 });
      for (let l = 0; l < 2; l++) await caches.updateAndFetch(l, x, x, 40);
      peak = Math.max(peak, xq.allocatedBytes());
      if (i % 2 === 0) caches.free();
      else caches[Symbol.dispose]();
    }
    const end = xq.allocatedBytes();
    xq.free();
    return { start, peak, end };
  });
  assert.ok(r.peak > r.start, `cache sets allocate (${JSON.stringify(r)})`);
  assert.equal(r.end, r.start, `allocated bytes return to the start (${JSON.stringify(r)})`);
  assert.deepEqual(errors, []);
  await chrome.close();
});
