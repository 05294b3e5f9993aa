// The Generate panel: a model the server offers (SmolLM2-135M-Instruct, Gemma 3 270M: picked
// from /models/index.json) or a GGUF file runs in the page on WebGPU, once with an f16 cache
// and once with XQuant (the analysis' knobs or its suggested plan), one after the other; both
// stream their text, the first differing token is marked, a chart follows the KV bytes per
// token; Capture sends the K/V of the typed text to the analysis above; the XQuant
// conversation is kept in IndexedDB (store.js) and can be continued after a reload.

import { KvChart } from './kv-chart.js';
import { StoreError, forgetConversation, loadConversation, saveConversation } from './store.js';

/** Where scripts/serve.mjs serves SmolLM2 (`npm start` fetches it once). */
export const MODEL_URL = new URL('models/smollm2-135m-instruct.gguf', location.href).href;
/** The models the server offers: `[{ id, name, url, bytes }]` (scripts/serve.mjs). */
const INDEX_URL = new URL('models/index.json', location.href).href;

const SERVED_NAME = 'SmolLM2-135M-Instruct Q4_1';
const $ = (id) => document.getElementById(id);
const mib = (b) => `${(b / 2 ** 20).toFixed(2)} MiB`;

export function initGenerate({ xq, cacheOptions, openCapture }) {
  // model: the loaded Model; runs: per cache kind, the last run; live: the XQuant conversation
  // of this page (cache and entry), continued in place; saved: the stored entry.
  // served: the models the server offers (absolute URLs).
  const g = { model: null, modelTag: null, served: [], runs: {}, live: null, saved: null, abort: null, busy: false };
  const chart = new KvChart($('gen-chart'));
  chart.draw();
  window.__demo = Object.assign(window.__demo ?? {}, { generate: g });

  function setState(text, state) {
    const el = $('gen-status');
    el.textContent = text;
    el.dataset.state = state;
  }

  function showError(e, what) {
    const el = $('gen-error');
    el.textContent = `${what}: ${e?.name ?? 'Error'}: ${e?.message ?? e}`;
    el.hidden = false;
  }

  function enable() {
    const has = !!g.model;
    const served = g.served.length > 0;
    $('gen-run').disabled = g.busy || !has;
    $('gen-capture').disabled = g.busy || !has;
    $('gen-stop').disabled = !g.busy;
    $('gen-load').disabled = g.busy || !served;
    $('gen-pick').disabled = g.busy || !served;
    $('gen-file').disabled = g.busy;
    $('gen-continue').disabled = g.busy || !(g.live || g.saved) || (!has && !served);
    $('gen-forget').disabled = g.busy;
  }

  async function task(label, work) {
    g.busy = true;
    g.abort = new AbortController();
    $('gen-error').hidden = true;
    setState(label + '…', 'busy');
    enable();
    try {
      await work(g.abort.signal);
    } catch (e) {
      if (e?.name === 'AbortError') setState('Stopped.', 'stopped');
      else {
        showError(e, label);
        setState('Failed.', 'error');
      }
    } finally {
      g.busy = false;
      g.abort = null;
      enable();
    }
  }

  // ---- the model ------------------------------------------------------------------------

  function progress(p) {
    const bar = $('gen-load-progress');
    bar.hidden = false;
    if (p.total) {
      bar.max = p.total;
      bar.value = p.loaded;
    } else bar.removeAttribute('value');
    $('gen-load-text').textContent =
      p.phase === 'download' ? `downloading ${mib(p.loaded)}${p.total ? ' of ' + mib(p.total) : ''}` : 'loading the weights';
  }

  // `url`: where a served model came from (a saved conversation reloads it from there).
  async function loadModel(source, name, signal, url = null) {
    let bytes = source.size ?? null; // a File's; a download's from its progress
    const model = await xq.loadModel(source, {
      signal,
      onProgress: (p) => {
        if (p.phase === 'download' && p.total) bytes = p.total;
        progress(p);
      },
    });
    // Freeing a model frees the caches its generations made: the saved entry stays in
    // IndexedDB (Continue restores it).
    g.model?.free();
    g.live = null;
    g.runs = {};
    g.model = model;
    const i = model.info;
    // What a saved conversation must match to be continued with this model.
    g.modelTag = { name, url, architecture: i.architecture, layers: i.layers, hidden: i.hidden, vocab: i.vocab, bytes };
    // A base model (Gemma 3 270M) has no chat template: prompts go in as typed.
    $('gen-chat').checked = i.chatTemplate;
    $('gen-chat').disabled = !i.chatTemplate;
    $('gen-chat').parentElement.title = i.chatTemplate ? '' : 'this model has no chat template (a base model)';
    $('gen-model').textContent =
      `${name}: ${i.architecture}, ${i.layers} layers, hidden ${i.hidden}, ${i.heads} heads (${i.kvHeads} K/V) × ${i.headDim}, ` +
      `vocab ${i.vocab}, context ${i.contextLength}${bytes ? ', ' + mib(bytes) : ''}.`;
    $('gen-model').dataset.loaded = '1';
    $('gen-model').dataset.architecture = i.architecture;
    $('gen-load-text').textContent = '';
    $('gen-load-progress').hidden = true;
    setState('Model ready.', 'ready');
  }

  // The models the server offers: its index, or SmolLM2 alone where a server has no index.
  async function servedModels() {
    try {
      const r = await fetch(INDEX_URL);
      if (r.ok) return (await r.json()).map((m) => ({ ...m, url: new URL(m.url, location.href).href }));
    } catch {
      // no index: try the one model path
    }
    try {
      if ((await fetch(MODEL_URL, { method: 'HEAD' })).ok) return [{ id: 'smollm2-135m', name: SERVED_NAME, url: MODEL_URL }];
    } catch {
      // nothing served
    }
    return [];
  }

  function picked() {
    return g.served.find((m) => m.url === $('gen-pick').value) ?? g.served[0];
  }

  // Loads a served model (`m`: an entry of g.served).
  function loadServed(m, signal) {
    return loadModel(m.url, `${m.name} (from this server)`, signal, m.url);
  }

  async function probeServer() {
    g.served = await servedModels();
    const pick = $('gen-pick');
    pick.replaceChildren(
      ...g.served.map((m) => Object.assign(document.createElement('option'), { value: m.url, textContent: m.bytes ? `${m.name}, ${mib(m.bytes)}` : m.name })),
    );
    const ok = g.served.length > 0;
    $('gen-load').dataset.available = ok ? '1' : '0';
    if (!ok) {
      $('gen-model').textContent =
        'The model is unavailable from this server (scripts/fetch-model could not fetch it): open a GGUF file instead.';
      $('gen-model').dataset.unavailable = '1';
    }
    enable();
  }

  // ---- runs -----------------------------------------------------------------------------

  function sampling() {
    const t = Number($('gen-temp').value);
    if (!(t > 0)) return {};
    return { temperature: t, topK: Number($('gen-topk').value), topP: Number($('gen-topp').value), seed: Number($('gen-seed').value) };
  }

  function promptText(text, chat) {
    return chat ? g.model.chatTemplate([{ role: 'user', content: text }]) : text;
  }

  function column(kind) {
    const col = $(`gen-col-${kind}`);
    return { text: col.querySelector('.gen-text'), stats: col.querySelector('.gen-stats'), col };
  }

  // One generation streamed into `out` (an element): its tokens as spans; resolves to the run.
  async function stream(kind, prompt, options, out, signal) {
    const run = { kind, tokens: [], text: '', kvBytes: 0, cacheTokens: 0, tokensPerSecond: 0, done: false };
    g.runs[kind] = run;
    const prefill = $('gen-prefill');
    const gen = g.model.generate(prompt, {
      ...options,
      signal,
      onPrefill: ({ done, total }) => {
        prefill.max = Math.max(1, total);
        prefill.value = done;
        setState(`${kind === 'f16' ? 'f16 cache' : 'XQuant'}: prefill ${done}/${total}`, 'busy');
      },
    });
    run.generation = gen;
    for await (const piece of gen) {
      const span = document.createElement('span');
      span.textContent = piece.text;
      span.dataset.i = String(piece.index);
      out.append(span);
      run.tokens.push(piece.token);
      run.text += piece.text;
      run.kvBytes = piece.kvAllocatedBytes;
      run.cacheTokens = piece.cacheTokens;
      if (kind !== 'continue') chart.add(kind, piece.cacheTokens, piece.kvAllocatedBytes);
      setState(`${kind === 'f16' ? 'f16 cache' : 'XQuant'}: token ${piece.index + 1}`, 'busy');
    }
    const s = g.model.stats();
    run.tokensPerSecond = s.tokensPerSecond;
    run.prefillTokensPerSecond = s.prefillTokensPerSecond;
    run.text = gen.text;
    run.finishReason = gen.finishReason;
    run.done = true;
    out.dataset.tokens = JSON.stringify(run.tokens);
    return run;
  }

  function showStats(kind, run) {
    column(kind).stats.textContent =
      `${run.tokens.length} tokens, ${run.tokensPerSecond.toFixed(2)} tokens/s (prefill ${run.prefillTokensPerSecond.toFixed(1)}/s), ` +
      `KV ${mib(run.kvBytes)} allocated at ${run.cacheTokens} tokens` +
      (run.finishReason === 'eos' ? '; ended at the end-of-sequence token' : '');
    column(kind).col.dataset.kvBytes = String(run.kvBytes);
  }

  function markDifference() {
    const a = g.runs.f16?.tokens ?? [];
    const b = g.runs.xquant?.tokens ?? [];
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    const el = $('gen-diff');
    for (const s of document.querySelectorAll('#generate .gen-text span.diff')) s.classList.remove('diff');
    if (i === a.length && i === b.length) {
      el.textContent = `The two outputs are identical (${a.length} tokens).`;
      el.dataset.first = '-1';
      return;
    }
    el.textContent = `The outputs differ from token ${i} on (marked).`;
    el.dataset.first = String(i);
    for (const kind of ['f16', 'xquant']) column(kind).text.querySelector(`span[data-i="${i}"]`)?.classList.add('diff');
  }

  function freeRuns() {
    for (const run of Object.values(g.runs)) {
      if (run.generation && run.generation.cache !== g.live?.cache) run.generation.cache.free?.();
    }
    g.runs = {};
  }

  async function generate(signal) {
    const chat = $('gen-chat').checked;
    const text = $('gen-prompt').value;
    const prompt = promptText(text, chat);
    const maxTokens = Number($('gen-max').value);
    const xqCache = cacheOptions();
    freeRuns();
    chart.clear();
    $('gen-diff').textContent = '';
    for (const kind of ['f16', 'xquant']) {
      const c = column(kind);
      c.text.textContent = '';
      c.stats.textContent = '';
      delete c.text.dataset.tokens;
    }
    const common = { maxTokens, ...sampling() };
    // One after the other, so that each has the GPU to itself and its tokens/s are honest.
    const f16 = await stream('f16', prompt, { ...common, cache: 'f16' }, column('f16').text, signal);
    showStats('f16', f16);
    const xqRun = await stream('xquant', prompt, { ...common, cache: xqCache }, column('xquant').text, signal);
    showStats('xquant', xqRun);
    markDifference();
    g.live?.cache && g.live.cache !== xqRun.generation.cache && g.live.cache.free?.();
    const entry = {
      model: g.modelTag,
      chat,
      prompt: text,
      text: (chat ? '' : text) + xqRun.text,
      tokens: xqRun.tokens,
      options: { cache: xqCache, sampling: common },
    };
    g.live = { cache: xqRun.generation.cache, entry };
    setState('Done.', 'done');
    await persist(entry, xqRun.generation.cache);
  }

  // ---- persistence ----------------------------------------------------------------------

  async function persist(entry, cache) {
    try {
      if (typeof cache.save !== 'function') throw new StoreError('this version of the package cannot save a cache set');
      const bytes = await cache.save();
      await saveConversation({ ...entry, cache: bytes });
      g.saved = { ...entry, savedAt: Date.now() };
      showSaved(entry, 'Saved in this browser');
    } catch (e) {
      showSaved(entry, 'Not saved');
      showError(e, 'Saving the conversation');
    }
  }

  function showSaved(entry, how) {
    $('gen-saved').hidden = false;
    $('gen-saved-text').textContent = entry.text;
    $('gen-saved-what').textContent =
      `${how}: the XQuant conversation (${entry.model?.name ?? 'a model'}, ${entry.tokens.length} generated tokens${entry.chat ? ', chat' : ''}).`;
  }

  // The next turn's text: as typed, or a ChatML user turn after the assistant's answer (the
  // cache never holds the end-of-sequence token: generation stops before feeding it).
  function moreText(entry, more) {
    if (!entry.chat) return more;
    const turn = g.model.chatTemplate([{ role: 'user', content: more }]);
    return '<|im_end|>\n' + turn.slice(Math.max(0, turn.lastIndexOf('<|im_start|>user')));
  }

  async function continueConversation(signal) {
    if (!g.model) {
      // The saved conversation's model, where the server offers it.
      const m = g.served.find((s) => s.url === g.saved?.model?.url) ?? picked();
      if (!m) throw new StoreError('no model is loaded and the server offers none: open the GGUF file first');
      await loadServed(m, signal);
    }
    let cache;
    let entry;
    if (g.live) {
      ({ cache, entry } = g.live);
    } else {
      const stored = await loadConversation();
      if (!stored) throw new StoreError('there is no saved conversation');
      const same = (a, b) => ['architecture', 'layers', 'hidden', 'vocab', 'bytes'].every((k) => a[k] === b[k]);
      if (stored.model && g.modelTag && !same(stored.model, g.modelTag)) {
        throw new StoreError(`the saved conversation is of another model (${stored.model.name}), not of the loaded one`);
      }
      // model.restoreCache checks the set against the model's shape (xq.restoreCacheSet does not).
      cache = await (g.model.restoreCache ? g.model.restoreCache(stored.cache) : xq.restoreCacheSet(stored.cache));
      const { cache: _bytes, ...rest } = stored;
      entry = rest;
      g.live = { cache, entry };
    }
    const more = $('gen-more').value;
    const out = $('gen-continued');
    out.textContent = '';
    delete out.dataset.tokens;
    const run = await stream('continue', moreText(entry, more), { cache, maxTokens: Number($('gen-more-max').value), ...sampling() }, out, signal);
    $('gen-continued-stats').textContent =
      `${run.tokens.length} tokens, ${run.tokensPerSecond.toFixed(2)} tokens/s, KV ${mib(run.kvBytes)} at ${run.cacheTokens} tokens`;
    const next = {
      ...entry,
      text: entry.text + (entry.chat ? '\n[user] ' + more + '\n' : more) + run.text,
      tokens: [...entry.tokens, ...run.tokens],
    };
    g.live = { cache, entry: next };
    setState('Done.', 'done');
    await persist(next, cache);
  }

  async function showStored() {
    try {
      const stored = await loadConversation();
      if (!stored) return;
      const { cache: _bytes, ...entry } = stored;
      g.saved = entry;
      showSaved(entry, `Saved ${new Date(entry.savedAt).toLocaleString()}`);
    } catch (e) {
      $('gen-saved').hidden = false;
      showError(e, 'The saved conversation');
    }
    enable();
  }

  // ---- wiring ---------------------------------------------------------------------------

  $('gen-load').addEventListener('click', () => task('Loading the model', (signal) => loadServed(picked(), signal)));
  $('gen-file').addEventListener('change', (ev) => {
    const f = ev.target.files[0];
    if (f) task(`Loading ${f.name}`, (signal) => loadModel(f, f.name, signal));
  });
  $('gen-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    task('Generating', generate);
  });
  $('gen-stop').addEventListener('click', () => g.abort?.abort());
  $('gen-capture').addEventListener('click', () =>
    task('Capturing the K/V', async () => {
      const text = promptText($('gen-prompt').value, $('gen-chat').checked);
      const bytes = await g.model.capture(text, { queries: true });
      setState('Captured: the analysis above shows it.', 'done');
      await openCapture(bytes, `capture of “${$('gen-prompt').value.slice(0, 40)}” (${g.modelTag.name})`);
    }),
  );
  $('gen-continue').addEventListener('click', () => task('Continuing', continueConversation));
  $('gen-forget').addEventListener('click', () =>
    task('Forgetting', async () => {
      await forgetConversation();
      if (g.live) g.live.cache.free?.();
      g.live = null;
      g.saved = null;
      $('gen-saved').hidden = true;
      $('gen-continued').textContent = '';
      setState('Forgotten.', 'done');
    }),
  );
  enable();
  probeServer();
  showStored();
}
