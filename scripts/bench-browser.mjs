// A real model in headless Chromium on WebGPU (SwiftShader where there is no GPU): the prefill
// and decode tokens/s of the f16 cache and of the default XQuant cache, through the npm
// package's documented API on the demo's server (`npm run bench:browser`). A prompt of
// BENCH_PROMPT tokens (default 512) of data/moby-dick-ch1.txt, then BENCH_STEPS
// (default 8) greedy tokens; each cache runs alone, and a first round of both warms up (it
// compiles every pipeline: on SwiftShader a first run's decode is up to 1.8× slower) and is
// not reported. Then two rounds in both orders (f16, XQuant, XQuant, f16: a cache that always
// ran second would carry whatever the first left behind); `summary` gives each cache's mean
// over them and XQuant / f16. BENCH_CACHE: a preset for the XQuant cache instead of the
// default plan. Prints one JSON object (adapter, date, figures). Needs the
// built package (`npm run build`) and the model: SmolLM2-135M from XQ_MODEL, or with the
// argument `gemma3-270m` Gemma 3 270M from XQ_GEMMA (scripts/fetch-model prints either).

import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { ROOT, browser } from '../tests/browser/harness.mjs';
import { serveDemo, CATALOGUE } from './serve.mjs';

const which = CATALOGUE.find((m) => m.id === (process.argv[2] ?? 'smollm2-135m'));
const variable = which?.option === 'gemma' ? 'XQ_GEMMA' : 'XQ_MODEL';
const model = process.env[variable];
if (!which || !model) {
  console.error(`bench-browser [${CATALOGUE.map((m) => m.id).join('|')}]: set ${variable} to the model (bash scripts/fetch-model prints its path)`);
  process.exit(2);
}
const promptTokens = Number(process.env.BENCH_PROMPT || 512);
const steps = Number(process.env.BENCH_STEPS || 8);
const preset = process.env.BENCH_CACHE || undefined;
const text = readFileSync(join(ROOT, 'data', 'moby-dick-ch1.txt'), 'utf8');

const server = await serveDemo(0, { model: null, gemma: null, [which.option]: model });
const chrome = await browser();
try {
  const page = await chrome.newPage();
  await page.goto(server.url);
  const result = await page.evaluate(
    async ({ url, text, promptTokens, steps, preset }) => {
      const { XQuant } = await import('/pkg/index.js');
      const xq = await XQuant.create();
      const m = await xq.loadModel(url);
      // BOS first where the model wants it (Gemma).
      const ids = Array.from(m.tokenize(text, { special: false, bos: true })).slice(0, promptTokens);
      if (ids.length < promptTokens) throw new Error(`the text has only ${ids.length} tokens`);
      const rows = [];
      for (const cache of ['f16', preset, 'f16', preset, preset, 'f16']) {
        const gen = m.generate(ids, { maxTokens: steps, cache, maxCtx: promptTokens + steps });
        for await (const _ of gen) {
          // the figures come from stats()
        }
        const s = m.stats();
        rows.push({
          cache: s.cache,
          promptTokens: s.promptTokens,
          generatedTokens: s.generatedTokens,
          prefillTokensPerSecond: s.prefillTokensPerSecond,
          decodeTokensPerSecond: s.tokensPerSecond,
          kvAllocatedBytes: s.kvAllocatedBytes,
        });
        gen.cache.free();
      }
      const adapter = xq.adapterInfo;
      m.free();
      return { adapter, warmup: rows.slice(0, 2), rows: rows.slice(2) };
    },
    { url: which.path, text, promptTokens, steps, preset },
  );
  const out = { model: which.name, date: new Date().toISOString().slice(0, 10), promptTokens, steps, plan: preset ?? 'default', ...result };
  for (const r of [...out.warmup, ...out.rows]) r.prefillOverDecode = r.prefillTokensPerSecond / r.decodeTokensPerSecond;
  const mean = (cache, key) => {
    const xs = out.rows.filter((r) => r.cache === cache).map((r) => r[key]);
    return xs.reduce((a, b) => a + b, 0) / xs.length;
  };
  const xquant = out.rows.find((r) => r.cache !== 'f16').cache;
  const of = (cache) => ({
    prefillTokensPerSecond: mean(cache, 'prefillTokensPerSecond'),
    decodeTokensPerSecond: mean(cache, 'decodeTokensPerSecond'),
  });
  out.summary = { f16: of('f16'), xquant: of(xquant) };
  out.summary.decodeXquantOverF16 = out.summary.xquant.decodeTokensPerSecond / out.summary.f16.decodeTokensPerSecond;
  out.summary.prefillXquantOverF16 = out.summary.xquant.prefillTokensPerSecond / out.summary.f16.prefillTokensPerSecond;
  console.log(JSON.stringify(out, null, 2));
} finally {
  await chrome.close();
  server.close();
}
