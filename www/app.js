// The demo: cross-layer similarity and XQuant's memory/quality trade-off of a model's K/V,
// computed in the browser on WebGPU by the xquant-wgpu package. Charts are 2D canvas.

import { XQuant } from 'xquant-wgpu';
import { initGenerate } from './generate.js';

const $ = (id) => document.getElementById(id);
// `seq` / `loadSeq` number the analyses and file loads: only the latest one's result is shown.
const state = { xq: null, bytes: null, name: '', report: null, sim: null, kind: 'key', busy: 0, plan: null, seq: 0, loadSeq: 0 };

function status(text, kind = 'info') {
  const el = $('status');
  el.textContent = text;
  el.dataset.kind = kind;
}

async function busy(label, work) {
  state.busy++;
  status(label + '…', 'busy');
  document.body.dataset.busy = '1';
  try {
    return await work();
  } finally {
    if (--state.busy === 0) delete document.body.dataset.busy;
  }
}

// The analysis options: the suggested plan while one is shown, else the knobs.
function options() {
  if (state.plan) return { plan: state.plan };
  const f = new FormData($('config'));
  return {
    groupSize: Number(f.get('groupSize')),
    baseBits: Number(f.get('baseBits')),
    residualBits: Number(f.get('residualBits')),
    groupQuantSize: Number(f.get('groupQuantSize')),
    eta: Number(f.get('eta')),
    valueAxis: f.get('valueAxis'),
  };
}

// Reads the header of a safetensors file enough to say what it holds, or why it is not K/V.
function describe(bytes) {
  if (bytes.byteLength < 8) throw new Error('not a safetensors file (too short)');
  const n = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
  if (n > bytes.byteLength - 8) throw new Error('not a safetensors file (bad header length)');
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  } catch {
    throw new Error('not a safetensors file (header is not JSON)');
  }
  const key = header['past_key_values.0.key'];
  if (!key) throw new Error('no tensors named past_key_values.{i}.key / .value in this file');
  const layers = Object.keys(header).filter((k) => /^past_key_values\.\d+\.key$/.test(k)).length;
  return { layers, shape: key.shape, dtype: key.dtype };
}

// ---- charts ---------------------------------------------------------------------------

function color(v) {
  // -1 blue, 0 white, 1 red.
  const t = Math.max(-1, Math.min(1, v));
  const a = Math.round(255 * (1 - Math.abs(t)));
  return t >= 0 ? `rgb(255,${a},${a})` : `rgb(${a},${a},255)`;
}

function drawHeatmap() {
  const c = $('heatmap');
  const g = c.getContext('2d');
  const { sim, report, kind } = state;
  if (!sim) return;
  const L = sim.layers;
  const cell = c.width / L;
  const m = sim[kind].cosine;
  g.clearRect(0, 0, c.width, c.height);
  for (let i = 0; i < L; i++) {
    for (let j = 0; j < L; j++) {
      g.fillStyle = color(m[i * L + j]);
      g.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
    }
  }
  // The layer groups (an anchor and the layers after it that reuse its keys' codes), boxed
  // on the diagonal.
  if (report) {
    g.strokeStyle = '#111';
    g.lineWidth = 2;
    const layers = report.layers;
    for (let a = 0; a < L; ) {
      let n = 1;
      while (a + n < L && layers[a + n].role === 'reuse' && layers[a + n].group === layers[a].group) n++;
      g.strokeRect(a * cell + 1, a * cell + 1, n * cell - 2, n * cell - 2);
      a += n;
    }
  }
  c.dataset.ready = '1';
  $('legend').innerHTML =
    '<span style="background:' + color(-1) + '"></span>−1 ' +
    '<span style="background:' + color(0) + '"></span>0 ' +
    '<span style="background:' + color(1) + '"></span>1';
}

function hover(ev) {
  const { sim, kind } = state;
  if (!sim) return;
  const c = $('heatmap');
  const r = c.getBoundingClientRect();
  const L = sim.layers;
  const j = Math.floor(((ev.clientX - r.left) / r.width) * L);
  const i = Math.floor(((ev.clientY - r.top) / r.height) * L);
  if (i < 0 || j < 0 || i >= L || j >= L) return;
  const cos = sim[kind].cosine[i * L + j];
  const mse = sim[kind].mse[i * L + j];
  $('hover').textContent = `${kind}s, layer ${i} × layer ${j}: cosine ${cos.toFixed(3)}, MSE ${mse.toFixed(4)}`;
}

