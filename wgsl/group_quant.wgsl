// Group quantization kernels: one invocation per cell = (row r, group g, other-index o).
// The storage layout is specified in src/layout.rs: params [R, n_groups, O], codes
// [R, n_groups, words_per_group, O] with a group's codes as one little-endian bit stream.
// A partial last group is padded by repeating its last member (the reference's padding).

// The tensor being encoded is a *block*: tokens [t0, t0 + n) of a *page* [R, page_tokens, D]
// whose codes and params buffers are laid out for the whole page. Its values come from an
// input view: x is [R, x_tokens, x_stride] and block token t is x token x_t0 + t (the recon
// input of quantize_residual uses the same view). For a whole tensor: t0 = x_t0 = 0,
// n = page_tokens = x_tokens, x_stride = D.
struct Dims {
    rows: u32,
    dim: u32,             // D
    n_groups: u32,        // groups per row of the page
    other: u32,           // O of the page: D (tokens axis) or page_tokens (channels axis)
    words_per_group: u32, // ceil(GROUP * BITS / 32)
    res_words_per_group: u32, // ceil(GROUP * RES_BITS / 32)
    t0: u32,              // first page token of the block
    n: u32,               // tokens in the block
    block_groups: u32,    // groups per row of the block
    block_other: u32,     // O of the block: D or n
    cells: u32,           // rows * block_groups * block_other
    x_tokens: u32,        // token rows per row of x
    x_t0: u32,            // x token of block token 0
    x_stride: u32,        // elements per token in x (D, or D rounded up to even for windows)
    grid_x: u32,          // workgroups along x (the grid is 2-D when cells / WG > 65535)
    eta: f32,             // data-free calibration, 0 = reference
}

override BITS: u32 = 2u;          // code width of `codes` / `anchor_codes`
override RES_BITS: u32 = 4u;      // code width of `res_codes`
override GROUP: u32 = 32u;        // members per group
override IN_F16: bool = false;    // `x` holds f16 pairs instead of f32
override X_TO_F16: bool = false;  // f32 `x` values are rounded to f16 as they load (caches hold f16)
override RECON_F16: bool = false; // `recon` holds f16 pairs instead of f32
override ROUND_F16: bool = false; // intermediate reconstructions are rounded to f16 (output dtype)
override PARAMS_F32: bool = false;// params as two f32 words instead of pack2x16float
override AXIS_CHANNELS: bool = false; // groups run along D instead of N
override WG: u32 = 64u;

const SCALE_FLOOR: f32 = 1e-8;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;             // [R, N, D] f32 bits or f16 pairs
@group(0) @binding(2) var<storage, read> anchor_codes: array<u32>;  // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(3) var<storage, read> recon: array<u32>;         // [R, N, D] f32 bits or f16 pairs
@group(0) @binding(4) var<storage, read_write> params: array<u32>;  // [R, n_groups, O] (scale, zero)
@group(0) @binding(5) var<storage, read_write> codes: array<u32>;   // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(6) var<storage, read_write> res_params: array<u32>; // [R, n_groups, O]
@group(0) @binding(7) var<storage, read_write> res_codes: array<u32>;  // [R, n_groups, rwpg, O], RES_BITS-bit

struct Cell {
    id: u32,     // invocation: (r * block_groups + bg) * block_other + bo
    pid: u32,    // the page cell: (r * n_groups + g) * other + o, index of its params
    r: u32,
    g: u32,      // page group
    o: u32,      // page other-index
    bg: u32,     // block group
    bo: u32,     // block other-index
    valid: u32,  // real (unpadded) members
}

fn cell_of(wg: vec3<u32>, lid: u32) -> Cell {
    var c: Cell;
    c.id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let per_row = dims.block_groups * dims.block_other;
    c.r = c.id / per_row;
    let rem = c.id % per_row;
    c.bg = rem / dims.block_other;
    c.bo = rem % dims.block_other;
    if AXIS_CHANNELS {
        c.g = c.bg;
        c.o = dims.t0 + c.bo;
        c.valid = min(GROUP, dims.dim - c.bg * GROUP);
    } else {
        c.g = dims.t0 / GROUP + c.bg;
        c.o = c.bo;
        c.valid = min(GROUP, dims.n - c.bg * GROUP);
    }
    c.pid = (c.r * dims.n_groups + c.g) * dims.other + c.o;
    return c;
}

