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

/** Whether `x` looks like a GPUDevice (duck-typed: also Node's `webgpu` package). */
function isGpuDevice(x) {
  return (
    x !== null &&
    typeof x === 'object' &&
    typeof x.createBuffer === 'function' &&
    typeof x.createComputePipeline === 'function' &&
    x.queue !== undefined &&
    x.limits !== undefined
  );
}

/**
 * Runs `create` with `navigator.gpu.requestAdapter` answering, once, with an adapter whose
 * `requestDevice` gives `device`: wgpu (in the wasm module) acquires its device that way, and
 * has no other door for a device it did not request itself. The hook removes itself on its
 * first call (and in any case when `create` settles).
 */
async function withDevice(device, create) {
  const gpu = navigator.gpu;
  const own = Object.prototype.hasOwnProperty.call(gpu, 'requestAdapter');
  const saved = own ? gpu.requestAdapter : undefined;
  const restore = () => {
    if (own) gpu.requestAdapter = saved;
    else delete gpu.requestAdapter;
  };
  const info = device.adapterInfo ?? {};
  const adapter = {
    features: device.features,
    limits: device.limits,
    info,
    isFallbackAdapter: Boolean(info.isFallbackAdapter),
    requestDevice: async () => device,
    requestAdapterInfo: async () => info,
  };
  gpu.requestAdapter = async () => {
    restore();
    return adapter;
  };
  try {
    return await create();
  } finally {
    if (gpu.requestAdapter !== saved) restore();
  }
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
   * missing. `options`: `{ device?: GPUDevice, powerPreference?: 'low-power' |
   * 'high-performance', wasm? }`. With `device`, everything runs on that (your) device, so
   * your GPUBuffers and ours meet; its `onuncapturederror` stays yours (our calls catch their
   * own errors in error scopes) and `free()` leaves it alive.
   */
  static async create(options = {}) {
    if (typeof navigator === 'undefined' || !navigator.gpu) {
      throw new WebGpuUnavailableError(
        'WebGPU is not available here: navigator.gpu is missing. Use a browser with WebGPU ' +
          '(Chrome/Edge 113+, Safari 26+) on a secure origin (https or localhost).',
      );
    }
    const { device } = options;
    if (device !== undefined && !isGpuDevice(device)) {
      throw new ConfigError('options.device must be a GPUDevice');
    }
    await ready(options.wasm);
    const create = () =>
      XQuantCore.create({ powerPreference: options.powerPreference, shared: device !== undefined });
    const core = device === undefined ? await create() : await withDevice(device, create);
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

  /**
   * `xquant plan` on the bytes of a K/V safetensors file: measures every candidate per layer
   * and K/V and resolves to `{ plan, effectiveBits, quantizedBits, kvBytes, error,
   * targetBits, context }` — the plan with the least measured error whose effective bits at
   * `context` tokens (window, sinks, params and residuals counted) meet `targetBits`. Pass
   * `plan` to `cacheSet({ ..., plan })` or save it as JSON for `xquant --plan`.
   */
  suggestPlan(bytes, options = {}) {
    return live(this.#core, 'XQuant').suggestPlan(bytes, options);
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

/**
 * One cache per attention layer, anchors and reuse layers cooperating on the GPU.
 *
 * Every call checks its arguments, records its work and submits it to the device's queue
 * before it returns: calls run in the order they are made, and after whatever you submitted
 * before making them, so a decode step can be issued without awaiting each call (await the
 * last one, or just submit your next kernels: they run after). A call refused by its checks
 * throws (as a rejected promise) and changes nothing; one the GPU refuses later (a destroyed
 * buffer, a buffer of another device) is undone if no later call was made, else the set
 * refuses further calls until `reset()`.
 */
export class CacheSet {
  #core;

  constructor(core) {
    this.#core = core;
  }

  /**
   * Appends `tokens` tokens to `layer`. `keys`/`values`: Float32Array or Uint16Array of f16
   * bits, or GPUBuffers on the context's device (usage STORAGE), `[batch, kvHeads, tokens,
   * headDim]`; `options` for buffers: `{ dtype: 'f32' | 'f16', offset, keysOffset,
   * valuesOffset }` (byte offsets, multiples of 256). Your buffers are read by the
   * submission and not kept.
   */
  append(layer, keys, values, tokens, options = {}) {
    return live(this.#core, 'CacheSet').append(layer, keys, values, tokens, options);
  }

  /**
   * Attention of `queries` (a GPUBuffer, `[batch, queryHeads, tokens, headDim]`) over every
   * token `layer` holds, read where they live (packed codes, f16 window), written into `out`
   * (a GPUBuffer you own). `options`: `{ queryHeads (required), tokens = 1, dtype = 'f32',
   * outDtype = 'f32', offset, outOffset, layout: 'heads' | 'tokens', pos0, scale }`.
   * By default the queries are the layer's last `tokens` tokens (append them first) and each
   * sees the tokens up to its own; `layout: 'tokens'` writes `[batch, tokens, queryHeads,
   * headDim]`, the rows an output projection reads.
   */
  attendGpu(layer, queries, out, options) {
    return live(this.#core, 'CacheSet').attendGpu(layer, queries, out, options ?? {});
  }

  /** As attendGpu with host queries (Float32Array or Uint16Array of f16 bits); resolves to a Float32Array. */
  attend(layer, queries, options) {
    return live(this.#core, 'CacheSet').attend(layer, queries, options ?? {});
  }

  /**
   * Writes every token of `layer`, reconstructed, into your GPUBuffers `keys` and `values`
   * (`[batch, kvHeads, tokens, headDim]`; `options`: `{ dtype: 'f32' | 'f16', keysOffset,
   * valuesOffset }`).
   */
  fetchInto(layer, keys, values, options = {}) {
    return live(this.#core, 'CacheSet').fetchInto(layer, keys, values, options);
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
   * As updateAndFetch, resolving to `{ keys, values, tokens, dtype, byteLength }` with the
   * set's own GPUBuffers: valid until the set's next call is submitted (a later call may
   * replace them with larger ones and destroy these). Prefer fetchInto.
   */
  updateAndFetchGpu(layer, keys, values, tokens) {
    return live(this.#core, 'CacheSet').updateAndFetchGpu(layer, keys, values, tokens);
  }

  /** Tokens `layer` holds. */
  tokens(layer) {
    return live(this.#core, 'CacheSet').tokens(layer);
  }

  /** `{ layers: [{ layer, role, group, tokens, effectiveBits, allocatedBytes, ... }], totals }`. */
  /** The plan every layer follows (the JSON object `xquant plan` writes). */
  plan() {
    return live(this.#core, 'CacheSet').plan();
  }

  stats() {
    return live(this.#core, 'CacheSet').stats();
  }

  /** Forgets every token and frees the GPU buffers; the set stays usable. */
  reset() {
    live(this.#core, 'CacheSet').reset();
  }

  /** Destroys the set's GPU buffers now (work already submitted completes). Later calls throw UsageError. */
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
