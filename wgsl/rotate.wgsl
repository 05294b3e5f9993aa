// The randomized Walsh–Hadamard rotation of head vectors (CPU twin:
// src/reference/rotation.rs): y = H (s ⊙ x) / √D, or its inverse x = s ⊙ (H y) / √D, with
// ±1 signs s hashed from a seed per stream (a layer's keys or values, one KV head). One
// invocation rotates one vector of D elements (a power of two, at most MAX_DIM), 4 elements
// at a time: no workgroup memory and no barriers (a decode step rotates a few vectors per
// layer; on lavapipe a vector spread over D / 4 invocations, its butterflies met in
// workgroup memory or each invocation summing the whole vector, was slower). From 8 to
// HELD_DIM the pipeline is built for its D and holds the vector in registers (`rotate_held`,
// `held_*`, 8 elements a 16-byte load or store; it also rotates a cache's fetch back as it
// reads a ring, FROM_RING, or decodes Lloyd-Max codes, FROM_LEVELS); any other D in a private
// array (`rotate_vectors`).
struct Dims {
    vectors: u32,   // vectors to rotate
    dim: u32,       // D
    head_div: u32,  // vector i is of head (i / head_div) % heads: T heads-major, 1 token-major
    heads: u32,
    gqa: u32,       // heads per KV head (queries), 1 for K/V
    stream: u32,    // (layer << 16) | (kind << 15): the sign streams' high bits
    rot_seed: u32,  // the rotation's seed
    grid_x: u32,    // workgroups along x
    split: u32,     // vectors i >= split are a second tensor's (PAIR): from x2, into y at y2
    stream2: u32,   // the second tensor's streams' high bits
    y2: u32,        // element of y where the second tensor's vectors start
    ring_tokens: u32, // TO_RING, FROM_RING: slots per row of the ring
    ring_t0: u32,   // TO_RING, FROM_RING: absolute token of each row's first vector (slot % ring_tokens)
    dense_tokens: u32, // TO_RING, FROM_*: token rows per row of the dense tensor (x, or y)
    dense_t0: u32,  // TO_RING, FROM_*: its token of each row's first vector
    other: u32,     // FROM_LEVELS: tokens (cells) per row of the page's codes
    page_t0: u32,   // FROM_LEVELS: page token of each row's first vector
    sinks: u32,     // FROM_RING: the ring's sink tokens a row, vectors from `split` on, into
                    // the dense tokens 0 .. sinks
    sink_slots: u32, // FROM_RING: slots per row of the sink section
    sink_word: u32, // FROM_RING: word of x where the sink section starts
    levels: array<vec4<f32>, 4>, // FROM_LEVELS: the 2^BITS Lloyd-Max levels, ascending
}

override WG: u32 = 64u;         // 8 on a CPU adapter (ROTATE_WG_CPU): one SIMD group
override IN_F16: bool = false;   // x holds halves
override OUT_F16: bool = false;  // y holds halves
override IN_PLACE: bool = false; // read y and write it back (x unused)
override INVERSE: bool = false;  // undo the rotation
override PAIR: bool = false;     // two tensors of as many vectors (an append's keys and values)
override TO_RING: bool = false;  // x's tokens [x_t0, x_t0 + head_div) of each row into the f16
                                 // ring y [rows, ring_tokens, D / 2] (OUT_F16), slot by slot
override ROUND_IN: bool = false; // f32 x values are rounded to f16 as they load: a cache rotates
                                 // what it holds (what an f16 cache would), whichever route
override PLAIN_FIRST: bool = false; // PAIR: the first tensor is copied as it is, not rotated (a
                                    // cache whose keys are not rotated and values are)
override FROM_RING: bool = false; // rotate_held: x is an f16 ring (as y with TO_RING), y dense
override FROM_LEVELS: bool = false; // rotate_held: x holds a page's Lloyd-Max codes grouped along
                                    // D (BITS of 1, 2 or 4, groups of GROUP that start a word
                                    // and tile D), x2 their norms (PARAMS_F32: f32, else halves)
override BITS: u32 = 2u;
override GROUP: u32 = 64u;
override PARAMS_F32: bool = false;
override DIM: u32 = 0u;          // D when the pipeline is built for one (a power of two from 8 to
                                 // HELD_DIM): `rotate_held` holds the vector in registers

