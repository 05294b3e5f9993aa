// A runtime's own f16 KV cache, as an in-browser runtime writes it (its own WGSL, bind groups
// made once, one uniform write per step): an append kernel and a split-K attention (chunks of
// CHUNK tokens, then a combine). The baseline of the runtime integration test and of
// `npm run bench:runtime`. `installRuntimeF16` runs in the page (page.evaluate) and installs
// `window.runtimeF16(device, shape, layers)`.

/** Installs `window.runtimeF16(device, { H, HQ, D, MAX }, layers)` in the page: `layers[l]`
 * holds the layer's `kin`/`vin` (buffer bindings of the new tokens' K/V, [H, n, D] f32), `q`
 * ([HQ, D] f32) and `o` (its output) buffers. Returns `{ step(n) }`: appends n tokens to every
 * layer and attends the newest, one submission; returns the main-thread ms of recording it. */
export function installRuntimeF16() {
  window.runtimeF16 = (device, { H, HQ, D, MAX }, layers) => {
    const U = GPUBufferUsage;
    const CHUNK = 256;
    const CHUNKS = Math.ceil(MAX / CHUNK);
    const module = device.createShaderModule({
      code: `
struct P { len: u32, n: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> kin: array<f32>;
@group(0) @binding(2) var<storage, read> vin: array<f32>;
@group(0) @binding(3) var<storage, read_write> kc: array<u32>;
@group(0) @binding(4) var<storage, read_write> vc: array<u32>;
@group(0) @binding(5) var<storage, read> q: array<f32>;
@group(0) @binding(6) var<storage, read_write> part: array<f32>;  // [HQ, CHUNKS, 2 + D]
@group(0) @binding(7) var<storage, read_write> o: array<f32>;
const H = ${H}u; const HQ = ${HQ}u; const D = ${D}u; const MAX = ${MAX}u;
const CHUNK = ${CHUNK}u; const CHUNKS = ${CHUNKS}u;
var<workgroup> s: array<f32, CHUNK>;
var<workgroup> qs: array<f32, D>;
@compute @workgroup_size(64)
fn append(@builtin(global_invocation_id) id: vec3<u32>) {
  let i = id.x;                      // (h, t, pair)
  if i >= H * p.n * (D / 2u) { return; }
  let pair = i % (D / 2u);
  let t = (i / (D / 2u)) % p.n;
  let h = i / (p.n * (D / 2u));
  let src = (h * p.n + t) * D + 2u * pair;
  let dst = (h * MAX + p.len + t) * (D / 2u) + pair;
  kc[dst] = pack2x16float(vec2<f32>(kin[src], kin[src + 1u]));
  vc[dst] = pack2x16float(vec2<f32>(vin[src], vin[src + 1u]));
}
// One workgroup (one invocation per channel) per query head and chunk: scores, the chunk's
// max and sum, its weighted value sums.
@compute @workgroup_size(${D})
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let hq = wg.x;
  let c = wg.y;
  let h = hq / (HQ / H);
  let n = p.len + p.n;
  let j0 = c * CHUNK;
  let at = (hq * CHUNKS + c) * (2u + D);
  if j0 >= n {
    return;
  }
  let m_tokens = min(CHUNK, n - j0);
  qs[lid] = q[hq * D + lid];
  workgroupBarrier();
  for (var j = lid; j < m_tokens; j += D) {
    let row = (h * MAX + j0 + j) * (D / 2u);
    var acc = vec2<f32>(0.0);
    for (var d = 0u; d < D / 2u; d++) {
      acc += unpack2x16float(kc[row + d]) * vec2<f32>(qs[2u * d], qs[2u * d + 1u]);
    }
    s[j] = (acc.x + acc.y) / sqrt(f32(D));
  }
  workgroupBarrier();
  var m = -3.0e38;
  for (var j = 0u; j < m_tokens; j++) { m = max(m, s[j]); }
  var l = 0.0;
  var acc = 0.0;
  for (var j = 0u; j < m_tokens; j++) {
    let e = exp(s[j] - m);
    l += e;
    let v = unpack2x16float(vc[(h * MAX + j0 + j) * (D / 2u) + lid / 2u]);
    acc += e * select(v.x, v.y, lid % 2u == 1u);
  }
  if lid == 0u { part[at] = m; part[at + 1u] = l; }
  part[at + 2u + lid] = acc;
}
@compute @workgroup_size(${D})
fn combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let hq = wg.x;
  let chunks = (p.len + p.n + CHUNK - 1u) / CHUNK;
  var m = -3.0e38;
  for (var c = 0u; c < chunks; c++) { m = max(m, part[(hq * CHUNKS + c) * (2u + D)]); }
  var l = 0.0;
  var acc = 0.0;
  for (var c = 0u; c < chunks; c++) {
    let at = (hq * CHUNKS + c) * (2u + D);
    let w = exp(part[at] - m);
    l += w * part[at + 1u];
    acc += w * part[at + 2u + lid];
  }
  o[hq * D + lid] = acc / l;
}`,
    });
    const pipe = (entryPoint) => device.createComputePipeline({ layout: 'auto', compute: { module, entryPoint } });
    const [appendPipe, attendPipe, combinePipe] = ['append', 'attend', 'combine'].map(pipe);
    const params = device.createBuffer({ size: 16, usage: U.UNIFORM | U.COPY_DST });
    const storage = (bytes) => device.createBuffer({ size: bytes, usage: U.STORAGE });
    const groups = layers.map((x) => {
      const [k, v, part] = [storage(H * MAX * D * 2), storage(H * MAX * D * 2), storage(HQ * CHUNKS * (2 + D) * 4)];
      const group = (p, bindings) =>
        device.createBindGroup({
          layout: p.getBindGroupLayout(0),
          entries: Object.entries(bindings).map(([binding, resource]) => ({ binding: Number(binding), resource })),
        });
      return [
        group(appendPipe, { 0: { buffer: params }, 1: x.kin, 2: x.vin, 3: { buffer: k }, 4: { buffer: v } }),
        group(attendPipe, { 0: { buffer: params }, 3: { buffer: k }, 4: { buffer: v }, 5: { buffer: x.q }, 6: { buffer: part } }),
        group(combinePipe, { 0: { buffer: params }, 6: { buffer: part }, 7: { buffer: x.o } }),
      ];
    });
    let len = 0;
    const step = (n) => {
      device.queue.writeBuffer(params, 0, new Uint32Array([len, n]));
      const t0 = performance.now();
      const enc = device.createCommandEncoder();
      for (const [append, attend, combine] of groups) {
        const pass = enc.beginComputePass();
        pass.setPipeline(appendPipe);
        pass.setBindGroup(0, append);
        pass.dispatchWorkgroups(Math.ceil((H * n * D) / 2 / 64));
        pass.setPipeline(attendPipe);
        pass.setBindGroup(0, attend);
        pass.dispatchWorkgroups(HQ, Math.ceil((len + n) / CHUNK));
        pass.setPipeline(combinePipe);
        pass.setBindGroup(0, combine);
        pass.dispatchWorkgroups(HQ);
        pass.end();
      }
      device.queue.submit([enc.finish()]);
      len += n;
      return performance.now() - t0;
    };
    return { step };
  };
}
