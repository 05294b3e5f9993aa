// A runtime author's use of the public API, checked by `tsc --noEmit` against js/index.d.ts.

import {
  CacheSet,
  ConfigError,
  ContextBudgetError,
  DeviceLostError,
  FormatError,
  GpuError,
  IoError,
  NonFiniteError,
  ShapeError,
  TooLargeError,
  UsageError,
  WebGpuUnavailableError,
  XQuant,
  XQuantError,
  ready,
  type AnalysisReport,
  type CachePlanJson,
  type PlanJsonText,
  CacheCheckpoint,
  type CacheSetOptions,
  type CacheStats,
  type Fetched,
  type FetchedGpu,
  type Quantized,
  type SuggestedPlan,
  F16Cache,
  Generation,
  Model,
  type GenerationStats,
  type Piece,
} from 'xquant-wgpu';
import { create as createGpu } from 'webgpu';

export async function decode(device: GPUDevice, q: GPUBuffer, out: GPUBuffer, k: GPUBuffer, v: GPUBuffer): Promise<void> {
  await ready();
  await ready(new URL('./xquant_wgpu_bg.wasm', 'https://example.com/'));
  const xq: XQuant = await XQuant.create({ device, powerPreference: 'high-performance' });
  // Node: the GPU of the npm `webgpu` package (Dawn); in a browser, navigator.gpu.
  const inNode: XQuant = await XQuant.create({ gpu: createGpu(['backend=vulkan']) });
  const shared: XQuant = await XQuant.create({ gpu: navigator.gpu, device });
  inNode.free();
  shared.free();
  const name: string = xq.adapterInfo.name;
  const fallback: boolean = xq.adapterInfo.isFallbackAdapter;
  const same: GPUDevice = xq.device;
  const bytes: number = xq.allocatedBytes();
  const roles = xq.pairLayers(4, 2);
  const role: 'anchor' | 'reuse' = roles[0].role;

  const options: CacheSetOptions = { layers: 2, kvHeads: 1, headDim: 64, maxCtx: 4096, window: 128, sinks: 4 };
  const caches: CacheSet = xq.cacheSet(options);
  const planned = xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan: 'kivi-2' });
  const plan: CachePlanJson = planned.plan();
  xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan });
  xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan: JSON.stringify(plan) as PlanJsonText, window: 64 });
  xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan: '{"format":"xquant-plan"}' });
  const rotated: CachePlanJson = {
    ...plan,
    rotation_seed: 7,
    layers: plan.layers.map(() => {
      const entry = { codes: 'own' as const, bits: 2, axis: 'channels' as const, eta: 0.15, rotation: 'hadamard' as const };
      return { key: entry, value: entry };
    }),
  };
  xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan: rotated });
  const lloyd: CachePlanJson = {
    ...rotated,
    layers: rotated.layers.map(({ key }) => ({ key, value: { ...key, eta: 0, levels: 'lloyd-max' as const } })),
  };
  xq.cacheSet({ layers: 2, kvHeads: 1, headDim: 64, plan: lloyd });

  const keys = new Float32Array(64);
  const half = new Uint16Array(64);
  await caches.append(0, keys, half, 1);
  await caches.append(1, k, v, 1, { dtype: 'f16', keysOffset: 0, valuesOffset: 256 });
  await caches.attendGpu(1, q, out, { queryHeads: 3, layout: 'tokens', outDtype: 'f16', pos0: 0, scale: 0.125 });
  const attended: Float32Array = await caches.attend(0, keys, { queryHeads: 1, tokens: 1 });
  await caches.fetchInto(0, k, v, { dtype: 'f32' });
  const fetched: Fetched = await caches.updateAndFetch(0, keys, keys, 1);
  const gpu: FetchedGpu = await caches.updateAndFetchGpu(0, keys, keys, 1);
  const gpuKeys: GPUBuffer = gpu.keys;
  const held: number = caches.tokens(0) + fetched.tokens + gpu.byteLength + attended.length;

  const stats: CacheStats = caches.stats();
  const t = stats.totals;
  const numbers: number[] = [
    t.effectiveBits, t.accountedBytes, t.allocatedBytes, t.fp16Bytes, t.ratioVsFp16, t.scratchBytes,
    t.liveTokens, t.pendingTokens,
  ];
  for (const l of stats.layers) {
    numbers.push(l.layer, l.tokens, l.windowTokens, l.sinkTokens, l.effectiveBits, l.accountedBytes, l.allocatedBytes, l.fp16Bytes);
    const codes: 'own' | number = l.key.codes;
    const axis: 'tokens' | 'channels' = l.value.axis;
    numbers.push(l.key.bits, l.value.residualBits, l.key.effectiveBits, l.value.allocatedBytes, typeof codes === 'number' ? codes : 0, axis.length);
  }

  const x = new Float32Array(256);
  const quantized: Quantized = await xq.quantizeCodes(x, [64, 4], 2, 32, { eta: 0, valueAxis: 'tokens', params: 'f32' });
  const params = await xq.computeReuseParams(x, quantized);
  const norms: Quantized = await xq.quantizeCodes(x, [64, 4], 2, 4, { valueAxis: 'channels', levels: 'lloyd-max' });
  const levelsName: 'uniform' | 'lloyd-max' = norms.levels;
  await xq.dequantWithParams(norms);
  const recon: Float32Array = await xq.dequantWithParams(quantized, params, { outDtype: 'f16' });
  await xq.quantizeResidual(x, recon, [64, 4], 2, 32, { outDtype: 'f32' });
  const sim = await xq.crossLayerSimilarity(x, recon, [64, 4]);
  const matrix = await xq.similarityMatrix([x, recon], [64, 4]);
  const file = new Uint8Array(0);
  const report: AnalysisReport = await xq.analyzeKv(file, { groupSize: 2, residualBits: 2 });
  await xq.analyzeKv(file.buffer, { plan: 'xquant-paper', window: 64, sinks: 4 });
  const suggested: SuggestedPlan = await xq.suggestPlan(file, { targetBits: 3, context: 1024, window: 64, sinks: 4 });
  xq.cacheSet({ layers: suggested.plan.layers.length, kvHeads: 1, headDim: 64, plan: suggested.plan });
  const kvSim = await xq.kvSimilarity(file);
  numbers.push(sim.cosine, matrix.cosine[0], report.totals.effective_bits, kvSim.key.cosine[0], held, bytes);

  try {
    await caches.append(0, keys, keys, 1);
  } catch (e) {
    if (e instanceof XQuantError) {
      const kind: string = e.name;
      const message: string = e.message;
      numbers.push(kind.length + message.length);
    }
    const handled =
      e instanceof ShapeError || e instanceof ConfigError || e instanceof NonFiniteError || e instanceof ContextBudgetError ||
      e instanceof WebGpuUnavailableError || e instanceof DeviceLostError || e instanceof GpuError ||
      e instanceof TooLargeError || e instanceof UsageError || e instanceof IoError || e instanceof FormatError;
    numbers.push(handled ? 1 : 0);
  }

  // A conversation's cache, saved and restored (bytes as Uint8Array or ArrayBuffer).
  const saved: Uint8Array = await caches.save();
  try {
    const restored: CacheSet = await xq.restoreCacheSet(saved.buffer as ArrayBuffer);
    numbers.push(restored.tokens(0));
    restored.free();
  } catch (e) {
    if (e instanceof FormatError) numbers.push(-1);
  }

  caches.reset();
  {
    using scoped = xq.cacheSet(options);
    await scoped.append(0, keys, keys, 1);
  }
  caches.free();
  planned[Symbol.dispose]();
  xq.free();
  void [name, fallback, same, role, gpuKeys, numbers];
}

