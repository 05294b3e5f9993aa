// The randomized Walsh–Hadamard rotation of head vectors (CPU twin:
// src/reference/rotation.rs): y = H (s ⊙ x) / √D, or its inverse x = s ⊙ (H y) / √D, with
// ±1 signs s hashed from a seed per stream (a layer's keys or values, one KV head). One
// workgroup rotates one vector of D elements (a power of two) in workgroup memory.

struct Dims {
    vectors: u32,   // vectors to rotate
    dim: u32,       // D
    head_div: u32,  // vector i is of head (i / head_div) % heads: T heads-major, 1 token-major
    heads: u32,
    gqa: u32,       // heads per KV head (queries), 1 for K/V
    stream: u32,    // (layer << 16) | (kind << 15): the sign streams' high bits
    seed: u32,
    grid_x: u32,    // workgroups along x
}

override WG: u32 = 64u;
override IN_F16: bool = false;   // x holds halves
override OUT_F16: bool = false;  // y holds halves
override IN_PLACE: bool = false; // read y and write it back (x unused)
override INVERSE: bool = false;  // undo the rotation

const MAX_DIM: u32 = 1024u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;        // [vectors, D] f32 or halves
@group(0) @binding(2) var<storage, read_write> y: array<u32>;  // [vectors, D] f32 or halves

var<workgroup> v: array<f32, MAX_DIM>;

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
    return select(1.0, -1.0, (mix(dims.seed ^ mix(stream ^ mix(d))) & 1u) == 1u);
}

// Element e of the input.
fn load(e: u32) -> f32 {
    var w: u32;
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
    let i = wg.y * dims.grid_x + wg.x;
    // A workgroup past the last vector still takes part in no barrier with others: it only
    // returns (uniformly: i is the same for the whole workgroup).
    if i >= dims.vectors {
        return;
    }
    let d_all = dims.dim;
    let head = (i / dims.head_div) % dims.heads;
    let stream = dims.stream | (head / dims.gqa);
    let base = i * d_all;
    for (var d = lid; d < d_all; d += WG) {
        var a = load(base + d);
        if !INVERSE {
            a *= sign_of(stream, d);
        }
        v[d] = a;
    }
    for (var h = 1u; h < d_all; h *= 2u) {
        workgroupBarrier();
        for (var p = lid; p < d_all / 2u; p += WG) {
            let j = (p / h) * 2u * h + p % h;
            let a = v[j];
            let b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
    }
    workgroupBarrier();
    let norm = 1.0 / sqrt(f32(d_all));
    if OUT_F16 {
        for (var w = lid; w < d_all / 2u; w += WG) {
            var pair = vec2<f32>(v[2u * w], v[2u * w + 1u]) * norm;
            if INVERSE {
                pair *= vec2<f32>(sign_of(stream, 2u * w), sign_of(stream, 2u * w + 1u));
            }
            y[(base >> 1u) + w] = pack2x16float(pair);
        }
    } else {
        for (var d = lid; d < d_all; d += WG) {
            var a = v[d] * norm;
            if INVERSE {
                a *= sign_of(stream, d);
            }
            y[base + d] = bitcast<u32>(a);
        }
    }
}
