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
    levels: array<vec4<f32>, 4>, // quantize_levels: the 2^BITS Lloyd-Max levels, ascending
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

// `v`, to be stored. llvmpipe writes storage lane by lane in a loop, and LLVM moves into that
// loop whatever it can recompute per lane from constants (a word of packed codes, f16 bit
// patterns): scalar code, a conversion per code and lane. A select on a condition it cannot
// decide (every dispatch has cells) keeps such a value one vector, computed once (on
// lavapipe the f16 quantize went 0.54 -> 0.83 of the copy kernel); a GPU compiler keeps one
// compare.
fn stored_whole(v: u32) -> u32 {
    return select(v, 0u, dims.cells == 0u);
}

fn stored_whole4(v: vec4<u32>) -> vec4<u32> {
    return select(v, vec4<u32>(0u), dims.cells == 0u);
}

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;             // [R, N, D] f32 bits or f16 pairs
@group(0) @binding(2) var<storage, read> anchor_codes: array<u32>;  // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(3) var<storage, read> recon: array<u32>;         // [R, N, D] f32 bits or f16 pairs
@group(0) @binding(4) var<storage, read_write> params: array<u32>;  // [R, n_groups, O] (scale, zero)
@group(0) @binding(5) var<storage, read_write> codes: array<u32>;   // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(6) var<storage, read_write> res_params: array<u32>; // [R, n_groups, O]
@group(0) @binding(7) var<storage, read_write> res_codes: array<u32>;  // [R, n_groups, rwpg, O], RES_BITS-bit

// The same buffers as 16-byte vectors, for the `*8` entry points only (an entry point may use
// one variable per binding): their 8 channels' values and codes are whole, aligned vectors
// (D and the x stride are multiples of 8), and llvmpipe loads or stores a vector per lane
// where it would move its words one by one.
@group(0) @binding(1) var<storage, read> x4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> anchor_codes4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> params4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> codes4: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read_write> res_params4: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read_write> res_codes4: array<vec4<u32>>;

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
        params[2u * id] = stored_whole(bitcast<u32>(p.x));
        params[2u * id + 1u] = stored_whole(bitcast<u32>(p.y));
        return p;
    }
    let packed = pack2x16float(p);
    params[id] = stored_whole(packed);
    return unpack2x16float(packed);
}

fn store_res_params(id: u32, p: vec2<f32>) -> vec2<f32> {
    if PARAMS_F32 {
        res_params[2u * id] = stored_whole(bitcast<u32>(p.x));
        res_params[2u * id + 1u] = stored_whole(bitcast<u32>(p.y));
        return p;
    }
    let packed = pack2x16float(p);
    res_params[id] = stored_whole(packed);
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
            codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
            pack_carry(&pk, code, BITS);
        }
    }
    if pk.off > 0u {
        codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
    }
}

// ---- Lloyd-Max levels (groups along D, whole groups) ----
// A cell's code of member v is the number of level midpoints b with v >= b * norm (the norm
// is the group's L2 norm, summed in member order; no division, as the CPU twin decides it),
// and x^ = norm * level[code]. The cell keeps only its norm: f32 at word pid, or f16 half o
// of row (r, g), each row starting a word. The invocation of an even o writes both halves
// of its word (the odd neighbour's norm recomputed) when that neighbour is in the block;
// an invocation alone in its word merges its half into what the word holds.

fn level(i: u32) -> f32 {
    return dims.levels[i / 4u][i % 4u];
}

fn cell_norm(c: Cell) -> f32 {
    var sum = 0.0;
    for (var i = 0u; i < c.valid; i++) {
        let v = load_x(member(c, i));
        sum += v * v;
    }
    return sqrt(sum);
}

fn level_code(v: f32, norm: f32) -> u32 {
    var code = 0u;
    for (var i = 0u; i + 1u < (1u << BITS); i++) {
        let b = (level(i) + level(i + 1u)) * 0.5;
        code += select(0u, 1u, v >= b * norm);
    }
    return code;
}