const MAX_DIM: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;        // [vectors, D] f32 or halves
@group(0) @binding(2) var<storage, read_write> y: array<u32>;  // [vectors, D] f32 or halves
@group(0) @binding(3) var<storage, read> x2: array<u32>;       // PAIR: the second tensor
@group(0) @binding(4) var<storage, read_write> y_pair: array<u32>; // PAIR with TO_RING: the second
                                                                 // tensor's ring (as y)

fn mix(a: u32) -> u32 {
    var h = a;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

fn sign_of(stream: u32, d: u32) -> f32 {
    return select(1.0, -1.0, (mix(dims.rot_seed ^ mix(stream ^ mix(d))) & 1u) == 1u);
}

// Element e of the input (`second`: of the second tensor, PAIR).
fn load(e: u32, second: bool) -> f32 {
    var w: u32;
    if second {
        w = x2[select(e, e >> 1u, IN_F16)];
        if IN_F16 {
            return unpack2x16float(w)[e & 1u];
        }
        return rounded(bitcast<f32>(w));
    }
    if IN_PLACE {
        w = y[select(e, e >> 1u, OUT_F16)];
        if OUT_F16 {
            return unpack2x16float(w)[e & 1u];
        }
        return bitcast<f32>(w);
    }
    w = x[select(e, e >> 1u, IN_F16)];
    if IN_F16 {
        return unpack2x16float(w)[e & 1u];
    }
    return rounded(bitcast<f32>(w));
}

// `v`, or (ROUND_IN) its f16 rounding.
fn rounded(v: f32) -> f32 {
    if ROUND_IN {
        return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
    }
    return v;
}

// Elements e .. e + 3 of the input (e, e + 1 and zeros when D is 2).
fn load4(e: u32, second: bool, n: u32) -> vec4<f32> {
    if n < 4u {
        return vec4<f32>(load(e, second), load(e + 1u, second), 0.0, 0.0);
    }
    return vec4<f32>(load(e, second), load(e + 1u, second), load(e + 2u, second), load(e + 3u, second));
}

fn signs4(stream: u32, d: u32) -> vec4<f32> {
    return vec4<f32>(sign_of(stream, d), sign_of(stream, d + 1u), sign_of(stream, d + 2u), sign_of(stream, d + 3u));
}

@compute @workgroup_size(WG)
fn rotate_vectors(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.y * dims.grid_x + wg.x) * WG + lid;
    if i >= dims.vectors {
        return;
    }
    let n = dims.dim;
    let second = PAIR && i >= dims.split;
    let k = select(i, i - dims.split, second);
    let head = (k / dims.head_div) % dims.heads;
    let stream = select(dims.stream, dims.stream2, second) | (head / dims.gqa);
    var src = k * n;
    var base = select(src, dims.y2 + src, second);
    if TO_RING {
        src = dense_at(k, n);
        base = slot_at(k, n);
    }
    let n4 = (n + 3u) / 4u;
    if PLAIN_FIRST && !second {
        for (var q = 0u; q < n4; q++) {
            store4(base + 4u * q, load4(src + 4u * q, false, n), n, false);
        }
        return;
    }
    // The vector as vec4s of 4 consecutive elements (a D of 2 fills half of one): the
    // butterflies of h = 1 and 2 run inside each vec4, the wider ones between vec4s, in the
    // CPU twin's order (each element sees the same sums), a quarter of the indexed accesses.
    var v: array<vec4<f32>, MAX_DIM / 4u>;
    for (var q = 0u; q < n4; q++) {
        v[q] = started4(src, q, second, stream, n);
    }
    for (var h = 1u; h < n4; h *= 2u) { // h counts vec4s: the butterflies of h = 4, 8, ...
        for (var p = 0u; p < n4 / 2u; p++) {
            let j = (p / h) * 2u * h + p % h;
            let a = v[j];
            let b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
    }
    let norm = 1.0 / sqrt(f32(n));
    for (var q = 0u; q < n4; q++) {
        finish4(base, q, v[q] * norm, stream, n, TO_RING && second);
    }
}

// Element 0 of vector k (token k % head_div of row k / head_div) of vectors of n elements
// in the dense tensor (`dense_tokens` tokens a row, from `dense_t0`), and in the ring (token
// `ring_t0 + t` in slot that % `ring_tokens`).
fn dense_at(k: u32, n: u32) -> u32 {
    return ((k / dims.head_div) * dims.dense_tokens + dims.dense_t0 + k % dims.head_div) * n;
}

fn slot_at(k: u32, n: u32) -> u32 {
    return ((k / dims.head_div) * dims.ring_tokens + (dims.ring_t0 + k % dims.head_div) % dims.ring_tokens) * n;
}

// vec4 q of the input (elements 4q ..), signed (forward) and through the butterflies of h = 1
// and 2 (of h = 1 alone where D is 2).
fn started4(src: u32, q: u32, second: bool, stream: u32, n: u32) -> vec4<f32> {
    return started(load4(src + 4u * q, second, n), q, stream, n);
}

// vec4 q of a vector, `e`: signed (forward) and through the butterflies of h = 1 and 2.
fn started(e: vec4<f32>, q: u32, stream: u32, n: u32) -> vec4<f32> {
    var s = e;
    if !INVERSE {
        s *= signs4(stream, 4u * q);
    }
    let h1 = vec4<f32>(s.x + s.y, s.x - s.y, s.z + s.w, s.z - s.w);
    let h2 = vec4<f32>(h1.x + h1.z, h1.y + h1.w, h1.x - h1.z, h1.y - h1.w);
    return select(h1, h2, n >= 4u);
}

// vec4 q of the output, scaled (`e`): signed (inverse) and stored.
fn finish4(base: u32, q: u32, e: vec4<f32>, stream: u32, n: u32, pair: bool) {
    store4(base + 4u * q, finished(e, q, stream), n, pair);
}

// vec4 q of the output, scaled (`e`): signed (inverse).
fn finished(e: vec4<f32>, q: u32, stream: u32) -> vec4<f32> {
    if INVERSE {
        return e * signs4(stream, 4u * q);
    }
    return e;
}

// Word w of the output (`pair`: of the second tensor's ring, y_pair).
fn put(w: u32, value: u32, pair: bool) {
    if pair {
        y_pair[w] = value;
    } else {
        y[w] = value;
    }
}

// Elements at .. at + 3 of the output (at, at + 1 when D is 2).
fn store4(at: u32, e: vec4<f32>, n: u32, pair: bool) {
    if OUT_F16 {
        put(at >> 1u, pack2x16float(e.xy), pair);
        if n >= 4u {
            put((at >> 1u) + 1u, pack2x16float(e.zw), pair);
        }
    } else {
        put(at, bitcast<u32>(e.x), pair);
        put(at + 1u, bitcast<u32>(e.y), pair);
        if n >= 4u {
            put(at + 2u, bitcast<u32>(e.z), pair);
            put(at + 3u, bitcast<u32>(e.w), pair);
        }
    }
}

// ---- A vector held in registers (DIM) ----
// llvmpipe keeps a private array indexed by a loop counter in memory and reads and writes it
// lane by lane (the loops above: half of a rotation's time at D = 64, measured on
// `update_and_fetch`'s inverse rotations). With D fixed the walks are written out, every
// index a constant once inlined and every guard folded by DIM, so the array stays in
// registers: the same butterflies in the same order as the loops. Written out to MAX_DIM
// the code made pipelines slower to build (the test suites' by half) for what D <= 64 gains.

const HELD_DIM: u32 = 64u;      // the largest D held in registers
alias Held = array<vec4<f32>, HELD_DIM / 4u>;

// The same buffers as 16-byte vectors, for `rotate_held` only (an entry point may use one
// variable per binding): a held vector of 8 or more elements moves in whole vectors, which
// llvmpipe loads and stores one per lane where it would move the words one by one.
@group(0) @binding(1) var<storage, read> x4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> x2_4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> y_pair4: array<vec4<u32>>;

// Where a held vector comes from and goes: input element `src`, output element `base`, the
// second tensor's (PAIR), the signs' stream, the second ring (`pair`).
struct HeldIo {
    src: u32,
    base: u32,
    second: bool,
    stream: u32,
    pair: bool,
}

@compute @workgroup_size(WG)
fn rotate_held(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.y * dims.grid_x + wg.x) * WG + lid;
    if i >= dims.vectors {
        return;
    }
    let second = PAIR && i >= dims.split;
    let sink = FROM_RING && i >= dims.split;
    let k = select(i, i - dims.split, second || sink);
    let per_row = select(dims.head_div, max(dims.sinks, 1u), sink);
    let head = (k / per_row) % dims.heads;
    let stream = select(dims.stream, dims.stream2, second) | (head / dims.gqa);
    var io = HeldIo(k * DIM, select(k * DIM, dims.y2 + k * DIM, second), second, stream, TO_RING && second);
    if TO_RING {
        io.src = dense_at(k, DIM);
        io.base = slot_at(k, DIM);
    }
    if FROM_RING {
        let row = k / per_row;
        let sink_src = 2u * dims.sink_word + (row * dims.sink_slots + k % per_row) * DIM;
        io.src = select(slot_at(k, DIM), sink_src, sink);
        io.base = select(dense_at(k, DIM), (row * dims.dense_tokens + k % per_row) * DIM, sink);
    }
    if FROM_LEVELS {
        io.base = dense_at(k, DIM);
    }
    if PLAIN_FIRST && !second {
        for (var e = 0u; e < DIM; e += 8u) {
            store8(io.base + e, load8(io.src + e, false), false);
        }
        return;
    }
    var v: Held;
    if FROM_LEVELS {
        held_levels(&v, io, k / dims.head_div, dims.page_t0 + k % dims.head_div);
    } else {
        held_pairs(&v, io, false);
    }
    held_rotate(&v);
    held_pairs(&v, io, true);
}

