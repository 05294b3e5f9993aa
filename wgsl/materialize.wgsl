// Materialising kernel: writes a block's reconstruction, or a full-precision window's tokens,
// into an output tensor. The output is [R, out_tokens, D] (f32, or f16 pairs in u32 words);
// block token t goes to output token out_t0 + t. The block's elements form `regions` disjoint
// runs in the output (one per row, or a single run when the rows are contiguous).
// `materialize` decodes any geometry element by element, specialised by KIND; `dequant8`,
// `dequant4` and `ring8` are its vector paths for the geometries they name (the host picks
// one). The bind group layout is explicit and holds every binding (unused ones get a 4-byte
// placeholder).
// One invocation owns RUN consecutive output elements of a region, aligned to whole words,
// so no two invocations of a dispatch share a word; a word only half inside the region keeps
// its other half (written by an earlier dispatch) by read-modify-write.
// Layout of codes and params: src/layout.rs. Block geometry: tokens [t0, t0 + n) of a page
// [R, page_tokens, D], as in group_quant.wgsl.

struct Dims {
    rows: u32,
    dim: u32,             // D
    n_groups: u32,        // groups per row of the page
    other: u32,           // O of the page: D (tokens axis) or page_tokens (channels axis)
    words_per_group: u32, // ceil(GROUP * BITS / 32)
    res_words_per_group: u32, // ceil(GROUP * RES_BITS / 32)
    t0: u32,              // first page token of the block (or first window token)
    n: u32,               // tokens in the block
    out_tokens: u32,      // token rows per row of the output
    out_t0: u32,          // output token of block token 0
    region_len: u32,      // elements per region (n * D, or R * n * D when contiguous)
    region_stride: u32,   // output elements between region starts
    runs_per_region: u32, // invocations per region
    regions: u32,         // 1 or R
    grid_x: u32,          // workgroups along x
    ring_tokens: u32,     // window_out: token slots per row of the ring
    sinks: u32,           // ring8: sink tokens a row, written to output tokens 0 .. sinks
    sink_slots: u32,      // ring8: slots per row of the sink section
    sink_word: u32,       // ring8: word of the ring binding where the sink section starts
    _pad0: u32,
    levels: array<vec4<f32>, 4>, // LEVELS: the 2^BITS Lloyd-Max levels, ascending
}

override BITS: u32 = 2u;
override RES_BITS: u32 = 4u;
override GROUP: u32 = 32u;
override OUT_F16: bool = false;   // out holds f16 pairs; every partial result is rounded to f16
override PARAMS_F32: bool = false;
override AXIS_CHANNELS: bool = false;
override WG: u32 = 256u;
override RUN: u32 = 8u;           // output elements per invocation (even)
override KIND: u32 = 0u;          // 0: dequant; 1: dequant + residual; 2: window (ring) tokens
override LEVELS: bool = false;    // codes index Lloyd-Max levels; params hold one norm per cell

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> codes: array<u32>;      // [R, n_groups, wpg, O], BITS-bit
@group(0) @binding(2) var<storage, read> params: array<u32>;     // [R, n_groups, O] (scale, zero)
@group(0) @binding(3) var<storage, read> res_codes: array<u32>;  // [R, n_groups, rwpg, O], RES_BITS-bit
@group(0) @binding(4) var<storage, read> res_params: array<u32>; // [R, n_groups, O]
@group(0) @binding(5) var<storage, read_write> out: array<u32>;  // [R, out_tokens, D] f32 bits or f16 pairs
@group(0) @binding(6) var<storage, read> ring: array<u32>;       // [R, ring_tokens, D_even / 2] f16 pairs

// The same buffers as 16-byte vectors, for `dequant8` only (an entry point may use one
// variable per binding): its 8 channels' codes, params and outputs are whole, aligned vectors
// (D a multiple of 8), and llvmpipe loads or stores a vector per lane where it would move its
// words one by one.
@group(0) @binding(1) var<storage, read> codes4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> params4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> res_codes4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> res_params4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> out4: array<vec4<u32>>;