// The norm of the cell at block other-index bo + 1 (the same row and group).
fn next_norm(c: Cell) -> f32 {
    var n = c;
    n.bo += 1u;
    n.o += 1u;
    return cell_norm(n);
}

fn store_norm(c: Cell, norm: f32) {
    if PARAMS_F32 {
        params[c.pid] = stored_whole(bitcast<u32>(norm));
        return;
    }
    let row_words = (dims.other + 1u) / 2u;
    let at = (c.r * dims.n_groups + c.g) * row_words + c.o / 2u;
    let odd = c.o % 2u == 1u;
    let next_in_block = c.bo + 1u < dims.block_other;
    if odd && c.bo > 0u {
        return;  // the even neighbour writes this word
    }
    if !odd && next_in_block {
        params[at] = stored_whole(pack2x16float(vec2<f32>(norm, next_norm(c))));
        return;
    }
    let held = unpack2x16float(params[at]);
    if odd {
        params[at] = stored_whole(pack2x16float(vec2<f32>(held.x, norm)));
    } else if c.o + 1u < dims.other {
        params[at] = stored_whole(pack2x16float(vec2<f32>(norm, held.y)));
    } else {
        params[at] = stored_whole(pack2x16float(vec2<f32>(norm, 0.0)));
    }
}

// quantize_codes with Lloyd-Max levels: a norm and the codes of each cell.
@compute @workgroup_size(WG)
fn quantize_levels(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    let norm = cell_norm(c);
    store_norm(c, norm);
    var pk = Packer(0u, 0u, 0u);
    for (var i = 0u; i < GROUP; i++) {
        let code = level_code(load_x(member(c, i)), norm);
        if pack_push(&pk, code, BITS) {
            codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
            pack_carry(&pk, code, BITS);
        }
    }
    if pk.off > 0u {
        codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
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
            codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
            pack_carry(&pk, code, BITS);
        }
    }
    if pk.off > 0u {
        codes[word_index(c, dims.words_per_group, pk.w)] = stored_whole(pk.acc);
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
            res_codes[word_index(c, dims.res_words_per_group, pk.w)] = stored_whole(pk.acc);
            pack_carry(&pk, code, RES_BITS);
        }
    }
    if pk.off > 0u {
        res_codes[word_index(c, dims.res_words_per_group, pk.w)] = stored_whole(pk.acc);
    }
}

// ---- 8 channels per invocation (groups along tokens, D a multiple of 8) ----
// The same numerics as the kernels above, one invocation per (row, group, 8 consecutive
// channels): every word of x it loads holds values it uses (two channels per f16 word), and
// the 8 channels' codes and params go out as runs of consecutive words.

struct Cell8 {
    id: u32,
    r: u32,
    g: u32,      // page group
    bg: u32,     // block group
    c0: u32,     // first channel
    valid: u32,  // real (unpadded) members
}

fn cell8_of(wg: vec3<u32>, lid: u32) -> Cell8 {
    var c: Cell8;
    c.id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let blocks = dims.dim / 8u;
    c.c0 = (c.id % blocks) * 8u;
    c.bg = (c.id / blocks) % dims.block_groups;
    c.r = c.id / (blocks * dims.block_groups);
    c.g = dims.t0 / GROUP + c.bg;
    c.valid = min(GROUP, dims.n - c.bg * GROUP);
    return c;
}

fn round_f16x4(v: vec4<f32>) -> vec4<f32> {
    // Round to nearest even at f16 precision with integer ops (cheaper than pack/unpack on
    // some drivers): normal f16 range by mantissa rounding, subnormals to multiples of 2^-24,
    // past the largest finite f16 to infinity (as a conversion does).
    let u = bitcast<vec4<u32>>(v);
    let normal = bitcast<vec4<f32>>((u + vec4<u32>(0xfffu) + ((u >> vec4<u32>(13u)) & vec4<u32>(1u))) & vec4<u32>(0xffffe000u));
    let sub = round(v * 16777216.0) * (1.0 / 16777216.0);
    let r = select(normal, sub, abs(v) < vec4<f32>(6.103515625e-05));
    let inf = bitcast<vec4<f32>>((u & vec4<u32>(0x80000000u)) | vec4<u32>(0x7f800000u));
    return select(r, inf, abs(r) > vec4<f32>(65504.0));
}

