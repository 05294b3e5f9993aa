// xquant-wgpu: XQuant cross-layer KV-cache quantization on WebGPU.
// The public API: a thin facade over the wasm-bindgen module, adding typed errors, option
// defaults, explicit memory release and `Symbol.dispose`.

import init, { XQuantCore, registerErrorClasses } from './xquant_wgpu.js';

/** Base class of every error this package throws. */
export class XQuantError extends Error {
  constructor(message) {
    super(message);
    this.name = new.target.name;
  }
}
/** A tensor has the wrong length, shape or type. */
export class ShapeError extends XQuantError {}
/** An option is out of range or of the wrong type. */
export class ConfigError extends XQuantError {}
/** An input holds NaN/Inf, or values f16 params cannot hold. */
export class NonFiniteError extends XQuantError {}
/** A cache would exceed `maxCtx`. */
export class ContextBudgetError extends XQuantError {}
/** No WebGPU (`navigator.gpu` missing or no adapter). */
export class WebGpuUnavailableError extends XQuantError {}
/** The GPU device was lost. */
export class DeviceLostError extends XQuantError {}
/** The GPU reported an error. */
export class GpuError extends XQuantError {}
/** A tensor exceeds what the device can bind. */
export class TooLargeError extends XQuantError {}
/** The object was freed, or a call on it is still running. */
export class UsageError extends XQuantError {}
/** Bad input data. */
export class IoError extends XQuantError {}

const ERRORS = {
  ShapeError, ConfigError, NonFiniteError, ContextBudgetError, WebGpuUnavailableError,
  DeviceLostError, GpuError, TooLargeError, UsageError, IoError,
};

let loading = null;

/** Loads the wasm module (once). `wasm`: an optional URL, Response or bytes of the `.wasm`. */
export function ready(wasm) {
  loading ??= init(wasm === undefined ? undefined : { module_or_path: wasm }).then(() => {
    registerErrorClasses(ERRORS);
  });
  return loading;
}

function live(owner, what) {
  if (owner === null) throw new UsageError(`this ${what} was freed`);
  return owner;
}

/** What wgpu reports, completed with the browser's GPUAdapterInfo of the device. */
async function describeAdapter(core) {
  const base = core.adapterInfo;
  let info = core.device?.adapterInfo;
  if (!info) {
    try {
      info = (await navigator.gpu.requestAdapter())?.info;
    } catch {
      info = undefined;
    }
  }
  const vendor = info?.vendor ?? '';
  const architecture = info?.architecture ?? '';
  const description = info?.description ?? '';
  const isFallbackAdapter = Boolean(info?.isFallbackAdapter);
  const name = base.name || description || [vendor, architecture].filter(Boolean).join(' ') || 'unknown adapter';
  return { ...base, name, vendor, architecture, description, isFallbackAdapter };
}

/** The GPU context: primitives, similarity and cache sets on one WebGPU device. */
export class XQuant {
  #core;
  #adapter;

  constructor(core, adapter) {
    this.#core = core;
    this.#adapter = adapter;
  }

  /**
   * Acquires WebGPU. Throws WebGpuUnavailableError when `navigator.gpu` or an adapter is
   * missing. `options`: `{ powerPreference?: 'low-power' | 'high-performance', wasm? }`.
   */
  static async create(options = {}) {
    if (typeof navigator === 'undefined' || !navigator.gpu) {
      throw new WebGpuUnavailableError(
        'WebGPU is not available here: navigator.gpu is missing. Use a browser with WebGPU ' +
          '(Chrome/Edge 113+, Safari 26+) on a secure origin (https or localhost).',
      );
    }
    await ready(options.wasm);
    const core = await XQuantCore.create({ powerPreference: options.powerPreference });
    return new XQuant(core, await describeAdapter(core));
  }