// `v`, to be stored. llvmpipe writes storage lane by lane in a loop, and LLVM moves into that
// loop whatever it can recompute per lane from constants (f16 bit patterns): scalar code for
// each lane. A select on a condition it cannot decide (every dispatch has rows) keeps such a
// value one vector, computed once (on lavapipe the f16 dequantize went 0.68 -> 0.95 of the
// copy kernel); a GPU compiler keeps one compare.
fn stored_whole(v: u32) -> u32 {
    return select(v, 0u, dims.rows == 0u);
}

fn stored_whole4(v: vec4<u32>) -> vec4<u32> {
    return select(v, vec4<u32>(0u), dims.rows == 0u);
}

// Position (r, t, d) of an element of the block [R, n, D].
struct Pos {
    r: u32,
    t: u32,
    d: u32,
}

fn pos_of(e: u32) -> Pos {
    let row = e / dims.dim;
    return Pos(row / dims.n, row % dims.n, e % dims.dim);
}

fn advance(p: ptr<function, Pos>) {
    (*p).d += 1u;
    if (*p).d == dims.dim {
        (*p).d = 0u;
        (*p).t += 1u;
        if (*p).t == dims.n {
            (*p).t = 0u;
            (*p).r += 1u;
        }
    }
}

// Where an element's code and params live in the page.
struct Slot {
    cell: u32,   // params index (r * n_groups + g) * O + o
    member: u32, // index within the group
    r: u32,
    g: u32,
    o: u32,
}

fn slot_of(p: Pos) -> Slot {
    var k = dims.t0 + p.t;
    var o = p.d;
    if AXIS_CHANNELS {
        k = p.d;
        o = dims.t0 + p.t;
    }
    let g = k / GROUP;
    return Slot((p.r * dims.n_groups + g) * dims.other + o, k % GROUP, p.r, g, o);
}

// Word index and bit offset of slot `s` in a code buffer of `wpg` words per group.
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

// A cell's norm (LEVELS): word `cell` (f32), or half o of row (r, g), rows starting words.
fn load_norm(s: Slot) -> f32 {
    if PARAMS_F32 {
        return bitcast<f32>(params[s.cell]);
    }
    let row_words = (dims.other + 1u) / 2u;
    return unpack2x16float(params[(s.r * dims.n_groups + s.g) * row_words + s.o / 2u])[s.o % 2u];
}

fn base_value(p: Pos) -> f32 {
    let s = slot_of(p);
    if LEVELS {
        let code = base_code(s);
        return dims.levels[code / 4u][code % 4u] * load_norm(s);
    }
    let q = load_params(s.cell);
    return f32(base_code(s)) * q.x + q.y;
}

fn residual_value(p: Pos) -> f32 {
    let s = slot_of(p);
    let rp = load_res_params(s.cell);
    let res = round_out(f32(res_code(s)) * rp.x + rp.y);
    return round_out(base_value(p)) + res;
}

fn ring_value(p: Pos) -> f32 {
    let half_dim = (dims.dim + 1u) / 2u;
    let slot = (dims.t0 + p.t) % dims.ring_tokens;
    let w = ring[(p.r * dims.ring_tokens + slot) * half_dim + p.d / 2u];
    return unpack2x16float(w)[p.d & 1u];
}

// The output words one invocation owns, and where its region starts and ends.
struct Run {
    first_word: u32,
    end_word: u32,   // exclusive, clipped to the region
    start: u32,      // region's first output element
    end: u32,        // region's end (exclusive)
    base_e: u32,     // block element of the region's first output element
}

fn run_of(wg: vec3<u32>, lid: u32) -> Run {
    let id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let k = id / dims.runs_per_region;
    let j = id % dims.runs_per_region;
    var r: Run;
    r.start = k * dims.region_stride + dims.out_t0 * dims.dim;
    r.end = r.start + dims.region_len;
    r.base_e = k * dims.region_len;
    if k >= dims.regions {
        r.first_word = 0u;
        r.end_word = 0u;
        return r;
    }
    if OUT_F16 {
        let w0 = r.start / 2u + j * (RUN / 2u);
        r.first_word = w0;
        r.end_word = min(w0 + RUN / 2u, (r.end + 1u) / 2u);
    } else {
        r.first_word = r.start + j * RUN;
        r.end_word = min(r.first_word + RUN, r.end);
    }
    return r;
}

