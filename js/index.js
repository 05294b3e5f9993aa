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
/** Something could not be read: a download failed, or the package's wasm module could not be loaded. */
export class IoError extends XQuantError {}
/**
 * Bytes that are not a valid file of their kind (a GGUF model, K/V safetensors, a saved cache
 * set): corrupt, truncated, of an unsupported version or type, or not matching (a saved cache
 * set of another kind, or one this device cannot hold).
 */
export class FormatError extends XQuantError {}

const ERRORS = {
  ShapeError, ConfigError, NonFiniteError, ContextBudgetError, WebGpuUnavailableError,
  DeviceLostError, GpuError, TooLargeError, UsageError, IoError, FormatError,
};

let loading = null;

/** Whether this is Node (or a runtime that says it is one): no `fetch` of `file:` URLs. */
function isNode() {
  return typeof process !== 'undefined' && typeof process.versions?.node === 'string';
}

/**
 * The `.wasm` next to this file. In a browser: its URL (wasm-bindgen fetches it). In Node,
 * whose fetch cannot read `file:` URLs: its bytes, read with `node:fs` (imported here, only
 * in Node, so the package has no Node-only static import and loads in a browser as is).
 */
async function defaultWasm() {
  const url = new URL('xquant_wgpu_bg.wasm', import.meta.url);
  if (!isNode() || url.protocol !== 'file:') return undefined;
  const fs = await import(/* webpackIgnore: true */ /* @vite-ignore */ 'node:fs/promises');
  return fs.readFile(url);
}

/**
 * Loads the wasm module (once). `wasm`: an optional URL, Response or bytes of the `.wasm`.
 * A failed load rejects with IoError and is not remembered: the next call tries again.
 */
