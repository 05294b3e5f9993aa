// Gemma 3 270M ($XQ_GEMMA) in headless Chromium: the demo's model picker loads it from the
// server; 8 greedy tokens per cache equal `xquant generate`'s (the demo's knobs: pairs of
// layers, which the model's sliding and global layers split where they meet); Capture shows
// its K/V in the heatmap; the saved conversation continues after a reload as it does in
// place. Then the package alone on a GPUDevice of WebGPU's default limits (a runtime's own
// device): its 189 MB embedding split across bindings, the f16 tokens equal again.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { demoSession, modelFile } from './harness.mjs';
import { LONG, analysisReady, continueWith, done, nativeTokens, tokensOf } from './panel.mjs';
import { GEMMA_PATH } from '../../scripts/serve.mjs';

const GEMMA = modelFile('XQ_GEMMA');
const PROMPT = 'The Eiffel Tower is located in the city of';
const MORE = ' It was built in';
const session = demoSession({ gemma: GEMMA.path });

test('Gemma 3 in the browser: the demo picks it, generates, captures, saves; the package at default limits', { skip: GEMMA.skip, timeout: 1800000 }, async (t) => {
  const started = Date.now();
  const lap = (what) => t.diagnostic(`${what}: ${((Date.now() - started) / 1000).toFixed(1)} s since the start`);
  // The native runs first: lavapipe and SwiftShader would share the two cores.
  const want = { f16: await nativeTokens(GEMMA.path, PROMPT, 'f16'), xquant: await nativeTokens(GEMMA.path, PROMPT, 'xquant') };
  lap('native xquant generate (both caches)');

  const page = await session.chrome.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(session.server.url);
  await analysisReady(page);

  await t.test('the picker offers Gemma; loaded, it has no chat template; 8 greedy tokens per cache as xquant generate', async () => {
    const options = await page.$$eval('#gen-pick option', (os) => os.map((o) => [o.value, o.textContent]));
    const gemma = options.find(([, name]) => name.startsWith('Gemma 3 270M'));
    assert.ok(gemma, JSON.stringify(options));
    assert.ok(gemma[0].endsWith(GEMMA_PATH), gemma[0]);
    await page.selectOption('#gen-pick', gemma[0]);
    await page.click('#gen-load');
    await page.waitForSelector('#gen-model[data-loaded="1"]', { timeout: LONG });
    lap('model loaded from the server');
    assert.equal(await page.getAttribute('#gen-model', 'data-architecture'), 'gemma3');
    assert.match(await page.textContent('#gen-model'), /gemma3, 18 layers, hidden 640, 4 heads \(1 K\/V\) × 256, vocab 262144/);
    assert.equal(await page.isChecked('#gen-chat'), false);
    assert.equal(await page.isDisabled('#gen-chat'), true);
    await page.fill('#gen-prompt', PROMPT);
    await page.fill('#gen-max', '8');
    await page.click('#gen-run');
    await done(page);
    lap('8 tokens with each cache');
    for (const kind of ['f16', 'xquant']) {
      assert.deepEqual(await tokensOf(page, `#gen-col-${kind} .gen-text`), want[kind], `${kind}: the tokens of xquant generate`);
    }
    assert.match(await page.textContent('#gen-col-f16 .gen-text'), /Paris/);
    const series = JSON.parse(await page.evaluate(() => document.getElementById('gen-chart').dataset.series));
    const f16At = new Map(series.f16);
    for (const [tokens, bytes] of series.xquant) assert.ok(bytes < f16At.get(tokens), `at ${tokens} tokens: XQuant ${bytes} B, f16 ${f16At.get(tokens)} B`);
  });

  await t.test('Capture shows Gemma\'s K/V in the heatmap', async () => {
    await page.click('#gen-capture');
    await page.waitForFunction(() => document.getElementById('dataset').textContent.startsWith('capture of'), null, { timeout: LONG });
    await analysisReady(page);
    assert.match(await page.textContent('#dataset'), /18 layers of \[B, H, S, D\] = \[1, 1, \d+, 256\]/);
    assert.equal(await page.locator('#table tr[data-layer]').count(), 18);
    assert.equal(await page.getAttribute('#heatmap', 'data-ready'), '1');
    lap('capture analysed');
  });

  await t.test('the saved conversation reloads Gemma and continues as it does in place', async () => {
    await page.waitForFunction(() => document.getElementById('gen-saved-what').textContent.startsWith('Saved'), null, { timeout: LONG });
    assert.match(await page.textContent('#gen-saved-what'), /Gemma 3 270M/);
    await page.evaluate(async () => {
      window.__saved = await (await import('/store.js')).loadConversation();
    });
    const inPlace = await continueWith(page, MORE, 3);
    assert.equal(inPlace.length, 3);
    lap('continued in place');
    await page.evaluate(async () => (await import('/store.js')).saveConversation(window.__saved));
    await page.reload();
    await page.waitForSelector('#gen-saved:not([hidden])');
    await page.waitForSelector('#gen-continue:not([disabled])');
    // Nothing is loaded after the reload: Continue loads the conversation's model (Gemma,
    // although the picker shows SmolLM2 first when the server offers it).
    const restored = await continueWith(page, MORE, 3);
    assert.equal(await page.getAttribute('#gen-model', 'data-architecture'), 'gemma3');
    assert.deepEqual(restored, inPlace, 'continuing the restored set = continuing in place');
    lap('reloaded, Gemma loaded again, restored and continued');
  });
  assert.deepEqual(errors, []);
  await page.close();

  await t.test('the package on a GPUDevice of WebGPU\'s default limits: the f16 tokens of xquant generate', async () => {
    const fresh = await session.chrome.newPage();
    try {
      await fresh.goto(session.server.url);
      const got = await fresh.evaluate(
        async ({ url }) => {
          const { XQuant } = await import('/pkg/index.js');
          const adapter = await navigator.gpu.requestAdapter();
          const device = await adapter.requestDevice(); // no required limits: the defaults
          const xq = await XQuant.create({ device });
          const model = await xq.loadModel(url);
          const run = model.generate('The Eiffel Tower is located in the city of', { maxTokens: 4, cache: 'f16' });
          for await (const _ of run);
          const out = { tokens: run.tokens, binding: device.limits.maxStorageBufferBindingSize };
          model.free();
          xq.free();
          return out;
        },
        { url: new URL(GEMMA_PATH.slice(1), session.server.url).href },
      );
      assert.equal(got.binding, 128 * 2 ** 20, 'the default storage binding limit');
      assert.deepEqual(got.tokens, want.f16.slice(0, 4));
      lap('the package at default limits');
    } finally {
      await fresh.close();
    }
  });
});
