// Merges the parts `scripts/bench-all.sh` wrote into one JSON and one markdown report:
// node scripts/bench-report.mjs OUT_DIR PRESET...
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import { join } from 'node:path';

const [out, ...presets] = process.argv.slice(2);
const part = (name) => JSON.parse(readFileSync(join(out, 'parts', `${name}.json`), 'utf8'));

const kernels = { f16: part('kernels-f16'), f32: part('kernels-f32') };
const cache = Object.fromEntries(presets.map((p) => [p, part(`cache-${p}`)]));
const model = part('model');
// The machine the parts were measured on (bench-all.sh writes it; older parts lack it).
const host = existsSync(join(out, 'parts', 'host.json'))
  ? part('host')
  : { cpu: os.cpus()[0]?.model ?? 'unknown', cores: os.cpus().length };
const report = {
  adapter: kernels.f16.adapter,
  date: kernels.f16.date,
  host,
  kernels,
  cache,
  model,
};
writeFileSync(join(out, 'all.json'), `${JSON.stringify(report, null, 2)}\n`);

const f = (x, d = 2) => (x == null ? '-' : Number(x).toFixed(d));
// Kernel launches of one step, XQuant / f16 (parts written before they were counted: '-').
const launches = (r) => (r.xquant_launches == null ? '-' : `${r.xquant_launches} / ${r.fp16_launches}`);
// The first step at a context, the pipelines it built included (parts written before it
// was measured: '-').
const firstStep = (r) =>
  r.xquant_first_step_ms == null
    ? '-'
    : `${f(r.xquant_first_step_ms, 0)} (${r.xquant_first_step_pipelines}) / ${f(r.fp16_first_step_ms, 0)} (${r.fp16_first_step_pipelines})`;
const lines = [];
const table = (head, rows) => {
  lines.push(`| ${head.join(' | ')} |`, `|${head.map((_, i) => (i ? '---:' : '---')).join('|')}|`);
  for (const r of rows) lines.push(`| ${r.join(' | ')} |`);
  lines.push('');
};

lines.push(`# Benchmarks: ${report.adapter}, ${report.date}`, '');
lines.push(`Host: ${report.host.cpu} (${report.host.cores} cores).`, '');
// How attention was launched (`XQUANT_ATTENTION_*`; parts written before it was recorded lack it).
const launch = Object.values(cache)[0]?.attention_launches;
if (launch) {
  lines.push(`Attention launches: workgroups of ${launch.workgroup}, ${launch.chunks} chunks, ${launch.fill} fill.`, '');
}

const k = kernels.f16;
lines.push(`## Kernels: ${JSON.stringify(k.dims)}, ${k.bits} bits, group ${k.group_quant_size}, residual ${k.residual_bits} bits`, '');
lines.push('"× copy": the median over rounds of copy time / kernel time, each kernel round right after a copy round over the same tensor.', '');
const f32 = Object.fromEntries(kernels.f32.kernels.map((r) => [r.kernel, r]));
table(
  ['kernel', 'f16 ms', 'f16 GB/s', 'f16 × copy', 'f32 ms', 'f32 × copy', 'f16: GPU / CPU ref'],
  k.kernels.map((r) => [r.kernel, f(r.ms, 3), f(r.gbps), f(r.vs_copy), f(f32[r.kernel]?.ms, 3), f(f32[r.kernel]?.vs_copy), `${f(r.vs_cpu, 1)}×`]),
);

const first = cache[presets[0]];
const m = first.model;
lines.push(`## Cache decode step: XQuant / f16 (${m.layers} layers, ${m.kv_heads} KV heads, ${m.q_heads} query heads, head dim ${m.head_dim})`, '');
lines.push(`A step appends one token to every layer and attends every layer's query heads over its cache, one submission; the median of ${first.steps} per-step ratios (4× as many at 64–256 tokens, 2× at 512), XQuant and f16 alternating. "First step": the untimed first step at a context, XQuant's then f16's, with the attention pipelines it built (a pipeline is built on first use; a driver's shader cache, such as Mesa's on disk, makes a repeated run's builds cheaper).`, '');
const contexts = first.decode.map((d) => d.context);
table(
  ['plan', ...contexts.map(String), `bits at ${contexts.at(-1)}`],
  presets.map((p) => [p, ...cache[p].decode.map((d) => f(d.attend_ratio)), f(cache[p].decode.at(-1).effective_bits, 1)]),
);
for (const p of presets) {
  lines.push(`### ${p} (window ${cache[p].window}, sinks ${cache[p].sinks})`, '');
  table(
    ['context', 'XQuant ms', 'f16 ms', 'XQuant / f16', 'XQuant B / token', 'f16 B / token', 'XQuant scratch B', 'f16 scratch B', 'launches XQuant / f16', 'first step ms (pipelines built) XQuant / f16'],
    cache[p].decode.map((d) => [d.context, f(d.xquant_attend_ms, 1), f(d.fp16_attend_ms, 1), f(d.attend_ratio), f(d.xquant_bytes_per_token, 0), f(d.fp16_bytes_per_token, 0), d.xquant_scratch_bytes, d.fp16_scratch_bytes, launches(d), firstStep(d)]),
  );
}
lines.push('## Memory (default plan): storage + scratch after a decode step', '');
table(
  ['tokens', 'XQuant bytes', 'f16 bytes (grown by doubling)', 'XQuant / f16', 'f16 exact-fit bytes', 'XQuant / exact-fit'],
  (cache.default ?? first).memory.map((r) => [r.tokens, r.xquant_bytes, r.fp16_bytes, f(r.xquant_bytes / r.fp16_bytes), r.fp16_exact_bytes, f(r.xquant_bytes / r.fp16_exact_bytes)]),
);
lines.push(`## Model: SmolLM2-135M, XQuant ${model.xquant} against the f16 cache`, '');
lines.push(`Prefill: the context in one pass, the mean of two per cache (XQuant, f16, f16, XQuant) after an untimed one of each (pipelines). Decode: the median of ${model.steps} greedy steps, XQuant and f16 alternating; "speed" is the median of per-step ratios.`, '');
table(
  ['context', 'XQuant prefill tok/s', 'f16 prefill tok/s', 'XQuant decode tok/s', 'f16 decode tok/s', 'XQuant / f16 speed', 'prefill / decode per token (XQuant)', 'XQuant KV bytes', 'f16 KV bytes', 'launches per step XQuant / f16'],
  model.rows.map((r) => [r.context, f(r.xquant_prefill_tokens_per_s, 1), f(r.fp16_prefill_tokens_per_s, 1), f(r.xquant_tokens_per_s), f(r.fp16_tokens_per_s), f(r.speed_ratio), `${f(r.xquant_prefill_tokens_per_s / r.xquant_tokens_per_s, 1)}×`, r.xquant_kv_bytes, r.fp16_kv_bytes, launches(r)]),
);
const md = lines.join('\n');
writeFileSync(join(out, 'all.md'), md);
process.stdout.write(md);