// Input vector i (of x2 for the second tensor, of y in place).
fn in_vec(i: u32, second: bool) -> vec4<u32> {
    if second {
        return x2_4[i];
    }
    if IN_PLACE {
        return y4[i];
    }
    return x4[i];
}

// Input elements e .. e + 7 (e a multiple of 8) as two vec4s.
fn load8(e: u32, second: bool) -> mat2x4<f32> {
    let halves = select(IN_F16, OUT_F16, IN_PLACE && !second);
    if halves {
        return halves8(in_vec(e / 8u, second));
    }
    let a = bitcast<vec4<f32>>(in_vec(e / 4u, second));
    let b = bitcast<vec4<f32>>(in_vec(e / 4u + 1u, second));
    if ROUND_IN && !(IN_PLACE && !second) {
        return mat2x4<f32>(round_f16x4(a), round_f16x4(b));
    }
    return mat2x4<f32>(a, b);
}

// Output elements at .. at + 7 (at a multiple of 8; `pair`: of the second ring).
fn store8(at: u32, m: mat2x4<f32>, pair: bool) {
    if OUT_F16 {
        let a = f16_bits4(m[0]);
        let b = f16_bits4(m[1]);
        put4(at / 8u, vec4<u32>(a.x | (a.y << 16u), a.z | (a.w << 16u), b.x | (b.y << 16u), b.z | (b.w << 16u)), pair);
        return;
    }
    put4(at / 4u, bitcast<vec4<u32>>(m[0]), pair);
    put4(at / 4u + 1u, bitcast<vec4<u32>>(m[1]), pair);
}