// Index in x (and recon) of member i (padding members repeat the last real one).
fn member(c: Cell, i: u32) -> u32 {
    let k = c.bg * GROUP + min(i, c.valid - 1u);
    var t = k;
    var d = c.bo;
    if AXIS_CHANNELS {
        t = c.bo;
        d = k;
    }
    return (c.r * dims.x_tokens + dims.x_t0 + t) * dims.x_stride + d;
}

fn load_x(e: u32) -> f32 {
    if IN_F16 {
        return unpack2x16float(x[e >> 1u])[e & 1u];
    }
    if X_TO_F16 {
        return round_f16(bitcast<f32>(x[e]));
    }
    return bitcast<f32>(x[e]);
}

fn load_recon(e: u32) -> f32 {
    if RECON_F16 {
        return unpack2x16float(recon[e >> 1u])[e & 1u];
    }
    return bitcast<f32>(recon[e]);
}

fn round_f16(v: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
}

fn levels(bits: u32) -> f32 {
    return f32((1u << bits) - 1u);
}

// (scale, zero) of a group with range [lo, hi].
fn fit(lo: f32, hi: f32, bits: u32) -> vec2<f32> {
    return vec2<f32>(max((hi - lo) / levels(bits), SCALE_FLOOR), lo);
}

// Data-free calibration: zero + eta * range, scale * (1 - 2 eta).
fn calibrate(p: vec2<f32>, bits: u32) -> vec2<f32> {
    if dims.eta == 0.0 {
        return p;
    }
    return vec2<f32>((1.0 - 2.0 * dims.eta) * p.x, p.y + dims.eta * p.x * levels(bits));
}

fn quant(v: f32, p: vec2<f32>, bits: u32) -> u32 {
    return u32(clamp(round((v - p.y) / p.x), 0.0, levels(bits)));
}

// Stores (scale, zero) and returns what storage keeps (f16-rounded unless PARAMS_F32).
fn store_params(id: u32, p: vec2<f32>) -> vec2<f32> {
    if PARAMS_F32 {
        params[2u * id] = bitcast<u32>(p.x);
        params[2u * id + 1u] = bitcast<u32>(p.y);
        return p;
    }
    let packed = pack2x16float(p);
    params[id] = packed;
    return unpack2x16float(packed);
}

fn store_res_params(id: u32, p: vec2<f32>) -> vec2<f32> {
    if PARAMS_F32 {
        res_params[2u * id] = bitcast<u32>(p.x);
        res_params[2u * id + 1u] = bitcast<u32>(p.y);
        return p;
    }
    let packed = pack2x16float(p);
    res_params[id] = packed;
    return unpack2x16float(packed);
}

// Index of word w of cell c in a page code buffer with `wpg` words per group.
fn word_index(c: Cell, wpg: u32, w: u32) -> u32 {
    return ((c.r * dims.n_groups + c.g) * wpg + w) * dims.other + c.o;
}

fn anchor_code(c: Cell, i: u32) -> u32 {
    let pos = i * BITS;
    let w = pos / 32u;
    let off = pos % 32u;
    var v = anchor_codes[word_index(c, dims.words_per_group, w)] >> off;
    if off + BITS > 32u {
        v |= anchor_codes[word_index(c, dims.words_per_group, w + 1u)] << (32u - off);
    }
    return v & ((1u << BITS) - 1u);
}

// Bit-stream writer: codes are appended at increasing bit offsets; full words are flushed.
struct Packer {
    acc: u32,
    off: u32,
    w: u32,
}

// Appends `code` of width `bits`; returns true when `p.acc` holds a full word to flush
// (the caller writes `flushed` and the packer continues with the carry).
fn pack_push(p: ptr<function, Packer>, code: u32, bits: u32) -> bool {
    (*p).acc |= code << (*p).off;
    (*p).off += bits;
    return (*p).off >= 32u;
}

