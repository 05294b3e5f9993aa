// Sliding-window layers in the package (`cacheSet({ attentionWindows })`), in their own Node
// process: a set with one sliding layer against a full set attended with the same window.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { GPUBufferUsage_COPY_SRC, GPUBufferUsage_STORAGE, gpuWithAdapter, loadPackage, probeGpu, random, readBuffer, skipWithout } from './gpu.mjs';

test('attentionWindows: a sliding layer attends and fetches like a full set within its window and holds about its window', async (t) => {
  const pkg = await loadPackage();
  const { webgpu, missing } = await probeGpu();
  if (!skipWithout(t, missing)) return;
  const { XQuant, ConfigError } = pkg;
  const xq = await XQuant.create({ gpu: await gpuWithAdapter(webgpu) });
  const [L, H, D, HQ, A] = [2, 1, 32, 2, 64];
  const shape = { layers: L, kvHeads: H, headDim: D, window: 32, sinks: 4, maxCtx: 1024, outputDtype: 'f32' };
  const slide = xq.cacheSet({ ...shape, attentionWindows: [A, null] });
  const full = xq.cacheSet(shape);
  const rand = random(21);
  const usage = GPUBufferUsage_STORAGE | GPUBufferUsage_COPY_SRC;
  let n = 0;
  for (const chunk of [100, 1, 1, 37, 1, 120, 1, 1, 1]) {
    n += chunk;
    for (let l = 0; l < L; l++) {
      const [k, v] = [rand(H * chunk * D), rand(H * chunk * D)];
      await slide.append(l, k, v, chunk);
      await full.append(l, k, v, chunk);
      const q = rand(HQ * D);
      const window = l === 0 ? A : undefined;
      const a = await slide.attend(l, q, { queryHeads: HQ });
      const b = await full.attend(l, q, { queryHeads: HQ, window });
      for (let i = 0; i < a.length; i++) assert.ok(Math.abs(a[i] - b[i]) <= 2e-4, `${n} tokens, layer ${l}: ${a[i]} vs ${b[i]}`);
    }
  }
  assert.equal(slide.tokens(0), n);
  const held = slide.heldTokens(0);
  assert.ok(held >= A && held < n / 2, `the sliding layer holds ${held} of ${n}`);
  assert.equal(slide.heldTokens(1), n, 'the global layer holds everything');
  const stats = slide.stats();
  assert.equal(stats.layers[0].heldTokens, held);
  assert.equal(stats.layers[0].tokens, n);
  assert.equal(stats.layers[0].sinkTokens, 0, 'the sinks fell out of the window');
  assert.ok(stats.layers[0].allocatedBytes < full.stats().layers[0].allocatedBytes);
  assert.equal(stats.totals.liveTokens, held + n);
  // fetchInto: the held tokens, equal to the full set's last ones.
  const device = xq.device;
  const fetch = async (set, count) => {
    const kb = device.createBuffer({ size: H * count * D * 4, usage });
    const vb = device.createBuffer({ size: H * count * D * 4, usage });
    await set.fetchInto(0, kb, vb);
    const out = await readBuffer(device, kb, H * count * D);
    kb.destroy();
    vb.destroy();
    return out;
  };
  const [mine, all] = [await fetch(slide, held), await fetch(full, n)];
  assert.deepEqual(mine, all.subarray((n - held) * D));
  // Malformed windows are ConfigErrors, and a plan's windows travel with it.
  for (const attentionWindows of [[A], [0, null], [1.5, null], 'x']) {
    assert.throws(() => xq.cacheSet({ ...shape, attentionWindows }), ConfigError, JSON.stringify(attentionWindows));
  }
  assert.equal(slide.plan().layers[0].attention_window, A);
  assert.equal(slide.plan().layers[1].attention_window, undefined);
  slide.free();
  full.free();
  xq.free();
});
