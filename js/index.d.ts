/// <reference types="@webgpu/types" />
// Types of xquant-wgpu's public API (js/index.js). The WebGPU types (`GPUDevice`,
// `GPUBuffer`, ...) come from `@webgpu/types`, a dependency of this package.

/** Base class of every error this package throws (`name` is the subclass's name). */
export class XQuantError extends Error {}
/** A tensor's length, shape, offset or type is wrong (also `layer` / `tokens` arguments). */
export class ShapeError extends XQuantError {}
/** An unknown option, an option of the wrong type or out of range (named as documented
 * here, e.g. "cacheSet option `maxCtx`: expected a non-negative integer, got the string
 * \"1\""), or a GPUBuffer without STORAGE. */
export class ConfigError extends XQuantError {}
/** An input holds NaN/Inf, or values f16 cannot hold. */
export class NonFiniteError extends XQuantError {}
/** A layer would exceed `maxCtx`. */
export class ContextBudgetError extends XQuantError {}
/** No WebGPU (`navigator.gpu` missing or no adapter). */
export class WebGpuUnavailableError extends XQuantError {}
/** The device was lost (or destroyed): every later GPU call rejects with it; create a new
 * XQuant. */
export class DeviceLostError extends XQuantError {}
/** The GPU refused a submission (a destroyed buffer, a buffer of another device). */
export class GpuError extends XQuantError {}
/** A tensor exceeds what the device can bind. */
export class TooLargeError extends XQuantError {}
/** Use after `free()` (or of updateAndFetchGpu's buffers after reset()/free()). */
export class UsageError extends XQuantError {}
/** Something could not be read: a download failed, or the package's wasm module could not be loaded. */
export class IoError extends XQuantError {}
/**
 * Bytes that are not a valid file of their kind (a GGUF model, K/V safetensors, a saved cache
 * set): corrupt, truncated, of an unsupported version or type, or not matching (a saved cache
 * set of another kind, or one this device cannot hold).
 */
export class FormatError extends XQuantError {}

/** Host tensors: f32 values, or IEEE half bit patterns. */
export type HostTensor = Float32Array | Uint16Array;

export interface AdapterInfo {
  name: string;
  backend: string;
  deviceType: string;
  driver: string;
  vendor: string;
  architecture: string;
  description: string;
  /** True for a CPU fallback such as SwiftShader. */
  isFallbackAdapter: boolean;
}

export interface QuantOptions {
  /** Data-free calibration η in [0, 0.5]; 0 reproduces the reference. */
  eta?: number;
  /** Grouping axis: 'tokens' (the reference) or 'channels' (per-token groups along D). */
  valueAxis?: 'tokens' | 'channels';
  /** Params storage: 'f16' (compact, default) or 'f32' (exact reference conformance). */
  params?: 'f16' | 'f32';
  /** What codes stand for: 'uniform' steps (a scale and zero per group, default) or
   * 'lloyd-max' levels of a rotated unit vector's coordinate, x = norm · level[code] (one
   * norm per group, returned as `scale`, `zero` all 0): 1..4 bits, `valueAxis: 'channels'`,
   * a group size that divides D, η 0. */
  levels?: 'uniform' | 'lloyd-max';
}

/** A quantizeCodes result. */
export interface Quantized {
  /** Bit-packed codes, `[R, nGroups, wordsPerGroup, O]` u32 words (see docs/library.md, "Storage format"). */
  codes: Uint32Array;
  /** `[R, nGroups, O]` scales. */
  scale: Float32Array;
  /** `[R, nGroups, O]` zeros. */
  zero: Float32Array;
  nRows: number;
  bits: number;
  shape: number[];
  groupQuantSize: number;
  valueAxis: 'tokens' | 'channels';
  params: 'f16' | 'f32';
  eta: number;
  levels: 'uniform' | 'lloyd-max';
}

export interface GroupParams {
  scale: Float32Array;
  zero: Float32Array;
}

export interface Similarity {
  mse: number;
  cosine: number;
}

export interface SimilarityMatrix {
  layers: number;
  /** L × L, row-major. */
  mse: Float32Array;
  /** L × L, row-major. */
  cosine: Float32Array;
}

