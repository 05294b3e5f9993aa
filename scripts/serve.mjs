// Serves the demo: www/ at /, the built npm package at /pkg/, the bundled data at /data/.
// Usage: node scripts/serve.mjs [port] (default 8080; 0 picks a free one). Prints the URL.

import { createServer } from 'node:http';
import { readFile } from 'node:fs/promises';
import { extname, join, normalize, resolve } from 'node:path';

const ROOT = resolve(import.meta.dirname, '..');
const MOUNTS = [
  ['/pkg/', join(ROOT, 'dist', 'xquant-wgpu')],
  ['/data/', join(ROOT, 'data')],
  ['/', join(ROOT, 'www')],
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

/** Starts the server on 127.0.0.1:`port`; resolves to { url, close }. */
export function serveDemo(port = 8080) {
  const server = createServer(async (req, res) => {
    let path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
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
      res.end(body);
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
  const { url } = await serveDemo(Number(process.argv[2] ?? 8080));
  console.log(`xquant-wgpu demo: ${url}  (Ctrl-C to stop)`);
}