  /**
   * `{ name, backend, deviceType, driver, vendor, architecture, description,
   * isFallbackAdapter }` of the adapter (a fallback adapter such as SwiftShader runs on the CPU).
   */
  get adapterInfo() {
    live(this.#core, 'XQuant');
    return { ...this.#adapter };
  }

  /** The `GPUDevice` (run your own kernels on our buffers). */
  get device() {
    return live(this.#core, 'XQuant').device;
  }

  /** Bytes of the GPU buffers this package holds right now. */
  allocatedBytes() {
    return live(this.#core, 'XQuant').allocatedBytes();
  }

  /** `[{ role: 'anchor' | 'reuse', group }]` for `n` layers in groups of `groupSize`. */
  pairLayers(n, groupSize) {
    return live(this.#core, 'XQuant').pairLayers(n, groupSize);
  }

  /** Quantizes `x` (`[..., N, D]`): `{ codes, scale, zero, nRows, bits, shape, ... }`. */
  quantizeCodes(x, shape, bits, groupQuantSize = 32, options = {}) {
    return live(this.#core, 'XQuant').quantizeCodes(x, shape, bits, groupQuantSize, options);
  }

  /** A reuse layer's own `{ scale, zero }` for the anchor's `codes` (a quantizeCodes result). */
  computeReuseParams(x, codes) {
    return live(this.#core, 'XQuant').computeReuseParams(x, codes);
  }

  /** `codes · scale + zero` as a Float32Array; `params` defaults to the codes' own. */
  dequantWithParams(codes, params = undefined, options = {}) {
    return live(this.#core, 'XQuant').dequantWithParams(codes, params, options);
  }

  /** The dequantized `bits`-bit residual of `x - recon`, a Float32Array. */
  quantizeResidual(x, recon, shape, bits, groupQuantSize = 32, options = {}) {
    return live(this.#core, 'XQuant').quantizeResidual(x, recon, shape, bits, groupQuantSize, options);
  }

  /** `{ mse, cosine }` of two tensors of one shape. */
  crossLayerSimilarity(a, b, shape) {
    return live(this.#core, 'XQuant').crossLayerSimilarity(a, b, shape);
  }

  /** `{ layers, mse, cosine }`: L × L row-major Float32Arrays for an array of layers. */
  similarityMatrix(layers, shape) {
    return live(this.#core, 'XQuant').similarityMatrix(layers, shape);
  }

  /**
   * `xquant analyze` on the bytes of a K/V safetensors file (tensors
   * `past_key_values.{i}.key/.value`, `[B, H, S, D]`): the same object as `analyze --json`.
   */
  analyzeKv(bytes, options = {}) {
    return live(this.#core, 'XQuant').analyzeKv(bytes, options);
  }

  /** `{ layers, shape, key: { cosine, mse }, value: { cosine, mse } }` of a K/V file. */
  kvSimilarity(bytes) {
    return live(this.#core, 'XQuant').kvSimilarity(bytes);
  }

  /** A coordinated set of XQuant caches, one per attention layer (see README). */
  cacheSet(options) {
    return new CacheSet(live(this.#core, 'XQuant').cacheSet(options ?? {}));
  }

  /** Releases the context (cache sets made from it keep working until freed). */
  free() {
    if (this.#core !== null) {
      this.#core.free();
      this.#core = null;
    }
  }

  [Symbol.dispose]() {
    this.free();
  }
}

/** One cache per attention layer, anchors and reuse layers cooperating on the GPU. */
export class CacheSet {
  #core;

  constructor(core) {
    this.#core = core;
  }

  /**
   * Appends `tokens` tokens to `layer` (`keys`/`values`: Float32Array or Uint16Array of f16
   * bits, `[batch, kvHeads, tokens, headDim]`) and resolves to `{ keys, values, tokens }`,
   * every token's reconstruction as Float32Arrays.
   */
  updateAndFetch(layer, keys, values, tokens) {
    return live(this.#core, 'CacheSet').updateAndFetch(layer, keys, values, tokens);
  }

  /**
   * As updateAndFetch, resolving to `{ keys, values, tokens, dtype, byteLength }` with
   * GPUBuffers on `xq.device`, valid until the next call on this set.
   */
  updateAndFetchGpu(layer, keys, values, tokens) {
    return live(this.#core, 'CacheSet').updateAndFetchGpu(layer, keys, values, tokens);
  }

  /** `{ layers: [{ layer, role, group, tokens, effectiveBits, allocatedBytes, ... }], totals }`. */
  stats() {
    return live(this.#core, 'CacheSet').stats();
  }

  /** Forgets every token and frees the GPU buffers; the set stays usable. */
  reset() {
    live(this.#core, 'CacheSet').reset();
  }

  /** Destroys the set's GPU buffers now. Later calls throw UsageError. */
  free() {
    if (this.#core !== null) {
      this.#core.release();
      this.#core.free();
      this.#core = null;
    }
  }

  [Symbol.dispose]() {
    this.free();
  }
}
