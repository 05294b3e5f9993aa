// Seeded fuzzing of the JS API's argument conversion: random argument values (wrong types,
// null/undefined, NaN, huge and negative numbers, typed arrays of wrong lengths and types,
// option objects mixing valid and invalid keys, random bytes as files). Every call must
// succeed or fail with an XQuantError subclass — never a RuntimeError (a wasm panic), a
// TypeError from inside the package, or a hang — and the instance must stay usable.
// XQ_FUZZ_SEED and XQ_FUZZ_CALLS change the seed (default 11) and the number of calls.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { appSession, evaluate, openApp } from './harness.mjs';

const SEED = Number(process.env.XQ_FUZZ_SEED ?? 11);
const CALLS = Number(process.env.XQ_FUZZ_CALLS ?? 20000);

const app = appSession();

test(`fuzzed arguments give typed errors only (seed ${SEED}, ${CALLS} calls)`, async () => {
  const { page, errors } = await openApp(app.chrome, app.server.url);
  const started = Date.now();
  const r = await evaluate(
    page,
    async ({ seed, calls }) => {
      const m = window.xquant;
      let s = seed >>> 0 || 1;
      const rnd = () => {
        // xorshift32
        s ^= s << 13;
        s >>>= 0;
        s ^= s >>> 17;
        s ^= s << 5;
        s >>>= 0;
        return s / 4294967296;
      };
      const int = (n) => Math.floor(rnd() * n);
      const pick = (xs) => xs[int(xs.length)];
      const xq = await m.XQuant.create();
      const dev = xq.device;
      const U = GPUBufferUsage;
      const liveBuffer = dev.createBuffer({ size: 4096, usage: U.STORAGE | U.COPY_DST | U.COPY_SRC });
      const deadBuffer = dev.createBuffer({ size: 4096, usage: U.STORAGE });
      deadBuffer.destroy();
      const mapBuffer = dev.createBuffer({ size: 256, usage: U.MAP_READ | U.COPY_DST });
      const good = await xq.quantizeCodes(new Float32Array(64).map((_, i) => Math.sin(i)), [8, 8], 2, 8);

      const small = () => pick([0, 1, 2, 3, 4, 8, 16, 32, 64]);
      const num = () =>
        pick([undefined, null, NaN, Infinity, -Infinity, -1, -0, 0, 1, 2, 3, 4, 7, 8, 9, 32, 1.5, 2 ** 31, 2 ** 32, 2 ** 53, 1e300, -1e9]);
      const typed = () => {
        const n = pick([0, 1, 7, 8, 16, 32, 64, 128, 256, int(300)]);
        const C = pick([Float32Array, Float32Array, Uint16Array, Int32Array, Float64Array, Uint8Array, Uint32Array]);
        const a = new C(n);
        for (let i = 0; i < n; i++) a[i] = C === Float32Array || C === Float64Array ? pick([rnd() * 4 - 2, rnd(), 0, NaN, 1e30]) : int(65536);
        return a;
      };
      const bytes = () => {
        const b = new Uint8Array(pick([0, 4, 8, 16, 64, 200]));
        for (let i = 0; i < b.length; i++) b[i] = int(256);
        // Sometimes a plausible header length and JSON.
        if (b.length >= 16 && rnd() < 0.5) {
          const header = new TextEncoder().encode(
            pick([
              '{}',
              '{"past_key_values.0.key":{"dtype":"F16","shape":[1,1,4,8],"data_offsets":[0,64]}}',
              '{"a":1}',
              '[',
            ]),
          );
          const out = new Uint8Array(8 + header.length + pick([0, 64, 128]));
          new DataView(out.buffer).setBigUint64(0, BigInt(pick([header.length, 1e6, 0])), true);
          out.set(header, 8);
          return out;
        }
        return rnd() < 0.2 ? b.buffer : b;
      };
      const shape = () => pick([undefined, null, 'x', [], [8], [8, 8], [2, 4], [1, 8, 8], [0, 8], [small(), small()], [-1, 8], [1.5, 8], ['8', 8], [2 ** 31, 2 ** 31]]);
      const KEYS = [
        'layers', 'kvHeads', 'headDim', 'batch', 'groupSize', 'baseBits', 'residualBits', 'groupQuantSize', 'maxCtx', 'eta',
        'valueAxis', 'params', 'window', 'sinks', 'decodePolicy', 'outputDtype', 'pageTokens', 'plan', 'queryHeads', 'tokens',
        'pos0', 'scale', 'window', 'layout', 'dtype', 'outDtype', 'offset', 'outOffset', 'keysOffset', 'valuesOffset', 'targetBits',
        'context', 'levels', 'kvError', 'queries', 'residualbits', 'maxCTX', 'kvHeadz', '__proto__', 'constructor', 'toString',
      ];
      const STRINGS = ['tokens', 'channels', 'f16', 'f32', 'window', 'reference', 'heads', 'kivi-2', 'xquant-paper', 'reference', 'lloyd-max', 'lloyd-2.5', 'uniform', '{', '{"layers":[]}', ''];
      const anyValue = (depth = 0) => {
        switch (int(depth > 1 ? 9 : 12)) {
          case 0: return num();
          case 1: return small();
          case 2: return pick(STRINGS);
          case 3: return pick([true, false, Symbol('s'), 10n, () => 1]);
          case 4: return typed();
          case 5: return pick([liveBuffer, deadBuffer, mapBuffer, { size: 4096, usage: U.STORAGE }, { size: -1, usage: 'x' }]);
          case 6: return bytes();
          case 7: return rnd() < 0.5 ? good : { ...good, codes: typed(), shape: shape(), bits: num() };
          case 8: return small();
          default: return options(depth + 1);
        }
      };
      function options(depth = 0) {
        const r = rnd();
        if (r < 0.1) return pick([undefined, null, 5, 'x', [], () => 1]);
        const o = {};
        const n = int(5);
        for (let i = 0; i < n; i++) o[pick(KEYS)] = rnd() < 0.5 ? small() : anyValue(depth + 1);
        return o;
      }
      const cacheOptions = () => {
        const o = { layers: pick([1, 2, 3]), kvHeads: pick([1, 2]), headDim: pick([4, 8, 16]), window: pick([0, 8]), groupQuantSize: 8 };
        if (rnd() < 0.6) Object.assign(o, options());
        return o;
      };
      const sets = [xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8, maxCtx: 256 })];
      const set = () => pick(sets);
      const arg = () => (rnd() < 0.6 ? pick([typed(), small(), num(), shape()]) : anyValue());

      const ops = [
        () => m.XQuant.create(rnd() < 0.7 ? pick([{ wasm: arg() }, { powerPreference: arg() }, { device: arg() }, options()]) : anyValue()),
        () => {
          const c = xq.cacheSet(rnd() < 0.8 ? cacheOptions() : anyValue());
          if (sets.length < 6) sets.push(c);
          else c.free();
        },
        () => set().append(pick([0, 1, 2, num()]), arg(), arg(), pick([1, 2, num()]), rnd() < 0.5 ? undefined : options()),
        () => {
          const t = pick([1, 2, 4]);
          const a = new Float32Array(t * 8).map(() => rnd() * 2 - 1);
          return set().append(pick([0, 1]), a, a, t, rnd() < 0.7 ? undefined : options());
        },
        () => set().updateAndFetch(pick([0, 1, num()]), arg(), arg(), pick([1, num()])),
        () => set().updateAndFetchGpu(pick([0, 1, num()]), arg(), arg(), pick([1, num()])),
        () => set().attend(pick([0, 1, num()]), arg(), rnd() < 0.5 ? { queryHeads: pick([1, 2, num()]), ...options() } : anyValue()),
        () => set().attendGpu(pick([0, 1, num()]), anyValue(), anyValue(), rnd() < 0.5 ? { queryHeads: pick([1, 2]), ...options() } : anyValue()),
        () => set().fetchInto(pick([0, 1, num()]), anyValue(), anyValue(), options()),
        () => set().tokens(anyValue()),
        () => set().stats(),
        () => set().plan(),
        () => (rnd() < 0.1 ? set().reset() : set().tokens(0)),
        () => xq.pairLayers(num(), num()),
        () => xq.quantizeCodes(arg(), shape(), pick([2, 3, num(), '2']), pick([4, 8, num()]), options()),
        () => xq.computeReuseParams(arg(), anyValue()),
        () => xq.dequantWithParams(anyValue(), rnd() < 0.5 ? undefined : anyValue(), options()),
        () => xq.quantizeResidual(arg(), arg(), shape(), pick([2, num()]), pick([8, num()]), options()),
        () => xq.crossLayerSimilarity(arg(), arg(), shape()),
        () => xq.similarityMatrix(rnd() < 0.5 ? [arg(), arg()] : anyValue(), shape()),
        () => xq.analyzeKv(rnd() < 0.8 ? bytes() : anyValue(), options()),
        () => xq.suggestPlan(rnd() < 0.8 ? bytes() : anyValue(), options()),
        () => xq.kvSimilarity(rnd() < 0.8 ? bytes() : anyValue()),
      ];

      const outcomes = {};
      const bad = [];
      const note = (k) => (outcomes[k] = (outcomes[k] ?? 0) + 1);
      const within = (p, ms) =>
        Promise.race([p, new Promise((_, no) => setTimeout(() => no(new Error('__hang__')), ms))]);
      for (let i = 0; i < calls; i++) {
        const which = int(ops.length);
        try {
          const v = ops[which]();
          const settled = await within(Promise.resolve(v), 10000);
          if (settled instanceof m.XQuant) settled.free();
          note('ok');
        } catch (e) {
          if (e instanceof m.XQuantError) note(e.name);
          else {
            note('untyped');
            if (bad.length < 20) bad.push({ call: i, op: which, error: `${e?.constructor?.name}: ${e?.message}` });
          }
        }
      }
      // Still usable: a primitive, a fresh cache set, and every set frees.
      let usable;
      try {
        const q = await xq.quantizeCodes(new Float32Array(64).map((_, i) => Math.cos(i)), [8, 8], 2, 8);
        const c = xq.cacheSet({ layers: 1, kvHeads: 1, headDim: 8, window: 8, groupQuantSize: 8 });
        const f = await c.updateAndFetch(0, new Float32Array(8).fill(0.25), new Float32Array(8).fill(0.25), 1);
        for (const x of sets) x.free();
        c.free();
        xq.free();
        usable = q.bits === 2 && f.tokens === 1;
      } catch (e) {
        usable = `${e?.constructor?.name}: ${e?.message}`;
      }
      return { outcomes, bad, usable };
    },
    { seed: SEED, calls: CALLS },
    300000,
  );
  const seconds = (Date.now() - started) / 1000;
  console.log(`  ${CALLS} calls in ${seconds.toFixed(1)} s: ${JSON.stringify(r.outcomes)}`);
  assert.deepEqual(r.bad, [], 'every failure is an XQuantError');
  assert.equal(r.usable, true);
  assert.ok(r.outcomes.ok > CALLS / 20, 'a fair share of the calls succeed');
  assert.deepEqual(errors, [], 'no page errors (no panics)');
  await page.close();
});