// The first block position an invocation computes.
fn first_pos(r: Run) -> Pos {
    var e = r.first_word;
    if OUT_F16 {
        e = max(2u * r.first_word, r.start);
    }
    return pos_of(r.base_e + e - r.start);
}

// Stores one output word from its halves; `keep` marks halves outside the region, which
// keep what the word holds.
fn store_word(w: u32, v: vec2<f32>, keep: vec2<bool>) {
    if !OUT_F16 {
        out[w] = stored_whole(bitcast<u32>(v.x));
        return;
    }
    var pair = v;
    if keep.x || keep.y {
        let old = unpack2x16float(out[w]);
        pair = select(v, old, keep);
    }
    out[w] = stored_whole(pack2x16float(pair));
}

fn value(p: Pos) -> f32 {
    if KIND == 0u {
        return base_value(p);
    } else if KIND == 1u {
        // A reuse layer: dequant(anchor codes, own params) + dequant(residual), each rounded
        // to the output dtype before the sum (as the reference adds fp16 tensors).
        return residual_value(p);
    }
    return ring_value(p);
}

@compute @workgroup_size(WG)
fn materialize(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = run_of(wg, lid);
    var p = first_pos(r);
    let halves = select(1u, 2u, OUT_F16);
    for (var w = r.first_word; w < r.end_word; w++) {
        var v = vec2<f32>(0.0, 0.0);
        var keep = vec2<bool>(true, true);
        for (var h = 0u; h < halves; h++) {
            let e = w * halves + h;
            if e >= r.start && e < r.end {
                v[h] = value(p);
                keep[h] = false;
                advance(&p);
            }
        }
        store_word(w, v, keep);
    }
}

// ---- A block's reconstruction, 8 channels x a run of tokens per invocation ----
// Groups along tokens, D a multiple of 8: an invocation loads the params of 8 channels once
// and walks the code words of a run of members (one word's members where codes never
// straddle words, 32 members = BITS whole words where they do), writing each token's 8
// channels as whole output words (no read-modify-write). Same values as `materialize` (KIND 0
// or 1).

// Code words at .. at + 7 (at a multiple of 8), of `res_codes` with `res`.
fn words8(res: bool, at: u32) -> array<vec4<u32>, 2> {
    if res {
        return array<vec4<u32>, 2>(res_codes4[at / 4u], res_codes4[at / 4u + 1u]);
    }
    return array<vec4<u32>, 2>(codes4[at / 4u], codes4[at / 4u + 1u]);
}

// Members per invocation of `dequant8`: one code word's, or 32 (BITS words) where codes
// straddle words.
fn run8() -> u32 {
    return select(32u / BITS, 32u, 32u % BITS != 0u);
}

// 8 channels' code words k (lo) and k + 1 (hi, loaded only where a code can straddle them)
// of a group whose word 0 is at `base`, `wpg` words to a group.
struct Walk8 {
    k: u32,
    lo: array<vec4<u32>, 2>,
    hi: array<vec4<u32>, 2>,
}

fn walk8(res: bool, base: u32, k: u32, wpg: u32, bits: u32) -> Walk8 {
    var w = Walk8(k, words8(res, base + k * dims.other), array<vec4<u32>, 2>());
    if 32u % bits != 0u && k + 1u < wpg {
        w.hi = words8(res, base + (k + 1u) * dims.other);
    }
    return w;
}

// The codes of group member m of the walk's 8 channels, moving the walk on to m's word
// (members come in order, so a straddling walk moves one word at a time).
fn member8(w: ptr<function, Walk8>, res: bool, base: u32, m: u32, wpg: u32, bits: u32) -> array<vec4<u32>, 2> {
    let p = m * bits;
    let k = p / 32u;
    if k != (*w).k {
        if 32u % bits == 0u {
            *w = walk8(res, base, k, wpg, bits);
        } else {
            (*w).k = k;
            (*w).lo = (*w).hi;
            if k + 1u < wpg {
                (*w).hi = words8(res, base + (k + 1u) * dims.other);
            }
        }
    }
    let off = p % 32u;
    var c = codes_at8((*w).lo, off, bits);
    if off + bits > 32u {
        let up = vec4<u32>(32u - off);
        let mask = vec4<u32>((1u << bits) - 1u);
        c[0] |= ((*w).hi[0] << up) & mask;
        c[1] |= ((*w).hi[1] << up) & mask;
    }
    return c;
}