function drawBars() {
  const { report, kind } = state;
  if (!report) return;
  const c = $('bars');
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  const layers = report.layers;
  const values = layers.flatMap((l) => [l[kind].recon_mse, l[kind].recon_mse_no_residual ?? 0]).filter((v) => v > 0);
  const lo = Math.log10(Math.min(...values)) - 0.3;
  const hi = Math.log10(Math.max(...values)) + 0.1;
  const h = c.height - 30;
  const y = (v) => h - ((Math.log10(v) - lo) / (hi - lo)) * h;
  const w = c.width / layers.length;
  const series = [
    ['anchor (own codes)', '#2b6cb0', (l) => (l.role === 'anchor' ? l[kind].recon_mse : null)],
    ['reuse, no residual', '#e53e3e', (l) => l[kind].recon_mse_no_residual],
    ['reuse + residual', '#38a169', (l) => (l.role === 'reuse' ? l[kind].recon_mse : null)],
  ];
  layers.forEach((l, i) => {
    series.forEach(([, col, f], s) => {
      const v = f(l);
      if (v === null || v === undefined || v <= 0) return;
      g.fillStyle = col;
      const x = i * w + 2 + s * ((w - 4) / 3);
      g.fillRect(x, y(v), (w - 4) / 3, h - y(v));
    });
  });
  g.fillStyle = '#333';
  g.font = '11px sans-serif';
  for (let i = 0; i < layers.length; i += Math.max(1, Math.floor(layers.length / 15))) g.fillText(String(i), i * w + 2, c.height - 16);
  series.forEach(([name, col], s) => {
    g.fillStyle = col;
    g.fillRect(10 + s * 170, c.height - 10, 10, 8);
    g.fillStyle = '#333';
    g.fillText(name, 24 + s * 170, c.height - 2);
  });
  g.fillText(`MSE, log10 ${lo.toFixed(1)} … ${hi.toFixed(1)}`, c.width - 190, 12);

  const b = $('bits');
  const gb = b.getContext('2d');
  gb.clearRect(0, 0, b.width, b.height);
  const maxBits = 16;
  const bh = b.height - 20;
  layers.forEach((l, i) => {
    const bits = l[kind].effective_bits;
    gb.fillStyle = l.role === 'anchor' ? '#2b6cb0' : '#38a169';
    gb.fillRect(i * w + 2, bh - (bits / maxBits) * bh, w - 4, (bits / maxBits) * bh);
  });
  gb.strokeStyle = '#999';
  gb.beginPath();
  gb.moveTo(0, 0.5);
  gb.lineTo(b.width, 0.5);
  gb.stroke();
  gb.fillStyle = '#333';
  gb.font = '11px sans-serif';
  gb.fillText('16 bits (fp16)', b.width - 90, 12);
  gb.fillText(`mean ${report.totals[kind + '_effective_bits'].toFixed(2)} bits`, 4, b.height - 4);
}

function drawMemory() {
  const { report } = state;
  if (!report) return;
  const ctxLen = Number($('context').value);
  $('context-value').textContent = String(ctxLen);
  const [B, H, , D] = report.shape;
  const L = report.layers.length;
  const fp16PerToken = L * 2 * B * H * D * 2;
  // The accounted XQuant rate of this analysis, plus the f16 window (and sinks) a cache keeps:
  // the plan's, or 128 tokens for the knobs (the cache set's default).
  const window = report.plan && state.plan ? report.plan.window + report.plan.sinks : 128;
  const xqPerToken = (fp16PerToken * report.totals.effective_bits) / 16;
  const fp16 = fp16PerToken * ctxLen;
  const xq = ctxLen <= window ? fp16 : fp16PerToken * window + xqPerToken * (ctxLen - window);
  const c = $('memory-bar');
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  const w = c.width - 150;
  g.font = '13px sans-serif';
  [['fp16', fp16, '#718096'], ['XQuant', xq, '#38a169']].forEach(([name, bytes, col], i) => {
    g.fillStyle = col;
    g.fillRect(140, 10 + i * 48, (w * bytes) / fp16, 36);
    g.fillStyle = '#222';
    g.fillText(`${name}: ${(bytes / 2 ** 20).toFixed(1)} MiB`, 4, 32 + i * 48);
  });
  $('memory-text').textContent =
    `K/V of all ${L} layers at ${ctxLen} tokens: fp16 ${(fp16 / 2 ** 20).toFixed(1)} MiB, XQuant ` +
    `${(xq / 2 ** 20).toFixed(1)} MiB (${((100 * xq) / fp16).toFixed(0)}%: ${report.totals.effective_bits.toFixed(2)} ` +
    `bits per element as accounted, plus ${window} f16 tokens: window and sinks).`;
}

