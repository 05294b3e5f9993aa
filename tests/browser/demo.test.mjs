// The demo page as `npm start` serves it: the heatmap appears, the numbers equal
// `xquant analyze --json` for the bundled capture, a knob changes them, Suggest makes a plan
// (shown per layer, downloadable, analysed as the CLI does), a file opens through the picker,
// a bad file gets a clear message, and a browser without WebGPU gets one too.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { ROOT, XQUANT, browser, cliJson } from './harness.mjs';
import { serveDemo } from '../../scripts/serve.mjs';
import { DEMO_MSE_REL, PLAN_BITS_SLACK } from './tolerances.mjs';

const KV = join(ROOT, 'data', 'smollm2-135m-kv.safetensors');
const OUT = join(ROOT, 'target', 'demo-test');
let server, chrome;

before(async () => {
  mkdirSync(OUT, { recursive: true });
  server = await serveDemo(0);
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  server?.close();
});

async function ready(page, configPart) {
  await page.waitForFunction(
    (part) => document.getElementById('status').dataset.kind === 'ok' && (!part || document.body.dataset.config.includes(part)),
    configPart,
    { timeout: 180000 },
  );
}

async function shown(page) {
  return page.evaluate(() =>
    [...document.querySelectorAll('#table tr[data-layer]')].map((tr) => ({
      key: Number(tr.querySelector('[data-field="key.recon_mse"]').dataset.value),
      value: Number(tr.querySelector('[data-field="value.recon_mse"]').dataset.value),
      keyBits: Number(tr.querySelector('[data-field="key.effective_bits"]').dataset.value),
    })),
  );
}

// The page and the CLI may run on different adapters (DEMO_MSE_REL); structure and bits must
// match exactly.

function assertMatches(rows, cli, what) {
  assert.equal(rows.length, cli.layers.length, what);
  for (const [i, r] of rows.entries()) {
    for (const [got, want] of [[r.key, cli.layers[i].key.recon_mse], [r.value, cli.layers[i].value.recon_mse]]) {
      assert.ok(Math.abs(got - want) <= DEMO_MSE_REL * want, `${what}: layer ${i}: page ${got}, CLI ${want}`);
    }
    assert.equal(r.keyBits, cli.layers[i].key.effective_bits, `${what}: layer ${i} bits`);
  }
}

