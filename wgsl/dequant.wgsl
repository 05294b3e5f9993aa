// Dequantization kernels: one invocation per output word (one f32, or two f16 halves), so
// invocations never share a word. Layout of codes and params: src/layout.rs.

struct Dims {
    rows: u32,
    tokens: u32,          // N
    dim: u32,             // D
    n_groups: u32,
    other: u32,           // O = D (tokens axis) or N (channels axis)
    words_per_group: u32, // ceil(GROUP * BITS / 32)
    res_words_per_group: u32, // ceil(GROUP * RES_BITS / 32)
    elements: u32,        // R * N * D
    out_words: u32,       // elements (f32 out) or ceil(elements / 2) (f16 out)
    grid_x: u32,          // workgroups along x
    _pad0: u32,
    _pad1: u32,
}

override BITS: u32 = 2u;
override RES_BITS: u32 = 4u;
override GROUP: u32 = 32u;
override OUT_F16: bool = false;   // out holds f16 pairs; every partial result is rounded to f16
override PARAMS_F32: bool = false;
override AXIS_CHANNELS: bool = false;
override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> codes: array<u32>;      // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(2) var<storage, read> params: array<u32>;     // [R, n_groups, O] (scale, zero)
@group(0) @binding(3) var<storage, read> res_codes: array<u32>;  // [R, n_groups, rwpg, O], RES_BITS-bit
@group(0) @binding(4) var<storage, read> res_params: array<u32>; // [R, n_groups, O]
@group(0) @binding(5) var<storage, read_write> out: array<u32>;  // [R, N, D] f32 bits or f16 pairs

// Where element e lives: its cell (params index), its member index and code word base.
struct Slot {
    cell: u32,   // params index (r * n_groups + g) * O + o
    member: u32, // index within the group
    r: u32,
    g: u32,
    o: u32,
}

fn slot_of(e: u32) -> Slot {
    let d = e % dims.dim;
    let t = (e / dims.dim) % dims.tokens;
    let r = e / (dims.dim * dims.tokens);
    var k = t;
    var o = d;
    if AXIS_CHANNELS {
        k = d;
        o = t;
    }
    let g = k / GROUP;
    return Slot((r * dims.n_groups + g) * dims.other + o, k % GROUP, r, g, o);
}

// Word index and bit offset of element slot `s` in a code buffer of `wpg` words per group.
fn code_pos(s: Slot, wpg: u32, bits: u32) -> vec2<u32> {
    let pos = s.member * bits;
    return vec2<u32>(((s.r * dims.n_groups + s.g) * wpg + pos / 32u) * dims.other + s.o, pos % 32u);
}

fn base_code(s: Slot) -> u32 {
    let at = code_pos(s, dims.words_per_group, BITS);
    var v = codes[at.x] >> at.y;
    if at.y + BITS > 32u {
        v |= codes[at.x + dims.other] << (32u - at.y);
    }
    return v & ((1u << BITS) - 1u);
}

fn res_code(s: Slot) -> u32 {
    let at = code_pos(s, dims.res_words_per_group, RES_BITS);
    var v = res_codes[at.x] >> at.y;
    if at.y + RES_BITS > 32u {
        v |= res_codes[at.x + dims.other] << (32u - at.y);
    }
    return v & ((1u << RES_BITS) - 1u);
}

fn load_params(cell: u32) -> vec2<f32> {
    if PARAMS_F32 {
        return vec2<f32>(bitcast<f32>(params[2u * cell]), bitcast<f32>(params[2u * cell + 1u]));
    }
    return unpack2x16float(params[cell]);
}

fn load_res_params(cell: u32) -> vec2<f32> {
    if PARAMS_F32 {
        return vec2<f32>(bitcast<f32>(res_params[2u * cell]), bitcast<f32>(res_params[2u * cell + 1u]));
    }
    return unpack2x16float(res_params[cell]);
}

fn round_out(v: f32) -> f32 {
    if OUT_F16 {
        return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
    }
    return v;
}

fn base_value(e: u32) -> f32 {
    let s = slot_of(e);
    let p = load_params(s.cell);
    return f32(base_code(s)) * p.x + p.y;
}

fn residual_value(e: u32) -> f32 {
    let s = slot_of(e);
    let base = round_out(base_value(e));
    let rp = load_res_params(s.cell);
    let res = round_out(f32(res_code(s)) * rp.x + rp.y);
    return base + res;
}

fn word_id(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * dims.grid_x + wg.x) * WG + lid;
}

fn store(w: u32, lo: f32, hi: f32) {
    if OUT_F16 {
        out[w] = pack2x16float(vec2<f32>(lo, hi));
    } else {
        out[w] = bitcast<u32>(lo);
    }
}

// dequant_with_params: codes * scale + zero.
@compute @workgroup_size(WG)
fn dequant(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = word_id(wg, lid);
    if w >= dims.out_words {
        return;
    }
    let per = select(1u, 2u, OUT_F16);
    let e = w * per;
    var hi = 0.0;
    if OUT_F16 && e + 1u < dims.elements {
        hi = base_value(e + 1u);
    }
    store(w, base_value(e), hi);
}

// A reuse layer's reconstruction: dequant(anchor codes, own params) + dequant(residual).
@compute @workgroup_size(WG)
fn dequant_residual(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = word_id(wg, lid);
    if w >= dims.out_words {
        return;
    }
    let per = select(1u, 2u, OUT_F16);
    let e = w * per;
    var hi = 0.0;
    if OUT_F16 && e + 1u < dims.elements {
        hi = residual_value(e + 1u);
    }
    store(w, residual_value(e), hi);
}