function drawTable() {
  const { report } = state;
  if (!report) return;
  const fmt = (v) => (v === null || v === undefined ? '–' : Number(v).toPrecision(4));
  let html =
    '<tr><th>layer</th><th>role</th><th>group</th>' +
    '<th>K mse</th><th>K no-res</th><th>K cos</th><th>K bits</th>' +
    '<th>V mse</th><th>V no-res</th><th>V cos</th><th>V bits</th></tr>';
  for (const l of report.layers) {
    html += `<tr data-layer="${l.layer}"><td>${l.layer}</td><td>${l.role}</td><td>${l.group}</td>`;
    for (const k of ['key', 'value']) {
      const s = l[k];
      html +=
        `<td data-field="${k}.recon_mse" data-value="${s.recon_mse}">${fmt(s.recon_mse)}</td>` +
        `<td>${fmt(s.recon_mse_no_residual)}</td><td>${fmt(s.cosine_to_anchor)}</td>` +
        `<td data-field="${k}.effective_bits" data-value="${s.effective_bits}">${fmt(s.effective_bits)}</td>`;
    }
    html += '</tr>';
  }
  const t = report.totals;
  html += `<tr class="totals"><td colspan="3">totals</td><td colspan="8" id="totals" data-effective-bits="${t.effective_bits}">` +
    `mean effective bits ${t.effective_bits.toFixed(3)} (K ${t.key_effective_bits.toFixed(3)}, V ${t.value_effective_bits.toFixed(3)}); ` +
    `${t.compressed_bytes} B accounted vs ${t.fp16_bytes} B fp16 (${(100 * t.ratio_vs_fp16).toFixed(1)}%)</td></tr>`;
  $('table').innerHTML = html;
}

// The plan per layer under the heatmap: a row for keys and one for values, darker for more
// bits; a borrowed entry is green with its residual's width, an own entry blue.
function drawPlanStrip() {
  const c = $('plan-strip');
  const legend = $('plan-legend');
  const plan = state.report?.plan;
  if (!plan) return;
  c.hidden = false;
  legend.hidden = false;
  const g = c.getContext('2d');
  const L = plan.layers.length;
  const cell = c.width / L;
  const rowH = 26;
  g.clearRect(0, 0, c.width, c.height);
  g.font = '10px sans-serif';
  g.textAlign = 'center';
  ['key', 'value'].forEach((kind, r) => {
    plan.layers.forEach((l, i) => {
      const e = l[kind];
      const own = e.codes === 'own';
      const shade = Math.round(235 - 40 * e.bits);
      g.fillStyle = own ? `rgb(${shade - 60},${shade - 20},255)` : `rgb(${shade - 60},220,${shade - 60})`;
      g.fillRect(i * cell + 0.5, 4 + r * (rowH + 4), cell - 1, rowH);
      g.fillStyle = '#111';
      const label = own ? `${e.bits}${e.axis === 'channels' ? 'c' : ''}` : `↖${e.residual_bits ? '+' + e.residual_bits : ''}`;
      g.fillText(label, i * cell + cell / 2, 4 + r * (rowH + 4) + 17);
    });
  });
  c.dataset.plan = JSON.stringify(plan);
  legend.textContent =
    `Plan "${plan.name}", top row keys, bottom row values, layer 0 on the left. Blue: own codes ` +
    `(the number is the bits; c: per-token groups along channels); green ↖: the previous ` +
    `layer's codes with own scale/zero (+n: an n-bit residual). Window ${plan.window}, ` +
    `${plan.sinks} sinks, groups of ${plan.group_quant_size}.`;
}

function drawAll() {
  drawHeatmap();
  drawPlanStrip();
  drawBars();
  drawMemory();
  drawTable();
}

// ---- work -----------------------------------------------------------------------------

async function analyzeNow() {
  const opts = options();
  const seq = ++state.seq;
  const label = state.plan ? `Analyzing the plan "${state.plan.name}"` : 'Analyzing (' + JSON.stringify(opts) + ')';
  let report;
  try {
    report = await busy(label, () => state.xq.analyzeKv(state.bytes, opts));
  } catch (e) {
    if (seq !== state.seq) return; // a later analysis replaced this one: its outcome counts
    throw e;
  }
  if (seq !== state.seq) return; // a later analysis replaced this one
  state.report = report;
  document.body.dataset.config = JSON.stringify(state.plan ? { plan: state.plan.name } : opts);
  drawAll();
  status(`Ready: ${state.name}, ${report.layers.length} layers, ${report.totals.effective_bits.toFixed(2)} bits per element.`, 'ok');
}

