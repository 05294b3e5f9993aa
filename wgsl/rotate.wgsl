// The randomized Walsh–Hadamard rotation of head vectors (CPU twin:
// src/reference/rotation.rs): y = H (s ⊙ x) / √D, or its inverse x = s ⊙ (H y) / √D, with
// ±1 signs s hashed from a seed per stream (a layer's keys or values, one KV head). One
// invocation rotates one vector of D elements (a power of two, at most MAX_DIM), 4 elements
// at a time: no workgroup memory and no barriers (a decode step rotates a few vectors per
// layer; on lavapipe a vector spread over D / 4 invocations, its butterflies met in
// workgroup memory or each invocation summing the whole vector, was slower). Up to HELD_DIM
// the pipeline is built for its D and holds the vector in registers (`held_*`); beyond, in a
// private array.
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
    ring_tokens: u32, // TO_RING: slots per row of the ring
    ring_t0: u32,   // TO_RING: absolute token of the first vector of each row (slot % ring_tokens)
    x_tokens: u32,  // TO_RING: token rows per row of x
    x_t0: u32,      // TO_RING: x token of the first vector of each row
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
override DIM: u32 = 0u;          // D when the pipeline is built for one (a power of two from 4 to
                                 // HELD_DIM): the vector is held in registers (`held_*`)

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
        let r = k / dims.head_div;
        let t = k % dims.head_div;
        src = (r * dims.x_tokens + dims.x_t0 + t) * n;
        base = (r * dims.ring_tokens + (dims.ring_t0 + t) % dims.ring_tokens) * n;
    }
    let n4 = (n + 3u) / 4u;
    if PLAIN_FIRST && !second {
        for (var q = 0u; q < n4; q++) {
            store4(base + 4u * q, load4(src + 4u * q, false, n), n, false);
        }
        return;
    }
    if DIM >= 4u {
        var v: Held;
        let io = HeldIo(src, base, second, stream, TO_RING && second);
        held_quads(&v, io, false);
        held_rotate(&v);
        held_quads(&v, io, true);
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

// vec4 q of the input (elements 4q ..), signed (forward) and through the butterflies of h = 1
// and 2 (of h = 1 alone where D is 2).
fn started4(src: u32, q: u32, second: bool, stream: u32, n: u32) -> vec4<f32> {
    var e = load4(src + 4u * q, second, n);
    if !INVERSE {
        e *= signs4(stream, 4u * q);
    }
    let h1 = vec4<f32>(e.x + e.y, e.x - e.y, e.z + e.w, e.z - e.w);
    let h2 = vec4<f32>(h1.x + h1.z, h1.y + h1.w, h1.x - h1.z, h1.y - h1.w);
    return select(h1, h2, n >= 4u);
}

// vec4 q of the output, scaled (`e`): signed (inverse) and stored.
fn finish4(base: u32, q: u32, e: vec4<f32>, stream: u32, n: u32, pair: bool) {
    var o = e;
    if INVERSE {
        o *= signs4(stream, 4u * q);
    }
    store4(base + 4u * q, o, n, pair);
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

// Where a held vector comes from and goes: input element `src`, output element `base`, the
// second tensor's (PAIR), the signs' stream, the second ring (`pair`).
struct HeldIo {
    src: u32,
    base: u32,
    second: bool,
    stream: u32,
    pair: bool,
}

// vec4 q of the vector: in (`out` false, `started4`) or out (scaled, `finish4`).
fn held_quad(v: ptr<function, Held>, q: u32, io: HeldIo, out: bool) {
    if 4u * q >= DIM {
        return;
    }
    if out {
        finish4(io.base, q, (*v)[q] * (1.0 / sqrt(f32(max(DIM, 1u)))), io.stream, DIM, io.pair);
        return;
    }
    (*v)[q] = started4(io.src, q, io.second, io.stream, DIM);
}

fn held_quads4(v: ptr<function, Held>, q0: u32, io: HeldIo, out: bool) {
    held_quad(v, q0, io, out);
    held_quad(v, q0 + 1u, io, out);
    held_quad(v, q0 + 2u, io, out);
    held_quad(v, q0 + 3u, io, out);
}

// Every vec4 of the vector, in or out.
fn held_quads(v: ptr<function, Held>, io: HeldIo, out: bool) {
    held_quads4(v, 0u, io, out);
    held_quads4(v, 4u, io, out);
    held_quads4(v, 8u, io, out);
    held_quads4(v, 12u, io, out);
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