// The codes at bit `off` of 8 channels' words (the bits of the word from `off` on).
fn codes_at8(w: array<vec4<u32>, 2>, off: u32, bits: u32) -> array<vec4<u32>, 2> {
    let mask = vec4<u32>((1u << bits) - 1u);
    return array<vec4<u32>, 2>((w[0] >> vec4<u32>(off)) & mask, (w[1] >> vec4<u32>(off)) & mask);
}

// f16 bit patterns (low 16 bits) as f32 values, with integer ops (as unpack2x16float, which
// llvmpipe converts lane by lane); the same as group_quant.wgsl's.
fn halves_to_f32(h: vec4<u32>) -> vec4<f32> {
    let e = h & vec4<u32>(0x7c00u);
    let sign = (h & vec4<u32>(0x8000u)) << vec4<u32>(16u);
    let normal = bitcast<vec4<f32>>(sign | (((h & vec4<u32>(0x7fffu)) << vec4<u32>(13u)) + vec4<u32>(0x38000000u)));
    let m = vec4<f32>(h & vec4<u32>(0x3ffu)) * (1.0 / 16777216.0);
    let sub = select(m, -m, sign != vec4<u32>(0u));
    let special = bitcast<vec4<f32>>(sign | vec4<u32>(0x7f800000u) | ((h & vec4<u32>(0x3ffu)) << vec4<u32>(13u)));
    return select(select(normal, sub, e == vec4<u32>(0u)), special, e == vec4<u32>(0x7c00u));
}

// Params vector i (of `res_params` with `res`).
fn params_vec(res: bool, i: u32) -> vec4<u32> {
    if res {
        return res_params4[i];
    }
    return params4[i];
}

// (scales, zeros) of cells cell .. cell + 7 (cell a multiple of 8), of `res_params` with `res`.
fn params8(res: bool, cell: u32) -> array<mat2x4<f32>, 2> {
    if PARAMS_F32 {
        // (scale, zero) word pairs.
        let a = bitcast<vec4<f32>>(params_vec(res, cell / 2u));
        let b = bitcast<vec4<f32>>(params_vec(res, cell / 2u + 1u));
        let c = bitcast<vec4<f32>>(params_vec(res, cell / 2u + 2u));
        let d = bitcast<vec4<f32>>(params_vec(res, cell / 2u + 3u));
        return array<mat2x4<f32>, 2>(
            mat2x4<f32>(vec4<f32>(a.x, a.z, b.x, b.z), vec4<f32>(c.x, c.z, d.x, d.z)),
            mat2x4<f32>(vec4<f32>(a.y, a.w, b.y, b.w), vec4<f32>(c.y, c.w, d.y, d.w)),
        );
    }
    // pack2x16float words: scale in the low half, zero in the high one.
    let lo = params_vec(res, cell / 4u);
    let hi = params_vec(res, cell / 4u + 1u);
    let mask = vec4<u32>(0xffffu);
    return array<mat2x4<f32>, 2>(
        mat2x4<f32>(halves_to_f32(lo & mask), halves_to_f32(hi & mask)),
        mat2x4<f32>(halves_to_f32(lo >> vec4<u32>(16u)), halves_to_f32(hi >> vec4<u32>(16u))),
    );
}

// 8 channels' codes times scale plus zero.
fn decode8(c: array<vec4<u32>, 2>, p: array<mat2x4<f32>, 2>) -> mat2x4<f32> {
    return mat2x4<f32>(vec4<f32>(c[0]) * p[0][0] + p[1][0], vec4<f32>(c[1]) * p[0][1] + p[1][1]);
}

// The same rounding as group_quant.wgsl's round_f16x4 (a shader module has no includes).
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

// f16 bit patterns of f32 values rounded to nearest even, as a conversion does, with integer
// ops (pack2x16float converts lane by lane on some drivers): the mantissa rounded and the
// exponent rebiased (past the largest finite f16: infinity), subnormals as multiples of
// 2^-24, NaN to a quiet NaN.
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