export interface CacheSetOptions {
  layers: number;
  kvHeads: number;
  headDim: number;
  batch?: number;
  /** Layers per group (1 = no sharing). Default 1. The defaults (`'kivi-lloyd'`: 3-bit keys
   * per channel, values rotated per token with 2-bit Lloyd–Max levels, groups of 64, window
   * 128, 4 sinks) were chosen by measurement (docs/quality.md) and apply as a whole: given any
   * quantizer option (`groupSize` … `params`, `keyBits`, `valueLevels`, `valueRotation`), the
   * others take KIVI-2's values (the per-option defaults below: 2-bit keys and values,
   * uniform, unrotated, groups of 32); given none, where kivi-lloyd cannot apply (a head dim
   * that is not a power of two from 64 to 256, a window or pageTokens that is not a multiple
   * of 64), the set uses KIVI-2's quantizer with the sinks. `plan: 'reference'` gives the
   * reference's pairs, `plan: 'kivi-2'` the previous default's quantizer. */
  groupSize?: number;
  /** Anchor bits of values (and of keys when `keyBits` is 0). Default 2. */
  baseBits?: number;
  /** Anchor bits of keys; 0: `baseBits`. Default 0 (kivi-lloyd, with no quantizer option: 3). */
  keyBits?: number;
  /** Reuse-layer residual bits (0 = pure reuse). Default 0. */
  residualBits?: number;
  /** Tokens (or channels) per quantization group. Default 32 (kivi-lloyd: 64). */
  groupQuantSize?: number;
  /** Window policy: most tokens a layer holds. Default 8192. */
  maxCtx?: number;
  eta?: number;
  /** Grouping of values: 'channels' (per token, the default) or 'tokens'. Keys are grouped
   * along tokens (per channel). */
  valueAxis?: 'tokens' | 'channels';
  /** What the values' codes stand for: 'uniform' steps (a scale and zero per group; the
   * per-option default) or 'lloyd-max' levels times a norm per group (kivi-lloyd's; needs
   * `valueAxis: 'channels'`, `eta` 0, 1..4 bits, no code sharing). */
  valueLevels?: 'uniform' | 'lloyd-max';
  /** Rotation of the values as they enter the cache: 'none' (the per-option default) or
   * 'hadamard' (kivi-lloyd's; head dims that are powers of two). Attention and fetch undo it. */
  valueRotation?: 'none' | 'hadamard';
  params?: 'f16' | 'f32';
  /** f16 tokens kept unquantized (multiple of groupQuantSize). Default 128. */
  window?: number;
  /** 'window' (default) or 'reference' (every call its own group, as the reference). */
  decodePolicy?: 'window' | 'reference';
  /** dtype of updateAndFetch's reconstructions (and the rounding of a reuse layer's
   * reconstruction before its residual, as the reference's fp16). Default 'f16'. */
  outputDtype?: 'f16' | 'f32';
  /** Most tokens per storage page (multiple of groupQuantSize); 0 (default): as many as
   * one storage binding holds (a layer's last page grows by doubling). */
  pageTokens?: number;
  /** First tokens kept in f16 in every layer (attention sinks). Default 4. */
  sinks?: number;
  /** One entry per layer: `null` for a global layer, or a sliding layer's attention window
   * (Gemma 3: 512 on 15 of 18 layers). A sliding layer attends within its window and keeps
   * only about that many tokens (its memory stays flat; `fetch` returns its last
   * `heldTokens`). Fills the layers a plan leaves without a window; `model.cacheSet` passes
   * the model's. Needs the 'window' decode policy. */
  attentionWindows?: (number | null)[];
  /** A per-layer plan instead of groupSize…params: a preset name ('xquant-paper',
   * 'kivi-2', 'kivi-lloyd', 'reference', 'pure-reuse', 'rotated-k3v2', 'rotated-2', 'lloyd-k3v2', 'lloyd-2.5',
   * 'lloyd-2', 'default'), a plan object (as `suggestPlan` or
   * `xquant plan` make it) or its JSON text. `window` and `sinks`, when given, replace the
   * plan's. */
  plan?: PlanPreset | CachePlanJson | PlanJsonText;
}

