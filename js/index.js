// xquant-wgpu: XQuant cross-layer KV-cache quantization on WebGPU.
// The public API: a thin facade over the wasm-bindgen module, adding typed errors, option
// defaults, explicit memory release and `Symbol.dispose`.

import init, { XQuantCore, checkOptions, registerErrorClasses } from './xquant_wgpu.js';

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
/** Bad input data, or the package's wasm module could not be loaded. */
export class IoError extends XQuantError {}
/**
 * Bytes that are not a valid file of their kind: corrupt, truncated, of an unsupported
 * version, or not matching (a saved cache set of another kind, or one this device cannot hold).
 */
export class FormatError extends XQuantError {}

const ERRORS = {
  ShapeError, ConfigError, NonFiniteError, ContextBudgetError, WebGpuUnavailableError,
  DeviceLostError, GpuError, TooLargeError, UsageError, IoError, FormatError,
};

let loading = null;

/**
 * Loads the wasm module (once). `wasm`: an optional URL, Response or bytes of the `.wasm`.
 * A failed load rejects with IoError and is not remembered: the next call tries again.
 */
export function ready(wasm) {
  if (loading === null) {
    const pending = Promise.resolve()
      .then(() => init(wasm === undefined ? undefined : { module_or_path: wasm }))
      .then(() => {
        registerErrorClasses(ERRORS);
      })
      .catch((e) => {
        if (loading === pending) loading = null;
        throw e instanceof XQuantError ? e : new IoError(`could not load the xquant-wgpu wasm module: ${e?.message ?? e}`);
      });
    loading = pending;
  }
  return loading;
}

function live(owner, what) {
  if (owner === null) throw new UsageError(`this ${what} was freed`);
  return owner;
}

/**
 * Watches `device.lost` (adding a handler; nothing of the device is replaced). `waiting`
 * holds the rejecters of the calls in flight, so a loss settles them all.
 */
/** How long a call in flight when the device is lost may take to settle before it is rejected. */
const LOST_GRACE_MS = 2000;

function watchLoss(device, core) {
  const state = { lost: null, waiting: new Set() };
  const lost = device?.lost;
  if (lost && typeof lost.then === 'function') {
    lost.then((info) => {
      state.lost = info?.message || info?.reason || 'lost';
      try {
        core.markLost(String(state.lost));
      } catch {
        // The context was freed: nothing of it runs any more.
      }
      // Calls in flight settle soon on a lost device (their scopes resolve) and are undone
      // then; a call that does not settle is rejected after a grace period, never left hanging.
      const waiting = [...state.waiting];
      state.waiting.clear();
      setTimeout(() => {
        for (const reject of waiting) reject(lostError(state));
      }, LOST_GRACE_MS);
    });
  }
  return state;
}

function lostError(state) {
  return new DeviceLostError(`the GPU device was lost (${state.lost}); create a new XQuant`);
}

/**
 * `run()`'s promise, rejected with DeviceLostError when the device is (or gets) lost before
 * it settles; a synchronous throw becomes a rejection.
 */