// Output words of 8 channels' values (f16 pairs, rounded like a conversion).
fn store_halves8(w: u32, v: mat2x4<f32>) {
    let a = f16_bits4(v[0]);
    let b = f16_bits4(v[1]);
    out4[w / 4u] = stored_whole4(vec4<u32>(a.x | (a.y << 16u), a.z | (a.w << 16u), b.x | (b.y << 16u), b.z | (b.w << 16u)));
}

fn round_out4(v: vec4<f32>) -> vec4<f32> {
    if OUT_F16 {
        return round_f16x4(v);
    }
    return v;
}

@compute @workgroup_size(WG)
fn dequant8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let span = run8();
    let blocks = dims.dim / 8u;
    let runs = (dims.n + span - 1u) / span;
    if id >= dims.rows * runs * blocks {
        return;
    }
    let c0 = (id % blocks) * 8u;
    let run = (id / blocks) % runs;
    let r = id / (blocks * runs);
    let pt = dims.t0 + run * span;                    // page token of the run's first member
    let g = pt / GROUP;
    let m0 = pt % GROUP;
    let cell = (r * dims.n_groups + g) * dims.other + c0;
    let own = params8(false, cell);
    let base = (r * dims.n_groups + g) * dims.words_per_group * dims.other + c0;
    var walk = walk8(false, base, m0 * BITS / 32u, dims.words_per_group, BITS);
    var res = own;
    let res_base = (r * dims.n_groups + g) * dims.res_words_per_group * dims.other + c0;
    var res_walk: Walk8;
    if KIND == 1u {
        res = params8(true, cell);
        res_walk = walk8(true, res_base, m0 * RES_BITS / 32u, dims.res_words_per_group, RES_BITS);
    }
    let n = min(span, dims.t0 + dims.n - pt);
    for (var i = 0u; i < n; i++) {
        let m = m0 + i;
        // Codes that never straddle words: the run's one word, shifted (no walk to move).
        var c = codes_at8(walk.lo, i * BITS, BITS);
        if 32u % BITS != 0u {
            c = member8(&walk, false, base, m, dims.words_per_group, BITS);
        }
        var v = decode8(c, own);
        if KIND == 1u {
            // A reuse layer: both terms rounded like the output before the sum.
            let e = decode8(member8(&res_walk, true, res_base, m, dims.res_words_per_group, RES_BITS), res);
            v = mat2x4<f32>(round_out4(v[0]) + round_out4(e[0]), round_out4(v[1]) + round_out4(e[1]));
        }
        let o = (r * dims.out_tokens + dims.out_t0 + pt - dims.t0 + i) * dims.dim + c0;
        store8(o, v);
    }
}

// Output elements o .. o + 7 (o a multiple of 8): f16 pairs, or f32.
fn store8(o: u32, v: mat2x4<f32>) {
    if OUT_F16 {
        store_halves8(o / 2u, v);
    } else {
        out4[o / 4u] = stored_whole4(bitcast<vec4<u32>>(v[0]));
        out4[o / 4u + 1u] = stored_whole4(bitcast<vec4<u32>>(v[1]));
    }
}

// ---- A block grouped along D, 4 tokens x one code word of channels per invocation ----
// BITS dividing 32 and at most 4 (a word's members are 8 or more whole channels), groups
// that start a word and tile D (D a multiple of 8), a block of whole quads of the page's
// tokens (cells): an invocation loads the code word of 4 consecutive tokens as one vector
// and their params, and writes each token's channels of that word as whole output vectors.
// Same values as `materialize` (KIND 0).

// The levels of 4 codes (LEVELS): chosen by selects up to 2 bits, else indexed.
fn levels4(c: vec4<u32>) -> vec4<f32> {
    let l = dims.levels[0];
    if BITS == 1u {
        return select(vec4<f32>(l.x), vec4<f32>(l.y), c == vec4<u32>(1u));
    }
    if BITS == 2u {
        let odd = (c & vec4<u32>(1u)) != vec4<u32>(0u);
        return select(select(vec4<f32>(l.x), vec4<f32>(l.y), odd), select(vec4<f32>(l.z), vec4<f32>(l.w), odd), c >= vec4<u32>(2u));
    }
    return vec4<f32>(dims.levels[c.x / 4u][c.x % 4u], dims.levels[c.y / 4u][c.y % 4u],
                     dims.levels[c.z / 4u][c.z % 4u], dims.levels[c.w / 4u][c.w % 4u]);
}

