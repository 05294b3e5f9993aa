// Dequantization kernels: one invocation per run of RUN consecutive output elements (an even
// number, so with f16 output every word belongs to one invocation). The run's position is
// found with one set of divisions and then advanced element by element.
// Layout of codes and params: src/layout.rs.

struct Dims {
    rows: u32,
    tokens: u32,          // N
    dim: u32,             // D
    n_groups: u32,
    other: u32,           // O = D (tokens axis) or N (channels axis)
    words_per_group: u32, // ceil(GROUP * BITS / 32)
    res_words_per_group: u32, // ceil(GROUP * RES_BITS / 32)
    elements: u32,        // R * N * D
    runs: u32,            // ceil(elements / RUN): invocations (informational)
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
override RUN: u32 = 8u;           // elements per invocation (even)

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> codes: array<u32>;      // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(2) var<storage, read> params: array<u32>;     // [R, n_groups, O] (scale, zero)
@group(0) @binding(3) var<storage, read> res_codes: array<u32>;  // [R, n_groups, rwpg, O], RES_BITS-bit
@group(0) @binding(4) var<storage, read> res_params: array<u32>; // [R, n_groups, O]
@group(0) @binding(5) var<storage, read_write> out: array<u32>;  // [R, N, D] f32 bits or f16 pairs

// Where an element lives: its cell (params index), its member index, row, group, other-index.
struct Slot {
    cell: u32,   // params index (r * n_groups + g) * O + o
    member: u32, // index within the group
    r: u32,
    g: u32,
    o: u32,
}

// Position (r, t, d) of an element in [R, N, D].
struct Pos {
    r: u32,
    t: u32,
    d: u32,
}

fn pos_of(e: u32) -> Pos {
    let row = e / dims.dim;
    return Pos(row / dims.tokens, row % dims.tokens, e % dims.dim);
}

fn advance(p: ptr<function, Pos>) {
    (*p).d += 1u;
    if (*p).d == dims.dim {
        (*p).d = 0u;
        (*p).t += 1u;
        if (*p).t == dims.tokens {
            (*p).t = 0u;
            (*p).r += 1u;
        }
    }
}

fn slot_of(p: Pos) -> Slot {
    var k = p.t;
    var o = p.d;
    if AXIS_CHANNELS {
        k = p.d;
        o = p.t;
    }
    let g = k / GROUP;
    return Slot((p.r * dims.n_groups + g) * dims.other + o, k % GROUP, p.r, g, o);
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

fn base_value(s: Slot) -> f32 {
    let p = load_params(s.cell);
    return f32(base_code(s)) * p.x + p.y;
}

fn residual_value(s: Slot) -> f32 {
    let rp = load_res_params(s.cell);
    let res = round_out(f32(res_code(s)) * rp.x + rp.y);
    return round_out(base_value(s)) + res;
}

fn run_id(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * dims.grid_x + wg.x) * WG + lid;
}

// Writes element e's value; with f16 output a word is written once its odd half is known
// (or at the tensor's end). `lo` carries the even half between calls.
fn emit(e: u32, v: f32, lo: ptr<function, f32>) {
    if !OUT_F16 {
        out[e] = bitcast<u32>(v);
    } else if (e & 1u) == 0u {
        *lo = v;
        if e + 1u == dims.elements {
            out[e / 2u] = pack2x16float(vec2<f32>(v, 0.0));
        }
    } else {
        out[e / 2u] = pack2x16float(vec2<f32>(*lo, v));
    }
}

// dequant_with_params: codes * scale + zero.
@compute @workgroup_size(WG)
fn dequant(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let first = run_id(wg, lid) * RUN;
    var p = pos_of(min(first, dims.elements - 1u));
    var lo = 0.0;
    for (var e = first; e < min(first + RUN, dims.elements); e++) {
        emit(e, base_value(slot_of(p)), &lo);
        advance(&p);
    }
}

// A reuse layer's reconstruction: dequant(anchor codes, own params) + dequant(residual),
// each rounded to the output dtype before the sum (as the reference adds fp16 tensors).
@compute @workgroup_size(WG)
fn dequant_residual(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let first = run_id(wg, lid) * RUN;
    var p = pos_of(min(first, dims.elements - 1u));
    var lo = 0.0;
    for (var e = first; e < min(first + RUN, dims.elements); e++) {
        emit(e, residual_value(slot_of(p)), &lo);
        advance(&p);
    }
}