// f16 bit patterns (low 16 bits) as f32 values, with integer ops (as unpack2x16float).
fn halves_to_f32(h: vec4<u32>) -> vec4<f32> {
    let e = h & vec4<u32>(0x7c00u);
    let sign = (h & vec4<u32>(0x8000u)) << vec4<u32>(16u);
    let normal = bitcast<vec4<f32>>(sign | (((h & vec4<u32>(0x7fffu)) << vec4<u32>(13u)) + vec4<u32>(0x38000000u)));
    let m = vec4<f32>(h & vec4<u32>(0x3ffu)) * (1.0 / 16777216.0);
    let sub = select(m, -m, sign != vec4<u32>(0u));
    let special = bitcast<vec4<f32>>(sign | vec4<u32>(0x7f800000u) | ((h & vec4<u32>(0x3ffu)) << vec4<u32>(13u)));
    return select(select(normal, sub, e == vec4<u32>(0u)), special, e == vec4<u32>(0x7c00u));
}

// Channels c0 .. c0 + 7 of block member i (padding repeats the last real member).
fn load8(c: Cell8, i: u32) -> mat2x4<f32> {
    let t = c.bg * GROUP + min(i, c.valid - 1u);
    let e = (c.r * dims.x_tokens + dims.x_t0 + t) * dims.x_stride + c.c0;
    if IN_F16 {
        let ab = x4[e / 8u];
        let lo = halves_to_f32(ab & vec4<u32>(0xffffu));
        let hi = halves_to_f32(ab >> vec4<u32>(16u));
        return mat2x4<f32>(vec4<f32>(lo.x, hi.x, lo.y, hi.y), vec4<f32>(lo.z, hi.z, lo.w, hi.w));
    }
    var m = mat2x4<f32>(bitcast<vec4<f32>>(x4[e / 4u]), bitcast<vec4<f32>>(x4[e / 4u + 1u]));
    if X_TO_F16 {
        m = mat2x4<f32>(round_f16x4(m[0]), round_f16x4(m[1]));
    }
    return m;
}

// (lo, hi) per channel widened by v.
fn widened8(r: array<mat2x4<f32>, 2>, v: mat2x4<f32>) -> array<mat2x4<f32>, 2> {
    return array<mat2x4<f32>, 2>(
        mat2x4<f32>(min(r[0][0], v[0]), min(r[0][1], v[1])),
        mat2x4<f32>(max(r[1][0], v[0]), max(r[1][1], v[1])),
    );
}

// Min and max of the group's members, per channel (padding members repeat the last real
// one, so they change neither), loaded in a loop: groups wider than KEPT.
fn range8(c: Cell8) -> array<mat2x4<f32>, 2> {
    let first = load8(c, 0u);
    var r = array<mat2x4<f32>, 2>(first, first);
    for (var i = 1u; i < GROUP; i++) {
        r = widened8(r, load8(c, i));
    }
    return r;
}

// (scale, zero) per channel of a range: scales in column 0 (channels 0-3) and 1 (4-7) of the
// first matrix, zeros of the second.
fn fit8(r: array<mat2x4<f32>, 2>, bits: u32) -> array<mat2x4<f32>, 2> {
    let n = vec4<f32>(levels(bits));
    return array<mat2x4<f32>, 2>(
        mat2x4<f32>(max((r[1][0] - r[0][0]) / n, vec4<f32>(SCALE_FLOOR)), max((r[1][1] - r[0][1]) / n, vec4<f32>(SCALE_FLOOR))),
        r[0],
    );
}

fn calibrate8(p: array<mat2x4<f32>, 2>, bits: u32) -> array<mat2x4<f32>, 2> {
    if dims.eta == 0.0 {
        return p;
    }
    let k = dims.eta * levels(bits);
    return array<mat2x4<f32>, 2>(
        mat2x4<f32>((1.0 - 2.0 * dims.eta) * p[0][0], (1.0 - 2.0 * dims.eta) * p[0][1]),
        mat2x4<f32>(p[1][0] + k * p[0][0], p[1][1] + k * p[0][1]),
    );
}