export type PlanPreset =
  | 'xquant-paper'
  | 'kivi-2'
  | 'kivi-lloyd'
  | 'reference'
  | 'pure-reuse'
  | 'rotated-k3v2'
  | 'rotated-2'
  | 'lloyd-k3v2'
  | 'lloyd-2.5'
  | 'lloyd-2'
  | 'default';
/** A plan as JSON text (an object: `{...}`), as `xquant plan` writes it. */
export type PlanJsonText = `{${string}`;

/** How one layer's keys or values are stored. */
export interface TensorPlanJson {
  /** 'own' codes, or the index of an earlier layer whose codes these decode. */
  codes: 'own' | number;
  /** 1..8 (a borrowing entry: its source's; may be left out). */
  bits?: number;
  /** Residual width of a borrowing entry, 0..8. Default 0. */
  residual_bits?: number;
  /** 'tokens' (per-channel params) or 'channels' (per-token params); a borrowing entry's is
   * its source's. */
  axis?: 'tokens' | 'channels';
  /** Data-free calibration, 0..0.5. Default 0. */
  eta?: number;
  /** 'hadamard': the head vectors are rotated (a randomized Walsh–Hadamard transform per
   * layer and KV head, signs from the plan's `rotation_seed`) before they are stored, which
   * spreads outlier channels so per-token groups quantize evenly; attention and `fetchInto`
   * undo it. Head dims that are powers of two. Default 'none' (a borrowing entry: its
   * source's). */
  rotation?: 'none' | 'hadamard';
  /** 'lloyd-max': own codes index Lloyd–Max levels for a rotated coordinate, scaled by the
   * group's f16 norm (16 bits per group instead of a scale and a zero); 1..4 bits,
   * `axis: 'channels'`, η 0, `group_quant_size` dividing the head dim; never borrowed.
   * Default 'uniform'. */
  levels?: 'uniform' | 'lloyd-max';
}

/** A cache plan (`xquant plan --out`; the format is in docs/plans.md). */
export interface CachePlanJson {
  format?: 'xquant-plan';
  version?: 1;
  name?: string;
  window: number;
  sinks?: number;
  group_quant_size: number;
  params?: 'f16' | 'f32';
  /** Seed of the rotation signs (entries with `rotation: 'hadamard'`). Default 24301. */
  rotation_seed?: number;
  layers: { key: TensorPlanJson; value: TensorPlanJson }[];
}

export interface CaptureOptions {
  /** Also every layer's queries after RoPE (`q.{i}`, `[1, heads, T, head_dim]` f16). */
  queries?: boolean;
}

export interface SuggestPlanOptions {
  /** Effective bits per element at `context` tokens, everything counted. Default 3. */
  targetBits?: number;
  /** Default 1024. */
  context?: number;
  /** f16 window of the plan. Default 64. */
  window?: number;
  /** f16 sinks of the plan. Default 4. */
  sinks?: number;
  /** 32, 64 or 128; default 0: each that divides the window, the best kept. */
  groupQuantSize?: number;
  /**
   * For a file without queries: plan by the K/V error alone (keys' relative error) instead of
   * refusing. It ranks plans poorly against perplexity and can choose plans that collapse the
   * model. Default false.
   */
  kvError?: boolean;
}

export interface SuggestedPlan {
  plan: CachePlanJson;
  targetBits: number;
  context: number;
  /** At `context` tokens, window and sinks included. */
  effectiveBits: number;
  /** Per quantized element. */
  quantizedBits: number;
  kvBytes: number;
  /**
   * The planner's measure, summed over layers: with the file's queries (`q.{i}`) the relative
   * squared error of each layer's attention output (the last 64 queries attending the plan's
   * cache of the file, keys and values measured apart and added); with `kvError` the values'
   * and keys' relative squared errors.
   */
  error: number;
  /** Which error chose the plan: 'attention' (the file has queries) or 'relative' (`kvError`). */
  keyError: 'attention' | 'relative';
}

