// The package as a user installs it, in headless Chromium on WebGPU: a cache set through
// prefill and decode must give what the native CLI gives for the same K/V file.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { CLI_MSE_REL, SIMILARITY_ABS, SIMILARITY_MSE_REL } from './tolerances.mjs';
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { APP, XQUANT, browser, evaluate, cliJson, installApp, openApp, serve } from './harness.mjs';

let server, chrome;

before(async () => {
  installApp();
  execFileSync(XQUANT, ['synth', '--out', join(APP, 'kv.safetensors'), '--layers', '4', '--heads', '2', '--tokens', '40', '--dim', '32', '--dtype', 'f16', '--seed', '5']);
  server = await serve(APP);
  chrome = await browser();
});

after(async () => {
  await chrome?.close();
  server?.close();
});

// Replays kv.safetensors in the page: tokens [0, prefill) as one call per layer, then one
// token per call, like `xquant analyze --prefill`. Returns per-layer MSE, stats and adapter.
async function replayInPage(page, prefill, options) {
  return evaluate(page, 
    async ({ prefill, options }) => {
      const { XQuant } = window.xquant;
      const bytes = new Uint8Array(await (await fetch('kv.safetensors')).arrayBuffer());
      const n = Number(new DataView(bytes.buffer).getBigUint64(0, true));
      const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
      const tensor = (name) => {
        const { data_offsets: [a, b], shape } = header[name];
        return { bits: new Uint16Array(bytes.slice(8 + n + a, 8 + n + b).buffer), shape };
      };
      const half = (h) => {
        const e = (h >> 10) & 31, m = h & 1023, s = h & 32768 ? -1 : 1;
        return e === 0 ? s * m * 2 ** -24 : s * (1 + m / 1024) * 2 ** (e - 15);
      };
      const layers = Object.keys(header).filter((k) => k.endsWith('.key')).length;
      const [B, H, S, D] = tensor('past_key_values.0.key').shape;
      const slice = (bits, a, b) => {
        const out = new Uint16Array(B * H * (b - a) * D);
        for (let r = 0; r < B * H; r++) out.set(bits.subarray((r * S + a) * D, (r * S + b) * D), r * (b - a) * D);
        return out;
      };
      const xq = await XQuant.create();
      const caches = xq.cacheSet({ layers, kvHeads: H, headDim: D, batch: B, ...options });
      const last = [];
      for (let start = 0; start < S; ) {
        const end = start === 0 ? prefill : start + 1;
        for (let l = 0; l < layers; l++) {
          const k = tensor(`past_key_values.${l}.key`).bits, v = tensor(`past_key_values.${l}.value`).bits;
          last[l] = await caches.updateAndFetch(l, slice(k, start, end), slice(v, start, end), end - start);
        }
        start = end;
      }
      const mse = (got, bits) => got.reduce((acc, x, i) => acc + (x - half(bits[i])) ** 2, 0) / got.length;
      const result = last.map((f, l) => ({
        key: mse(f.keys, tensor(`past_key_values.${l}.key`).bits),
        value: mse(f.values, tensor(`past_key_values.${l}.value`).bits),
        tokens: f.tokens,
      }));
      const stats = caches.stats();
      caches.free();
      const adapter = xq.adapterInfo;
      xq.free();
      return { result, stats, adapter };
    },
    { prefill, options },
  );
}

const REFERENCE = { groupSize: 2, residualBits: 4, valueAxis: 'tokens', sinks: 0 };

// Keys and values rotated (Hadamard, per token groups), layer 1 borrowing layer 0's codes;
// layers 2 and 3 with Lloyd-Max levels (a norm per token and group).
const rotatedEntry = (bits, codes = 'own') => ({ codes, bits, axis: 'channels', eta: 0.15, rotation: 'hadamard' });
const lloydEntry = (bits) => ({ codes: 'own', bits, axis: 'channels', rotation: 'hadamard', levels: 'lloyd-max' });
const ROTATED = {
  format: 'xquant-plan', version: 1, name: 'rotated', window: 8, sinks: 2, group_quant_size: 8,
  params: 'f16', rotation_seed: 77,
  layers: [
    { key: rotatedEntry(2), value: rotatedEntry(3) },
    { key: { ...rotatedEntry(2, 0), residual_bits: 2 }, value: rotatedEntry(2) },
    { key: lloydEntry(4), value: { codes: 'own', bits: 2, axis: 'tokens' } },
    { key: { codes: 'own', bits: 2, axis: 'tokens' }, value: lloydEntry(2) },
  ],
};

