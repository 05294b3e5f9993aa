// What the tests of the demo's Generate panel share (generate.test.mjs on SmolLM2,
// gemma.test.mjs on Gemma 3): the native tokens to compare with, and driving the panel.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { XQUANT } from './harness.mjs';

/** The demo's default knobs, as `xquant generate` options. */
export const KNOBS = ['--group-size', '2', '--base-bits', '2', '--residual-bits', '4', '--group-quant-size', '32', '--eta', '0', '--value-axis', 'tokens'];

/** How long a step of the panel may take on SwiftShader. */
export const LONG = 900000;

/** `xquant generate --json`'s tokens for `prompt` with `cache` ('f16', or 'xquant' with the demo's knobs). */
export async function nativeTokens(model, prompt, cache, maxTokens = 8) {
  const args = ['generate', '--model', model, '--prompt', prompt, '--max-tokens', String(maxTokens), '--cache', cache, '--json'];
  const { stdout } = await promisify(execFile)(XQUANT, cache === 'xquant' ? [...args, ...KNOBS] : args, { encoding: 'utf8' });
  return JSON.parse(stdout).tokens;
}

/** Waits for the panel's run to end and asserts that it ended well. */
export async function done(page) {
  await page.waitForFunction(
    () => ['done', 'error', 'stopped'].includes(document.getElementById('gen-status').dataset.state),
    null,
    { timeout: LONG },
  );
  const state = await page.evaluate(() => document.getElementById('gen-status').dataset.state);
  const error = await page.evaluate(() => document.getElementById('gen-error').textContent);
  assert.equal(state, 'done', `the panel says: ${error}`);
}

/** The token ids an output element of the panel shows. */
export const tokensOf = (page, sel) => page.evaluate((s) => JSON.parse(document.querySelector(s).dataset.tokens), sel);

/** Waits for the analysis above the panel to show a result. */
export async function analysisReady(page) {
  await page.waitForFunction(() => document.getElementById('status').dataset.kind === 'ok', null, { timeout: LONG });
}

/** Continues the saved conversation with `more` for `maxTokens` tokens; resolves to their ids. */
export async function continueWith(page, more, maxTokens) {
  await page.fill('#gen-more', more);
  await page.fill('#gen-more-max', String(maxTokens));
  await page.click('#gen-continue');
  await done(page);
  return tokensOf(page, '#gen-continued');
}
