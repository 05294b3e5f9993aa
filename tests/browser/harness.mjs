// Browser test harness: installs the packed npm package into a scratch app the way a user
// would, serves it on 127.0.0.1, and drives headless Chromium (WebGPU via SwiftShader).

import { execFileSync } from 'node:child_process';
import { createServer } from 'node:http';
import { accessSync, constants, existsSync, mkdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { delimiter, join, extname, resolve } from 'node:path';
import { after, before } from 'node:test';
import { chromium } from 'playwright-core';
import { serveDemo } from '../../scripts/serve.mjs';

export const ROOT = resolve(import.meta.dirname, '../..');
// One app per test file (node --test runs files in parallel processes).
export const APP = join(ROOT, 'target', 'browser-app', String(process.pid));
export const XQUANT = join(ROOT, 'target', 'debug', 'xquant');

const CHROMIUM_ARGS = [
  '--no-sandbox',
  '--disable-gpu-sandbox',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--disable-quic',
];

/** Packs dist/xquant-wgpu and installs the tarball into a fresh app, once per process. */
export function installApp() {
  if (!existsSync(join(ROOT, 'dist', 'xquant-wgpu', 'package.json'))) {
    throw new Error('dist/xquant-wgpu is missing: run `npm run build` first');
  }
  rmSync(APP, { recursive: true, force: true });
  mkdirSync(APP, { recursive: true });
  const tgz = execFileSync('npm', ['pack', join(ROOT, 'dist', 'xquant-wgpu'), '--pack-destination', APP, '--silent'], {
    encoding: 'utf8',
  }).trim().split('\n').pop();
  writeFileSync(join(APP, 'package.json'), JSON.stringify({ name: 'app', private: true, type: 'module' }));
  execFileSync('npm', ['install', '--no-audit', '--no-fund', '--prefer-offline', join(APP, tgz)], { cwd: APP, stdio: 'pipe' });
  writeFileSync(
    join(APP, 'index.html'),
    `<!doctype html><meta charset="utf-8"><title>xquant-wgpu test app</title><link rel="icon" href="data:,">
<script type="importmap">{ "imports": { "xquant-wgpu": "./node_modules/xquant-wgpu/index.js" } }</script>
<script type="module">
  import * as xquant from 'xquant-wgpu';
  window.xquant = xquant;
  document.title = 'ready';
</script>`,
  );
  return tgz;
}

const TYPES = {
  '.html': 'text/html',
  '.js': 'text/javascript',
  '.mjs': 'text/javascript',
  '.json': 'application/json',
  '.wasm': 'application/wasm',
  '.safetensors': 'application/octet-stream',
};

/** Serves `root` on 127.0.0.1 (a secure context); resolves to { url, close }. */
export function serve(root) {
  const server = createServer((req, res) => {
    let pathname = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    if (pathname.endsWith('/')) pathname += 'index.html';
    const path = join(root, pathname);
    if (!path.startsWith(root)) {
      res.writeHead(403).end();
      return;
    }
    try {
      const body = readFileSync(path);
      res.writeHead(200, { 'content-type': TYPES[extname(path)] ?? 'application/octet-stream', 'content-length': body.length });
      res.end(body);
    } catch {
      res.writeHead(404).end();
    }
  });
  return new Promise((ok) =>
    server.listen(0, '127.0.0.1', () => ok({ url: `http://127.0.0.1:${server.address().port}/`, close: () => server.close() })),
  );
}

/** A file on PATH that is executable, or null. */
function onPath(name) {
  for (const dir of (process.env.PATH ?? '').split(delimiter)) {
    if (!dir) continue;
    const file = join(dir, name);
    try {
      accessSync(file, constants.X_OK);
      if (statSync(file).isFile()) return file;
    } catch {
      // not here
    }
  }
  return null;
}

let chromiumPath;

/**
 * The Chromium to drive: `CHROMIUM_PATH`, else `chromium`, `chromium-browser` or
 * `google-chrome` on PATH, else a browser Playwright installed itself.
 */
export function findChromium() {
  if (chromiumPath) return chromiumPath;
  const env = process.env.CHROMIUM_PATH;
  if (env) {
    if (!existsSync(env)) throw new Error(`CHROMIUM_PATH=${env} does not exist`);
    return (chromiumPath = env);
  }
  for (const name of ['chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable']) {
    const found = onPath(name);
    if (found) return (chromiumPath = found);
  }
  let bundled = null;
  try {
    bundled = chromium.executablePath();
  } catch {
    bundled = null;
  }
  if (bundled && existsSync(bundled)) return (chromiumPath = bundled);
  throw new Error(
    'no Chromium found: set CHROMIUM_PATH, put chromium (Debian: apt-get install chromium), ' +
      'chromium-browser or google-chrome on PATH, or install Playwright\'s browser',
  );
}

/** Headless Chromium; `webgpu: false` launches without the WebGPU flag. */
export async function browser({ webgpu = true } = {}) {
  const args = webgpu ? ['--enable-unsafe-webgpu', ...CHROMIUM_ARGS] : CHROMIUM_ARGS;
  return chromium.launch({ executablePath: findChromium(), args, headless: true });
}

/** A page of the app with the package loaded (`window.xquant`); console errors collected. */
export async function openApp(b, url) {
  const page = await b.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => {
    if (m.type() === 'error') errors.push(m.text());
  });
  await page.goto(url);
  await page.waitForFunction(() => document.title === 'ready', null, { timeout: 30000 });
  return { page, errors };
}