for (const [name, prefill, cliArgs, options] of [
  // analyze replays with the reference's options by default, the package with the cache
  // set's: the first two cases give the package the reference's.
  ['window policy', 24, ['--window', '8', '--group-quant-size', '8'], { window: 8, groupQuantSize: 8, ...REFERENCE }],
  ['reference policy', 32, ['--decode-policy', 'reference'], { decodePolicy: 'reference', ...REFERENCE }],
  ['a preset plan with sinks', 24, ['--preset', 'kivi-2', '--window', '0', '--sinks', '3'], { plan: 'kivi-2', window: 0, sinks: 3 }],
  ['a rotated plan with Lloyd-Max levels', 24, ['--plan', join(APP, 'rotated-plan.json')], { plan: ROTATED }],
]) {
  test(`cache set prefill + decode matches the native CLI (${name})`, async () => {
    if (typeof options.plan === 'object') writeFileSync(join(APP, 'rotated-plan.json'), JSON.stringify(options.plan));
    const cli = cliJson(['analyze', join(APP, 'kv.safetensors'), '--prefill', String(prefill), ...cliArgs]);
    const { page, errors } = await openApp(chrome, server.url);
    const { result, stats, adapter } = await replayInPage(page, prefill, options);
    console.log(`  adapter in the browser: ${JSON.stringify(adapter)}`);
    assert.equal(result.length, cli.layers.length);
    for (const [l, layer] of cli.layers.entries()) {
      assert.equal(result[l].tokens, 40);
      for (const [field, got] of [['recon_mse_key', result[l].key], ['recon_mse_value', result[l].value]]) {
        const want = layer.cache[field];
        assert.ok(Math.abs(got - want) <= CLI_MSE_REL * want, `layer ${l} ${field}: browser ${got}, CLI ${want}`);
      }
      assert.equal(stats.layers[l].allocatedBytes, layer.cache.allocated_bytes, `layer ${l} allocated bytes`);
      assert.equal(stats.layers[l].accountedBytes, layer.cache.accounted_bytes, `layer ${l} accounted bytes`);
      assert.equal(stats.layers[l].key.codes === 'own' ? 'anchor' : 'reuse', layer.role);
      assert.equal(stats.layers[l].sinkTokens, layer.cache.sink_tokens ?? -1, `layer ${l} sinks`);
    }
    assert.deepEqual(errors, []);
    await page.close();
  });
}

test('primitives in the browser match the CLI analysis', async () => {
  const cli = cliJson(['analyze', join(APP, 'kv.safetensors'), '--params', 'f32']);
  const { page } = await openApp(chrome, server.url);
  const got = await evaluate(page, async () => {
    const { XQuant } = window.xquant;
    const bytes = new Uint8Array(await (await fetch('kv.safetensors')).arrayBuffer());
    const n = Number(new DataView(bytes.buffer).getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
    const bits = (name) => new Uint16Array(bytes.slice(8 + n + header[name].data_offsets[0], 8 + n + header[name].data_offsets[1]).buffer);
    const shape = header['past_key_values.0.key'].shape;
    const xq = await XQuant.create();
    const [k0, k1] = [bits('past_key_values.0.key'), bits('past_key_values.1.key')];
    const q = await xq.quantizeCodes(k0, shape, 2, 32, { params: 'f32' });
    const recon = await xq.dequantWithParams(q, undefined, { outDtype: 'f16' });
    const own = await xq.computeReuseParams(k1, q);
    const bare = await xq.dequantWithParams(q, own, { outDtype: 'f16' });
    const f32 = (b) => Float32Array.from(b, (h) => {
      const e = (h >> 10) & 31, m = h & 1023, s = h & 32768 ? -1 : 1;
      return e === 0 ? s * m * 2 ** -24 : s * (1 + m / 1024) * 2 ** (e - 15);
    });
    const anchorMse = (await xq.crossLayerSimilarity(f32(k0), recon, shape)).mse;
    const bareMse = (await xq.crossLayerSimilarity(f32(k1), bare, shape)).mse;
    const sim = await xq.crossLayerSimilarity(k1, k0, shape);
    const matrix = await xq.similarityMatrix([k0, k1, bits('past_key_values.2.key')], shape);
    xq.free();
    return { anchorMse, bareMse, sim, matrix: Array.from(matrix.cosine) };
  });
  const rel = (a, b) => Math.abs(a - b) / Math.abs(b);
  assert.ok(rel(got.anchorMse, cli.layers[0].key.recon_mse) < CLI_MSE_REL, `anchor ${got.anchorMse} vs ${cli.layers[0].key.recon_mse}`);
  assert.ok(rel(got.bareMse, cli.layers[1].key.recon_mse_no_residual) < CLI_MSE_REL);
  assert.ok(Math.abs(got.sim.cosine - cli.layers[1].key.cosine_to_anchor) < SIMILARITY_ABS);
  assert.ok(rel(got.sim.mse, cli.layers[1].key.mse_to_anchor) < SIMILARITY_MSE_REL);
  assert.equal(got.matrix.length, 9);
  assert.ok(Math.abs(got.matrix[1] - cli.layers[1].key.cosine_to_anchor) < SIMILARITY_ABS);
  await page.close();
});
