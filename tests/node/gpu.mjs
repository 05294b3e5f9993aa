// What the Node test files share: the built package, a Dawn GPU with an adapter (Chromium's
// SwiftShader Vulkan driver when nothing else is found), the native CLI, the real models,
// deterministic inputs and buffer read-back. Not a test file itself (no `.test.` in its name).
//
// The GPU: Dawn (webgpu@0.6.2) refuses lavapipe ("Vulkan shaderUniform*ArrayDynamicIndexing
// required") and ships no SwiftShader of its own; it finds Chromium's SwiftShader Vulkan
// driver (Debian `chromium`: /usr/lib/chromium/vk_swiftshader_icd.json). Without an adapter
// the tests skip, saying so, unless REQUIRE_GPU=1 (CI), which makes that a failure.

import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';

export const PACKAGE = new URL('../../dist/xquant-wgpu/index.js', import.meta.url);
/** The native CLI (`cargo test`, run before the Node tests in npm test, builds it). */
export const XQUANT = new URL('../../target/debug/xquant', import.meta.url).pathname;
const SWIFTSHADER_ICD = '/usr/lib/chromium/vk_swiftshader_icd.json';
export const REQUIRE_GPU = process.env.REQUIRE_GPU === '1';

// GPUBufferUsage's flags (WebGPU spec), so the tests need none of Dawn's globals installed.
export const GPUBufferUsage_MAP_READ = 0x1;
export const GPUBufferUsage_COPY_SRC = 0x4;
export const GPUBufferUsage_COPY_DST = 0x8;
export const GPUBufferUsage_STORAGE = 0x80;

/** The built package (dist/xquant-wgpu); throws, saying how to build it, when it is missing. */
export async function loadPackage() {
  if (!existsSync(PACKAGE)) {
    throw new Error(`${PACKAGE.pathname} is missing: build the package first (bash scripts/build-wasm.sh)`);
  }
  return import(PACKAGE);
}

/** The process's one Dawn instance (see gpuWithAdapter). */
let instance = null;

/**
 * The process's GPU (`create([])` of the `webgpu` package `webgpu`) when it has an adapter, or
 * null. One instance per process, held for its lifetime: Dawn crashed (SIGSEGV, or a futex
 * abort) in processes that created a second instance while the first one was collected.
 */
export async function gpuWithAdapter(webgpu) {
  if (instance) return instance;
  let gpu = webgpu.create([]);
  if (!(await gpu.requestAdapter())) {
    // Dawn reads the Vulkan driver list when a GPU is created: none it can use was there, so
    // use SwiftShader's (scripts/test.sh sets the same before starting Node) and retry.
    if (process.env.VK_ICD_FILENAMES || !existsSync(SWIFTSHADER_ICD)) return null;
    process.env.VK_ICD_FILENAMES = SWIFTSHADER_ICD;
    gpu = webgpu.create([]);
    if (!(await gpu.requestAdapter())) return null;
  }
  instance = gpu;
  return gpu;
}

/**
 * Why the GPU tests cannot run here, or null when they can: the `webgpu` npm package and an
 * adapter. Resolves to `{ webgpu, missing }`.
 */
export async function probeGpu() {
  let webgpu;
  try {
    webgpu = await import('webgpu');
  } catch (e) {
    return { webgpu: null, missing: `the npm package \`webgpu\` could not be loaded (${e.message}); run npm ci` };
  }
  if ((await gpuWithAdapter(webgpu)) === null) {
    return { webgpu, missing: `Dawn (npm webgpu) found no GPU adapter (install chromium for SwiftShader: ${SWIFTSHADER_ICD})` };
  }
  return { webgpu, missing: null };
}

/** Skips `t` visibly for `missing` (a reason), or fails under REQUIRE_GPU=1. Returns whether to go on. */
export function skipWithout(t, missing) {
  if (missing === null) return true;
  assert.ok(!REQUIRE_GPU, `REQUIRE_GPU=1 but ${missing}`);
  console.log(`SKIPPED: ${missing}; set REQUIRE_GPU=1 to fail instead`);
  t.skip(missing);
  return false;
}

/**
 * The real model file in `$variable` (XQ_MODEL: SmolLM2, XQ_GEMMA: Gemma 3), or null after
 * skipping `t` (an error under REQUIRE_MODEL=1).
 */
export function modelOrSkip(t, variable) {
  const path = process.env[variable];
  if (path && existsSync(path)) return path;
  const why = path ? `${variable}=${path} does not exist` : `${variable} is not set (scripts/fetch-model)`;
  if (process.env.REQUIRE_MODEL === '1') throw new Error(`REQUIRE_MODEL=1 but ${why}`);
  t.skip(why);
  return null;
}

/** Deterministic values in [-2, 2). */
export function random(seed) {
  return (n) =>
    Float32Array.from({ length: n }, () => {
      seed = (seed * 1103515245 + 12345) % 2147483648;
      return (seed / 2147483648) * 4 - 2;
    });
}

/** Reads `n` f32 of a GPUBuffer (usage COPY_SRC) back to the host. */
export async function readBuffer(device, buffer, n) {
  const staging = device.createBuffer({ size: n * 4, usage: GPUBufferUsage_MAP_READ | GPUBufferUsage_COPY_DST });
  const enc = device.createCommandEncoder();
  enc.copyBufferToBuffer(buffer, 0, staging, 0, n * 4);
  device.queue.submit([enc.finish()]);
  await staging.mapAsync(1 /* GPUMapMode.READ */);
  const out = new Float32Array(staging.getMappedRange().slice(0));
  staging.destroy();
  return out;
}