/**
 * `page.evaluate`, but failing fast when the page reports an error (a wasm panic would
 * otherwise leave the promise pending forever) or after `ms`.
 */
export function evaluate(page, fn, arg, ms = 120000) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`page did not answer within ${ms} ms`)), ms);
    const fail = (e) => {
      clearTimeout(timer);
      reject(new Error(`page error: ${e}`));
    };
    page.once('pageerror', fail);
    page.evaluate(fn, arg).then(
      (v) => {
        clearTimeout(timer);
        page.off('pageerror', fail);
        resolve(v);
      },
      (e) => {
        clearTimeout(timer);
        reject(e);
      },
    );
  });
}

/** Runs the native CLI and parses its JSON output. */
export function cliJson(args) {
  return JSON.parse(execFileSync(XQUANT, [...args, '--json'], { encoding: 'utf8', env: { ...process.env } }));
}



/**
 * The usual test file's session: registers hooks that install the packed app, serve it and
 * launch Chromium before the tests and close both after. Returns `{ server, chrome }`, set
 * once the `before` hook has run.
 */
export function appSession() {
  const session = { server: null, chrome: null };
  before(async () => {
    installApp();
    session.server = await serve(APP);
    session.chrome = await browser();
  });
  after(async () => {
    await session.chrome?.close();
    session.server?.close();
  });
  return session;
}

/**
 * A real model for model tests: `{ path }` from `$variable` (XQ_MODEL: SmolLM2-135M, XQ_GEMMA:
 * Gemma 3 270M), or `{ path: null, skip }` with the reason to print; REQUIRE_MODEL=1 turns its
 * absence into an error.
 */
export function modelFile(variable = 'XQ_MODEL') {
  const path = process.env[variable];
  if (path && existsSync(path)) return { path, skip: false };
  const why = path ? `${variable}=${path} does not exist` : `${variable} is not set (scripts/fetch-model prints the path)`;
  if (process.env.REQUIRE_MODEL === '1') throw new Error(`REQUIRE_MODEL=1 but ${why}`);
  return { path: null, skip: `no model: ${why}` };
}

/**
 * The demo page's session: the server `npm start` runs (scripts/serve.mjs, with the models at
 * /models/ when given: `model` SmolLM2, default $XQ_MODEL; `gemma` Gemma 3, default $XQ_GEMMA)
 * and Chromium, as appSession() does.
 */
export function demoSession({ model = process.env.XQ_MODEL, gemma = process.env.XQ_GEMMA } = {}) {
  const session = { server: null, chrome: null };
  before(async () => {
    session.server = await serveDemo(0, { model: model || null, gemma: gemma || null });
    session.chrome = await browser();
  });
  after(async () => {
    await session.chrome?.close();
    session.server?.close();
  });
  return session;
}
