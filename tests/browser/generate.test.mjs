// The demo's Generate panel on the real model (SmolLM2-135M, $XQ_MODEL, served by
// scripts/serve.mjs as `npm start` serves it): load from the server, 8 greedy tokens with an
// f16 cache and with XQuant equal to `xquant generate`'s, the KV chart (XQuant below f16),
// Capture into the heatmap, save → reload → continue equal to continuing in place, and a
// truncated GGUF's clear message. One page session, the model loaded once per page load:
// generation on SwiftShader is slow.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, openSync, readSync, writeFileSync, closeSync } from 'node:fs';
import { join } from 'node:path';
import { ROOT, demoSession, modelFile } from './harness.mjs';
import { LONG, analysisReady, continueWith, done, nativeTokens, tokensOf } from './panel.mjs';
import { serveDemo } from '../../scripts/serve.mjs';

const MODEL = modelFile();
const OUT = join(ROOT, 'target', 'demo-test');
const PROMPT = 'The capital of France is';
const MORE = ' Its population is';
const session = demoSession({ model: MODEL.path, gemma: null });

test('the Generate panel on the real model', { skip: MODEL.skip, timeout: 1500000 }, async (t) => {
  const started = Date.now();
  const lap = (what) => t.diagnostic(`${what}: ${((Date.now() - started) / 1000).toFixed(1)} s since the start`);
  mkdirSync(OUT, { recursive: true });
  const native8 = (async () => {
    const want = { f16: await nativeTokens(MODEL.path, PROMPT, 'f16'), xquant: await nativeTokens(MODEL.path, PROMPT, 'xquant') };
    lap('native xquant generate (both caches)');
    return want;
  })();
  native8.catch(() => {}); // awaited below

  const page = await session.chrome.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(session.server.url);
  await analysisReady(page);

  await t.test('loads the model from the server; 8 greedy tokens per cache as xquant generate; the KV chart', async () => {
    await page.waitForSelector('#gen-load[data-available="1"]:not([disabled])');
    await page.click('#gen-load');
    await page.waitForSelector('#gen-model[data-loaded="1"]', { timeout: LONG });
    lap('page loaded, model loaded from the server');
    await page.fill('#gen-prompt', PROMPT);
    await page.uncheck('#gen-chat');
    await page.fill('#gen-max', '8');
    await page.click('#gen-run');
    await done(page);
    lap('8 tokens with each cache');
    const want = await native8;
    for (const kind of ['f16', 'xquant']) {
      const text = await page.textContent(`#gen-col-${kind} .gen-text`);
      assert.ok(text.startsWith(' Paris'), `${kind}: ${JSON.stringify(text)}`);
      assert.deepEqual(await tokensOf(page, `#gen-col-${kind} .gen-text`), want[kind], `${kind}: the tokens of xquant generate`);
    }
    // The first difference is reported (none, or an index marked in both columns).
    const first = Number(await page.evaluate(() => document.getElementById('gen-diff').dataset.first));
    if (first >= 0) assert.equal(await page.locator('#generate .gen-text span.diff').count(), 2);
    // The chart: a point per piece for each run; XQuant allocates less at equal token counts.
    const series = JSON.parse(await page.evaluate(() => document.getElementById('gen-chart').dataset.series));
    assert.equal(series.f16.length, 8);
    assert.equal(series.xquant.length, 8);
    const f16At = new Map(series.f16);
    for (const [tokens, bytes] of series.xquant) {
      assert.ok(f16At.has(tokens), `f16 has a point at ${tokens} tokens`);
      assert.ok(bytes < f16At.get(tokens), `at ${tokens} tokens: XQuant ${bytes} B, f16 ${f16At.get(tokens)} B`);
    }
    await page.screenshot({ path: join(OUT, 'generate.png'), fullPage: true });
  });

  await t.test('Capture sends the typed text\'s K/V to the heatmap and the numbers', async () => {
    await page.click('#gen-capture');
    await page.waitForFunction(() => document.getElementById('dataset').textContent.startsWith('capture of'), null, { timeout: LONG });
    await analysisReady(page);
    assert.match(await page.textContent('#dataset'), /30 layers of \[B, H, S, D\] = \[1, 3, \d+, 64\]/);
    assert.equal(await page.locator('#table tr[data-layer]').count(), 30);
    assert.equal(await page.getAttribute('#heatmap', 'data-ready'), '1');
    lap('capture analysed');
  });

  const canSave = await page.evaluate(async () => {
    const { CacheSet, XQuant } = await import('/pkg/index.js');
    return typeof CacheSet.prototype.save === 'function' && typeof XQuant.prototype.restoreCacheSet === 'function';
  });
  const noSave = canSave ? false : 'the package has no CacheSet.save() / XQuant.restoreCacheSet() yet';
  await t.test('save, reload, continue: the tokens of continuing in place', { skip: noSave }, async () => {
    // The saved conversation (after the XQuant run) is kept aside: continuing in place saves
    // anew, so it is put back before the reload.
    await page.waitForFunction(() => document.getElementById('gen-saved-what').textContent.startsWith('Saved'), null, { timeout: LONG });
    await page.evaluate(async () => {
      window.__saved = await (await import('/store.js')).loadConversation();
    });
    const inPlace = await continueWith(page, MORE, 4);
    assert.equal(inPlace.length, 4);
    lap('continued in place (4 tokens)');
    await page.evaluate(async () => (await import('/store.js')).saveConversation(window.__saved));
    await page.reload();
    await page.waitForSelector('#gen-saved:not([hidden])');
    assert.match(await page.textContent('#gen-saved-text'), /^The capital of France is Paris/);
    await page.waitForSelector('#gen-continue:not([disabled])');
    const restored = await continueWith(page, MORE, 4);
    assert.deepEqual(restored, inPlace, 'continuing the restored set = continuing in place');
    lap('reloaded, model loaded again, restored and continued (4 tokens)');
  });

  await t.test('a truncated GGUF gets a clear message; the page keeps working', async () => {
    const head = Buffer.alloc(1000);
    const fd = openSync(MODEL.path, 'r');
    readSync(fd, head, 0, 1000, 0);
    closeSync(fd);
    const truncated = join(OUT, 'truncated.gguf');
    writeFileSync(truncated, head);
    await page.setInputFiles('#gen-file', truncated);
    await page.waitForFunction(() => document.getElementById('gen-error').textContent.includes('truncated.gguf'), null, { timeout: LONG });
    assert.equal(await page.isHidden('#gen-error'), false);
    assert.match(await page.textContent('#gen-error'), /^Loading truncated\.gguf: \w*Error: \S/);
    assert.equal(await page.getAttribute('#gen-model', 'data-loaded'), '1', 'the loaded model stays');
    await page.selectOption('select[name=residualBits]', '2');
    await page.waitForFunction(
      () => document.getElementById('status').dataset.kind === 'ok' && document.body.dataset.config.includes('"residualBits":2'),
      null,
      { timeout: LONG },
    );
    lap('truncated GGUF');
  });
  assert.deepEqual(errors, []);
  await page.close();
});

