// Serves the demo: www/ at /, the built npm package at /pkg/, the bundled data at /data/, and
// the model (a GGUF file, when one is given) at /models/smollm2-135m-instruct.gguf.
// Usage: node scripts/serve.mjs [port] [model.gguf] (port default 8080, 0 picks a free one;
// the model defaults to $XQ_MODEL, as scripts/fetch-model prints it). Prints the URL.

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
/** Where the page finds the model (www/generate.js asks for the same path). */
export const MODEL_PATH = '/models/smollm2-135m-instruct.gguf';
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

/**
 * Starts the server on 127.0.0.1:`port`; resolves to { url, close }. `options.model`: the
 * GGUF file to serve at MODEL_PATH (default $XQ_MODEL; none: that path answers 404).
 */
export function serveDemo(port = 8080, { model = process.env.XQ_MODEL || null } = {}) {
  const server = createServer(async (req, res) => {
    let path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    if (path === MODEL_PATH) {
      if (model) await sendModel(req, res, model);
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
  const { url } = await serveDemo(Number(process.argv[2] ?? 8080), { model });
  console.log(`xquant-wgpu demo: ${url}  (Ctrl-C to stop)`);
  console.log(model ? `model: ${model} at ${url.replace(/\/$/, '')}${MODEL_PATH}` : 'no model given: the Generate panel offers a file picker');
}