function guarded(state, run, settle) {
  if (state.lost !== null) return Promise.reject(lostError(state));
  let p;
  try {
    p = run();
  } catch (e) {
    return Promise.reject(state.lost !== null ? lostError(state) : e);
  }
  return new Promise((resolve, reject) => {
    state.waiting.add(reject);
    Promise.resolve(p).then(
      (v) => {
        state.waiting.delete(reject);
        settle?.(state.lost !== null);
        if (state.lost !== null) reject(lostError(state));
        else resolve(v);
      },
      (e) => {
        state.waiting.delete(reject);
        reject(state.lost !== null ? lostError(state) : e);
      },
    );
  });
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
  #state;

  constructor(core, adapter) {
    this.#core = core;
    this.#adapter = adapter;
    this.#state = watchLoss(core.device, core);
  }

  /** A GPU call on the live context (rejects, never throws). */
  #call(f) {
    let core;
    try {
      core = live(this.#core, 'XQuant');
    } catch (e) {
      return Promise.reject(e);
    }
    return guarded(this.#state, () => f(core));
  }

  /**
   * Acquires WebGPU. Throws WebGpuUnavailableError when `navigator.gpu` or an adapter is
   * missing. `options`: `{ device?: GPUDevice, powerPreference?: 'low-power' |
   * 'high-performance', wasm? }`. With `device`, everything runs on that (your) device, so
   * your GPUBuffers and ours meet; its `onuncapturederror` stays yours (our calls catch their
   * own errors in error scopes) and `free()` leaves it alive.
   */
  static async create(options = {}) {
    if (options === null || typeof options !== 'object' || Array.isArray(options)) {
      throw new ConfigError(`XQuant.create: options must be an object, got ${options === null ? 'null' : typeof options}`);
    }
    if (typeof navigator === 'undefined' || !navigator.gpu) {
      throw new WebGpuUnavailableError(
        'WebGPU is not available here: navigator.gpu is missing. Use a browser with WebGPU ' +
          '(Chrome/Edge 113+, Safari 26+) on a secure origin (https or localhost).',
      );
    }
    await ready(options.wasm);
    checkOptions('XQuant.create', options);
    const { device } = options;
    if (device !== undefined && !isGpuDevice(device)) {
      throw new ConfigError('XQuant.create option `device`: expected a GPUDevice');
    }
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
    return this.#call((core) => core.quantizeCodes(x, shape, bits, groupQuantSize, options));
  }

  /** A reuse layer's own `{ scale, zero }` for the anchor's `codes` (a quantizeCodes result). */
  computeReuseParams(x, codes) {
    return this.#call((core) => core.computeReuseParams(x, codes));
  }

  /** `codes · scale + zero` as a Float32Array; `params` defaults to the codes' own. */
  dequantWithParams(codes, params = undefined, options = {}) {
    return this.#call((core) => core.dequantWithParams(codes, params, options));
  }

  /** The dequantized `bits`-bit residual of `x - recon`, a Float32Array. */
  quantizeResidual(x, recon, shape, bits, groupQuantSize = 32, options = {}) {
    return this.#call((core) => core.quantizeResidual(x, recon, shape, bits, groupQuantSize, options));
  }

  /** `{ mse, cosine }` of two tensors of one shape. */
  crossLayerSimilarity(a, b, shape) {
    return this.#call((core) => core.crossLayerSimilarity(a, b, shape));
  }

  /** `{ layers, mse, cosine }`: L × L row-major Float32Arrays for an array of layers. */
  similarityMatrix(layers, shape) {
    return this.#call((core) => core.similarityMatrix(layers, shape));
  }

  /**
   * `xquant analyze` on the bytes of a K/V safetensors file (tensors
   * `past_key_values.{i}.key/.value`, `[B, H, S, D]`): the same object as `analyze --json`.
   */
  analyzeKv(bytes, options = {}) {
    return this.#call((core) => core.analyzeKv(bytes, options));
  }

  /**
   * `xquant plan` on the bytes of a K/V safetensors file: measures every candidate per layer
   * and K/V and resolves to `{ plan, effectiveBits, quantizedBits, kvBytes, error,
   * targetBits, context }` — the plan with the least measured error whose effective bits at
   * `context` tokens (window, sinks, params and residuals counted) meet `targetBits`. Pass
   * `plan` to `cacheSet({ ..., plan })` or save it as JSON for `xquant --plan`.
   */
  suggestPlan(bytes, options = {}) {
    return this.#call((core) => core.suggestPlan(bytes, options));
  }

  /** `{ layers, shape, key: { cosine, mse }, value: { cosine, mse } }` of a K/V file. */
  kvSimilarity(bytes) {
    return this.#call((core) => core.kvSimilarity(bytes));
  }

  /** A coordinated set of XQuant caches, one per attention layer (see README). */
  cacheSet(options) {
    const core = live(this.#core, 'XQuant');
    if (this.#state.lost !== null) throw lostError(this.#state);
    return new CacheSet(core.cacheSet(options ?? {}), this.#state);
  }

  /**
   * A cache set restored from the bytes of `CacheSet.save()` (a Uint8Array or ArrayBuffer),
   * on this context's device: it continues exactly as the saved set would have. Rejects with
   * FormatError for bytes that are corrupt, truncated, of another version or kind, or that
   * this device cannot hold; nothing is allocated then.
   */
  restoreCacheSet(bytes) {
    return this.#call((core) => core.restoreCacheSet(bytes)).then((core) => new CacheSet(core, this.#state));
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
  #state;
  /** Counts reset() and free() (updateAndFetchGpu's buffers do not outlive them). */
  #epoch = 0;

  constructor(core, state) {
    this.#core = core;
    this.#state = state;
  }

  /** A GPU call on the live set (rejects, never throws). */
  #call(f) {
    let core;
    try {
      core = live(this.#core, 'CacheSet');
    } catch (e) {
      return Promise.reject(e);
    }
    return guarded(this.#state, () => f(core), (lost) => {
      try {
        core.settle(lost); // a call caught by a device loss is undone
      } catch {
        // The set was freed meanwhile: nothing to undo.
      }
    });
  }

  /**
   * Appends `tokens` tokens to `layer`. `keys`/`values`: Float32Array or Uint16Array of f16
   * bits, or GPUBuffers on the context's device (usage STORAGE), `[batch, kvHeads, tokens,
   * headDim]`; `options` for buffers: `{ dtype: 'f32' | 'f16', offset, keysOffset,
   * valuesOffset }` (byte offsets, multiples of 256). Your buffers are read by the
   * submission and not kept.
   */
  append(layer, keys, values, tokens, options = {}) {
    return this.#call((core) => core.append(layer, keys, values, tokens, options));
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
    return this.#call((core) => core.attendGpu(layer, queries, out, options ?? {}));
  }

  /** As attendGpu with host queries (Float32Array or Uint16Array of f16 bits); resolves to a Float32Array. */
  attend(layer, queries, options) {
    return this.#call((core) => core.attend(layer, queries, options ?? {}));
  }

  /**
   * Writes every token of `layer`, reconstructed, into your GPUBuffers `keys` and `values`
   * (`[batch, kvHeads, tokens, headDim]`; `options`: `{ dtype: 'f32' | 'f16', keysOffset,
   * valuesOffset }`).
   */
  fetchInto(layer, keys, values, options = {}) {
    return this.#call((core) => core.fetchInto(layer, keys, values, options));
  }

  /**
   * Appends `tokens` tokens to `layer` (`keys`/`values`: Float32Array or Uint16Array of f16
   * bits, `[batch, kvHeads, tokens, headDim]`) and resolves to `{ keys, values, tokens }`,
   * every token's reconstruction as Float32Arrays.
   */
  updateAndFetch(layer, keys, values, tokens) {
    return this.#call((core) => core.updateAndFetch(layer, keys, values, tokens));
  }

  /**
   * As updateAndFetch, resolving to `{ keys, values, tokens, dtype, byteLength }` with the
   * set's own GPUBuffers: valid until the set's next call is submitted (a later call may
   * replace them with larger ones and destroy these). Prefer fetchInto.
   */
  updateAndFetchGpu(layer, keys, values, tokens) {
    const epoch = this.#epoch;
    return this.#call((core) => core.updateAndFetchGpu(layer, keys, values, tokens)).then((r) => {
      if (this.#epoch !== epoch) {
        throw new UsageError('the cache set was reset or freed before updateAndFetchGpu resolved: its buffers are gone');
      }
      return r;
    });
  }

  /**
   * The set as bytes (resolves to a Uint8Array): its plan, options, bookkeeping and packed
   * data exactly as stored, in a versioned, checksummed container (see README, "Persisting a
   * cache"). Recorded and submitted now: later calls do not change what is saved. Restore
   * it with `XQuant.restoreCacheSet(bytes)`.
   */
  save() {
    return this.#call((core) => core.save());
  }

  /** Tokens `layer` holds. */
  tokens(layer) {
    return live(this.#core, 'CacheSet').tokens(layer);
  }

  /** The plan every layer follows (the JSON object `xquant plan` writes). */
  plan() {
    return live(this.#core, 'CacheSet').plan();
  }

  /**
   * `{ layers: [{ layer, tokens, effectiveBits, accountedBytes, allocatedBytes, key, value,
   * ... }], totals }`: `effectiveBits`/`accountedBytes` are the reference's accounting,
   * `allocatedBytes`/`ratioVsFp16` the GPU buffers (see index.d.ts).
   */
  stats() {
    return live(this.#core, 'CacheSet').stats();
  }

  /**
   * Forgets every token and frees the GPU buffers; the set stays usable. Calls made before
   * it were submitted already and complete (see README, "Ordering and lifetimes").
   */
  reset() {
    live(this.#core, 'CacheSet').reset();
    this.#epoch++;
  }

  /** Destroys the set's GPU buffers now (work already submitted completes). Later calls throw UsageError. */
  free() {
    if (this.#core !== null) {
      this.#core.release();
      this.#core.free();
      this.#core = null;
      this.#epoch++;
    }
  }

  [Symbol.dispose]() {
    this.free();
  }
}