// After a flush: start the next word with the bits that did not fit.
fn pack_carry(p: ptr<function, Packer>, code: u32, bits: u32) {
    (*p).off -= 32u;
    (*p).w += 1u;
    (*p).acc = code >> (bits - (*p).off);
}

fn x_range(c: Cell) -> vec2<f32> {
    var lo = load_x(member(c, 0u));
    var hi = lo;
    for (var i = 1u; i < c.valid; i++) {
        let v = load_x(member(c, i));
        lo = min(lo, v);
        hi = max(hi, v);
    }
    return vec2<f32>(lo, hi);
}

// quantize_codes: own params and codes of x.
@compute @workgroup_size(WG)
fn quantize(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    let range = x_range(c);
    let p = fit(range.x, range.y, BITS);
    store_params(c.pid, calibrate(p, BITS));
    var pk = Packer(0u, 0u, 0u);
    for (var i = 0u; i < GROUP; i++) {
        let code = quant(load_x(member(c, i)), p, BITS);
        if pack_push(&pk, code, BITS) {
            codes[word_index(c, dims.words_per_group, pk.w)] = pk.acc;
            pack_carry(&pk, code, BITS);
        }
    }
    if pk.off > 0u {
        codes[word_index(c, dims.words_per_group, pk.w)] = pk.acc;
    }
}

// compute_reuse_params: a fresh min/max calibration of x (the anchor's codes fix only shapes).
@compute @workgroup_size(WG)
fn fit_params(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    let range = x_range(c);
    store_params(c.pid, calibrate(fit(range.x, range.y, BITS), BITS));
}

// quantize_residual: params and codes of x - recon (recon as the caller rounded it).
@compute @workgroup_size(WG)
fn quantize_residual(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    var lo = load_x(member(c, 0u)) - load_recon(member(c, 0u));
    var hi = lo;
    for (var i = 1u; i < c.valid; i++) {
        let e = member(c, i);
        let d = load_x(e) - load_recon(e);
        lo = min(lo, d);
        hi = max(hi, d);
    }
    let p = fit(lo, hi, BITS);
    store_params(c.pid, p);
    var pk = Packer(0u, 0u, 0u);
    for (var i = 0u; i < GROUP; i++) {
        let e = member(c, i);
        let code = quant(load_x(e) - load_recon(e), p, BITS);
        if pack_push(&pk, code, BITS) {
            codes[word_index(c, dims.words_per_group, pk.w)] = pk.acc;
            pack_carry(&pk, code, BITS);
        }
    }
    if pk.off > 0u {
        codes[word_index(c, dims.words_per_group, pk.w)] = pk.acc;
    }
}

// The fused reuse path: own params for the anchor's codes, then the RES_BITS residual of x
// against that reconstruction (rounded like the output), all from one walk over the group.
@compute @workgroup_size(WG)
fn reuse_fit(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    let range = x_range(c);
    let own = store_params(c.pid, calibrate(fit(range.x, range.y, BITS), BITS));
    var lo = 0.0;
    var hi = 0.0;
    for (var i = 0u; i < c.valid; i++) {
        var rec = f32(anchor_code(c, i)) * own.x + own.y;
        if ROUND_F16 {
            rec = round_f16(rec);
        }
        let d = load_x(member(c, i)) - rec;
        if i == 0u {
            lo = d;
            hi = d;
        } else {
            lo = min(lo, d);
            hi = max(hi, d);
        }
    }
    let rp = fit(lo, hi, RES_BITS);
    store_res_params(c.pid, rp);
    var pk = Packer(0u, 0u, 0u);
    for (var i = 0u; i < GROUP; i++) {
        var rec = f32(anchor_code(c, i)) * own.x + own.y;
        if ROUND_F16 {
            rec = round_f16(rec);
        }
        let code = quant(load_x(member(c, i)) - rec, rp, RES_BITS);
        if pack_push(&pk, code, RES_BITS) {
            res_codes[word_index(c, dims.res_words_per_group, pk.w)] = pk.acc;
            pack_carry(&pk, code, RES_BITS);
        }
    }
    if pk.off > 0u {
        res_codes[word_index(c, dims.res_words_per_group, pk.w)] = pk.acc;
    }
}