// Output vector i (`pair`: of y_pair), kept one vector: llvmpipe stores lane by lane, and LLVM
// moves into that loop what it can recompute per lane from constants (the f16 packing); a
// select on a condition it cannot decide (a launch has vectors) keeps it computed once.
fn put4(i: u32, value: vec4<u32>, pair: bool) {
    let v = select(value, vec4<u32>(0u), dims.vectors == 0u);
    if pair {
        y_pair4[i] = v;
    } else {
        y4[i] = v;
    }
}

// vec4s 2p and 2p + 1 of the vector: in (`out` false: loaded, signed, the butterflies of h =
// 1 and 2) or out (scaled, signed, stored).
fn held_pair(v: ptr<function, Held>, p: u32, io: HeldIo, out: bool) {
    if 8u * p >= DIM {
        return;
    }
    if out {
        let norm = 1.0 / sqrt(f32(max(DIM, 1u)));
        let a = finished((*v)[2u * p] * norm, 2u * p, io.stream);
        let b = finished((*v)[2u * p + 1u] * norm, 2u * p + 1u, io.stream);
        store8(io.base + 8u * p, mat2x4<f32>(a, b), io.pair);
        return;
    }
    let m = load8(io.src + 8u * p, io.second);
    (*v)[2u * p] = started(m[0], 2u * p, io.stream, DIM);
    (*v)[2u * p + 1u] = started(m[1], 2u * p + 1u, io.stream, DIM);
}