// f16 bit patterns of f32 values rounded to nearest even, as a conversion does, with integer
// ops (pack2x16float converts lane by lane on llvmpipe; materialize.wgsl has the same): the
// mantissa rounded and the exponent rebiased (past the largest finite f16: infinity),
// subnormals as multiples of 2^-24, NaN to a quiet NaN.
fn f16_bits4(v: vec4<f32>) -> vec4<u32> {
    let u = bitcast<vec4<u32>>(v);
    let a = u & vec4<u32>(0x7fffffffu);
    let sign = (u >> vec4<u32>(16u)) & vec4<u32>(0x8000u);
    let rounded = (a + vec4<u32>(0xfffu) + ((a >> vec4<u32>(13u)) & vec4<u32>(1u))) >> vec4<u32>(13u);
    let normal = min(rounded - vec4<u32>(0x1c000u), vec4<u32>(0x7c00u));
    let sub = vec4<u32>(round(abs(v) * 16777216.0));
    let bits = select(select(normal, sub, a < vec4<u32>(0x38800000u)), vec4<u32>(0x7e00u), a > vec4<u32>(0x7f800000u));
    return sign | bits;
}

// Params vector i := v (of `res_params` with `res`).
fn put_params_vec(res: bool, i: u32, v: vec4<u32>) {
    if res {
        res_params4[i] = stored_whole4(v);
    } else {
        params4[i] = stored_whole4(v);
    }
}

// Stores 8 channels' params at cell (r, g, c0..) (of `res_params` with `res`) as two or four
// vectors; returns what storage keeps (f16-rounded unless PARAMS_F32).
fn put_params8(res: bool, c: Cell8, p: array<mat2x4<f32>, 2>) -> array<mat2x4<f32>, 2> {
    let pid = (c.r * dims.n_groups + c.g) * dims.other + c.c0;
    let s = p[0];
    let z = p[1];
    if PARAMS_F32 {
        // (scale, zero) word pairs.
        put_params_vec(res, pid / 2u, bitcast<vec4<u32>>(vec4<f32>(s[0].x, z[0].x, s[0].y, z[0].y)));
        put_params_vec(res, pid / 2u + 1u, bitcast<vec4<u32>>(vec4<f32>(s[0].z, z[0].z, s[0].w, z[0].w)));
        put_params_vec(res, pid / 2u + 2u, bitcast<vec4<u32>>(vec4<f32>(s[1].x, z[1].x, s[1].y, z[1].y)));
        put_params_vec(res, pid / 2u + 3u, bitcast<vec4<u32>>(vec4<f32>(s[1].z, z[1].z, s[1].w, z[1].w)));
        return p;
    }
    // pack2x16float words: scale in the low half, zero in the high one.
    let s0 = f16_bits4(s[0]);
    let s1 = f16_bits4(s[1]);
    let z0 = f16_bits4(z[0]);
    let z1 = f16_bits4(z[1]);
    put_params_vec(res, pid / 4u, s0 | (z0 << vec4<u32>(16u)));
    put_params_vec(res, pid / 4u + 1u, s1 | (z1 << vec4<u32>(16u)));
    return array<mat2x4<f32>, 2>(
        mat2x4<f32>(halves_to_f32(s0), halves_to_f32(s1)),
        mat2x4<f32>(halves_to_f32(z0), halves_to_f32(z1)),
    );
}

fn store_params8(c: Cell8, p: array<mat2x4<f32>, 2>) -> array<mat2x4<f32>, 2> {
    return put_params8(false, c, p);
}

fn store_res_params8(c: Cell8, p: array<mat2x4<f32>, 2>) {
    put_params8(true, c, p);
}

fn quant8(v: mat2x4<f32>, p: array<mat2x4<f32>, 2>, bits: u32) -> array<vec4<u32>, 2> {
    let n = vec4<f32>(levels(bits));
    return array<vec4<u32>, 2>(
        vec4<u32>(clamp(round((v[0] - p[1][0]) / p[0][0]), vec4<f32>(0.0), n)),
        vec4<u32>(clamp(round((v[1] - p[1][1]) / p[0][1]), vec4<f32>(0.0), n)),
    );
}