// Cell o's (scale, zero) in group g of row r, or (norm, 0) with LEVELS.
fn cell_params(r: u32, g: u32, o: u32) -> vec2<f32> {
    if LEVELS {
        return vec2<f32>(load_norm(Slot((r * dims.n_groups + g) * dims.other + o, 0u, r, g, o)), 0.0);
    }
    return load_params((r * dims.n_groups + g) * dims.other + o);
}

// Members 4 j .. 4 j + 3 of code word `word`, decoded with `p`.
fn decode4(word: u32, j: u32, p: vec2<f32>) -> vec4<f32> {
    let shifts = vec4<u32>(4u * j * BITS) + vec4<u32>(0u, BITS, 2u * BITS, 3u * BITS);
    let c = (vec4<u32>(word) >> shifts) & vec4<u32>((1u << BITS) - 1u);
    if LEVELS {
        return levels4(c) * p.x;
    }
    return vec4<f32>(c) * p.x + p.y;
}

@compute @workgroup_size(WG)
fn dequant4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let per_word = 32u / BITS;
    let words = dims.n_groups * dims.words_per_group; // code words of a token
    let quads = dims.n / 4u;
    if id >= dims.rows * quads * words {
        return;
    }
    let wi = id % words;
    let quad = (id / words) % quads;
    let r = id / (words * quads);
    let g = wi / dims.words_per_group;
    let k = wi % dims.words_per_group;
    let o0 = dims.t0 + 4u * quad;                     // page token (cell) of the quad's first
    let c0 = g * GROUP + k * per_word;                // first channel of the word
    let cw = codes4[(((r * dims.n_groups + g) * dims.words_per_group + k) * dims.other + o0) / 4u];
    for (var t = 0u; t < 4u; t++) {
        let p = cell_params(r, g, o0 + t);
        let o = (r * dims.out_tokens + dims.out_t0 + 4u * quad + t) * dims.dim + c0;
        for (var j = 0u; j < per_word / 8u; j++) {
            store8(o + 8u * j, mat2x4<f32>(decode4(cw[t], 2u * j, p), decode4(cw[t], 2u * j + 1u, p)));
        }
    }
}

// ---- Window tokens, one token x 8 channels per invocation ----
// D a multiple of 8: an invocation moves one 16-byte vector of the ring's halves into the
// output (as it is, or as 8 f32). Same values as `materialize` (KIND 2). The ring's sinks
// (`sinks` a row, in their section of the same buffer) come first in the same launch.

@group(0) @binding(6) var<storage, read> ring4: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn ring8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let blocks = dims.dim / 8u;
    let sink_ids = dims.rows * dims.sinks * blocks;
    if id >= sink_ids + dims.rows * dims.n * blocks {
        return;
    }
    let sink = id < sink_ids;
    let j = select(id - sink_ids, id, sink);
    let per_row = select(dims.n, dims.sinks, sink);
    let c0 = (j % blocks) * 8u;
    let t = (j / blocks) % per_row;
    let r = j / (blocks * per_row);
    let slot = (dims.t0 + t) % dims.ring_tokens;
    let window_at = ((r * dims.ring_tokens + slot) * dims.dim + c0) / 8u;
    let sink_at = dims.sink_word / 4u + ((r * dims.sink_slots + t) * dims.dim + c0) / 8u;
    let h = ring4[select(window_at, sink_at, sink)];
    let o = (r * dims.out_tokens + select(dims.out_t0, 0u, sink) + t) * dims.dim + c0;
    if OUT_F16 {
        out4[o / 8u] = stored_whole4(h);
    } else {
        store8(o, halves8(h));
    }
}

// The 8 halves of 4 words as f32 values, in order.
fn halves8(w: vec4<u32>) -> mat2x4<f32> {
    let lo = halves_to_f32(w & vec4<u32>(0xffffu));
    let hi = halves_to_f32(w >> vec4<u32>(16u));
    return mat2x4<f32>(vec4<f32>(lo.x, hi.x, lo.y, hi.y), vec4<f32>(lo.z, hi.z, lo.w, hi.w));
}