/** Where a GPUBuffer's tensor starts and what it holds. */
export interface BufferOptions {
  /** Element type of the buffer's values. Default 'f32'. */
  dtype?: 'f32' | 'f16';
  /** Byte offset (a multiple of 256) of keys and values. Default 0. */
  offset?: number;
  keysOffset?: number;
  valuesOffset?: number;
  /** 'heads': keys and values are [batch, kvHeads, tokens, headDim] (default); 'tokens':
   * [batch, tokens, kvHeads, headDim], as a projection writes them (made heads-major on the
   * GPU, or on the CPU for typed arrays; with one token the two are the same bytes). */
  layout?: 'heads' | 'tokens';
}

export interface AttendOptions {
  /** Query heads (a multiple of kvHeads). Required. */
  queryHeads: number;
  /** Query tokens per head. Default 1. */
  tokens?: number;
  /** Absolute position of query token 0 (query t sees cached tokens <= pos0 + t). Default:
   * the layer's last `tokens` tokens. */
  pos0?: number;
  /** Softmax scale. Default 1 / sqrt(headDim). */
  scale?: number;
  /** A sliding-window layer's window: query position p sees cached positions p' with
   * p - p' < window only (Gemma 3's local layers: 512). At least 1. Default: every position. */
  window?: number;
  /** 'heads': out is [batch, queryHeads, tokens, headDim] (default); 'tokens': [batch,
   * tokens, queryHeads, headDim]. */
  layout?: 'heads' | 'tokens';
  /** The same for the queries: 'heads' (default) or 'tokens' ([batch, tokens, queryHeads,
   * headDim]). */
  queryLayout?: 'heads' | 'tokens';
}

export interface AttendGpuOptions extends AttendOptions {
  /** Queries' element type. Default 'f32'. */
  dtype?: 'f32' | 'f16';
  /** Output's element type. Default 'f32'. */
  outDtype?: 'f32' | 'f16';
  /** Byte offsets (multiples of 256) of the queries and the output. */
  offset?: number;
  outOffset?: number;
}

export interface Fetched {
  /** `[batch, kvHeads, tokens, headDim]` reconstructed keys. */
  keys: Float32Array;
  values: Float32Array;
  tokens: number;
}

export interface FetchedGpu {
  /** Valid until the next call on the set; the first `byteLength` bytes hold the tensor. */
  keys: GPUBuffer;
  values: GPUBuffer;
  tokens: number;
  dtype: 'f16' | 'f32';
  byteLength: number;
}

/** One layer's keys or values: their plan entry and bytes (see CacheStats). */
export interface KvStats {
  codes: 'own' | number;
  bits: number;
  residualBits: number;
  axis: 'tokens' | 'channels';
  /** 16 · accountedBytes / fp16Bytes. */
  effectiveBits: number;
  /** Codes at their width, two f16 per group and channel, residuals; f16 window and sinks. */
  accountedBytes: number;
  /** GPU buffers (pages, window ring, sinks). */
  allocatedBytes: number;
  fp16Bytes: number;
}

export interface LayerStats {
  layer: number;
  /** Tokens appended (the next token's position). */
  tokens: number;
  /** Tokens still held: all, or a sliding layer's last ones (about its window). */
  heldTokens: number;
  windowTokens: number;
  sinkTokens: number;
  /** K + V. */
  effectiveBits: number;
  accountedBytes: number;
  allocatedBytes: number;
  fp16Bytes: number;
  key: KvStats;
  value: KvStats;
}

/**
 * Two measures of size: *accounted* bytes follow the reference's accounting (codes at their
 * width, two f16 params per group, residuals, f16 window and sinks) and give
 * `effectiveBits`; *allocated* bytes are the GPU buffers actually held (pages grow by
 * doubling, the window ring is allocated whole) and give `ratioVsFp16`. So `effectiveBits /
 * 16` and `ratioVsFp16` differ: the first is the format's rate, the second what the GPU
 * holds right now. All are 0 for an empty set.
 */
