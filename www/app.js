// The demo: cross-layer similarity and XQuant's memory/quality trade-off of a model's K/V,
// computed in the browser on WebGPU by the xquant-wgpu package. Charts are 2D canvas.

import { XQuant } from 'xquant-wgpu';

const $ = (id) => document.getElementById(id);
const state = { xq: null, bytes: null, name: '', report: null, sim: null, kind: 'key', busy: 0 };

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

function options() {
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
  // The layer groups: anchor + reuse layers, boxed on the diagonal.
  if (report) {
    const gs = report.config.group_size;
    g.strokeStyle = '#111';
    g.lineWidth = 2;
    for (let a = 0; a < L; a += gs) {
      const n = Math.min(gs, L - a);
      g.strokeRect(a * cell + 1, a * cell + 1, n * cell - 2, n * cell - 2);
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
  // The accounted XQuant rate of this analysis, plus the 128-token f16 window a cache keeps.
  const window = 128;
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
    `bits per element as accounted, plus a ${window}-token f16 window).`;
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

function drawAll() {
  drawHeatmap();
  drawBars();
  drawMemory();
  drawTable();
}

// ---- work -----------------------------------------------------------------------------

async function analyzeNow() {
  const opts = options();
  const report = await busy('Analyzing (' + JSON.stringify(opts) + ')', () => state.xq.analyzeKv(state.bytes, opts));
  state.report = report;
  document.body.dataset.config = JSON.stringify(opts);
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
  state.bytes = bytes;
  state.name = name;
  $('dataset').textContent = `${name}: ${info.layers} layers of [B, H, S, D] = [${info.shape.join(', ')}] ${info.dtype}`;
  try {
    state.sim = await busy('Measuring cross-layer similarity', () => state.xq.kvSimilarity(bytes));
    await analyzeNow();
  } catch (e) {
    $('file-error').textContent = `${name}: ${e.name}: ${e.message}`;
    $('file-error').hidden = false;
    status('That file could not be analyzed.', 'error');
  }
}

async function suggest() {
  const bound = Number($('bound').value);
  const candidates = [];
  for (const baseBits of [2, 3, 4]) candidates.push({ groupSize: 1, baseBits, residualBits: 0 });
  for (const residualBits of [0, 1, 2, 3, 4]) candidates.push({ groupSize: 2, baseBits: 2, residualBits });
  for (const residualBits of [0, 2, 4]) candidates.push({ groupSize: 3, baseBits: 2, residualBits });
  const base = options();
  let best = null;
  for (const [i, c] of candidates.entries()) {
    const opts = { ...base, ...c };
    const r = await busy(`Trying ${i + 1}/${candidates.length}`, () => state.xq.analyzeKv(state.bytes, opts));
    const err = r.layers.reduce((s, l) => s + l.key.recon_mse + l.value.recon_mse, 0) / (2 * r.layers.length);
    if (err <= bound && (!best || r.totals.effective_bits < best.bits)) best = { opts, bits: r.totals.effective_bits, err };
  }
  if (!best) {
    $('suggestion').textContent = `No candidate stays under ${bound}.`;
    status('No suggestion.', 'ok');
    return;
  }
  const f = $('config');
  for (const [k, v] of Object.entries(best.opts)) if (f.elements[k]) f.elements[k].value = String(v);
  $('suggestion').textContent =
    `Suggested: groups of ${best.opts.groupSize}, ${best.opts.baseBits}-bit anchors, residual ${best.opts.residualBits} ` +
    `→ ${best.bits.toFixed(2)} bits, mean MSE ${best.err.toFixed(4)}.`;
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
  $('config').addEventListener('change', () => analyzeNow().catch((e) => status(`${e.name}: ${e.message}`, 'error')));
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
  const res = await fetch('data/smollm2-135m-kv.safetensors');
  await load(new Uint8Array(await res.arrayBuffer()), 'SmolLM2-135M-Instruct, 160 tokens of Pride and Prejudice');
}

main();
