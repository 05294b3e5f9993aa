// Serves the demo: www/ at /, the built npm package at /pkg/, the bundled data at /data/, and
// the models it is given (GGUF files) at /models/, listed by /models/index.json.
// Usage: node scripts/serve.mjs [port] [smollm2.gguf] [gemma3.gguf] (port default 8080, 0
// picks a free one; the models default to $XQ_MODEL and $XQ_GEMMA, as scripts/fetch-model
// prints them). Prints the URL.

import { createServer } from 'node:http';
import { createReadStream } from 'node:fs';
import { readFile, stat } from 'node:fs/promises';
import { extname, join, normalize, resolve } from 'node:path';

const ROOT = resolve(import.meta.dirname, '..');
const MOUNTS = [
  ['/pkg/', join(ROOT, 'dist', 'xquant-wgpu')],
  ['/data/', join(ROOT, 'data')],
  ['/', join(ROOT, 'www')],
];
/** Where the page finds SmolLM2 (the demo's first model). */
export const MODEL_PATH = '/models/smollm2-135m-instruct.gguf';
/** Where the page finds Gemma 3 270M. */
export const GEMMA_PATH = '/models/gemma-3-270m-q4_k_m.gguf';
/** The models the demo offers, as /models/index.json lists those served (in this order). */
export const CATALOGUE = [
  { id: 'smollm2-135m', name: 'SmolLM2-135M-Instruct Q4_1', path: MODEL_PATH, option: 'model' },
  { id: 'gemma3-270m', name: 'Gemma 3 270M (base) Q4_K_M', path: GEMMA_PATH, option: 'gemma' },
];
const TYPES = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript',
  '.css': 'text/css',
  '.json': 'application/json',
  '.wasm': 'application/wasm',
  '.ts': 'text/plain',
  '.png': 'image/png',
};

/** Streams the model file with its length (no whole-file read per request); HEAD too. */
async function sendModel(req, res, file) {
  let size;
  try {
    const s = await stat(file);
    if (!s.isFile()) throw new Error('not a file');
    size = s.size;
  } catch {
    res.writeHead(404, { 'content-type': 'text/plain' }).end('no model is served (see scripts/fetch-model)');
    return;
  }
  res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(size), 'cache-control': 'no-cache' });
  if (req.method === 'HEAD') {
    res.end();
    return;
  }
  const stream = createReadStream(file);
  stream.on('error', () => res.destroy());
  res.on('close', () => stream.destroy());
  stream.pipe(res);
}

/** The catalogue's models whose file exists, with their size: /models/index.json. */
async function modelIndex(files) {
  const index = [];
  for (const m of CATALOGUE) {
    const file = files[m.option];
    if (!file) continue;
    try {
      const s = await stat(file);
      if (s.isFile()) index.push({ id: m.id, name: m.name, url: m.path.slice(1), bytes: s.size });
    } catch {
      // not there: not offered
    }
  }
  return index;
}

/**
 * Starts the server on 127.0.0.1:`port`; resolves to { url, close }. `options.model`: the
 * SmolLM2 GGUF to serve at MODEL_PATH (default $XQ_MODEL), `options.gemma`: the Gemma 3 GGUF
 * at GEMMA_PATH (default $XQ_GEMMA); a model not given answers 404 and is not listed.
 */
export function serveDemo(port = 8080, { model = process.env.XQ_MODEL || null, gemma = process.env.XQ_GEMMA || null } = {}) {
  const files = { model, gemma };
  const server = createServer(async (req, res) => {
    let path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    if (path === '/models/index.json') {
      res.writeHead(200, { 'content-type': 'application/json', 'cache-control': 'no-cache' });
      res.end(JSON.stringify(await modelIndex(files)));
      return;
    }
    const served = CATALOGUE.find((m) => m.path === path);
    if (served) {
      const file = files[served.option];
      if (file) await sendModel(req, res, file);
      else res.writeHead(404, { 'content-type': 'text/plain' }).end('no model is served (see scripts/fetch-model)');
      return;
    }
    if (path.endsWith('/')) path += 'index.html';
    const [prefix, dir] = MOUNTS.find(([p]) => path.startsWith(p));
    const file = normalize(join(dir, path.slice(prefix.length)));
    if (!file.startsWith(dir)) {
      res.writeHead(403).end();
      return;
    }
    try {
      const body = await readFile(file);
      res.writeHead(200, { 'content-type': TYPES[extname(file)] ?? 'application/octet-stream', 'cache-control': 'no-cache' });
      res.end(req.method === 'HEAD' ? undefined : body);
    } catch {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found');
    }
  });
  return new Promise((ok, fail) => {
    server.once('error', fail);
    server.listen(port, '127.0.0.1', () => ok({ url: `http://127.0.0.1:${server.address().port}/`, close: () => server.close() }));
  });
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const model = process.argv[3] || process.env.XQ_MODEL || null;
  const gemma = process.argv[4] || process.env.XQ_GEMMA || null;
  const { url } = await serveDemo(Number(process.argv[2] ?? 8080), { model, gemma });
  console.log(`xquant-wgpu demo: ${url}  (Ctrl-C to stop)`);
  const base = url.replace(/\/$/, '');
  if (model) console.log(`model: ${model} at ${base}${MODEL_PATH}`);
  if (gemma) console.log(`model: ${gemma} at ${base}${GEMMA_PATH}`);
  if (!model && !gemma) console.log('no model given: the Generate panel offers a file picker');
}
