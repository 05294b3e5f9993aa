// SmolLM2-135M in headless Chromium on WebGPU (SwiftShader where there is no GPU): the prefill
// and decode tokens/s of the f16 cache and of the default XQuant cache, through the npm
// package's documented API on the demo's server (`npm run bench:browser`). A prompt of
// BENCH_PROMPT tokens (default 512) of data/moby-dick-ch1.txt, then BENCH_STEPS
// (default 8) greedy tokens; each cache runs alone, f16 and XQuant alternating, and a first
// round warms up (it compiles every pipeline: on SwiftShader a first run's decode is up to 1.8×
// slower) and is not reported. Prints one JSON object (adapter, date, figures). Needs the
// built package (`npm run build`) and XQ_MODEL (scripts/fetch-model).

import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { ROOT, browser } from '../tests/browser/harness.mjs';
import { serveDemo, MODEL_PATH } from './serve.mjs';

const model = process.env.XQ_MODEL;
if (!model) {
  console.error('bench-browser: set XQ_MODEL to the model (bash scripts/fetch-model prints its path)');
  process.exit(2);
}
const promptTokens = Number(process.env.BENCH_PROMPT || 512);
const steps = Number(process.env.BENCH_STEPS || 8);
const text = readFileSync(join(ROOT, 'data', 'moby-dick-ch1.txt'), 'utf8');

const server = await serveDemo(0, { model });
const chrome = await browser();
try {
  const page = await chrome.newPage();
  await page.goto(server.url);
  const result = await page.evaluate(
    async ({ url, text, promptTokens, steps }) => {
      const { XQuant } = await import('/pkg/index.js');
      const xq = await XQuant.create();
      const m = await xq.loadModel(url);
      const ids = Array.from(m.tokenize(text, { special: false })).slice(0, promptTokens);
      if (ids.length < promptTokens) throw new Error(`the text has only ${ids.length} tokens`);
      const rows = [];
      for (const cache of ['f16', undefined, 'f16', undefined]) {
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
    { url: MODEL_PATH, text, promptTokens, steps },
  );
  const out = { date: new Date().toISOString().slice(0, 10), promptTokens, steps, ...result };
  for (const r of [...out.warmup, ...out.rows]) r.prefillOverDecode = r.prefillTokensPerSecond / r.decodeTokensPerSecond;
  console.log(JSON.stringify(out, null, 2));
} finally {
  await chrome.close();
  server.close();
}