// Index of word w of 8-channel cell c in codes [R, groups, wpg, O] (its first channel).
fn word_index8(c: Cell8, wpg: u32, w: u32) -> u32 {
    return ((c.r * dims.n_groups + c.g) * wpg + w) * dims.other + c.c0;
}

// Stores word w of the 8 channels' codes: into `res_codes` with `res`, else `codes`.
fn store_word8(c: Cell8, w: u32, word: array<vec4<u32>, 2>, res: bool) {
    if res {
        let at = word_index8(c, dims.res_words_per_group, w) / 4u;
        res_codes4[at] = stored_whole4(word[0]);
        res_codes4[at + 1u] = stored_whole4(word[1]);
        return;
    }
    let at = word_index8(c, dims.words_per_group, w) / 4u;
    codes4[at] = stored_whole4(word[0]);
    codes4[at + 1u] = stored_whole4(word[1]);
}

// A bit-stream writer for 8 channels at once (the same offsets in every channel).
struct Packer8 {
    acc: array<vec4<u32>, 2>,
    off: u32,
    w: u32,
}

// Appends 8 codes; the packer's word goes out whenever it fills, the rest of a code that
// did not fit starts the next one (`finish8` stores a last, partial word).
fn pack8(c: Cell8, pk: ptr<function, Packer8>, code: array<vec4<u32>, 2>, bits: u32, res: bool) {
    let off = vec4<u32>((*pk).off);
    (*pk).acc[0] |= code[0] << off;
    (*pk).acc[1] |= code[1] << off;
    (*pk).off += bits;
    if (*pk).off >= 32u {
        store_word8(c, (*pk).w, (*pk).acc, res);
        (*pk).off -= 32u;
        (*pk).w += 1u;
        let carry = (*pk).off > 0u;
        let shift = vec4<u32>(bits - (*pk).off);
        (*pk).acc[0] = select(vec4<u32>(0u), code[0] >> shift, carry);
        (*pk).acc[1] = select(vec4<u32>(0u), code[1] >> shift, carry);
    }
}

fn finish8(c: Cell8, pk: Packer8, res: bool) {
    if pk.off > 0u {
        store_word8(c, pk.w, pk.acc, res);
    }
}

// ---- A group of up to KEPT members in registers ----
// llvmpipe keeps a function's arrays in registers only where every index is a constant; an
// array indexed by a loop counter is read and written lane by lane in memory. Walks over a
// kept group are therefore written out quad by quad, every index a constant once inlined
// (on the benchmark's groups of 32 that made quantize 1.4x and the fused reuse fit 1.9x as
// fast as loops over a private array). Members past GROUP are never used: GROUP is a
// constant, so the guards fold away.

// Members a `*8` kernel keeps in registers between its walks over a group (groups up to
// this size; wider ones walk it in loops and load their members again).
const KEPT: u32 = 32u;

// 4 consecutive members' 8 channels.
alias Quad8 = array<mat2x4<f32>, 4>;
// Members 0 .. KEPT - 1 of a group, 4 per quad.
alias Members8 = array<Quad8, 8>;
// Code words 0 .. 7 of a group's 8 channels (KEPT members of up to 8 bits).
alias Words8 = array<array<vec4<u32>, 2>, 8>;

// Members first .. first + 3 (none past GROUP: a quad that starts there is zero, and
// members of a partial quad past GROUP repeat the last real member, as padding does).
fn load_quad8(c: Cell8, first: u32) -> Quad8 {
    if first >= GROUP {
        return Quad8();
    }
    return Quad8(load8(c, first), load8(c, first + 1u), load8(c, first + 2u), load8(c, first + 3u));
}

fn load_members8(c: Cell8) -> Members8 {
    return Members8(
        load_quad8(c, 0u), load_quad8(c, 4u), load_quad8(c, 8u), load_quad8(c, 12u),
        load_quad8(c, 16u), load_quad8(c, 20u), load_quad8(c, 24u), load_quad8(c, 28u),
    );
}

