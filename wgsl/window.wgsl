// Full-precision window: tokens appended to an f16 ring [R, ring_tokens, D_even / 2 words]
// (a token's row is padded to an even number of halves, so every token owns whole words).
// Token t (absolute) lives in slot t % ring_tokens. One invocation writes one word. PAIR: a
// second tensor of the same shape (an append's values, the keys in x) into a second ring of
// the same shape, by the invocations after the first's: one launch for both.

struct Dims {
    rows: u32,
    dim: u32,          // D
    n: u32,            // tokens to append
    ring_tokens: u32,  // slots per row of the ring
    ring_t0: u32,      // absolute token of the first appended token
    x_tokens: u32,     // token rows per row of x
    x_t0: u32,         // x token of the first appended token
    grid_x: u32,       // workgroups along x
}

override IN_F16: bool = false;   // x holds f16 pairs instead of f32
override WG: u32 = 256u;
override PAIR: bool = false;     // x2 into ring2 as well

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;          // [R, x_tokens, D] f32 bits or f16 pairs
@group(0) @binding(2) var<storage, read_write> ring: array<u32>; // [R, ring_tokens, D_even / 2] f16 pairs
@group(0) @binding(3) var<storage, read> x2: array<u32>;         // PAIR: as x
@group(0) @binding(4) var<storage, read_write> ring2: array<u32>; // PAIR: as ring

// Element e of x (`second`: of x2).
fn load_x(e: u32, second: bool) -> f32 {
    var w: u32;
    if second {
        w = x2[select(e, e >> 1u, IN_F16)];
    } else {
        w = x[select(e, e >> 1u, IN_F16)];
    }
    if IN_F16 {
        return unpack2x16float(w)[e & 1u];
    }
    return bitcast<f32>(w);
}

@compute @workgroup_size(WG)
fn append(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let half_dim = (dims.dim + 1u) / 2u;
    let words = dims.rows * dims.n * half_dim;
    var id = (wg.y * dims.grid_x + wg.x) * WG + lid;
    let second = PAIR && id >= words;
    if second {
        id -= words;
    }
    if id >= words {
        return;
    }
    let dw = id % half_dim;
    let t = (id / half_dim) % dims.n;
    let r = id / (half_dim * dims.n);
    let src = (r * dims.x_tokens + dims.x_t0 + t) * dims.dim + 2u * dw;
    var hi = 0.0;
    if 2u * dw + 1u < dims.dim {
        hi = load_x(src + 1u, second);
    }
    let slot = (dims.ring_t0 + t) % dims.ring_tokens;
    let at = (r * dims.ring_tokens + slot) * half_dim + dw;
    let word = pack2x16float(vec2<f32>(load_x(src, second), hi));
    if second {
        ring2[at] = word;
    } else {
        ring[at] = word;
    }
}