export function ready(wasm) {
  if (loading === null) {
    const pending = Promise.resolve()
      .then(() => (wasm === undefined ? defaultWasm() : wasm))
      .then((source) => init(source === undefined ? undefined : { module_or_path: source }))
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

/** Whether `x` looks like a GPU (`navigator.gpu`, or `create()` of Node's `webgpu` package). */
function isGpu(x) {
  return x !== null && typeof x === 'object' && typeof x.requestAdapter === 'function';
}

/** Whether the global object is a window or a worker (the only places wgpu looks for a GPU). */
function isBrowserGlobal() {
  return globalThis.Window !== undefined || globalThis.WorkerGlobalScope !== undefined;
}

/**
 * Puts `value` at `obj[key]` (an own, configurable data property) and returns the function
 * that puts back what was there: the same own property, or none.
 */
function swap(obj, key, value) {
  const before = Object.getOwnPropertyDescriptor(obj, key);
  Object.defineProperty(obj, key, { value, configurable: true, writable: true, enumerable: false });
  return () => {
    if (before) Object.defineProperty(obj, key, before);
    else delete obj[key];
  };
}

/**
 * Makes `gpu` what wgpu finds, for one context creation. wgpu (in the wasm module) reads
 * `navigator.gpu` once, in `Instance::new`, and only on a global that has `Window` or
 * `WorkerGlobalScope`; it asks that GPU for an adapter right after. So, where needed,
 * `Window` and `navigator.gpu` are provided until that `requestAdapter` call (at the latest
 * until `create` settles), then put back as they were. With `device`, the same
 * `requestAdapter` answers, once, with an adapter whose `requestDevice` gives `device`: wgpu
 * has no other door for a device it did not request itself. Creations take turns (each
 * changes shared objects for a moment).
 */
let creating = Promise.resolve();
function withGpu(gpu, device, create) {
  const run = async () => {
    const restores = [];
    const restore = () => {
      while (restores.length > 0) restores.pop()();
    };
    try {
      if (!isBrowserGlobal()) restores.push(swap(globalThis, 'Window', class Window {}));
      const nav = globalThis.navigator;
      if (nav === undefined || nav === null) restores.push(swap(globalThis, 'navigator', { gpu }));
      else if (nav.gpu !== gpu) restores.push(swap(nav, 'gpu', gpu));
      const request = gpu.requestAdapter;
      const answer =
        device === undefined
          ? (options) => request.call(gpu, options)
          : async () => adapterOf(device);
      restores.push(
        swap(gpu, 'requestAdapter', (options) => {
          restore();
          return answer(options);
        }),
      );
      return await create();
    } finally {
      restore();
    }
  };
  const result = creating.then(run, run);
  creating = result.catch(() => {});
  return result;
}

/** An adapter whose `requestDevice` gives `device` (what wgpu needs of it). */
function adapterOf(device) {
  const info = device.adapterInfo ?? {};
  return {
    features: device.features,
    limits: device.limits,
    info,
    isFallbackAdapter: Boolean(info.isFallbackAdapter),
    requestDevice: async () => device,
    requestAdapterInfo: async () => info,
  };
}

/**
 * wgpu sorts the errors of its error scopes with `instanceof GPUValidationError` and
 * `instanceof GPUOutOfMemoryError` (any other error is a panic in the wasm module), on
 * globals. Browsers have them; Node has them only if the `webgpu` package's `globals` were
 * installed (`Object.assign(globalThis, globals)`). Where one is missing, a stand-in stays
 * defined (non-enumerable) for the life of the process: a class that recognizes the GPU's
 * error objects by their class name.
 */
function defineGpuErrorClasses() {
  for (const name of ['GPUValidationError', 'GPUOutOfMemoryError']) {
    if (globalThis[name] !== undefined) continue;
    const standIn = {
      [name]: class extends Error {
        static [Symbol.hasInstance](x) {
          for (let p = x; p !== null && (typeof p === 'object' || typeof p === 'function'); p = Object.getPrototypeOf(p)) {
            if (p.constructor?.name === name) return true;
          }
          return false;
        }
      },
    }[name];
    Object.defineProperty(globalThis, name, { value: standIn, configurable: true, writable: true, enumerable: false });
  }
}

/** What wgpu reports, completed with the GPUAdapterInfo of the device. */
async function describeAdapter(core, gpu) {
  const base = core.adapterInfo;
  let info = core.device?.adapterInfo;
  if (!info) {
    try {
      info = (await gpu.requestAdapter())?.info;
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
   * Acquires WebGPU. Throws WebGpuUnavailableError when there is no GPU (no `gpu` option and
   * no `navigator.gpu`) or no adapter. `options`: `{ gpu?: GPU, device?: GPUDevice,
   * powerPreference?: 'low-power' | 'high-performance', wasm? }`. `gpu`: the GPU to use
   * (default `navigator.gpu`; in Node, `create([])` of the `webgpu` package). With `device`,
   * everything runs on that (your) device, so your GPUBuffers and ours meet; its
   * `onuncapturederror` stays yours (our calls catch their own errors in error scopes) and
   * `free()` leaves it alive.
   */
  static async create(options = {}) {
    if (options === null || typeof options !== 'object' || Array.isArray(options)) {
      throw new ConfigError(`XQuant.create: options must be an object, got ${options === null ? 'null' : typeof options}`);
    }
    const gpu = options.gpu ?? (typeof navigator === 'undefined' ? undefined : navigator.gpu);
    if (gpu === undefined || gpu === null) {
      throw new WebGpuUnavailableError(
        isNode() && !isBrowserGlobal()
          ? 'WebGPU is not available here: Node has no navigator.gpu. Install the `webgpu` ' +
              "package (npm install webgpu) and pass its GPU: import { create } from 'webgpu'; " +
              'await XQuant.create({ gpu: create([]) }).'
          : 'WebGPU is not available here: navigator.gpu is missing. Use a browser with WebGPU ' +
              '(Chrome/Edge 113+, Safari 26+) on a secure origin (https or localhost).',
      );
    }
    await ready(options.wasm);
    checkOptions('XQuant.create', options);
    if (!isGpu(gpu)) {
      throw new ConfigError('XQuant.create option `gpu`: expected a GPU (navigator.gpu, or create() of the `webgpu` package)');
    }
    const { device } = options;
    if (device !== undefined && !isGpuDevice(device)) {
      throw new ConfigError('XQuant.create option `device`: expected a GPUDevice');
    }
    if (!isBrowserGlobal()) defineGpuErrorClasses();
    const create = () =>
      XQuantCore.create({ powerPreference: options.powerPreference, shared: device !== undefined });
    const core = await withGpu(gpu, device, create);
    return new XQuant(core, await describeAdapter(core, gpu));
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

  /** `level(code) · scale + zero` as a Float32Array (the level is the code itself unless the
   * codes are Lloyd–Max levels); `params` defaults to the codes' own. */
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

  /** A coordinated set of XQuant caches, one per attention layer (see docs/cache.md). */
  cacheSet(options) {
    const core = live(this.#core, 'XQuant');
    if (this.#state.lost !== null) throw lostError(this.#state);
    return new CacheSet(core.cacheSet(options ?? {}), this.#state);
  }

  /**
   * Loads a GGUF model (llama family: F32/F16/Q8_0/Q4_1 weights) onto the device. `source`:
   * a URL (string or URL), a `Response`, a `Blob`/`File`, an `ArrayBuffer` or a `Uint8Array`.
   * `options`: `{ onProgress({ phase: 'download' | 'load', loaded, total }), signal }`.
   * Rejects with IoError when the download fails, FormatError for a file that is not a
   * GGUF this package runs (truncated, another architecture, unsupported weight types).
   */
  async loadModel(source, options = {}) {
    const core = live(this.#core, 'XQuant');
    checkOptions('loadModel', options);
    const { onProgress, signal } = options;
    if (onProgress !== undefined && typeof onProgress !== 'function') {
      throw new ConfigError('loadModel option `onProgress`: expected a function');
    }
    const bytes = await readModelSource(source, onProgress, signal);
    signal?.throwIfAborted?.();
    onProgress?.({ phase: 'load', loaded: 0, total: bytes.byteLength });
    const model = await this.#call(() => core.loadModel(bytes));
    onProgress?.({ phase: 'load', loaded: bytes.byteLength, total: bytes.byteLength });
    return new Model(model, this, this.#state);
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
    setCores.set(this, core);
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
   * outDtype = 'f32', offset, outOffset, layout: 'heads' | 'tokens', queryLayout, pos0, scale
   * }`. By default the queries are the layer's last `tokens` tokens (append them first) and
   * each sees the tokens up to its own; `layout: 'tokens'` writes `[batch, tokens, queryHeads,
   * headDim]`, the rows an output projection reads; `queryLayout: 'tokens'` reads the queries
   * that way.
   */
  attendGpu(layer, queries, out, options) {
    return this.#call((core) => core.attendGpu(layer, queries, out, options ?? {}));
  }

  /** The live core, for a synchronous call (throws DeviceLostError on a lost device). */
  #now() {
    const core = live(this.#core, 'CacheSet');
    if (this.#state.lost !== null) throw lostError(this.#state);
    return core;
  }

  /**
   * Records appending `tokens` tokens to `layer` into your `encoder` (a GPUCommandEncoder of
   * the context's device) and submits nothing: `keys`/`values` are GPUBuffers as for append
   * (`[batch, kvHeads, tokens, headDim]`, or `[batch, tokens, kvHeads, headDim]` with
   * `layout: 'tokens'`; options `{ dtype, offset, keysOffset, valuesOffset, layout }`). The set counts the tokens at once. Submit the encoder yourself; when
   * you do not, or the submission fails, `rollback` to a checkpoint taken before. Throws
   * (typed errors) and records nothing when its arguments are refused.
   */
  encodeAppend(encoder, layer, keys, values, tokens, options = {}) {
    this.#now().encodeAppend(encoder, layer, keys, values, tokens, options);
  }

  /**
   * Records the attention of `queries` over `layer`'s tokens into your `out` (GPUBuffers and
   * options as for attendGpu) into your `encoder`, and submits nothing.
   */
  encodeAttend(encoder, layer, queries, out, options) {
    this.#now().encodeAttend(encoder, layer, queries, out, options ?? {});
  }

  /**
   * A snapshot of every layer (tokens, pages, window) to `rollback` to: take one before
   * recording a step, free it once the step's submission succeeded (it keeps buffers a
   * later call replaced alive until then).
   */
  checkpoint() {
    return new CacheCheckpoint(this.#now().checkpoint());
  }

  /**
   * Puts every layer back where `checkpoint` found it (taken on this set since its last
   * reset) and uses the checkpoint up; the set accepts calls again, also after a GPU failure.
   */
  rollback(checkpoint) {
    if (!(checkpoint instanceof CacheCheckpoint)) {
      throw new UsageError('rollback takes a checkpoint from this set\'s checkpoint()');
    }
    live(this.#core, 'CacheSet').rollback(checkpoint[CHECKPOINT]());
    checkpoint.free();
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
   * data exactly as stored, in a versioned, checksummed container (see docs/cache.md, "Persisting a
   * cache"). Recorded and submitted now: later calls do not change what is saved. Restore
   * it with `XQuant.restoreCacheSet(bytes)`.
   */
  save() {
    return this.#call((core) => core.save());
  }

  /** Tokens appended to `layer` (the next token's position). */
  tokens(layer) {
    return live(this.#core, 'CacheSet').tokens(layer);
  }

  /** Tokens `layer` still holds, its last ones: all of them but in a sliding layer. */
  heldTokens(layer) {
    return live(this.#core, 'CacheSet').heldTokens(layer);
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
   * it were submitted already and complete (see docs/npm-package.md, "Ordering and lifetimes").
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

const CHECKPOINT = Symbol('checkpoint');

/** A snapshot of a CacheSet (`caches.checkpoint()`), for `caches.rollback(checkpoint)`. */
export class CacheCheckpoint {
  #core;

  constructor(core) {
    this.#core = core;
  }

  /** The wasm core (for CacheSet.rollback only). */
  [CHECKPOINT]() {
    return live(this.#core, 'CacheCheckpoint');
  }

  /** Lets go of the snapshot (and of buffers only it kept alive). */
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

/** A Model's methods for its Generations only. */
const STEP = Symbol('step');
const REPORT = Symbol('report');

/** The wasm core of each CacheSet (for a Model generating over it). */
const setCores = new WeakMap();

/** The bytes of a model `source` (see XQuant.loadModel), streamed with progress. */
async function readModelSource(source, onProgress, signal) {
  if (source instanceof Uint8Array) return source;
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  if (ArrayBuffer.isView(source)) return new Uint8Array(source.buffer, source.byteOffset, source.byteLength);
  if (typeof Blob !== 'undefined' && source instanceof Blob) {
    return readStream(source.stream(), source.size, onProgress, signal);
  }
  if (typeof source === 'string' || (typeof URL !== 'undefined' && source instanceof URL)) {
    let response;
    try {
      response = await fetch(source, { signal });
    } catch (e) {
      if (signal?.aborted) throw signal.reason;
      throw new IoError(`could not fetch the model from ${source}: ${e?.message ?? e}`);
    }
    if (!response.ok) {
      throw new IoError(`could not fetch the model from ${source}: HTTP ${response.status} ${response.statusText}`.trim());
    }
    source = response;
  }
  if (typeof Response !== 'undefined' && source instanceof Response) {
    // A compressed response's length is not the body's: then the total is unknown.
    const encoded = (source.headers.get('content-encoding') ?? 'identity') !== 'identity';
    const length = Number(source.headers.get('content-length'));
    const total = !encoded && Number.isFinite(length) && length > 0 ? length : null;
    if (source.body === null) return new Uint8Array(await source.arrayBuffer());
    return readStream(source.body, total, onProgress, signal);
  }
  throw new ConfigError('loadModel: the source must be a URL, a Response, a Blob/File, an ArrayBuffer or a Uint8Array');
}

/** Reads a stream into one Uint8Array, reporting `{ phase: 'download', loaded, total }`. */
async function readStream(stream, total, onProgress, signal) {
  const reader = stream.getReader();
  let whole = total !== null ? new Uint8Array(total) : null;
  const chunks = [];
  let loaded = 0;
  try {
    for (;;) {
      if (signal?.aborted) throw signal.reason;
      const { done, value } = await reader.read();
      if (done) break;
      if (whole !== null && loaded + value.byteLength <= whole.byteLength) {
        whole.set(value, loaded);
      } else {
        if (whole !== null) chunks.push(whole.subarray(0, loaded));
        whole = null;
        chunks.push(value);
      }
      loaded += value.byteLength;
      onProgress?.({ phase: 'download', loaded, total });
    }
  } catch (e) {
    reader.cancel().catch(() => {});
    if (signal?.aborted) throw signal.reason;
    throw e instanceof XQuantError ? e : new IoError(`reading the model failed after ${loaded} bytes: ${e?.message ?? e}`);
  }
  if (whole !== null) return loaded === whole.byteLength ? whole : whole.subarray(0, loaded);
  const out = new Uint8Array(loaded);
  let at = 0;
  for (const c of chunks) {
    out.set(c, at);
    at += c.byteLength;
  }
  return out;
}

/** Token ids given as any array-like of integers, checked. */
function tokenIds(ids, what) {
  if (ids === null || typeof ids !== 'object' || typeof ids.length !== 'number') {
    throw new ShapeError(`${what}: expected an array of token ids`);
  }
  const out = new Uint32Array(ids.length);
  for (let i = 0; i < ids.length; i++) {
    const t = ids[i];
    if (!Number.isInteger(t) || t < 0 || t > 0xffffffff) {
      throw new ShapeError(`${what}[${i}]: expected a token id (a non-negative integer), got ${String(t)}`);
    }
    out[i] = t;
  }
  return out;
}

/**
 * A loaded model: its tokenizer, generation over an XQuant or f16 cache, K/V capture.
 * Steps of different generations never overlap on the GPU (they take turns, token by token).
 */
export class Model {
  #core;
  #xq;
  #state;
  #info;
  #turn = Promise.resolve();
  #owned = new Set();
  #last = null;

  constructor(core, xq, state) {
    this.#core = core;
    this.#xq = xq;
    this.#state = state;
    this.#info = core.info();
  }

  /** `{ architecture, layers, heads, kvHeads, headDim, hidden, ffn, vocab, contextLength, eosToken, bosToken, addBos }`. */
  get info() {
    live(this.#core, 'Model');
    return { ...this.#info };
  }

  /** Token ids of `text` (`options.special`, default true: `<|im_start|>` and such are control
   * tokens; `options.bos`, default false: BOS first where the model wants it, `info.addBos`). */
  tokenize(text, options = {}) {
    const core = live(this.#core, 'Model');
    checkOptions('tokenize', options);
    if (typeof text !== 'string') throw new ShapeError('tokenize: text must be a string');
    return core.tokenize(text, options.special ?? true, options.bos === true);
  }

  /** The text of token ids. */
  detokenize(ids) {
    const core = live(this.#core, 'Model');
    return core.detokenize(tokenIds(ids, 'detokenize'));
  }

  /** The model's chat template over `[{ role, content }]` (`options.addGenerationPrompt`, default true). */
  chatTemplate(messages, options = {}) {
    const core = live(this.#core, 'Model');
    checkOptions('chatTemplate', options);
    return core.chatTemplate(messages, options.addGenerationPrompt ?? true);
  }

  /** An XQuant CacheSet shaped for this model (options as `XQuant.cacheSet`, less the shape). */
  cacheSet(options = {}) {
    live(this.#core, 'Model');
    const { layers, kvHeads, headDim, contextLength, attentionWindows } = this.#info;
    const windows = attentionWindows.some((w) => w !== null) ? { attentionWindows } : {};
    return this.#xq.cacheSet({ maxCtx: contextLength, ...windows, ...options, layers, kvHeads, headDim });
  }

  /** A plain f16 cache for this model (`options.maxCtx`, default the model's context). */
  f16Cache(options = {}) {
    const core = live(this.#core, 'Model');
    if (this.#state.lost !== null) throw lostError(this.#state);
    return new F16Cache(core.f16Cache(options.maxCtx ?? this.#info.contextLength));
  }

  /**
   * Generates after `prompt` (text, or token ids) and streams the new tokens:
   * `for await (const piece of model.generate(prompt, options))`. Options: `{ maxTokens =
   * 128, cache, maxCtx, temperature = 0 (greedy), topK, topP, seed, signal, onPrefill }`;
   * `cache`: `'f16'`, a preset's name, cacheSet options (a plan included), or a CacheSet /
   * F16Cache to continue (its tokens come first). The returned Generation's `cache` is the
   * cache it fills: pass it to the next call to continue the conversation.
   */
  generate(prompt, options = {}) {
    const core = live(this.#core, 'Model');
    if (options === null || typeof options !== 'object') {
      throw new ConfigError('generate: options must be an object');
    }
    checkOptions('generate', options);
    if (options.onPrefill !== undefined && typeof options.onPrefill !== 'function') {
      throw new ConfigError('generate option `onPrefill`: expected a function');
    }
    // A text prompt that starts a conversation starts with BOS where the model wants it.
    const given = options.cache;
    const held = given instanceof CacheSet ? given.tokens(0) : given instanceof F16Cache ? given.tokens() : 0;
    const ids = typeof prompt === 'string' ? this.tokenize(prompt, { bos: held === 0 }) : tokenIds(prompt, 'generate: prompt');
    if (ids.length === 0) throw new ShapeError('generate: the prompt has no tokens');
    const { cache, gen } = this.#start(core, options);
    return new Generation(this, gen, cache, ids, options);
  }

  #start(core, options) {
    const given = options.cache;
    const maxCtx = options.maxCtx;
    let cache = given;
    if (!(given instanceof CacheSet) && !(given instanceof F16Cache)) {
      if (given === 'f16') cache = this.f16Cache({ maxCtx });
      else if (typeof given === 'string') cache = this.cacheSet({ plan: given, ...(maxCtx ? { maxCtx } : {}) });
      else if (given === undefined || (given !== null && typeof given === 'object')) {
        cache = this.cacheSet({ ...(given ?? {}), ...(maxCtx ? { maxCtx } : {}) });
      } else {
        throw new ConfigError("generate option `cache`: expected 'f16', a preset name, cacheSet options, a CacheSet or an F16Cache");
      }
      this.#owned.add(cache);
    }
    try {
      const gen = cache instanceof F16Cache
        ? core.generateF16(f16Cores.get(cache), options)
        : core.generateXQuant(setCores.get(cache), options);
      return { cache, gen };
    } catch (e) {
      if (cache !== given) {
        this.#owned.delete(cache);
        cache.free();
      }
      throw e;
    }
  }

  /** Runs `step` when the GPU is ours (one step of one generation at a time). */
  [STEP](step) {
    const run = this.#turn.then(() => {
      live(this.#core, 'Model');
      return guarded(this.#state, step);
    });
    this.#turn = run.catch(() => {});
    return run;
  }

  /** Records a generation's figures for stats(). */
  [REPORT](figures) {
    this.#last = figures;
  }

  /**
   * A saved conversation's cache (the bytes of `CacheSet.save()` or `F16Cache.save()`)
   * restored for this model: a CacheSet or an F16Cache to pass as `generate`'s `cache`.
   * FormatError for bytes that are corrupt, truncated, or saved for another model's shape.
   */
  restoreCache(bytes) {
    let core;
    let data;
    try {
      core = live(this.#core, 'Model');
      if (bytes instanceof ArrayBuffer) data = new Uint8Array(bytes);
      else if (bytes instanceof Uint8Array) data = bytes;
      else throw new FormatError('restoreCache: the saved cache must be a Uint8Array or an ArrayBuffer');
    } catch (e) {
      return Promise.reject(e);
    }
    return this[STEP](() => core.restoreCache(data)).then(({ kind, cache }) =>
      kind === 'f16' ? new F16Cache(cache) : new CacheSet(cache, this.#state),
    );
  }

  /**
   * The K/V of `text` as safetensors bytes (f16, keys after RoPE): what analyzeKv reads; with
   * `{ queries: true }` also every layer's queries, by which suggestPlan judges plans.
   */
  capture(text, options) {
    let core;
    try {
      core = live(this.#core, 'Model');
      if (typeof text !== 'string') throw new ShapeError('capture: text must be a string');
    } catch (e) {
      return Promise.reject(e);
    }
    return this[STEP](() => core.capture(text, options));
  }

  /**
   * The last generation's figures: `{ cacheTokens, kvAllocatedBytes, promptTokens,
   * generatedTokens, prefillMs, decodeMs, tokensPerSecond, prefillTokensPerSecond, cache }`
   * (`tokensPerSecond`: decode only), or null before any.
   */
  stats() {
    live(this.#core, 'Model');
    return this.#last === null ? null : { ...this.#last };
  }

  /** Frees the model's GPU buffers and the caches its generations created. */
  free() {
    if (this.#core !== null) {
      for (const c of this.#owned) c.free();
      this.#owned.clear();
      this.#core.free();
      this.#core = null;
    }
  }

  [Symbol.dispose]() {
    this.free();
  }
}

/**
 * One generation: an async iterable of pieces `{ token, text, index, cacheTokens,
 * kvAllocatedBytes }` (iterate it once). `tokens` and `text` grow as it runs; `finishReason`
 * is `'eos'`, `'maxTokens'` or `'aborted'` at the end.
 */
export class Generation {
  #model;
  #core;
  #prompt;
  #options;
  #started = false;
  /** The cache the generation fills (CacheSet or F16Cache): pass it on to continue. */
  cache;
  /** Token ids generated so far. */
  tokens = [];
  /** Text generated so far. */
  text = '';
  /** Why it ended, or null while it runs. */
  finishReason = null;

  constructor(model, core, cache, prompt, options) {
    this.#model = model;
    this.#core = core;
    this.cache = cache;
    this.#prompt = prompt;
    this.#options = options;
  }

  /** The prompt's token ids. */
  get promptTokens() {
    return Array.from(this.#prompt);
  }

  [Symbol.asyncIterator]() {
    if (this.#started) throw new UsageError('a Generation can be iterated once');
    this.#started = true;
    return this.#run();
  }

  async *#run() {
    const core = this.#core;
    const { signal, onPrefill } = this.#options;
    const now = () => (typeof performance !== 'undefined' ? performance.now() : Date.now());
    const figures = {
      cache: this.cache instanceof F16Cache ? 'f16' : 'xquant',
      promptTokens: this.#prompt.length,
      generatedTokens: 0,
      prefillMs: 0,
      decodeMs: 0,
      tokensPerSecond: 0,
      prefillTokensPerSecond: 0,
      cacheTokens: 0,
      kvAllocatedBytes: 0,
    };
    const abort = () => {
      if (signal?.aborted) {
        this.finishReason = 'aborted';
        throw signal.reason;
      }
    };
    try {
      abort();
      const t0 = now();
      const progress = onPrefill ? (done, total) => onPrefill({ done, total }) : undefined;
      await this.#model[STEP](() => core.prefill(this.#prompt, progress));
      figures.prefillMs = now() - t0;
      figures.prefillTokensPerSecond = (this.#prompt.length / figures.prefillMs) * 1000;
      for (let index = 0; ; index++) {
        abort();
        const t = now();
        const piece = await this.#model[STEP](() => core.next());
        if (piece === null) break;
        figures.decodeMs += now() - t;
        figures.generatedTokens++;
        figures.tokensPerSecond = (figures.generatedTokens / figures.decodeMs) * 1000;
        figures.cacheTokens = piece.cacheTokens;
        figures.kvAllocatedBytes = piece.kvAllocatedBytes;
        this.tokens.push(piece.token);
        this.text += piece.text;
        this.#model[REPORT]({ ...figures });
        yield { ...piece, index };
      }
      this.text += core.flush();
      this.finishReason = core.finish();
    } finally {
      this.#model[REPORT]({ ...figures });
    }
  }
}

/** The wasm core of each F16Cache. */
const f16Cores = new WeakMap();

/** A plain f16 K/V cache for a model (`model.f16Cache()`, or `generate(..., { cache: 'f16' })`). */
export class F16Cache {
  #core;

  constructor(core) {
    this.#core = core;
    f16Cores.set(this, core);
  }

  /** Tokens the cache holds. */
  tokens() {
    return live(this.#core, 'F16Cache').tokens();
  }

  /** `{ totals: { tokens, allocatedBytes, fp16Bytes, scratchBytes } }`. */
  stats() {
    return live(this.#core, 'F16Cache').stats();
  }

  /** Forgets every token (the cache stays usable). */
  reset() {
    live(this.#core, 'F16Cache').reset();
  }

  /** The cache as bytes (Uint8Array) for `model.restoreCache` (same container as CacheSet.save). */
  save() {
    try {
      return live(this.#core, 'F16Cache').save();
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** Frees the GPU buffers now; later calls throw UsageError. */
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