// (lo, hi) widened by member i (unchanged past GROUP).
fn widen8(r: array<mat2x4<f32>, 2>, v: mat2x4<f32>, i: u32) -> array<mat2x4<f32>, 2> {
    if i >= GROUP {
        return r;
    }
    return widened8(r, v);
}

fn widen_quad8(r: array<mat2x4<f32>, 2>, q: Quad8, first: u32) -> array<mat2x4<f32>, 2> {
    return widen8(widen8(widen8(widen8(r, q[0], first), q[1], first + 1u), q[2], first + 2u), q[3], first + 3u);
}

// Min and max of a kept group's members, per channel.
fn range_members8(m: Members8) -> array<mat2x4<f32>, 2> {
    var r = array<mat2x4<f32>, 2>(m[0][0], m[0][0]);
    r = widen_quad8(r, m[0], 0u);
    r = widen_quad8(r, m[1], 4u);
    r = widen_quad8(r, m[2], 8u);
    r = widen_quad8(r, m[3], 12u);
    r = widen_quad8(r, m[4], 16u);
    r = widen_quad8(r, m[5], 20u);
    r = widen_quad8(r, m[6], 24u);
    return widen_quad8(r, m[7], 28u);
}

// Puts member i's codes at bit i * bits of the group's stream (none past GROUP) and stores
// each word as it fills (into `res_codes` with `res`).
fn put_codes8(c: Cell8, w: ptr<function, Words8>, i: u32, code: array<vec4<u32>, 2>, bits: u32, res: bool) {
    if i >= GROUP {
        return;
    }
    let k = i * bits / 32u;
    let off = (i * bits) % 32u;
    (*w)[k][0] |= code[0] << vec4<u32>(off);
    (*w)[k][1] |= code[1] << vec4<u32>(off);
    if off + bits > 32u {
        (*w)[k + 1u][0] |= code[0] >> vec4<u32>(32u - off);
        (*w)[k + 1u][1] |= code[1] >> vec4<u32>(32u - off);
    }
    let last = i + 1u == GROUP;
    if off + bits >= 32u || last {
        store_word8(c, k, (*w)[k], res);
    }
    if off + bits > 32u && last {
        store_word8(c, k + 1u, (*w)[k + 1u], res);
    }
}

fn put_quad8(c: Cell8, w: ptr<function, Words8>, q: Quad8, first: u32, p: array<mat2x4<f32>, 2>, bits: u32, res: bool) {
    put_codes8(c, w, first, quant8(q[0], p, bits), bits, res);
    put_codes8(c, w, first + 1u, quant8(q[1], p, bits), bits, res);
    put_codes8(c, w, first + 2u, quant8(q[2], p, bits), bits, res);
    put_codes8(c, w, first + 3u, quant8(q[3], p, bits), bits, res);
}

// Stores the codes of a kept group quantized with params p (into `res_codes` with `res`).
fn store_codes_members8(c: Cell8, m: Members8, p: array<mat2x4<f32>, 2>, bits: u32, res: bool) {
    var w: Words8;
    put_quad8(c, &w, m[0], 0u, p, bits, res);
    put_quad8(c, &w, m[1], 4u, p, bits, res);
    put_quad8(c, &w, m[2], 8u, p, bits, res);
    put_quad8(c, &w, m[3], 12u, p, bits, res);
    put_quad8(c, &w, m[4], 16u, p, bits, res);
    put_quad8(c, &w, m[5], 20u, p, bits, res);
    put_quad8(c, &w, m[6], 24u, p, bits, res);
    put_quad8(c, &w, m[7], 28u, p, bits, res);
}

// Word k of the anchor's codes of the group when the group has more than k (n) words, else
// zero.
fn anchor_word8(c: Cell8, k: u32, n: u32) -> array<vec4<u32>, 2> {
    if k >= n {
        return array<vec4<u32>, 2>();
    }
    return anchor_words8(c, k);
}

