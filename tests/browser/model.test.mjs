// The model runtime in the package, as a web developer adds a local LLM to a page: load
// SmolLM2 from a URL with progress, tokenize, chat template, stream a generation over an
// XQuant cache and continue it, sample with a seed, abort, capture K/V for the analysis, and
// the errors. (The demo's test compares greedy tokens with native `xquant generate`.)

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { APP, ROOT, appSession, evaluate, openApp } from './harness.mjs';

const MODEL = process.env.XQ_MODEL;
const skip = !MODEL && (process.env.REQUIRE_MODEL === '1' ? false : 'XQ_MODEL is not set (scripts/fetch-model)');
const app = appSession();

test('the model API in the page: load, tokenize, generate, continue, sample, abort, capture, errors', { skip }, async () => {
  if (!MODEL) throw new Error('REQUIRE_MODEL=1 but XQ_MODEL is not set');
  symlinkSync(MODEL, join(APP, 'model.gguf'));
  // A truncated copy: the header and part of the metadata.
  writeFileSync(join(APP, 'truncated.gguf'), readFileSync(MODEL).subarray(0, 100000));
  const hf = JSON.parse(readFileSync(join(ROOT, 'tests/data/tokenizer_hf_ids.json'), 'utf8')).cases.slice(0, 3);
  const { page, errors } = await openApp(app.chrome, app.server.url);
  const r = await evaluate(
    page,
    async ({ hf }) => {
      const { XQuant } = window.xquant;
      const xq = await XQuant.create();
      const caught = async (f) => {
        try {
          await f();
          return 'no error';
        } catch (e) {
          return `${e.name}: ${e.message}`;
        }
      };
      const out = { adapter: xq.adapterInfo.name };
      const progress = [];
      const model = await xq.loadModel(new URL('model.gguf', location.href), { onProgress: (p) => progress.push(p) });
      out.progress = progress;
      out.info = model.info;

      out.tokenized = hf.map((c) => Array.from(model.tokenize(c.text)));
      out.roundTrip = hf.map((c) => model.detokenize(c.ids) === c.text);
      out.chat = model.chatTemplate([
        { role: 'system', content: 'Be brief.' },
        { role: 'user', content: 'Hi' },
      ]);
      out.chatIds = Array.from(model.tokenize('<|im_start|>user')).length;

      // Greedy over the default XQuant cache, then a second turn on the same cache.
      const g = model.generate('The capital of France is', { maxTokens: 3 });
      const pieces = [];
      for await (const p of g) pieces.push(p);
      out.first = { pieces, tokens: g.tokens, text: g.text, finish: g.finishReason, stats: model.stats(), cacheTokens: g.cache.tokens(0) };
      out.firstText = model.detokenize(g.tokens);
      out.setStats = g.cache.stats().totals;
      // Saved and restored, the conversation continues exactly as the original does.
      const saved = await g.cache.save();
      const restored = await model.restoreCache(saved);
      const g2 = model.generate(' Its river is the', { maxTokens: 2, cache: g.cache });
      for await (const _ of g2);
      out.second = { tokens: g2.tokens, sameCache: g2.cache === g.cache, cacheTokens: g.cache.tokens(0), prompt: g2.promptTokens.length };
      const r2 = model.generate(' Its river is the', { maxTokens: 2, cache: restored });
      for await (const _ of r2);
      out.restored = { tokens: r2.tokens, isSet: restored instanceof window.xquant.CacheSet, saved: saved.byteLength };
      const other = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64 });
      const otherBytes = await other.save();
      out.otherModel = await caught(() => model.restoreCache(otherBytes));
      out.corrupt = await caught(() => model.restoreCache(saved.slice(0, 100)));

      // Sampling: the same seed draws the same tokens.
      const sample = async (seed) => {
        const s = model.generate('Once upon a time', { maxTokens: 3, cache: 'f16', temperature: 1.2, topK: 40, topP: 0.95, seed });
        for await (const _ of s);
        s.cache.free();
        return s.tokens;
      };
      out.sampled = [await sample(11), await sample(11)];

      // Abort after the first token: the iteration throws the signal's reason.
      const ac = new AbortController();
      const a = model.generate('The capital of France is', { maxTokens: 5, cache: 'f16', signal: ac.signal });
      out.aborted = await caught(async () => {
        for await (const _ of a) ac.abort();
      });
      out.abortedState = { finish: a.finishReason, tokens: a.tokens.length, cacheTokens: a.cache.tokens() };

      // Capture feeds the analysis.
      const kv = await model.capture('It is a truth universally acknowledged');
      const report = await xq.analyzeKv(kv);
      out.capture = { bytes: kv.byteLength, layers: report.layers?.length ?? report.n_layers ?? null, keys: Object.keys(report).slice(0, 8) };
      // With its queries: the planner judges by attention, and says 6 tokens are too few; a
      // file without queries is refused unless kvError asks for the K/V error (planned at one
      // group size: each size's ~70 group-quantization pipelines take SwiftShader ~20 s to
      // build on first use; the search over sizes is tests/cli.rs's).
      const withQueries = await model.capture('It is a truth universally acknowledged', { queries: true });
      const plan = { targetBits: 4, window: 0, sinks: 1 };
      out.suggest = {
        queryBytes: withQueries.byteLength - kv.byteLength,
        short: await caught(() => xq.suggestPlan(withQueries, plan)),
        noQueries: await caught(() => xq.suggestPlan(kv, plan)),
        kvError: (await xq.suggestPlan(kv, { ...plan, kvError: true, groupQuantSize: 32 })).keyError,
        badOption: await caught(() => model.capture('x', { queries: 1 })),
      };

      // Errors: typed, and the model keeps working.
      out.errors = {
        missing: await caught(() => xq.loadModel('missing.gguf')),
        truncated: await caught(() => xq.loadModel('truncated.gguf')),
        notGguf: await caught(() => xq.loadModel(new Uint8Array(64))),
        badSource: await caught(() => xq.loadModel(42)),
        unknownOption: await caught(() => model.generate('x', { maxToken: 3 })),
        temperature: await caught(() => model.generate('x', { temperature: -1 })),
        emptyPrompt: await caught(() => model.generate('')),
        badIds: await caught(() => model.detokenize([1, -2])),
        badRole: await caught(() => model.chatTemplate([{ role: 'robot', content: 'x' }])),
        twice: await caught(async () => {
          const t = model.generate('x', { maxTokens: 1, cache: 'f16' });
          for await (const _ of t);
          for await (const _ of t);
        }),
      };
      const again = model.generate('The capital of France is', { maxTokens: 1, cache: 'f16' });
      for await (const _ of again);
      out.afterErrors = again.tokens;
      model.free();
      out.freed = await caught(() => model.generate('x'));
      xq.free();
      return out;
    },
    { hf },
    600000,
  );

  // Progress: the download streamed to the file's size, then the load.
  const size = statSync(MODEL).size;
  const downloads = r.progress.filter((p) => p.phase === 'download');
  assert.ok(downloads.length > 1, `download progress events: ${downloads.length}`);
  assert.ok(downloads.every((p, i) => p.total === size && (i === 0 || p.loaded >= downloads[i - 1].loaded)), JSON.stringify(downloads.slice(0, 3)));
  assert.equal(downloads.at(-1).loaded, size);
  assert.deepEqual(r.progress.at(-1), { phase: 'load', loaded: size, total: size });
  assert.equal(r.info.layers, 30);
  assert.equal(r.info.kvHeads, 3);

  // The tokenizer agrees with HuggingFace's ids and decodes them back.
  assert.deepEqual(r.tokenized, hf.map((c) => c.ids));
  assert.deepEqual(r.roundTrip, hf.map(() => true));
  assert.equal(r.chat, '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n');
  assert.equal(r.chatIds, 2, '<|im_start|> is one control token');

  console.log(`browser (${r.adapter}): XQuant decode ${r.first.stats.tokensPerSecond.toFixed(2)} tokens/s, prefill ${r.first.stats.prefillTokensPerSecond.toFixed(2)} tokens/s`);
  // The first turn: pieces stream, the text is the tokens', the cache holds every token.
  const first = r.first;
  assert.equal(first.tokens.length, 3);
  assert.equal(first.finish, 'maxTokens');
  assert.ok(first.text.startsWith(' Paris'), first.text);
  assert.equal(first.text, r.firstText);
  assert.deepEqual(first.pieces.map((p) => p.index), [0, 1, 2]);
  assert.deepEqual(first.pieces.map((p) => p.cacheTokens), [6, 7, 8]);
  assert.equal(first.cacheTokens, 8);
  assert.ok(first.pieces.every((p) => p.kvAllocatedBytes > 0));
  assert.equal(first.pieces.at(-1).kvAllocatedBytes, r.setStats.allocatedBytes);
  assert.equal(first.stats.cache, 'xquant');
  assert.equal(first.stats.generatedTokens, 3);
  assert.equal(first.stats.promptTokens, 5);
  assert.ok(first.stats.tokensPerSecond > 0 && first.stats.prefillMs > 0);
  // The second turn continues on the same cache after every earlier token.
  assert.ok(r.second.sameCache);
  assert.equal(r.second.tokens.length, 2);
  assert.equal(r.second.cacheTokens, 8 + r.second.prompt + 2);

  assert.deepEqual(r.restored.tokens, r.second.tokens, 'the restored cache continues as the original');
  assert.ok(r.restored.isSet);
  assert.match(r.otherModel, /^FormatError: .*layers/);
  assert.match(r.corrupt, /^FormatError: /);

  // Sampling is reproducible with a seed.
  assert.deepEqual(r.sampled[0], r.sampled[1]);
  assert.equal(r.sampled[0].length, 3);

  // Abort: AbortError, the tokens so far kept.
  assert.match(r.aborted, /^AbortError/);
  assert.equal(r.abortedState.finish, 'aborted');
  assert.equal(r.abortedState.tokens, 1);
  assert.equal(r.abortedState.cacheTokens, 6);

  assert.ok(r.capture.bytes > 30 * 2 * 3 * 6 * 64 * 2, `capture bytes ${r.capture.bytes}`);
  // 30 layers of 9 query heads x 6 tokens x 64 f16 queries, plus their headers.
  assert.ok(r.suggest.queryBytes >= 30 * 9 * 6 * 64 * 2, `query bytes ${r.suggest.queryBytes}`);
  assert.match(r.suggest.short, /^ConfigError: .*6 tokens.*at least 64/);
  assert.match(r.suggest.noQueries, /^ConfigError: suggestPlan: the file has no queries .*kvError: true/);
  assert.equal(r.suggest.kvError, 'relative');
  assert.match(r.suggest.badOption, /^ConfigError: capture option `queries`: expected true or false, got 1/);

  const e = r.errors;
  assert.match(e.missing, /^IoError: .*HTTP 404/);
  assert.match(e.truncated, /^FormatError: /);
  assert.match(e.notGguf, /^FormatError: /);
  assert.match(e.badSource, /^ConfigError: loadModel: the source must be/);
  assert.match(e.unknownOption, /^ConfigError: .*maxToken.*did you mean `maxTokens`/);
  assert.match(e.temperature, /^ConfigError: temperature/);
  assert.match(e.emptyPrompt, /^ShapeError: /);
  assert.match(e.badIds, /^ShapeError: detokenize\[1\]/);
  assert.match(e.badRole, /^ConfigError: messages\[0\]\.role/);
  assert.match(e.twice, /^UsageError: /);
  assert.equal(r.afterErrors.length, 1);
  assert.match(r.freed, /^UsageError: this Model was freed/);
  // The console's only error is the browser's own line for the deliberate 404.
  assert.deepEqual(errors, ['Failed to load resource: the server responded with a status of 404 (Not Found)']);
});
