// A short generation in Node on the npm `webgpu` package (Dawn, on Chromium's SwiftShader):
// the model read as a Blob with progress, greedy tokens equal to the native `xquant generate`.
// Its own file (process): in node.test.mjs, after that file's GPU instances, loading the
// model hung inside Dawn.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { promisify } from 'node:util';
import { XQUANT, gpuWithAdapter, loadPackage, modelOrSkip, probeGpu, skipWithout } from './gpu.mjs';

test('a short generation in Node: greedy tokens equal the native xquant generate', async (t) => {
  const MODEL = modelOrSkip(t, 'XQ_MODEL');
  if (!MODEL) return;
  const pkg = await loadPackage();
  const { webgpu, missing } = await probeGpu();
  if (!skipWithout(t, missing)) return;
  const gpu = await gpuWithAdapter(webgpu);
  const prompt = 'The capital of France is';
  const { stdout } = await promisify(execFile)(XQUANT, ['generate', '--model', MODEL, '--prompt', prompt, '--max-tokens', '4', '--json']);
  const native = JSON.parse(stdout);
  const xq = await pkg.XQuant.create({ gpu });
  const phases = [];
  const model = await xq.loadModel(new Blob([await readFile(MODEL)]), { onProgress: (p) => phases.push(p.phase) });
  assert.ok(phases.includes('download') && phases.at(-1) === 'load', phases.join());
  assert.deepEqual(Array.from(model.tokenize(prompt)), native.prompt_tokens);
  // SmolLM2 wants no BOS (Gemma does: info.addBos), so `bos` changes nothing here.
  assert.equal(model.info.architecture, 'llama');
  assert.equal(model.info.addBos, false);
  assert.equal(model.info.chatTemplate, true);
  assert.deepEqual(model.info.attentionWindows, new Array(model.info.layers).fill(null), 'every SmolLM2 layer is global');
  assert.deepEqual(Array.from(model.tokenize(prompt, { bos: true })), native.prompt_tokens);
  assert.throws(() => model.tokenize(prompt, { bos: 1 }), (e) => e.name === 'ConfigError' && /bos/.test(e.message));
  const run = model.generate(prompt, { maxTokens: 4 });
  for await (const _ of run);
  assert.deepEqual(run.tokens, native.tokens, `node: ${run.text} / native: ${native.text}`);
  assert.ok(run.text.startsWith(' Paris'), run.text);
  assert.ok(model.stats().tokensPerSecond > 0);
  model.free();
  xq.free();
});