// The anchor's code words of the group (BITS-bit; the words past its last are zero).
fn anchor_members8(c: Cell8) -> Words8 {
    let n = (GROUP * BITS + 31u) / 32u;
    return Words8(
        anchor_word8(c, 0u, n), anchor_word8(c, 1u, n), anchor_word8(c, 2u, n), anchor_word8(c, 3u, n),
        anchor_word8(c, 4u, n), anchor_word8(c, 5u, n), anchor_word8(c, 6u, n), anchor_word8(c, 7u, n),
    );
}

// quantize_codes, 8 channels per invocation.
@compute @workgroup_size(WG)
fn quantize8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell8_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    if GROUP <= KEPT {
        let m = load_members8(c);
        let p = fit8(range_members8(m), BITS);
        store_params8(c, calibrate8(p, BITS));
        store_codes_members8(c, m, p, BITS, false);
        return;
    }
    let p = fit8(range8(c), BITS);
    store_params8(c, calibrate8(p, BITS));
    var pk: Packer8;
    for (var i = 0u; i < GROUP; i++) {
        pack8(c, &pk, quant8(load8(c, i), p, BITS), BITS, false);
    }
    finish8(c, pk, false);
}

// compute_reuse_params, 8 channels per invocation.
@compute @workgroup_size(WG)
fn fit_params8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell8_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    store_params8(c, calibrate8(fit8(range8(c), BITS), BITS));
}

// The anchor's codes of member i for the 8 channels, from `words` (the 8 channels' word
// holding member i; BITS divides 32, so a code never straddles words).
fn anchor_codes8(words: array<vec4<u32>, 2>, i: u32) -> mat2x4<f32> {
    let off = vec4<u32>((i * BITS) % 32u);
    let mask = vec4<u32>((1u << BITS) - 1u);
    return mat2x4<f32>(vec4<f32>((words[0] >> off) & mask), vec4<f32>((words[1] >> off) & mask));
}

fn anchor_words8(c: Cell8, w: u32) -> array<vec4<u32>, 2> {
    let at = word_index8(c, dims.words_per_group, w) / 4u;
    return array<vec4<u32>, 2>(anchor_codes4[at], anchor_codes4[at + 1u]);
}

// x - (anchor codes * own scale + zero, rounded like the output) for member i.
fn residual8(v: mat2x4<f32>, code: mat2x4<f32>, own: array<mat2x4<f32>, 2>) -> mat2x4<f32> {
    var r0 = code[0] * own[0][0] + own[1][0];
    var r1 = code[1] * own[0][1] + own[1][1];
    if ROUND_F16 {
        r0 = round_f16x4(r0);
        r1 = round_f16x4(r1);
    }
    return mat2x4<f32>(v[0] - r0, v[1] - r1);
}

// Codes of at most 2 bits take 4 values: their reconstructions (rounded like the output),
// computed once per group instead of once per member.
fn levels8(own: array<mat2x4<f32>, 2>) -> array<mat2x4<f32>, 4> {
    let zero = mat2x4<f32>();
    return array<mat2x4<f32>, 4>(
        residual8(zero, mat2x4<f32>(vec4<f32>(0.0), vec4<f32>(0.0)), own),
        residual8(zero, mat2x4<f32>(vec4<f32>(1.0), vec4<f32>(1.0)), own),
        residual8(zero, mat2x4<f32>(vec4<f32>(2.0), vec4<f32>(2.0)), own),
        residual8(zero, mat2x4<f32>(vec4<f32>(3.0), vec4<f32>(3.0)), own),
    );
}

// x - the level of member i's codes in `words` (levels8 holds -level), picked by the codes'
// bits.
fn residual_of_levels8(v: mat2x4<f32>, words: array<vec4<u32>, 2>, i: u32, l: array<mat2x4<f32>, 4>) -> mat2x4<f32> {
    let off = vec4<u32>((i * BITS) % 32u);
    let c0 = words[0] >> off;
    let c1 = words[1] >> off;
    let zero = vec4<u32>(0u);
    let odd0 = (c0 & vec4<u32>(1u)) != zero;
    let odd1 = (c1 & vec4<u32>(1u)) != zero;
    let high0 = (c0 & vec4<u32>(((1u << BITS) - 1u) & 2u)) != zero;
    let high1 = (c1 & vec4<u32>(((1u << BITS) - 1u) & 2u)) != zero;
    let n0 = select(select(l[0][0], l[1][0], odd0), select(l[2][0], l[3][0], odd0), high0);
    let n1 = select(select(l[0][1], l[1][1], odd1), select(l[2][1], l[3][1], odd1), high1);
    return mat2x4<f32>(v[0] + n0, v[1] + n1);
}

