// The randomized Walsh–Hadamard rotation of head vectors (CPU twin:
// src/reference/rotation.rs): y = H (s ⊙ x) / √D, or its inverse x = s ⊙ (H y) / √D, with
// ±1 signs s hashed from a seed per stream (a layer's keys or values, one KV head). One
// invocation rotates one vector of D elements (a power of two, at most MAX_DIM) in its own
// registers: no workgroup memory and no barriers (a decode step rotates a few dozen
// vectors per layer; barriers would cost more than the arithmetic).
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

override WG: u32 = 64u;
override IN_F16: bool = false;   // x holds halves
override OUT_F16: bool = false;  // y holds halves
override IN_PLACE: bool = false; // read y and write it back (x unused)
override INVERSE: bool = false;  // undo the rotation
override PAIR: bool = false;     // two tensors of as many vectors (an append's keys and values)
override TO_RING: bool = false;  // x's tokens [x_t0, x_t0 + head_div) of each row into the f16
                                 // ring y [rows, ring_tokens, D / 2] (OUT_F16), slot by slot

const MAX_DIM: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;        // [vectors, D] f32 or halves
@group(0) @binding(2) var<storage, read_write> y: array<u32>;  // [vectors, D] f32 or halves
@group(0) @binding(3) var<storage, read> x2: array<u32>;       // PAIR: the second tensor

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
        return bitcast<f32>(w);
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
    return bitcast<f32>(w);
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
    var v: array<f32, MAX_DIM>;
    for (var d = 0u; d < n; d++) {
        var a = load(src + d, second);
        if !INVERSE {
            a *= sign_of(stream, d);
        }
        v[d] = a;
    }
    for (var h = 1u; h < n; h *= 2u) {
        for (var p = 0u; p < n / 2u; p++) {
            let j = (p / h) * 2u * h + p % h;
            let a = v[j];
            let b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
    }
    let norm = 1.0 / sqrt(f32(n));
    if OUT_F16 {
        for (var w = 0u; w < n / 2u; w++) {
            var pair = vec2<f32>(v[2u * w], v[2u * w + 1u]) * norm;
            if INVERSE {
                pair *= vec2<f32>(sign_of(stream, 2u * w), sign_of(stream, 2u * w + 1u));
            }
            y[(base >> 1u) + w] = pack2x16float(pair);
        }
    } else {
        for (var d = 0u; d < n; d++) {
            var a = v[d] * norm;
            if INVERSE {
                a *= sign_of(stream, d);
            }
            y[base + d] = bitcast<u32>(a);
        }
    }
}