export interface CacheStats {
  layers: LayerStats[];
  totals: {
    /** `16 · accountedBytes / fp16Bytes` over every layer (accounting). */
    effectiveBits: number;
    /** Sum of the layers' accounted bytes. */
    accountedBytes: number;
    /** Sum of the layers' GPU bytes (scratch not included). */
    allocatedBytes: number;
    /** The same tokens in f16 (K and V). */
    fp16Bytes: number;
    /** `allocatedBytes / fp16Bytes` (GPU buffers, not accounting). */
    ratioVsFp16: number;
    /** The set's scratch, in no layer: attention partials, updateAndFetch outputs. */
    scratchBytes: number;
    /** Tokens held, summed over layers (a token in 30 layers counts 30 times). */
    liveTokens: number;
    /** decodePolicy 'reference': tokens anchors published that a reuse layer has not read
     * yet (bounded by maxCtx); 0 under 'window'. */
    pendingTokens: number;
  };
}

export interface AnalyzeOptions extends QuantOptions {
  groupSize?: number;
  baseBits?: number;
  residualBits?: number;
  groupQuantSize?: number;
  /** Analyse a plan instead (as `cacheSet`'s `plan`; not with groupSize … params). */
  plan?: PlanPreset | CachePlanJson | PlanJsonText;
  /** With `plan`: replace the plan's window / sinks. */
  window?: number;
  sinks?: number;
}

export interface TensorStats {
  recon_mse: number;
  recon_mse_no_residual: number | null;
  cosine_to_anchor: number | null;
  mse_to_anchor: number | null;
  effective_bits: number;
  compressed_bytes: number;
  allocated_bytes: number;
}

/** `xquant analyze --json`. */
export interface AnalysisReport {
  config: Record<string, number | string>;
  plan: CachePlanJson;
  adapter: string;
  shape: number[];
  layers: { layer: number; role: 'anchor' | 'reuse'; group: number; key: TensorStats; value: TensorStats }[];
  totals: {
    effective_bits: number;
    key_effective_bits: number;
    value_effective_bits: number;
    compressed_bytes: number;
    fp16_bytes: number;
    ratio_vs_fp16: number;
    allocated_bytes: number;
  };
}

export interface KvSimilarity {
  layers: number;
  shape: number[];
  key: { cosine: Float32Array; mse: Float32Array };
  value: { cosine: Float32Array; mse: Float32Array };
}

/** Where a model comes from: a URL, a fetch Response, a Blob/File, or its bytes. */
export type ModelSource = string | URL | Response | Blob | ArrayBuffer | ArrayBufferView;

export interface LoadProgress {
  /** `download`: bytes read from the source; `load`: parsing and uploading to the GPU (0, then total). */
  phase: 'download' | 'load';
  loaded: number;
  /** Bytes in all, or null when the server did not say. */
  total: number | null;
}

export interface LoadModelOptions {
  onProgress?: (progress: LoadProgress) => void;
  signal?: AbortSignal;
}

