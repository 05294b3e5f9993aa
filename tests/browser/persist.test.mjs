// A conversation's cache saved in the browser and restored: the restored set continues
// exactly like the original; malformed bytes reject with FormatError and allocate nothing.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { appSession, evaluate, openApp } from './harness.mjs';

const app = appSession();

test('save → restore continues bit for bit; bad bytes are FormatErrors', async () => {
  const { page, errors } = await openApp(app.chrome, app.server.url);
  const r = await evaluate(page, async () => {
    const { XQuant, FormatError } = window.xquant;
    const [L, H, D, HQ] = [3, 2, 32, 4];
    let seed = 11;
    const rand = (n) =>
      Float32Array.from({ length: n }, () => {
        seed = (seed * 1103515245 + 12345) % 2147483648;
        return (seed / 2147483648) * 4 - 2;
      });
    const xq = await XQuant.create();
    const options = { layers: L, kvHeads: H, headDim: D, window: 32, groupQuantSize: 32, pageTokens: 64, maxCtx: 1024 };
    const original = xq.cacheSet(options);
    for (const t of [37, 1, 64, 5, 1]) {
      for (let l = 0; l < L; l++) await original.append(l, rand(H * t * D), rand(H * t * D), t);
    }
    const bytes = await original.save();
    const out = { saved: bytes.byteLength, allocated: original.stats().totals.allocatedBytes };
    const restored = await xq.restoreCacheSet(bytes.buffer.slice(0));
    out.sameStats = JSON.stringify(restored.stats()) === JSON.stringify(original.stats());
    out.sameBytes = (await restored.save()).every((b, i) => b === bytes[i]);

    // Both continue with the same tokens: attention outputs are identical.
    out.differences = 0;
    for (const t of [1, 1, 40, 1]) {
      for (let l = 0; l < L; l++) {
        const [k, v, q] = [rand(H * t * D), rand(H * t * D), rand(HQ * D)];
        await original.append(l, k, v, t);
        await restored.append(l, k, v, t);
        const [a, b] = await Promise.all([
          original.attend(l, q, { queryHeads: HQ }),
          restored.attend(l, q, { queryHeads: HQ }),
        ]);
        for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) out.differences++;
      }
    }
    out.tokens = [original.tokens(0), restored.tokens(0)];

    // Malformed bytes: FormatError, nothing allocated.
    const before = xq.allocatedBytes();
    const refused = async (b) => {
      try {
        (await xq.restoreCacheSet(b)).free();
        return 'restored';
      } catch (e) {
        return e instanceof FormatError ? 'FormatError' : `${e.name}: ${e.message}`;
      }
    };
    const corrupt = bytes.slice();
    corrupt[corrupt.length >> 1] ^= 1;
    const version = bytes.slice();
    version[8] = 9;
    out.bad = [
      await refused(corrupt),
      await refused(bytes.slice(0, bytes.length - 1)),
      await refused(bytes.slice(0, 20)),
      await refused(version),
      await refused(new Uint8Array(0)),
      await refused(new TextEncoder().encode('not a cache at all')),
      await refused('bytes'),
    ];
    out.leaked = xq.allocatedBytes() - before;
    restored.free();
    original.free();
    xq.free();
    return out;
  });
  assert.deepEqual(errors, []);
  console.log(`saved ${r.saved} bytes for ${r.allocated} allocated bytes`);
  assert.ok(r.sameStats, 'stats differ after restore');
  assert.ok(r.sameBytes, 'save → restore → save changed the bytes');
  assert.equal(r.differences, 0);
  assert.deepEqual(r.tokens, [151, 151]);
  assert.deepEqual(r.bad, Array(7).fill('FormatError'));
  assert.equal(r.leaked, 0);
});