// Member v's residual against the anchor's code in `words` (its word) and the own params.
// Padding members repeat the last real member and the anchor padded its group alike, so
// their residuals repeat the last real one's.
fn member_residual8(v: mat2x4<f32>, words: array<vec4<u32>, 2>, i: u32, own: array<mat2x4<f32>, 2>, l: array<mat2x4<f32>, 4>) -> mat2x4<f32> {
    if BITS <= 2u {
        return residual_of_levels8(v, words, i, l);
    }
    return residual8(v, anchor_codes8(words, i), own);
}

// A kept quad's residuals (members past GROUP: zero, never used).
fn residual_quad8(q: Quad8, first: u32, a: Words8, own: array<mat2x4<f32>, 2>, l: array<mat2x4<f32>, 4>) -> Quad8 {
    if first >= GROUP {
        return Quad8();
    }
    var d: Quad8;
    d[0] = member_residual8(q[0], a[first * BITS / 32u], first, own, l);
    d[1] = member_residual8(q[1], a[(first + 1u) * BITS / 32u], first + 1u, own, l);
    d[2] = member_residual8(q[2], a[(first + 2u) * BITS / 32u], first + 2u, own, l);
    d[3] = member_residual8(q[3], a[(first + 3u) * BITS / 32u], first + 3u, own, l);
    return d;
}

// The fused reuse path, 8 channels per invocation (BITS divides 32).
@compute @workgroup_size(WG)
fn reuse_fit8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = cell8_of(wg, lid);
    if c.id >= dims.cells {
        return;
    }
    if GROUP <= KEPT {
        let m = load_members8(c);
        let own = store_params8(c, calibrate8(fit8(range_members8(m), BITS), BITS));
        let a = anchor_members8(c);
        let l = levels8(own);
        let d = Members8(
            residual_quad8(m[0], 0u, a, own, l), residual_quad8(m[1], 4u, a, own, l),
            residual_quad8(m[2], 8u, a, own, l), residual_quad8(m[3], 12u, a, own, l),
            residual_quad8(m[4], 16u, a, own, l), residual_quad8(m[5], 20u, a, own, l),
            residual_quad8(m[6], 24u, a, own, l), residual_quad8(m[7], 28u, a, own, l),
        );
        let rp = fit8(range_members8(d), RES_BITS);
        store_res_params8(c, rp);
        store_codes_members8(c, d, rp, RES_BITS, true);
        return;
    }
    let own = store_params8(c, calibrate8(fit8(range8(c), BITS), BITS));
    let per_word = 32u / BITS;
    let l = levels8(own);
    var r: array<mat2x4<f32>, 2>;   // the residuals' (lo, hi)
    var words = anchor_words8(c, 0u);
    for (var i = 0u; i < GROUP; i++) {
        if i > 0u && i % per_word == 0u {
            words = anchor_words8(c, i / per_word);
        }
        let d = member_residual8(load8(c, i), words, i, own, l);
        if i == 0u {
            r = array<mat2x4<f32>, 2>(d, d);
        } else {
            r = widened8(r, d);
        }
    }
    let rp = fit8(r, RES_BITS);
    store_res_params8(c, rp);
    var pk: Packer8;
    words = anchor_words8(c, 0u);
    for (var i = 0u; i < GROUP; i++) {
        if i > 0u && i % per_word == 0u {
            words = anchor_words8(c, i / per_word);
        }
        pack8(c, &pk, quant8(member_residual8(load8(c, i), words, i, own, l), rp, RES_BITS), RES_BITS, true);
    }
    finish8(c, pk, true);
}