/** A local LLM in the page: load with progress, stream a chat reply, continue, persist. */
export async function chat(xq: XQuant, file: Blob, signal: AbortSignal): Promise<string> {
  const model: Model = await xq.loadModel(file, { onProgress: (p) => void (p.total === null ? p.loaded : p.loaded / p.total), signal });
  const prompt = model.chatTemplate([{ role: 'user', content: 'Hi' }], { addGenerationPrompt: true });
  const run: Generation = model.generate(prompt, { maxTokens: 8, cache: { plan: 'kivi-2' }, temperature: 0.7, topK: 40, topP: 0.9, seed: 1, signal, onPrefill: ({ done, total }) => void (done / total) });
  let text = '';
  for await (const piece of run) {
    const p: Piece = piece;
    text += p.text + String(p.kvAllocatedBytes + p.cacheTokens + p.index + p.token);
  }
  const bytes: Uint8Array = run.cache instanceof F16Cache ? await run.cache.save() : await run.cache.save();
  const restored: CacheSet | F16Cache = await model.restoreCache(bytes);
  const next = model.generate(model.tokenize(' more'), { cache: restored, maxTokens: 2 });
  for await (const _ of next);
  const stats: GenerationStats | null = model.stats();
  const kv: Uint8Array = await model.capture(text);
  await xq.analyzeKv(kv);
  const f16 = model.f16Cache({ maxCtx: 64 });
  f16.free();
  const summary = `${model.detokenize(run.tokens)} ${run.finishReason ?? ''} ${stats?.tokensPerSecond ?? 0} ${model.info.contextLength}`;
  model.free();
  return summary;
}