// Every pair of vec4s of the vector, in or out.
fn held_pairs(v: ptr<function, Held>, io: HeldIo, out: bool) {
    held_pair(v, 0u, io, out);
    held_pair(v, 1u, io, out);
    held_pair(v, 2u, io, out);
    held_pair(v, 3u, io, out);
    held_pair(v, 4u, io, out);
    held_pair(v, 5u, io, out);
    held_pair(v, 6u, io, out);
    held_pair(v, 7u, io, out);
}

// ---- FROM_LEVELS: a token of a page's Lloyd-Max codes, decoded as it is held ----
// A token's code words (D * BITS / 32, 8 at most) and its groups' norms (D / GROUP) are
// loaded once, in walks written out like the vector's, and each vec4 of channels decodes
// from them: norm x level, the values `materialize` writes, rotated back before they are
// rounded to the output.

// Word i of x, of x2 (`norms`).
fn word_at(i: u32, norms: bool) -> u32 {
    if norms {
        return x2_4[i / 4u][i % 4u];
    }
    return x4[i / 4u][i % 4u];
}

alias TokenWords = array<u32, 8>;

// Code words of a group (at least 1: a pipeline that does not decode levels is built too).
fn level_wpg() -> u32 {
    return max(GROUP * BITS / 32u, 1u);
}

// Code word w of the token at cell o of row r.
fn level_word(words: ptr<function, TokenWords>, w: u32, r: u32, o: u32) {
    let wpg = level_wpg();
    if w >= DIM * BITS / 32u {
        return;
    }
    (*words)[w] = word_at(((r * (DIM / GROUP) + w / wpg) * wpg + w % wpg) * dims.other + o, false);
}

// The norm of group g of the token at cell o of row r.
fn level_norm(norms: ptr<function, array<f32, 8>>, g: u32, r: u32, o: u32) {
    if g >= DIM / GROUP {
        return;
    }
    let cell = r * (DIM / GROUP) + g;
    if PARAMS_F32 {
        (*norms)[g] = bitcast<f32>(word_at(cell * dims.other + o, true));
        return;
    }
    (*norms)[g] = unpack2x16float(word_at(cell * ((dims.other + 1u) / 2u) + o / 2u, true))[o % 2u];
}

// The levels of 4 codes: chosen by selects up to 2 bits, else indexed.
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

// vec4 q of the vector (channels 4q ..), decoded and started (`started`).
fn level_quad(v: ptr<function, Held>, words: ptr<function, TokenWords>, norms: ptr<function, array<f32, 8>>, q: u32, stream: u32) {
    if 4u * q >= DIM {
        return;
    }
    let g = 4u * q / GROUP;
    let p = (4u * q % GROUP) * BITS;
    let word = (*words)[g * level_wpg() + p / 32u];
    let shifts = vec4<u32>(p % 32u) + vec4<u32>(0u, BITS, 2u * BITS, 3u * BITS);
    let c = (vec4<u32>(word) >> shifts) & vec4<u32>((1u << BITS) - 1u);
    (*v)[q] = started(levels4(c) * (*norms)[g], q, stream, DIM);
}

fn level_quads4(v: ptr<function, Held>, words: ptr<function, TokenWords>, norms: ptr<function, array<f32, 8>>, q0: u32, stream: u32) {
    level_quad(v, words, norms, q0, stream);
    level_quad(v, words, norms, q0 + 1u, stream);
    level_quad(v, words, norms, q0 + 2u, stream);
    level_quad(v, words, norms, q0 + 3u, stream);
}