test('without a served model the panel says so and offers the file picker; a damaged saved conversation gets a message', async () => {
  const bare = await serveDemo(0, { model: null, gemma: null });
  const page = await session.chrome.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  try {
    await page.goto(bare.url);
    await page.waitForSelector('#gen-model[data-unavailable="1"]', { timeout: LONG });
    assert.match(await page.textContent('#gen-model'), /model is unavailable.*open a GGUF file/);
    assert.equal(await page.isDisabled('#gen-load'), true);
    assert.equal(await page.isDisabled('#gen-file'), false);
    // A damaged saved conversation: a message, Forget removes it, the page keeps working.
    await page.evaluate(
      () =>
        new Promise((ok, fail) => {
          const r = indexedDB.open('xquant-demo', 1);
          r.onupgradeneeded = () => r.result.createObjectStore('conversations');
          r.onerror = () => fail(r.error);
          r.onsuccess = () => {
            const tx = r.result.transaction('conversations', 'readwrite');
            tx.objectStore('conversations').put({ version: 1, cache: 'not bytes' }, 'last');
            tx.oncomplete = () => (r.result.close(), ok());
            tx.onerror = () => fail(tx.error);
          };
        }),
    );
    await page.reload();
    await page.waitForFunction(() => document.getElementById('gen-error').textContent.includes('damaged'), null, { timeout: LONG });
    assert.match(await page.textContent('#gen-error'), /StoreError: the saved conversation is damaged/);
    await page.click('#gen-forget');
    await page.waitForSelector('#gen-saved', { state: 'hidden' });
    assert.equal(await page.evaluate(async () => (await import('/store.js')).loadConversation()), null);
    assert.deepEqual(errors, []);
  } finally {
    await page.close();
    bare.close();
  }
});
