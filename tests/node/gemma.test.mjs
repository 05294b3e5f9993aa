// Gemma 3 270M ($XQ_GEMMA, Q4_K_M) in Node on the npm `webgpu` package (Dawn, on Chromium's
// SwiftShader), in its own process: the model as a Blob, what `info` says about it, and
// greedy tokens over the f16 cache and the default XQuant cache equal to the native
// `xquant generate`'s.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { promisify } from 'node:util';
import { XQUANT, gpuWithAdapter, loadPackage, modelOrSkip, probeGpu, skipWithout } from './gpu.mjs';

const PROMPT = 'The Eiffel Tower is located in the city of';
const TOKENS = 4;

async function native(model, cache) {
  const args = ['generate', '--model', model, '--prompt', PROMPT, '--max-tokens', String(TOKENS), '--cache', cache, '--json'];
  const { stdout } = await promisify(execFile)(XQUANT, args, { encoding: 'utf8', maxBuffer: 1 << 24 });
  return JSON.parse(stdout);
}

test('Gemma 3 in Node: info, BOS, no chat template, greedy tokens of both caches equal the native xquant generate', { timeout: 900000 }, async (t) => {
  const file = modelOrSkip(t, 'XQ_GEMMA');
  if (!file) return;
  const pkg = await loadPackage();
  const { webgpu, missing } = await probeGpu();
  if (!skipWithout(t, missing)) return;
  // The native runs go first (their GPU is lavapipe, the two would share the 2 cores).
  const want = { f16: await native(file, 'f16'), xquant: await native(file, 'xquant') };
  const xq = await pkg.XQuant.create({ gpu: await gpuWithAdapter(webgpu) });
  const started = Date.now();
  const model = await xq.loadModel(new Blob([await readFile(file)]));
  t.diagnostic(`loaded in ${((Date.now() - started) / 1000).toFixed(1)} s`);
  const i = model.info;
  assert.equal(i.architecture, 'gemma3');
  assert.deepEqual([i.layers, i.heads, i.kvHeads, i.headDim, i.hidden, i.vocab], [18, 4, 1, 256, 640, 262144]);
  assert.equal(i.addBos, true);
  assert.equal(i.chatTemplate, false, 'a base model');
  assert.throws(() => model.chatTemplate([{ role: 'user', content: 'hi' }]), (e) => e.name === 'ConfigError');
  assert.deepEqual(
    i.attentionWindows,
    Array.from({ length: 18 }, (_, l) => (l % 6 === 5 ? null : 512)),
    'every sixth layer global, the others sliding over 512 tokens',
  );
  assert.deepEqual(Array.from(model.tokenize(PROMPT, { bos: true })), want.f16.prompt_tokens, 'BOS first, as natively');
  assert.equal(model.tokenize(PROMPT).length, want.f16.prompt_tokens.length - 1);
  for (const cache of ['f16', 'xquant']) {
    const run = model.generate(PROMPT, { maxTokens: TOKENS, ...(cache === 'f16' ? { cache: 'f16' } : {}) });
    for await (const _ of run);
    assert.deepEqual(run.tokens, want[cache].tokens, `${cache}: node "${run.text}" / native "${want[cache].text}"`);
    t.diagnostic(`${cache}: "${run.text}", ${model.stats().tokensPerSecond.toFixed(2)} tokens/s`);
  }
  assert.match(want.f16.text, /Paris/);
  model.free();
  xq.free();
});