async function load(bytes, name) {
  $('file-error').hidden = true;
  let info;
  try {
    info = describe(bytes);
  } catch (e) {
    $('file-error').textContent = `${name}: ${e.message}`;
    $('file-error').hidden = false;
    return;
  }
  const mine = ++state.loadSeq;
  state.bytes = bytes;
  state.name = name;
  state.plan = null; // a plan is per layer: it belongs to the file it was measured on
  $('download').hidden = true;
  $('suggestion').textContent = '';
  $('dataset').textContent = `${name}: ${info.layers} layers of [B, H, S, D] = [${info.shape.join(', ')}] ${info.dtype}`;
  try {
    const sim = await busy('Measuring cross-layer similarity', () => state.xq.kvSimilarity(bytes));
    if (mine !== state.loadSeq) return; // a later file replaced this one
    state.sim = sim;
    await analyzeNow();
  } catch (e) {
    if (mine !== state.loadSeq) return;
    $('file-error').textContent = `${name}: ${e.name}: ${e.message}`;
    $('file-error').hidden = false;
    status('That file could not be analyzed.', 'error');
  }
}

async function suggest() {
  const opts = {
    targetBits: Number($('target-bits').value),
    context: Number($('plan-context').value),
    window: Number($('plan-window').value),
    sinks: Number($('plan-sinks').value),
  };
  let r;
  try {
    r = await busy(`Measuring candidates for ${opts.targetBits} bits`, () => state.xq.suggestPlan(state.bytes, opts));
  } catch (e) {
    $('suggestion').textContent = `${e.name}: ${e.message}`;
    status('No plan.', 'ok');
    return;
  }
  state.plan = r.plan;
  const link = $('download');
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([JSON.stringify(r.plan, null, 2) + '\n'], { type: 'application/json' }));
  link.hidden = false;
  $('suggestion').textContent =
    `${r.effectiveBits.toFixed(2)} bits at ${r.context} tokens (${r.quantizedBits.toFixed(2)} per quantized element), ` +
    `measured error ${r.error.toFixed(3)} (${r.keyError === 'attention' ? 'attention output error under the file\'s last 64 queries, summed over layers' : 'K/V relative error'}).`;
  $('suggestion').dataset.effectiveBits = String(r.effectiveBits);
  await analyzeNow();
}

async function main() {
  try {
    state.xq = await XQuant.create();
  } catch (e) {
    status(`${e.name}: ${e.message}`, 'error');
    document.body.dataset.nowebgpu = '1';
    return;
  }
  const a = state.xq.adapterInfo;
  $('adapter').textContent =
    `GPU: ${a.name} (${a.backend}${a.isFallbackAdapter ? ', a CPU fallback adapter: slow, and not your GPU' : ''})`;
  $('heatmap').addEventListener('mousemove', hover);
  for (const r of document.querySelectorAll('input[name=kind]')) {
    r.addEventListener('change', () => {
      state.kind = r.value;
      drawAll();
    });
  }
  $('config').addEventListener('change', () => {
    state.plan = null;
    $('download').hidden = true;
    $('suggestion').textContent = '';
    analyzeNow().catch((e) => status(`${e.name}: ${e.message}`, 'error'));
  });
  $('context').addEventListener('input', drawMemory);
  $('suggest').addEventListener('click', () => suggest().catch((e) => status(`${e.name}: ${e.message}`, 'error')));
  $('file').addEventListener('change', async (ev) => {
    const f = ev.target.files[0];
    if (f) await load(new Uint8Array(await f.arrayBuffer()), f.name);
  });
  const drop = $('drop');
  drop.addEventListener('dragover', (ev) => {
    ev.preventDefault();
    drop.classList.add('over');
  });
  drop.addEventListener('dragleave', () => drop.classList.remove('over'));
  drop.addEventListener('drop', async (ev) => {
    ev.preventDefault();
    drop.classList.remove('over');
    const f = ev.dataTransfer.files[0];
    if (f) await load(new Uint8Array(await f.arrayBuffer()), f.name);
  });
  // The Generate panel runs XQuant with this page's configuration and sends captures here.
  initGenerate({ xq: state.xq, cacheOptions: options, openCapture: load });
  const res = await fetch('data/smollm2-135m-kv.safetensors');
  if (!res.ok) {
    status(`The bundled capture did not load (HTTP ${res.status}); open a file instead.`, 'error');
    return;
  }
  await load(new Uint8Array(await res.arrayBuffer()), 'SmolLM2-135M-Instruct, 160 tokens of Pride and Prejudice');
}

main();