// @ts-expect-error: temperature is a number
export const badSampling: import('xquant-wgpu').GenerateOptions = { temperature: 'hot' };

// @ts-expect-error: layers, kvHeads and headDim are required
export const missing: CacheSetOptions = { layers: 1 };
// @ts-expect-error: a misspelt option is not an option
export const typo: CacheSetOptions = { layers: 1, kvHeads: 1, headDim: 8, residualbits: 2 };
// @ts-expect-error: a rotation is 'none' or 'hadamard'
export const badRotation: import('xquant-wgpu').TensorPlanJson = { codes: 'own', rotation: 'walsh' };
// @ts-expect-error: levels are 'uniform' or 'lloyd-max'
export const badLevels: import('xquant-wgpu').TensorPlanJson = { codes: 'own', levels: 'nf4' };
// @ts-expect-error: not a preset's name ('kivi-2')
export const notPreset: CacheSetOptions = { layers: 1, kvHeads: 1, headDim: 8, plan: 'kivi2' };

/** A runtime's decode step recorded into its own encoder, one submission. */
export async function runtimeStep(device: GPUDevice, caches: CacheSet, k: GPUBuffer, v: GPUBuffer, q: GPUBuffer, out: GPUBuffer): Promise<void> {
  const cp: CacheCheckpoint = caches.checkpoint();
  const enc: GPUCommandEncoder = device.createCommandEncoder();
  caches.encodeAppend(enc, 0, k, v, 1, { dtype: 'f16', keysOffset: 256 });
  caches.encodeAttend(enc, 0, q, out, { queryHeads: 9, layout: 'tokens' });
  caches.encodeAppend(enc, 0, k, v, 4, { layout: 'tokens' });
  caches.encodeAttend(enc, 0, q, out, { queryHeads: 9, tokens: 4, queryLayout: 'tokens' });
  // @ts-expect-error: layouts are 'heads' | 'tokens'
  caches.encodeAppend(enc, 0, k, v, 4, { layout: 'token' });
  device.pushErrorScope('validation');
  device.queue.submit([enc.finish()]);
  if (await device.popErrorScope()) caches.rollback(cp);
  else cp.free();
  // @ts-expect-error: encodeAppend returns nothing to await
  await caches.encodeAppend(enc, 0, k, v, 1).then(() => 0);
}

// @ts-expect-error: maxCtx is a number
export const wrongType: CacheSetOptions = { layers: 1, kvHeads: 1, headDim: 8, maxCtx: '1' };