// The token at cell o of row r, into the held vector.
fn held_levels(v: ptr<function, Held>, io: HeldIo, r: u32, o: u32) {
    var words: TokenWords;
    var norms: array<f32, 8>;
    level_word(&words, 0u, r, o);
    level_word(&words, 1u, r, o);
    level_word(&words, 2u, r, o);
    level_word(&words, 3u, r, o);
    level_word(&words, 4u, r, o);
    level_word(&words, 5u, r, o);
    level_word(&words, 6u, r, o);
    level_word(&words, 7u, r, o);
    level_norm(&norms, 0u, r, o);
    level_norm(&norms, 1u, r, o);
    level_norm(&norms, 2u, r, o);
    level_norm(&norms, 3u, r, o);
    level_norm(&norms, 4u, r, o);
    level_norm(&norms, 5u, r, o);
    level_norm(&norms, 6u, r, o);
    level_norm(&norms, 7u, r, o);
    level_quads4(v, &words, &norms, 0u, io.stream);
    level_quads4(v, &words, &norms, 4u, io.stream);
    level_quads4(v, &words, &norms, 8u, io.stream);
    level_quads4(v, &words, &norms, 12u, io.stream);
}

// Butterfly p (< D / 8) of the stage of h vec4s.
fn held_butterfly(v: ptr<function, Held>, p: u32, h: u32) {
    if p >= DIM / 8u {
        return;
    }
    let j = (p / h) * 2u * h + p % h;
    let a = (*v)[j];
    let b = (*v)[j + h];
    (*v)[j] = a + b;
    (*v)[j + h] = a - b;
}

// The stage of h vec4s (h < D / 4).
fn held_stage(v: ptr<function, Held>, h: u32) {
    if h >= DIM / 4u {
        return;
    }
    held_butterfly(v, 0u, h);
    held_butterfly(v, 1u, h);
    held_butterfly(v, 2u, h);
    held_butterfly(v, 3u, h);
    held_butterfly(v, 4u, h);
    held_butterfly(v, 5u, h);
    held_butterfly(v, 6u, h);
    held_butterfly(v, 7u, h);
}

// The butterflies between vec4s: h = 4, 8, .. elements (HELD_DIM / 8 at most).
fn held_rotate(v: ptr<function, Held>) {
    held_stage(v, 1u);
    held_stage(v, 2u);
    held_stage(v, 4u);
    held_stage(v, 8u);
}

// f16 bit patterns (low 16 bits) as f32 values, with integer ops (unpack2x16float converts
// lane by lane on llvmpipe); the same as materialize.wgsl's (a module has no includes).
fn halves_to_f32(h: vec4<u32>) -> vec4<f32> {
    let e = h & vec4<u32>(0x7c00u);
    let sign = (h & vec4<u32>(0x8000u)) << vec4<u32>(16u);
    let normal = bitcast<vec4<f32>>(sign | (((h & vec4<u32>(0x7fffu)) << vec4<u32>(13u)) + vec4<u32>(0x38000000u)));
    let m = vec4<f32>(h & vec4<u32>(0x3ffu)) * (1.0 / 16777216.0);
    let sub = select(m, -m, sign != vec4<u32>(0u));
    let special = bitcast<vec4<f32>>(sign | vec4<u32>(0x7f800000u) | ((h & vec4<u32>(0x3ffu)) << vec4<u32>(13u)));
    return select(select(normal, sub, e == vec4<u32>(0u)), special, e == vec4<u32>(0x7c00u));
}

// The 8 halves of 4 words as f32 values, in order; the same as materialize.wgsl's.
fn halves8(w: vec4<u32>) -> mat2x4<f32> {
    let lo = halves_to_f32(w & vec4<u32>(0xffffu));
    let hi = halves_to_f32(w >> vec4<u32>(16u));
    return mat2x4<f32>(vec4<f32>(lo.x, hi.x, lo.y, hi.y), vec4<f32>(lo.z, hi.z, lo.w, hi.w));
}

// f16 bit patterns of f32 values rounded to nearest even, with integer ops; the same as
// materialize.wgsl's.
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

// f32 values rounded to f16 precision (ROUND_IN), with integer ops; the same as
// materialize.wgsl's `round_f16x4`.
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
