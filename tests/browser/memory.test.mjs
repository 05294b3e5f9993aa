// Soak: cache sets created, filled and freed over and over return the package's GPU memory
// to where it started, and the page's JS heap (garbage collected through CDP) to within
// SOAK_HEAP_BYTES of it. XQ_SOAK_CYCLES sets the number of cycles (default 1000, ~10 s).

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { browser, evaluate, installApp, openApp, serve, APP } from './harness.mjs';
import { SOAK_HEAP_BYTES } from './tolerances.mjs';

const CYCLES = Number(process.env.XQ_SOAK_CYCLES ?? 1000);
const WARMUP = 20;

let server;

before(async () => {
  installApp();
  server = await serve(APP);
});

after(() => server?.close());

test(`${CYCLES} cache sets created, filled and freed leave no GPU memory and no JS heap behind`, async () => {
  const chrome = await browser();
  const { page, errors } = await openApp(chrome, server.url);
  const cdp = await page.context().newCDPSession(page);
  const heap = async () => {
    for (let i = 0; i < 3; i++) await cdp.send('HeapProfiler.collectGarbage');
    return (await cdp.send('Runtime.getHeapUsage')).usedSize;
  };
  await evaluate(page, async () => {
    const xq = await window.xquant.XQuant.create();
    const x = new Float32Array(2 * 40 * 16).map((_, i) => Math.sin(i));
    window.soak = { xq, start: xq.allocatedBytes(), peak: 0 };
    window.cycles = async (n) => {
      for (let i = 0; i < n; i++) {
        const caches = xq.cacheSet({ layers: 2, kvHeads: 2, headDim: 16, window: 8, groupQuantSize: 8 });
        await caches.append(0, x, x, 40);
        await caches.updateAndFetch(1, x, x, 40);
        window.soak.peak = Math.max(window.soak.peak, xq.allocatedBytes());
        if (i % 2 === 0) caches.free();
        else caches[Symbol.dispose]();
      }
      return xq.allocatedBytes();
    };
  });
  await evaluate(page, (n) => window.cycles(n), WARMUP);
  const heapStart = await heap();
  const t0 = Date.now();
  const end = await evaluate(page, (n) => window.cycles(n), CYCLES, 600000);
  const seconds = (Date.now() - t0) / 1000;
  const heapEnd = await heap();
  const { start, peak } = await page.evaluate(() => ({ start: window.soak.start, peak: window.soak.peak }));
  await page.evaluate(() => window.soak.xq.free());
  console.log(
    `  ${CYCLES} cycles in ${seconds.toFixed(1)} s; GPU bytes start ${start}, peak ${peak}, end ${end}; ` +
      `JS heap after GC ${heapStart} → ${heapEnd} (${heapEnd - heapStart >= 0 ? '+' : ''}${heapEnd - heapStart} bytes)`,
  );
  assert.ok(peak > start, 'cache sets allocate');
  assert.equal(end, start, 'allocated bytes return to the start');
  assert.ok(heapEnd - heapStart <= SOAK_HEAP_BYTES, `JS heap grew by ${heapEnd - heapStart} bytes`);
  assert.deepEqual(errors, []);
  await chrome.close();
});