test('the demo shows the bundled capture as xquant analyze does, and reacts', async () => {
  const page = await chrome.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(server.url);
  await page.waitForSelector('#heatmap[data-ready="1"]', { timeout: 180000 });
  await ready(page);
  // Any adapter: the line names it (and its backend).
  assert.match(await page.textContent('#adapter'), /^GPU: \S.* \(\w+/);

  const before = await shown(page);
  assertMatches(before, cliJson(['analyze', KV]), 'default config');

  await page.selectOption('select[name=residualBits]', '2');
  await ready(page, '"residualBits":2');
  const after = await shown(page);
  assert.notDeepEqual(after, before, 'a knob changes the numbers');
  assertMatches(after, cliJson(['analyze', KV, '--residual-bits', '2']), 'residual 2');

  await page.hover('#heatmap', { position: { x: 100, y: 50 } });
  assert.match(await page.textContent('#hover'), /layer \d+ × layer \d+: cosine/);
  await page.screenshot({ path: join(OUT, 'demo.png'), fullPage: true });

  // Suggest a plan: the strip under the heatmap shows it, the numbers are the plan's as
  // `xquant analyze --plan` computes them, the plan meets its target and can be downloaded.
  await page.fill('#target-bits', '3');
  // Window 32: one group size (32) to measure, half the candidates of window 64's two.
  await page.selectOption('#plan-window', '32');
  await page.click('#suggest');
  // The planner measures 28 candidates per group size through the attention kernels: minutes
  // on SwiftShader.
  await page.waitForSelector('#suggestion[data-effective-bits]', { timeout: 900000 });
  await ready(page, '"plan"');
  const suggested = await page.evaluate(async () => ({
    bits: Number(document.getElementById('suggestion').dataset.effectiveBits),
    strip: JSON.parse(document.getElementById('plan-strip').dataset.plan),
    downloaded: await (await fetch(document.getElementById('download').href)).text(),
  }));
  assert.ok(suggested.bits <= 3 + PLAN_BITS_SLACK, `suggested ${suggested.bits} bits`);
  // The bundled capture has its queries: the plan was chosen by attention output.
  assert.match(await page.textContent('#suggestion'), /attention output error/);
  const planFile = join(OUT, 'suggested-plan.json');
  writeFileSync(planFile, suggested.downloaded);
  assert.deepEqual(JSON.parse(suggested.downloaded), suggested.strip);
  assert.equal(suggested.strip.layers.length, before.length);
  assertMatches(await shown(page), cliJson(['analyze', KV, '--plan', planFile]), 'suggested plan');
  await page.screenshot({ path: join(OUT, 'demo-plan.png'), fullPage: true });

  // A file through the picker.
  const synth = join(OUT, 'synth.safetensors');
  execFileSync(XQUANT, ['synth', '--out', synth, '--layers', '6', '--heads', '2', '--tokens', '64', '--dim', '32']);
  await page.setInputFiles('#file', synth);
  await page.waitForFunction(() => document.querySelectorAll('#table tr[data-layer]').length === 6, null, { timeout: 120000 });
  await ready(page);
  assert.match(await page.textContent('#dataset'), /6 layers/);

  // Something that is not K/V gets a clear message, and the page keeps the last data.
  const bad = join(OUT, 'bad.safetensors');
  const header = JSON.stringify({ 'model.weight': { dtype: 'F32', shape: [2], data_offsets: [0, 8] } });
  const buf = Buffer.alloc(8 + header.length + 8);
  buf.writeBigUInt64LE(BigInt(header.length));
  buf.write(header, 8);
  writeFileSync(bad, buf);
  await page.setInputFiles('#file', bad);
  await page.waitForSelector('#file-error:not([hidden])');
  assert.match(await page.textContent('#file-error'), /past_key_values/);
  assert.equal(await page.evaluate(() => document.querySelectorAll('#table tr[data-layer]').length), 6);
  assert.deepEqual(errors, []);
  await page.close();
});

test('without WebGPU the page says so', async () => {
  const plain = await browser({ webgpu: false });
  const page = await plain.newPage();
  await page.goto(server.url);
  await page.waitForFunction(() => document.body.dataset.nowebgpu === '1', null, { timeout: 60000 });
  assert.match(await page.textContent('#status'), /WebGpuUnavailableError/);
  await plain.close();
});

test('the demo checks its fetch and shows only the latest analysis', async () => {
  // The bundled capture answering 404: a clear message, not a parse error.
  const failing = await chrome.newPage();
  await failing.route('**/data/smollm2-135m-kv.safetensors', (route) => route.fulfill({ status: 404, body: 'not found' }));
  await failing.goto(server.url);
  await failing.waitForFunction(() => document.getElementById('status').dataset.kind === 'error', null, { timeout: 120000 });
  assert.match(await failing.textContent('#status'), /did not load \(HTTP 404\)/);
  await failing.close();

  // Two knob changes in a row, the first analysis made to finish last: the second one's
  // numbers stay on the page.
  const page = await chrome.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(server.url);
  await ready(page);
  const before = await page.evaluate(() => document.body.dataset.config);
  await page.evaluate(async () => {
    const { XQuant } = await import('/pkg/index.js');
    const analyze = XQuant.prototype.analyzeKv;
    let calls = 0;
    XQuant.prototype.analyzeKv = function (...args) {
      const p = analyze.apply(this, args);
      if (calls++ > 0) return p;
      window.slowDone = false;
      return p.finally(() => new Promise((ok) => setTimeout(ok, 3000))).finally(() => (window.slowDone = true));
    };
  });
  await page.selectOption('select[name=residualBits]', '2');
  await page.selectOption('select[name=baseBits]', '3');
  await page.waitForFunction(() => window.slowDone === true, null, { timeout: 180000 });
  await ready(page, '"baseBits":3');
  await new Promise((ok) => setTimeout(ok, 500));
  const config = JSON.parse(await page.evaluate(() => document.body.dataset.config));
  assert.notEqual(JSON.stringify(config), before);
  assert.equal(config.baseBits, 3, 'the latest analysis is shown');
  assert.equal(config.residualBits, 2);
  assert.deepEqual(errors, []);
  await page.close();
});