export interface ModelInfo {
  architecture: 'llama' | 'gemma3';
  layers: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  hidden: number;
  ffn: number;
  vocab: number;
  /** The model's training context (generation stops there). */
  contextLength: number;
  eosToken: number;
  bosToken: number;
  /** Whether a prompt starts with BOS (Gemma: true; SmolLM2: false). */
  addBos: boolean;
  /** Whether `chatTemplate()` works: the GGUF carries a ChatML chat template (SmolLM2-Instruct:
   * true; Gemma 3 270M, a base model: false, and `chatTemplate()` throws ConfigError). */
  chatTemplate: boolean;
  /** Each layer's attention window: `null` on global layers, the window on sliding ones
   * (Gemma 3: 512). The model's caches keep only that much of a sliding layer. */
  attentionWindows: (number | null)[];
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

export interface GenerateOptions {
  /** New tokens at most (default 128); generation also ends at the end-of-sequence token. */
  maxTokens?: number;
  /**
   * The cache: `'f16'`, a preset's name, cacheSet options (a `plan` included; default: the
   * cacheSet defaults), or a CacheSet / F16Cache to continue (its tokens come first).
   */
  cache?: 'f16' | PlanPreset | Omit<CacheSetOptions, 'layers' | 'kvHeads' | 'headDim'> | CacheSet | F16Cache;
  /** Token budget of a cache the call creates (default: the model's context length). */
  maxCtx?: number;
  /** 0 (default): greedy. Above 0: sampling after top-k, then top-p. */
  temperature?: number;
  /** Keep the k most likely tokens (0, default: all). */
  topK?: number;
  /** Keep the most likely tokens up to this probability (1, default: all). */
  topP?: number;
  /** Seed of the draws (default 0): the same seed draws the same tokens. */
  seed?: number;
  /** Aborting ends the iteration with the signal's reason; the cache keeps the tokens so far. */
  signal?: AbortSignal;
  /** Prompt tokens processed so far (the prompt runs in chunks of 64 tokens). */
  onPrefill?: (progress: { done: number; total: number }) => void;
}

/** One generated token. */
export interface Piece {
  token: number;
  /** The text the token completes ('' while a UTF-8 character is incomplete). */
  text: string;
  /** 0 for the first generated token. */
  index: number;
  /** Tokens in the cache after this one (prompt and earlier turns included). */
  cacheTokens: number;
  /** Bytes of the cache's GPU buffers after this token. */
  kvAllocatedBytes: number;
}

export interface GenerationStats {
  cache: 'f16' | 'xquant';
  promptTokens: number;
  generatedTokens: number;
  prefillMs: number;
  decodeMs: number;
  /** Generated tokens per second of decoding (prefill excluded). */
  tokensPerSecond: number;
  prefillTokensPerSecond: number;
  cacheTokens: number;
  kvAllocatedBytes: number;
}

/** A loaded model: tokenizer, generation over an XQuant or f16 cache, K/V capture. */
export class Model {
  private constructor();
  readonly info: ModelInfo;
  /** Token ids; `special` (default true) reads `<|im_start|>` and such as control tokens;
   * `bos` (default false) puts BOS first where the model wants it (`info.addBos`). A text
   * prompt given to `generate` on a fresh cache gets it. */
  tokenize(text: string, options?: { special?: boolean; bos?: boolean }): Uint32Array;
  detokenize(ids: ArrayLike<number>): string;
  /** ChatML over the messages; without a system message the template's own comes first. */
  chatTemplate(messages: ChatMessage[], options?: { addGenerationPrompt?: boolean }): string;
  /** An XQuant CacheSet shaped for this model. */
  cacheSet(options?: Omit<CacheSetOptions, 'layers' | 'kvHeads' | 'headDim'>): CacheSet;
  /** A plain f16 cache for this model. */
  f16Cache(options?: { maxCtx?: number }): F16Cache;
  /** Streams new tokens after `prompt` (text or token ids). */
  generate(prompt: string | ArrayLike<number>, options?: GenerateOptions): Generation;
  /**
   * A saved conversation's cache (`CacheSet.save()` / `F16Cache.save()` bytes) restored for this
   * model, to pass as `generate`'s `cache`; FormatError for corrupt bytes or another model's shape.
   */
  restoreCache(bytes: Uint8Array | ArrayBuffer): Promise<CacheSet | F16Cache>;
  /**
   * The K/V of `text` (f16 cache, keys after RoPE) as safetensors bytes: what analyzeKv reads;
   * with `queries: true` also every layer's queries (`q.{i}`, f16), by which suggestPlan judges
   * plans. ConfigError for an unknown option or a `queries` that is not a boolean.
   */
  capture(text: string, options?: CaptureOptions): Promise<Uint8Array>;
  /** The last generation's figures, or null before any. */
  stats(): GenerationStats | null;
  /** Frees the weights and the caches this model's generations created. */
  free(): void;
  [Symbol.dispose](): void;
}

/** One generation; iterate it once. */
export class Generation implements AsyncIterable<Piece> {
  private constructor();
  /** The cache it fills: pass it as `cache` to continue the conversation. */
  readonly cache: CacheSet | F16Cache;
  readonly promptTokens: number[];
  /** Generated so far. */
  readonly tokens: number[];
  readonly text: string;
  /** Why it ended; null while it runs. */
  readonly finishReason: 'eos' | 'maxTokens' | 'aborted' | null;
  [Symbol.asyncIterator](): AsyncIterator<Piece>;
}

/** A plain f16 K/V cache for a model. */
export class F16Cache {
  private constructor();
  tokens(): number;
  stats(): { totals: { tokens: number; allocatedBytes: number; fp16Bytes: number; scratchBytes: number } };
  reset(): void;
  /** The cache as bytes for `model.restoreCache`. */
  save(): Promise<Uint8Array>;
  free(): void;
  [Symbol.dispose](): void;
}

/** Loads the wasm module once (XQuant.create calls it); without `wasm`, the `.wasm` next to
 * the package's index.js (fetched in a browser, read from disk in Node). A failed load
 * rejects with IoError and is not remembered: the next call tries again. */
export function ready(wasm?: string | URL | Response | BufferSource): Promise<void>;

export interface CreateOptions {
  /** The GPU to use: `navigator.gpu` (the default), or in Node `create([])` of the npm
   * `webgpu` package (Dawn), which Node needs (it has no `navigator.gpu`). wgpu looks for it
   * at `navigator.gpu` of a window or worker: during `create` the package provides that where
   * missing (`Window`, `navigator.gpu`) and puts it back. In Node it also defines the globals
   * `GPUValidationError` and `GPUOutOfMemoryError` if they are missing (stand-ins that
   * recognize the GPU's error objects; wgpu sorts errors with `instanceof`); they stay. */
  gpu?: GPU;
  /** Your GPUDevice: run on it (your buffers and ours meet; its onuncapturederror stays
   * yours; free() leaves it alive). Default: the package requests its own. */
  device?: GPUDevice;
  powerPreference?: 'low-power' | 'high-performance';
  /** URL, Response or bytes of the .wasm (bundlers resolve it themselves). */
  wasm?: string | URL | Response | BufferSource;
}

/**
 * Every method that returns a promise rejects (never throws) with an XQuantError subclass;
 * after the device is lost they reject with DeviceLostError. Options objects accept only
 * the names typed here (others are a ConfigError).
 */
export class XQuant {
  static create(options?: CreateOptions): Promise<XQuant>;
  readonly adapterInfo: AdapterInfo;
  readonly device: GPUDevice;
  allocatedBytes(): number;
  pairLayers(n: number, groupSize: number): { role: 'anchor' | 'reuse'; group: number }[];
  quantizeCodes(x: HostTensor, shape: number[], bits: number, groupQuantSize?: number, options?: QuantOptions): Promise<Quantized>;
  computeReuseParams(x: HostTensor, codes: Quantized): Promise<GroupParams>;
  dequantWithParams(codes: Quantized, params?: GroupParams, options?: { outDtype?: 'f16' | 'f32' }): Promise<Float32Array>;
  quantizeResidual(x: HostTensor, recon: HostTensor, shape: number[], bits: number, groupQuantSize?: number, options?: QuantOptions & { outDtype?: 'f16' | 'f32' }): Promise<Float32Array>;
  crossLayerSimilarity(a: HostTensor, b: HostTensor, shape: number[]): Promise<Similarity>;
  similarityMatrix(layers: HostTensor[], shape: number[]): Promise<SimilarityMatrix>;
  /** `xquant analyze --json` on a K/V safetensors file's bytes (schema in docs/cli.md). */
  analyzeKv(bytes: Uint8Array | ArrayBuffer, options?: AnalyzeOptions): Promise<AnalysisReport>;
  suggestPlan(bytes: Uint8Array | ArrayBuffer, options?: SuggestPlanOptions): Promise<SuggestedPlan>;
  kvSimilarity(bytes: Uint8Array | ArrayBuffer): Promise<KvSimilarity>;
  /** Throws ConfigError for bad options, DeviceLostError once the device is lost. */
  cacheSet(options: CacheSetOptions): CacheSet;
  /**
   * Loads a GGUF model (architectures `llama` and `gemma3`; F32, F16, Q8_0, Q4_0, Q4_1, Q5_0,
   * Q5_1, Q4_K, Q5_K or Q6_K weights) onto the device, streamed
   * with progress. Rejects with IoError when the download fails and with FormatError (or
   * ConfigError for a model the kernels cannot run) for a file it cannot use.
   */
  loadModel(source: ModelSource, options?: LoadModelOptions): Promise<Model>;
  /**
   * A cache set restored from `CacheSet.save()`'s bytes; it continues exactly as the saved
   * set would have. Rejects with FormatError (allocating nothing) for bytes that are corrupt,
   * truncated, of another version or kind, or that this device cannot hold.
   */
  restoreCacheSet(bytes: Uint8Array | ArrayBuffer): Promise<CacheSet>;
  free(): void;
  [Symbol.dispose](): void;
}

/**
 * Calls are submitted before they return and run in call order. Layers are independent:
 * each append adds tokens to its layer only (appending to one layer twice in a step adds two
 * tokens there, as a chunked prefill does); a reuse layer whose anchor does not hold the
 * tokens yet quantizes them with codes of its own. reset() and free() may be called while
 * calls are in flight: those calls were submitted already and complete (host results
 * resolve; updateAndFetchGpu rejects with UsageError, its buffers being gone), and a GPU
 * failure they meet later is reported by their own promise only.
 */
/** A snapshot of a CacheSet (`caches.checkpoint()`), for `caches.rollback(checkpoint)`. */
export class CacheCheckpoint {
  private constructor();
  /** Lets go of the snapshot (and of buffers only it kept alive). */
  free(): void;
  [Symbol.dispose](): void;
}

export class CacheSet {
  /** Appends tokens from host arrays or your GPUBuffers (submitted before it returns). */
  append(layer: number, keys: HostTensor | GPUBuffer, values: HostTensor | GPUBuffer, tokens: number, options?: BufferOptions): Promise<void>;
  /** Attention over the layer's cache into your `out` buffer (submitted before it returns). */
  attendGpu(layer: number, queries: GPUBuffer, out: GPUBuffer, options: AttendGpuOptions): Promise<void>;
  /** Attention of host queries; resolves to the output (layout as options.layout). */
  attend(layer: number, queries: HostTensor, options: AttendOptions): Promise<Float32Array>;
  /**
   * Records appending `tokens` tokens from your GPUBuffers into your `encoder`, submitting
   * nothing (the set counts them at once: submit the encoder, or `rollback`). Throws typed
   * errors, recording nothing, when its arguments are refused.
   */
  encodeAppend(encoder: GPUCommandEncoder, layer: number, keys: GPUBuffer, values: GPUBuffer, tokens: number, options?: BufferOptions): void;
  /** Records the attention of `queries` into `out` (your GPUBuffers) into your `encoder`, submitting nothing. */
  encodeAttend(encoder: GPUCommandEncoder, layer: number, queries: GPUBuffer, out: GPUBuffer, options: AttendGpuOptions): void;
  /** A snapshot of every layer to `rollback` to; free it once the step it guards was submitted and succeeded. */
  checkpoint(): CacheCheckpoint;
  /** Every layer back to `checkpoint` (which is used up); the set accepts calls again. */
  rollback(checkpoint: CacheCheckpoint): void;
  /** Every token the layer holds (`[batch, kvHeads, heldTokens, headDim]`), reconstructed, into your GPUBuffers. */
  fetchInto(layer: number, keys: GPUBuffer, values: GPUBuffer, options?: { dtype?: 'f32' | 'f16'; keysOffset?: number; valuesOffset?: number }): Promise<void>;
  /** Tokens appended to the layer (the next token's position). */
  tokens(layer: number): number;
  /** Tokens the layer still holds, its last ones: all of them but in a sliding layer. */
  heldTokens(layer: number): number;
  /**
   * The set as bytes: plan, options, bookkeeping and the packed data exactly as stored
   * (versioned, checksummed). Submitted now: later calls do not change what is saved.
   */
  save(): Promise<Uint8Array>;
  updateAndFetch(layer: number, keys: HostTensor, values: HostTensor, tokens: number): Promise<Fetched>;
  updateAndFetchGpu(layer: number, keys: HostTensor, values: HostTensor, tokens: number): Promise<FetchedGpu>;
  /** The plan every layer follows. */
  plan(): CachePlanJson;
  /** Host-side accounting (answers after device loss too). */
  stats(): CacheStats;
  /** Forgets every token and frees the set's buffers; the set stays usable. */
  reset(): void;
  /** Destroys the set's buffers now; later calls reject with UsageError. */
  free(): void;
  [Symbol.dispose](): void;
}
